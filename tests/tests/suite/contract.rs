//! The provider contract under random schedules: inputs, heartbeats,
//! parallel and late calls, images, reasoning, failures, steering, stops,
//! crashes with resume, and forks are driven through the coordinator's
//! core (a real session log on disk), and every request built along the
//! way is put on the wire for both APIs and checked against every profile
//! of the strict model server. A request a real server would refuse fails
//! the test with the server's own error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use corral_e2e::strict::{Memory, Profile, check};
use corral_harness::agent::core::Overrides;
use corral_harness::agent::{Core, Effect, Record, SessionConfig, StopCause, StopMode};
use corral_harness::llm::conform::{self, CallIds};
use corral_harness::llm::{Item, Request, Response, Role, StopReason, Usage, chat, responses};
use corral_harness::ops::Operation;
use corral_harness::session::SessionLog;
use corral_proto::{Captured, OperationResult, OperationSpec, Outcome, SandboxId};
use serde_json::json;

/// A 1x1 PNG.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0A, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0x00, 0x01, 0x00, 0x00,
    0x05, 0x00, 0x01, 0x0D, 0x0A, 0x2D, 0xB4, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4E, 0x44, 0xAE,
    0x42, 0x60, 0x82,
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn config() -> SessionConfig {
    let mut c = corral_e2e::session_config("gpt-5-mini", SandboxId::new("contract").unwrap());
    c.system_prompt = "be brief".into();
    c.max_output_tokens = Some(10);
    c.max_turns = 1_000;
    c
}

/// Everything a schedule can make the model say, and whether it reasoned
/// through Chat Completions' `reasoning_content`.
fn response(rng: &mut Rng, turn: u64) -> (Response, bool) {
    let mut output = Vec::new();
    let chat_reasoning = rng.chance(30);
    if rng.chance(30) {
        // Responses API reasoning, with or without its encrypted content.
        let mut raw = json!({"type": "reasoning", "id": format!("rs_{turn}"), "summary": []});
        if rng.chance(60) {
            raw["encrypted_content"] = json!("gAAAA-opaque");
        }
        output.push(Item::Reasoning {
            summary: Vec::new(),
            raw,
        });
    }
    if chat_reasoning {
        output.push(conform::chat_reasoning("thinking it over"));
    }
    let shape = rng.below(10);
    if shape < 2 {
        // Reasoning only, or nothing at all.
        let r = Response {
            id: None,
            stop: StopReason::Complete,
            output,
            usage: Usage::default(),
        };
        return (r, false);
    }
    if shape < 5 || rng.chance(30) {
        output.push(Item::Message {
            role: Role::Assistant,
            text: format!("text of turn {turn}").into(),
            provider_id: None,
        });
    }
    if shape >= 4 {
        for n in 0..=rng.below(3) {
            let call_id: Arc<str> = match rng.below(3) {
                // A server that numbers calls per response repeats ids.
                0 => format!("call_{n}").into(),
                1 => format!("c{turn}x{n}abcdefghij")
                    .chars()
                    .take(9)
                    .collect::<String>()
                    .into(),
                _ => format!("call_{turn}_{n}_{}", rng.below(1000)).into(),
            };
            let (name, arguments) = match rng.below(5) {
                0 => ("ViewImage", json!({"path": "/workspace/p.png"}).to_string()),
                1 => ("Bash", "{not json".to_string()),
                2 => ("Nope", "{}".to_string()),
                _ => ("Bash", json!({"command": "echo hi"}).to_string()),
            };
            output.push(Item::ToolCall {
                call_id,
                name: name.into(),
                arguments: arguments.into(),
                provider_id: None,
            });
        }
    }
    let response = Response {
        id: None,
        stop: StopReason::Complete,
        output,
        usage: Usage::default(),
    };
    (response, chat_reasoning)
}

fn finished(op: &Operation, rng: &mut Rng) -> Operation {
    let mut op = op.clone();
    match (&op.spec, rng.below(6)) {
        (_, 0) => op.fail("the sandbox was lost"),
        (OperationSpec::ReadFile(_), _) => {
            let mut r = OperationResult::with_outcome(Outcome::Exited { code: 0 });
            r.file_data = Bytes::from_static(PNG);
            r.file_size = PNG.len() as u64;
            op.finish(r);
        }
        _ => {
            let mut r = OperationResult::with_outcome(Outcome::Exited { code: 0 });
            r.stdout = Captured {
                head: Bytes::from_static(b"hi\n"),
                tail: Bytes::new(),
                total_bytes: 3,
                truncated: false,
            };
            op.finish(r);
        }
    }
    op
}

/// Checks a request on both wire protocols against every profile; the
/// reasoning memory uses the ids as they go on the wire.
fn check_request(req: &Request, memory: &Memory, context: &str) {
    let mut ids = CallIds::default();
    let wire_memory = Memory {
        reasoning_by_call: memory
            .reasoning_by_call
            .iter()
            .map(|(id, r)| (ids.of(&Arc::from(id.as_str())), r.clone()))
            .collect(),
    };
    let chat_body = chat::request_body(req).unwrap();
    let responses_body = responses::request_body(req).unwrap();
    for profile in Profile::ALL {
        let (body, memory) = match profile {
            Profile::OpenAiResponses => (&responses_body, &Memory::default()),
            _ => (&chat_body, &wire_memory),
        };
        if let Err(refusal) = check(profile, body, memory) {
            panic!(
                "{profile:?} refused a request ({context}): {refusal}\n{}",
                serde_json::to_string_pretty(body).unwrap()
            );
        }
    }
}

struct Sim {
    dir: tempfile::TempDir,
    id: String,
    core: Option<Core>,
    in_flight: Option<u64>,
    running: HashMap<corral_proto::OperationId, Operation>,
    memory: Memory,
    requests: usize,
}

impl Sim {
    fn core(&mut self) -> &mut Core {
        self.core.as_mut().unwrap()
    }

    /// Carries out the core's effects as the event loop would.
    fn effects(&mut self, context: &str) {
        for e in self.core().take_effects() {
            match e {
                Effect::Send { turn, request } => {
                    check_request(&request, &self.memory, context);
                    self.requests += 1;
                    self.in_flight = Some(turn);
                }
                Effect::CancelRequest => self.in_flight = None,
                Effect::Add(ops) => {
                    for op in ops {
                        self.running.insert(op.id.clone(), op);
                    }
                }
                Effect::Cancel(ids) => {
                    for id in ids {
                        if let Some(mut op) = self.running.remove(&id) {
                            op.fail("canceled");
                            self.core().operation(op).unwrap();
                        }
                    }
                }
                Effect::ArmGrace | Effect::Emit(_) => {}
            }
        }
    }

    fn crash_and_resume(&mut self) {
        self.core = None;
        self.in_flight = None;
        let (core, _) = Core::open(self.dir.path(), &self.id, Overrides::default()).unwrap();
        self.core = Some(core);
        // The worker still has the operations: they are added again.
        self.running.clear();
    }
}

fn run(seed: u64, steps: usize) -> usize {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let dir = tempfile::tempdir().unwrap();
    let log = SessionLog::<Record>::create(dir.path(), "s").unwrap();
    let core = Core::create(log, config()).unwrap();
    let mut sim = Sim {
        dir,
        id: "s".into(),
        core: Some(core),
        in_flight: None,
        running: HashMap::new(),
        memory: Memory::default(),
        requests: 0,
    };
    sim.core().input("first", "start").unwrap();
    let mut forks = 0;
    for step in 0..steps {
        let context = format!("seed {seed}, step {step}");
        sim.effects(&context);
        match rng.below(100) {
            0..=29 => {
                if let Some(turn) = sim.in_flight.take() {
                    let (r, reasoned) = response(&mut rng, turn);
                    sim.core().model_done(turn, Ok(r)).unwrap();
                    // The server wants its reasoning back with the calls
                    // (ids as recorded: repeated ones are made unique).
                    let calls: Vec<String> = sim
                        .core()
                        .state()
                        .calls
                        .iter()
                        .filter(|(_, c)| c.turn == turn)
                        .map(|(id, _)| id.clone())
                        .collect();
                    if reasoned {
                        for id in calls {
                            sim.memory
                                .reasoning_by_call
                                .insert(id, "thinking it over".into());
                        }
                    }
                }
            }
            30..=49 => {
                let ids: Vec<_> = sim.running.keys().cloned().collect();
                if !ids.is_empty() {
                    let id = &ids[rng.below(ids.len() as u64) as usize];
                    let op = sim.running.remove(id).unwrap();
                    let done = finished(&op, &mut rng);
                    sim.core().operation(done).unwrap();
                }
            }
            50..=57 => sim.core().grace_over().unwrap(),
            58..=65 => sim
                .core()
                .heartbeat(corral_harness::agent::core::now_ms())
                .unwrap(),
            66..=75 => {
                let n = rng.next();
                sim.core()
                    .input(&format!("i{n}"), "typed while it works")
                    .unwrap();
            }
            76..=78 => {
                if let Some(turn) = sim.in_flight.take() {
                    let e = corral_harness::llm::LlmError::Http {
                        api: "chat completions",
                        status: 400,
                        code: None,
                        message: "refused".into(),
                        retry_after: None,
                    };
                    sim.core().model_done(turn, Err(e)).unwrap();
                }
            }
            79..=81 => sim
                .core()
                .stop(StopMode::Hard, StopCause::Requested)
                .unwrap(),
            82..=86 => sim.crash_and_resume(),
            87 if forks < 2 => {
                forks += 1;
                sim.effects(&context);
                let child = format!("f{forks}");
                corral_harness::sessions::Sessions::new(sim.dir.path())
                    .fork(&sim.id, &child, None)
                    .unwrap();
                sim.id = child;
                sim.crash_and_resume();
            }
            _ => {}
        }
        sim.effects(&context);
        if sim.core().ending().is_some() || sim.core().state().failure.is_some() {
            // A run that ended: the next one starts with a new input.
            sim.crash_and_resume();
            let n = rng.next();
            sim.core().input(&format!("n{n}"), "go on").unwrap();
        }
    }
    sim.requests
}

#[test]
fn every_request_of_random_schedules_is_accepted_by_every_profile() {
    let mut requests = 0;
    for seed in 1..=60 {
        requests += run(seed, 80);
    }
    assert!(
        requests > 500,
        "the schedules sent only {requests} requests"
    );
}
