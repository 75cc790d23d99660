//! The coordinator's decisions, step by step, against a real session log
//! in a temporary directory. Model answers and operation snapshots are
//! fed in by hand; the event loop and real operations are tested end to end
//! in `tests/tests/suite/agent.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use corral_proto::{Captured, OperationId, OperationResult, Outcome, SandboxId};

use super::*;
use crate::agent::record::StopCause;
use crate::agent::state::Shown;
use crate::context::{Budget, RUNNING_PLACEHOLDER};
use crate::llm::{Item, Role, StopReason, ToolOutput, Usage};
use crate::ops::OpStatus;

fn config() -> SessionConfig {
    SessionConfig {
        model: "m".into(),
        system_prompt: "be brief".into(),
        tools: None,
        sandbox_id: SandboxId::new("sb").unwrap(),
        image: None,
        template: None,
        budget: Budget::default(),
        max_output_tokens: None,
        reasoning_effort: None,
        max_turns: 20,
        skills: Vec::new(),
        worker: None,
        endpoint: None,
        tool_choice: None,
        keep_tool_choice: false,
        workspace: None,
        worker_id: None,
        on_sandbox_lost: Default::default(),
        generation: 0,
        egress: Vec::new(),
        tenant: None,
    }
}

fn new_core(dir: &std::path::Path, id: &str) -> Core {
    let log = SessionLog::create(dir, id).unwrap();
    Core::create(log, config()).unwrap()
}

/// A session "s" whose first answer made these calls; their operations.
fn with_calls(dir: &std::path::Path, list: &[(&str, &str, &str)]) -> (Core, Vec<Operation>) {
    let mut core = new_core(dir, "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(1, Ok(calls(list))).unwrap();
    let ops = fx(&mut core).adds;
    (core, ops)
}

fn resume(dir: &std::path::Path, id: &str) -> Core {
    Core::open(dir, id, Default::default()).unwrap().0
}

fn text(t: &str) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output: vec![Item::Message {
            role: Role::Assistant,
            text: t.into(),
            provider_id: None,
        }],
        usage: Usage {
            input_tokens: 10,
            output_tokens: 2,
            ..Usage::default()
        },
    }
}

fn calls(list: &[(&str, &str, &str)]) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output: list
            .iter()
            .map(|(id, name, args)| Item::ToolCall {
                call_id: (*id).into(),
                name: (*name).into(),
                arguments: (*args).into(),
                provider_id: None,
            })
            .collect(),
        usage: Usage::default(),
    }
}

fn bash(cmd: &str) -> String {
    serde_json::json!({ "command": cmd }).to_string()
}

#[derive(Debug, Default)]
struct Fx {
    sends: Vec<(u64, crate::llm::Request)>,
    cancels_request: usize,
    adds: Vec<Operation>,
    cancels: Vec<OperationId>,
    grace: usize,
    events: Vec<Event>,
}

fn fx(core: &mut Core) -> Fx {
    let mut f = Fx::default();
    for e in core.take_effects() {
        match e {
            Effect::Send { turn, request } => f.sends.push((turn, request)),
            Effect::CancelRequest => f.cancels_request += 1,
            Effect::Add(ops) => f.adds.extend(ops),
            Effect::Cancel(ids) => f.cancels.extend(ids),
            Effect::ArmGrace => f.grace += 1,
            Effect::Emit(e) => f.events.push(e),
        }
    }
    f
}

fn done(op: &Operation, stdout: &str) -> Operation {
    let mut op = op.clone();
    let mut r = OperationResult::with_outcome(Outcome::Exited { code: 0 });
    r.stdout = Captured {
        head: Bytes::copy_from_slice(stdout.as_bytes()),
        tail: Bytes::new(),
        total_bytes: stdout.len() as u64,
        truncated: false,
    };
    op.finish(r);
    op
}

fn kinds(dir: &std::path::Path, id: &str) -> Vec<&'static str> {
    SessionLog::<Record>::records(dir, id)
        .unwrap()
        .map(|r| r.unwrap().1.kind())
        .collect()
}

fn result_texts(req: &crate::llm::Request) -> Vec<(String, String)> {
    req.input
        .iter()
        .filter_map(|i| match i {
            Item::ToolResult { call_id, output } => Some((
                call_id.to_string(),
                output
                    .iter()
                    .map(|o| match o {
                        ToolOutput::Text { text } => text.to_string(),
                        ToolOutput::Image { .. } => "[image]".into(),
                    })
                    .collect::<String>(),
            )),
            _ => None,
        })
        .collect()
}

/// Live state equals the state replayed from the log.
fn assert_replays(dir: &std::path::Path, core: &Core) {
    let replayed = replay(dir, core.session_id()).unwrap();
    assert_eq!(
        &replayed,
        core.state(),
        "replay drifted from the live state"
    );
    assert_eq!(
        replayed.context.build(),
        core.state().context.build(),
        "the next request differs after replay"
    );
}

#[test]
fn an_input_is_persisted_then_a_turn_then_the_request_goes_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i1", "hello").unwrap();
    let f = fx(&mut core);
    assert_eq!(kinds(dir.path(), "s"), ["start", "input", "turn"]);
    assert_eq!(f.sends.len(), 1);
    let (turn, req) = &f.sends[0];
    assert_eq!(*turn, 1);
    let mut want = core.state().context.build().request;
    want.cache_key = Some(super::cache_key("s"));
    assert_eq!(req, &want, "the request is the builder's snapshot");
    assert!(
        matches!(&req.input[0], Item::Message { role: Role::System, text, .. } if text.contains("be brief"))
    );
    // The same input id again is a redelivery: ignored.
    core.input("i1", "hello").unwrap();
    assert!(fx(&mut core).sends.is_empty());
    core.model_done(1, Ok(text("hi"))).unwrap();
    core.stop(StopMode::WhenIdle, StopCause::Requested).unwrap();
    assert_eq!(core.ending(), Some(Ending::Done));
    assert_eq!(core.state().final_text, "hi");
    assert_replays(dir.path(), &core);
}

#[test]
fn tool_calls_are_recorded_before_dispatch_and_their_result_wakes_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "list files").unwrap();
    fx(&mut core);
    core.model_done(1, Ok(calls(&[("c1", "Bash", &bash("ls"))])))
        .unwrap();
    let f = fx(&mut core);
    assert_eq!(
        kinds(dir.path(), "s"),
        ["start", "input", "turn", "response", "call"],
        "the call record (with its operations) precedes the dispatch"
    );
    assert_eq!(f.adds.len(), 1);
    assert_eq!(f.grace, 1);
    assert!(f.sends.is_empty(), "no turn while the grace window is open");
    let op = &f.adds[0];
    assert_eq!(core.state().ops[&op.id].spec, op.spec);
    // Progress is kept in memory, not recorded.
    let mut running = op.clone();
    running.status = OpStatus::Awaiting;
    running
        .progress
        .push(corral_proto::OutputStream::Stdout, b"partial");
    core.operation(running).unwrap();
    assert_eq!(kinds(dir.path(), "s").len(), 5);
    core.operation(done(op, "a\nb\n")).unwrap();
    let f = fx(&mut core);
    assert_eq!(
        f.sends.len(),
        1,
        "the only call finished: the window ends early"
    );
    assert_eq!(
        result_texts(&f.sends[0].1),
        [("c1".to_string(), "a\nb".to_string())]
    );
    assert_eq!(f.sends[0].1.cache_key, Some(super::cache_key("s")));
    assert_replays(dir.path(), &core);
}

#[test]
fn completions_are_batched_and_a_slow_call_shows_the_placeholder() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    // As `corral run` does: end when idle, asked before the work starts.
    core.stop(StopMode::WhenIdle, StopCause::Requested).unwrap();
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(
        1,
        Ok(calls(&[
            ("a", "Bash", &bash("true")),
            ("b", "Bash", &bash("true")),
            ("slow", "Bash", &bash("sleep 100")),
        ])),
    )
    .unwrap();
    let ops = fx(&mut core).adds;
    core.operation(done(&ops[0], "A")).unwrap();
    assert!(
        fx(&mut core).sends.is_empty(),
        "batched: the window is open"
    );
    core.operation(done(&ops[1], "B")).unwrap();
    assert!(fx(&mut core).sends.is_empty());
    core.grace_over().unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "one turn for both fast results");
    let results = result_texts(&f.sends[0].1);
    assert_eq!(results.len(), 3);
    assert_eq!(results[0], ("a".into(), "A".into()));
    assert_eq!(results[1], ("b".into(), "B".into()));
    assert_eq!(results[2], ("slow".into(), RUNNING_PLACEHOLDER.into()));
    core.model_done(2, Ok(text("waiting for slow"))).unwrap();
    core.stop(StopMode::WhenIdle, StopCause::Requested).unwrap();
    assert_eq!(core.ending(), None, "a call is still running");
    core.operation(done(&ops[2], "S")).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "a finished call wakes the model");
    let results = result_texts(&f.sends[0].1);
    assert_eq!(
        results.iter().filter(|(c, _)| c == "slow").count(),
        1,
        "one output per call: the sent placeholder stays"
    );
    let Some(Item::UserContent { parts }) = f.sends[0].1.input.last() else {
        panic!("the late result comes last, as a user message")
    };
    let late = ToolOutput::text_of(parts);
    assert!(
        late.contains("tool call slow") && late.ends_with("\nS"),
        "{late}"
    );
    core.model_done(3, Ok(text("all done"))).unwrap();
    assert_eq!(core.ending(), Some(Ending::Done));
    assert_replays(dir.path(), &core);
}

#[test]
fn grace_expiry_alone_starts_no_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (mut core, ops) = with_calls(dir.path(), &[("a", "Bash", &bash("sleep 9"))]);
    core.grace_over().unwrap();
    assert!(fx(&mut core).sends.is_empty());
    assert!(core.waiting_only_for_calls());
    core.operation(done(&ops[0], "")).unwrap();
    assert_eq!(fx(&mut core).sends.len(), 1);
}

#[test]
fn malformed_arguments_and_unknown_tools_answer_at_once_and_the_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(
        1,
        Ok(calls(&[
            ("bad", "Bash", "{\"command\": "),
            ("nope", "Teleport", "{}"),
            ("ok", "Bash", &bash("sleep 5")),
        ])),
    )
    .unwrap();
    let f = fx(&mut core);
    assert_eq!(f.grace, 0, "an immediate error bypasses the grace window");
    assert_eq!(f.adds.len(), 1);
    assert_eq!(f.sends.len(), 1);
    let results = result_texts(&f.sends[0].1);
    assert!(results[0].1.contains("not valid JSON"), "{results:?}");
    assert!(results[1].1.contains("\"Teleport\" is not available"));
    assert_eq!(results[2].1, RUNNING_PLACEHOLDER);
    assert!(
        f.events
            .iter()
            .any(|e| matches!(e, Event::ToolCall { error: Some(_), .. }))
    );
    assert_replays(dir.path(), &core);
}

#[test]
fn an_over_long_tool_name_is_answered_as_an_error_and_kept_out_of_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    let long = "N".repeat(3_000_000);
    core.model_done(
        1,
        Ok(calls(&[
            ("long", long.as_str(), &bash("true")),
            ("ok", "Bash", &bash("true")),
        ])),
    )
    .unwrap();
    let f = fx(&mut core);
    // Nothing of the misnamed call runs; the other one does.
    assert_eq!(f.adds.len(), 1);
    let results = result_texts(&f.sends[0].1);
    assert!(
        results[0].1.contains("was 3000000 bytes") && results[0].1.contains("nothing was run"),
        "{results:?}"
    );
    // Neither the next request nor the log carries the name.
    let sent = serde_json::to_string(&f.sends[0].1.input).unwrap();
    assert!(sent.len() < 64 * 1024, "{} bytes sent back", sent.len());
    let logged: usize = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len() as usize)
        .sum();
    assert!(logged < 1 << 20, "{logged} bytes logged");
    assert_replays(dir.path(), &core);
}

#[test]
fn an_oversized_argument_is_answered_as_an_error_and_kept_out_of_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    let big = serde_json::json!({ "path": "big.txt", "content": "x".repeat(7 << 20) }).to_string();
    core.model_done(
        1,
        Ok(calls(&[
            ("big", "WriteFile", &big),
            ("ok", "Bash", &bash("true")),
        ])),
    )
    .unwrap();
    let f = fx(&mut core);
    // Nothing of the oversized call runs; the other one does.
    assert_eq!(f.adds.len(), 1);
    let results = result_texts(&f.sends[0].1);
    assert!(
        results[0].1.contains(&format!("were {} bytes", big.len()))
            && results[0].1.contains("nothing was run"),
        "{results:?}"
    );
    // The next request is small: the 7 MiB is in neither the call nor the
    // result, nor in the log the session resumes from.
    let sent = serde_json::to_string(&f.sends[0].1.input).unwrap();
    assert!(sent.len() < 64 * 1024, "{} bytes sent back", sent.len());
    let logged: usize = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len() as usize)
        .sum();
    assert!(logged < 1 << 20, "{logged} bytes logged");
    assert_replays(dir.path(), &core);
}

#[test]
fn a_new_input_steers_the_request_in_flight_and_its_late_answer_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i1", "write a poem").unwrap();
    fx(&mut core);
    core.input("i2", "no, a haiku").unwrap();
    let f = fx(&mut core);
    assert_eq!(f.cancels_request, 1);
    assert_eq!(f.sends.len(), 1);
    assert_eq!(f.sends[0].0, 2);
    let users: Vec<String> = f.sends[0]
        .1
        .input
        .iter()
        .filter_map(|i| match i {
            Item::Message {
                role: Role::User,
                text,
                ..
            } => Some(text.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(users, ["write a poem", "no, a haiku"]);
    core.model_done(1, Ok(text("a long poem"))).unwrap();
    assert!(
        !kinds(dir.path(), "s").contains(&"response"),
        "the superseded turn's answer is not recorded"
    );
    core.model_done(2, Ok(text("haiku"))).unwrap();
    assert_eq!(core.state().final_text, "haiku");
    assert_replays(dir.path(), &core);
}

#[test]
fn completions_never_interrupt_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let (mut core, ops) = with_calls(dir.path(), &[("a", "Bash", &bash("x"))]);
    core.grace_over().unwrap();
    core.input("i2", "also this").unwrap();
    assert_eq!(fx(&mut core).sends.len(), 1);
    core.operation(done(&ops[0], "X")).unwrap();
    let f = fx(&mut core);
    assert!(f.sends.is_empty() && f.cancels_request == 0);
    core.model_done(2, Ok(text("ok"))).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "the result goes in the next turn");
    assert!(
        matches!(f.sends[0].1.input.last(), Some(Item::UserContent { parts }) if ToolOutput::text_of(parts).ends_with("\nX")),
        "a late result (its placeholder was sent) comes as a user message"
    );
}

#[test]
fn heartbeats_tell_the_model_what_runs_and_its_output_so_far() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.heartbeat(now_ms()).unwrap();
    assert!(
        !kinds(dir.path(), "s").contains(&"heartbeat"),
        "never during a request"
    );
    core.model_done(1, Ok(calls(&[("c", "Bash", &bash("make"))])))
        .unwrap();
    let ops = fx(&mut core).adds;
    core.grace_over().unwrap();
    core.model_done(1, Ok(text("late"))).unwrap();
    let mut running = ops[0].clone();
    running.status = OpStatus::Awaiting;
    running
        .progress
        .push(corral_proto::OutputStream::Stdout, b"compiling 3/10\n");
    core.operation(running).unwrap();
    assert!(core.waiting_only_for_calls());
    core.heartbeat(now_ms() + 65_000).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1);
    let last_user = f.sends[0]
        .1
        .input
        .iter()
        .rev()
        .find_map(|i| match i {
            Item::Message {
                role: Role::User,
                text,
                ..
            } => Some(text.to_string()),
            _ => None,
        })
        .unwrap();
    assert!(last_user.starts_with("[heartbeat]"), "{last_user}");
    assert!(
        last_user.contains(r#"Bash call c {"command":"make"}: running for 65s"#),
        "{last_user}"
    );
    assert!(last_user.contains("compiling 3/10"), "{last_user}");
    // The placeholder went with it: every call in a request has a result.
    assert_eq!(
        result_texts(&f.sends[0].1),
        [("c".into(), RUNNING_PLACEHOLDER.into())]
    );
    assert_replays(dir.path(), &core);
}

#[test]
fn a_hard_stop_cancels_everything_records_the_ends_and_drops_late_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut core, ops) = with_calls(dir.path(), &[("c", "Bash", &bash("sleep 100"))]);
    core.grace_over().unwrap();
    core.input("i2", "more").unwrap();
    fx(&mut core);
    core.stop(StopMode::Hard, StopCause::Requested).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.cancels_request, 1);
    assert_eq!(f.cancels, [ops[0].id.clone()]);
    assert_eq!(core.ending(), None, "waits for the operation's final state");
    // An add that reaches the worker after the stop is canceled then.
    let mut late = ops[0].clone();
    late.status = OpStatus::Awaiting;
    core.operation(late).unwrap();
    assert_eq!(fx(&mut core).cancels, [ops[0].id.clone()]);
    core.model_done(2, Ok(text("late"))).unwrap();
    let mut canceled = ops[0].clone();
    canceled.finish(OperationResult::with_outcome(Outcome::Canceled));
    core.operation(canceled).unwrap();
    assert!(fx(&mut core).sends.is_empty(), "no turn after a hard stop");
    assert_eq!(core.ending(), Some(Ending::Interrupted));
    assert_eq!(core.state().calls["c"].shown, Shown::Final);
    assert_replays(dir.path(), &core);
}

#[test]
fn a_resumed_session_follows_running_operations_and_resends_a_lost_turn() {
    let dir = tempfile::tempdir().unwrap();
    let ops = {
        let mut core = new_core(dir.path(), "s");
        core.input("i", "go").unwrap();
        fx(&mut core);
        core.model_done(
            1,
            Ok(calls(&[
                ("a", "Bash", &bash("x")),
                ("b", "Bash", &bash("y")),
            ])),
        )
        .unwrap();
        let ops = fx(&mut core).adds;
        core.operation(done(&ops[0], "A")).unwrap();
        core.grace_over().unwrap();
        assert_eq!(fx(&mut core).sends.len(), 1, "turn 2 is in flight");
        ops
        // The process dies here: turn 2 unanswered, b still running.
    };
    let mut core = resume(dir.path(), "s");
    core.kick().unwrap();
    let f = fx(&mut core);
    assert_eq!(
        f.adds.iter().map(|o| &o.id).collect::<Vec<_>>(),
        [&ops[1].id],
        "only the operation without a terminal record is added again"
    );
    assert_eq!(f.sends.len(), 1, "the lost turn is sent again");
    assert_eq!(f.sends[0].0, 3);
    assert_eq!(
        result_texts(&f.sends[0].1),
        [
            ("a".into(), "A".into()),
            ("b".into(), RUNNING_PLACEHOLDER.into())
        ]
    );
    assert_replays(dir.path(), &core);
}

#[test]
fn resume_translates_calls_that_were_never_translated_and_gives_lost_results() {
    use crate::agent::record::OpSnapshot;
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = SessionLog::<Record>::create(dir.path(), "s").unwrap();
        let op = OperationId::new("op1").unwrap();
        let spec = corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("x"));
        for r in [
            Record::Start { config: config() },
            Record::Input {
                input_id: "i".into(),
                text: "go".into(),
            },
            Record::Turn { turn: 1 },
            Record::Response {
                turn: 1,
                response: calls(&[("a", "Bash", &bash("x")), ("b", "Bash", &bash("y"))]),
            },
            Record::Call {
                call_id: "a".into(),
                tool: "Bash".into(),
                arguments: bash("x"),
                turn: 1,
                at_unix_ms: 0,
                outcome: CallOutcome::Submit,
                operations: vec![OpEntry {
                    id: op.clone(),
                    spec,
                }],
            },
            Record::Operation {
                snapshot: OpSnapshot {
                    id: op,
                    status: OpStatus::Completed,
                    result: Some(OperationResult::with_outcome(Outcome::Exited { code: 3 })),
                    failure: None,
                    lost: false,
                },
            },
        ] {
            log.append(&r).unwrap();
        }
    }
    let mut core = resume(dir.path(), "s");
    let f = fx(&mut core);
    assert_eq!(f.adds.len(), 1, "call b is translated and dispatched");
    let a = &core.state().calls["a"];
    assert_eq!(a.shown, Shown::Final, "call a's lost result is given");
    assert_eq!(f.grace, 1, "b, dispatched now, gets its grace window");
    core.kick().unwrap();
    assert!(fx(&mut core).sends.is_empty());
    core.grace_over().unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "a's result wakes the model");
    assert!(result_texts(&f.sends[0].1)[0].1.contains("Exit code: 3"));
    assert_replays(dir.path(), &core);
}

#[test]
fn a_model_failure_ends_the_run_and_a_resume_asks_again() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut core = new_core(dir.path(), "s");
        core.input("i", "go").unwrap();
        fx(&mut core);
        let err = crate::llm::LlmError::Http {
            api: "responses",
            status: 400,
            code: Some("invalid_request_error".into()),
            message: "bad".into(),
            retry_after: None,
        };
        core.model_done(1, Err(err)).unwrap();
        assert_eq!(core.ending(), Some(Ending::Failed));
        assert!(kinds(dir.path(), "s").contains(&"model_failure"));
        assert!(!kinds(dir.path(), "s").contains(&"response"));
    }
    let mut core = resume(dir.path(), "s");
    assert_eq!(core.ending(), None);
    core.kick().unwrap();
    assert_eq!(fx(&mut core).sends.len(), 1);
}

#[test]
fn refusals_and_cut_off_answers_fail_the_run_and_their_calls_do_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    let mut r = calls(&[("c", "Bash", "{\"command\": \"ls")]);
    r.stop = StopReason::MaxOutputTokens;
    core.model_done(1, Ok(r)).unwrap();
    let f = fx(&mut core);
    assert!(f.adds.is_empty());
    assert_eq!(core.ending(), Some(Ending::Failed));
    assert!(
        core.state()
            .failure
            .as_deref()
            .unwrap()
            .contains("output-token limit")
    );
    assert_replays(dir.path(), &core);
}

#[test]
fn the_turn_limit_ends_the_run_as_failed() {
    let dir = tempfile::tempdir().unwrap();
    let log = SessionLog::create(dir.path(), "s").unwrap();
    let mut cfg = config();
    cfg.max_turns = 1;
    let mut core = Core::create(log, cfg).unwrap();
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(1, Ok(calls(&[("c", "Teleport", "{}")])))
        .unwrap();
    assert_eq!(core.ending(), Some(Ending::Failed));
    assert!(fx(&mut core).sends.is_empty());
}

#[test]
fn a_fork_closes_inherited_calls_with_an_explicit_result() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut core = new_core(dir.path(), "p");
        core.input("i", "go").unwrap();
        fx(&mut core);
        core.model_done(1, Ok(calls(&[("c", "Bash", &bash("sleep 9"))])))
            .unwrap();
        fx(&mut core);
    }
    crate::sessions::Sessions::new(dir.path())
        .fork("p", "child", Some(1))
        .unwrap();
    let mut core = resume(dir.path(), "child");
    let f = fx(&mut core);
    assert!(f.adds.is_empty(), "nothing of the parent runs in the child");
    assert_ne!(core.config().sandbox_id.as_str(), "sb");
    core.kick().unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1);
    let results = result_texts(&f.sends[0].1);
    assert!(results[0].1.contains("interrupted by fork"), "{results:?}");
    assert!(
        crate::sessions::Sessions::new(dir.path())
            .fork("p", "child", None)
            .is_err(),
        "a fork never overwrites"
    );
    assert!(
        crate::sessions::Sessions::new(dir.path())
            .fork("p", "c2", Some(5))
            .is_err()
    );
}

/// Every tool call in a request has a result (a provider rejects a call
/// without one), and no call has two final results.
fn assert_every_call_has_one_result(req: &crate::llm::Request) {
    use std::collections::HashMap;
    let mut finals: HashMap<String, usize> = HashMap::new();
    for (id, text) in result_texts(req) {
        let e = finals.entry(id).or_default();
        if text != RUNNING_PLACEHOLDER {
            *e += 1;
        }
    }
    for item in &req.input {
        if let Item::ToolCall { call_id, .. } = item {
            assert!(
                finals.contains_key(&**call_id),
                "call {call_id} has no result in the request"
            );
        }
    }
    for (id, n) in finals {
        assert!(n <= 1, "call {id} has {n} final results");
    }
}

#[test]
fn a_long_session_replays_in_one_read() {
    let dir = tempfile::tempdir().unwrap();
    let log = SessionLog::create(dir.path(), "s").unwrap();
    let mut cfg = config();
    cfg.max_turns = 1_000;
    let mut core = Core::create(log, cfg).unwrap();
    core.input("i", "go").unwrap();
    let mut turn = fx(&mut core).sends[0].0;
    for n in 0..150 {
        core.model_done(turn, Ok(calls(&[(&format!("c{n}"), "Bash", &bash("x"))])))
            .unwrap();
        let ops = fx(&mut core).adds;
        core.operation(done(&ops[0], &format!("out {n}"))).unwrap();
        turn = fx(&mut core).sends[0].0;
    }
    assert!(core.state().turns() > 150);
    assert!(kinds(dir.path(), "s").len() > 600);
    assert_replays(dir.path(), &core);
}

#[test]
fn heartbeats_never_fire_when_idle_disturbed_or_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.heartbeat(now_ms()).unwrap();
    assert!(!core.waiting_only_for_calls(), "nothing runs");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(
        1,
        Ok(calls(&[
            ("a", "Bash", &bash("x")),
            ("b", "Bash", &bash("y")),
        ])),
    )
    .unwrap();
    let ops = fx(&mut core).adds;
    core.heartbeat(now_ms()).unwrap();
    assert!(
        fx(&mut core).sends.is_empty(),
        "not during the grace window"
    );
    core.grace_over().unwrap();
    core.operation(done(&ops[0], "A")).unwrap();
    fx(&mut core);
    core.heartbeat(now_ms()).unwrap();
    assert!(fx(&mut core).sends.is_empty(), "not while a request is out");
    core.stop(StopMode::Hard, StopCause::Requested).unwrap();
    core.model_done(2, Ok(text("late"))).unwrap();
    core.heartbeat(now_ms()).unwrap();
    assert!(
        !kinds(dir.path(), "s").contains(&"heartbeat"),
        "not while stopping"
    );
}

#[test]
fn an_input_ends_the_grace_window_and_a_hard_stop_during_it_starts_no_turn() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.model_done(1, Ok(calls(&[("a", "Bash", &bash("x"))])))
        .unwrap();
    fx(&mut core);
    assert!(core.grace_active());
    core.input("i2", "hurry").unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "an input ends the window at once");
    assert!(!core.grace_active());

    let dir = tempfile::tempdir().unwrap();
    let (mut core, ops) = with_calls(dir.path(), &[("a", "Bash", &bash("x"))]);
    core.stop(StopMode::Hard, StopCause::Requested).unwrap();
    assert!(!core.grace_active());
    core.operation(done(&ops[0], "A")).unwrap();
    assert!(fx(&mut core).sends.is_empty());
    assert_eq!(core.ending(), Some(Ending::Interrupted));
    // A stop does not outlive its run: the next one delivers the result.
    drop(core);
    let mut core = resume(dir.path(), "s");
    assert_eq!(core.ending(), None);
    core.kick().unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1);
    assert_eq!(result_texts(&f.sends[0].1), [("a".into(), "A".into())]);
}

#[test]
fn a_newer_response_replaces_the_grace_window() {
    let dir = tempfile::tempdir().unwrap();
    let (mut core, first) = with_calls(dir.path(), &[("a", "Bash", &bash("slow"))]);
    core.grace_over().unwrap();
    core.input("i2", "also").unwrap();
    fx(&mut core);
    core.model_done(2, Ok(calls(&[("b", "Bash", &bash("fast"))])))
        .unwrap();
    let second = fx(&mut core).adds;
    assert!(core.grace_active());
    core.operation(done(&second[0], "B")).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "only turn 2's calls count for its window");
    assert!(!core.grace_active());
    core.operation(done(&first[0], "A")).unwrap();
    assert!(
        fx(&mut core).sends.is_empty(),
        "no interrupting the request"
    );
}

/// A small deterministic generator, so failures reproduce from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Random interleavings of inputs, model answers (text, calls, malformed
/// calls, failures, stale answers), operation updates, grace expiries,
/// heartbeats, stops and crashes: after every run the log replays to the
/// live state, and after a crash the resumed session replays too.
#[test]
fn random_interleavings_replay_to_the_same_state() {
    for seed in 1..=60u64 {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut core = new_core(dir.path(), "s");
        let mut in_flight: Vec<u64> = Vec::new();
        let mut running: Vec<Operation> = Vec::new();
        let mut n = 0;
        for _ in 0..40 {
            n += 1;
            let step = rng.below(10);
            match step {
                0 | 1 => core
                    .input(&format!("in{n}"), &format!("input {n}"))
                    .unwrap(),
                2..=4 if !in_flight.is_empty() => {
                    let turn = in_flight[rng.below(in_flight.len())];
                    let answer = match rng.below(5) {
                        0 => Ok(text(&format!("answer {n}"))),
                        1 => Ok(calls(&[(&format!("c{n}"), "Bash", &bash("x"))])),
                        2 => Ok(calls(&[
                            (&format!("c{n}a"), "Bash", &bash("y")),
                            (&format!("c{n}b"), "Bash", "{oops"),
                        ])),
                        3 => Ok(calls(&[(&format!("c{n}"), "SkillUse", "{}")])),
                        _ => Err(crate::llm::LlmError::Transport("down".into())),
                    };
                    core.model_done(turn, answer).unwrap();
                }
                5 | 6 if !running.is_empty() => {
                    let op = running.remove(rng.below(running.len()));
                    let end = if rng.below(4) == 0 {
                        let mut o = op.clone();
                        o.fail("lost");
                        o
                    } else {
                        done(&op, &format!("out {n}"))
                    };
                    core.operation(end).unwrap();
                }
                7 => core.grace_over().unwrap(),
                8 => core.heartbeat(1_000 * n).unwrap(),
                _ => {
                    if rng.below(3) == 0 {
                        core.stop(StopMode::Hard, StopCause::Requested).unwrap();
                    } else {
                        // A crash: the next process resumes from the log.
                        drop(core);
                        core = resume(dir.path(), "s");
                        core.kick().unwrap();
                        in_flight.clear();
                    }
                }
            }
            for e in core.take_effects() {
                match e {
                    Effect::Send { turn, request } => {
                        assert_every_call_has_one_result(&request);
                        in_flight.push(turn);
                    }
                    Effect::Add(ops) => {
                        for op in ops {
                            running.retain(|o| o.id != op.id);
                            running.push(op);
                        }
                    }
                    _ => {}
                }
            }
            assert_replays(dir.path(), &core);
        }
    }
}

fn too_long() -> crate::llm::LlmError {
    crate::llm::LlmError::Http {
        api: "responses",
        status: 400,
        code: Some("context_length_exceeded".into()),
        message: "Your input exceeds the context window of this model.".into(),
        retry_after: None,
    }
}

#[test]
fn a_request_refused_as_too_long_is_cut_down_and_sent_again_a_few_times() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    let mut turn = fx(&mut core).sends[0].0;
    for n in 0..6 {
        core.model_done(turn, Ok(calls(&[(&format!("c{n}"), "Bash", &bash("x"))])))
            .unwrap();
        let ops = fx(&mut core).adds;
        core.operation(done(&ops[0], &"y".repeat(20_000))).unwrap();
        turn = fx(&mut core).sends[0].0;
    }
    let before = core.state().context.build().estimated_tokens;
    core.model_done(turn, Err(too_long())).unwrap();
    let f = fx(&mut core);
    assert_eq!(f.sends.len(), 1, "sent again at once");
    let Some(Event::TurnStarted {
        estimated_tokens,
        changes,
        ..
    }) = f
        .events
        .iter()
        .find(|e| matches!(e, Event::TurnStarted { .. }))
        .cloned()
    else {
        panic!()
    };
    assert!(
        estimated_tokens <= before * 3 / 4,
        "{estimated_tokens} vs {before}"
    );
    assert!(!changes.is_empty(), "what was elided is reported");
    assert!(kinds(dir.path(), "s").contains(&"shrink"));
    assert_replays(dir.path(), &core);
    // It gives up after a few tries, with the provider's words.
    for _ in 0..MAX_SHRINKS {
        let turn = core.state().in_flight.unwrap();
        core.model_done(turn, Err(too_long())).unwrap();
        fx(&mut core);
    }
    assert_eq!(core.ending(), Some(Ending::Failed));
    assert!(
        core.state()
            .failure
            .as_deref()
            .unwrap()
            .contains("context window")
    );
    assert_replays(dir.path(), &core);
}

/// Servers that repeat call ids (`call_0` every turn, or two calls with one
/// id) still get each result matched to its own call.
#[test]
fn repeated_call_ids_are_made_unique_before_they_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (mut core, first) = with_calls(dir.path(), &[("call_0", "Bash", &bash("slow"))]);
    core.grace_over().unwrap();
    core.input("i2", "also").unwrap();
    fx(&mut core);
    core.model_done(
        2,
        Ok(calls(&[
            ("call_0", "Bash", &bash("a")),
            ("call_0", "Bash", &bash("b")),
        ])),
    )
    .unwrap();
    let second = fx(&mut core).adds;
    assert_eq!(core.state().tool_calls(), 3, "three calls, three records");
    core.operation(done(&second[0], "A")).unwrap();
    core.operation(done(&second[1], "B")).unwrap();
    core.operation(done(&first[0], "SLOW")).unwrap();
    core.model_done(3, Ok(text("ok"))).unwrap();
    let built = core.state().context.build().request;
    assert_every_call_has_one_result(&built);
    let results = result_texts(&built);
    assert!(
        results.contains(&("call_0.t2.1".into(), "A".into())),
        "{results:?}"
    );
    assert!(
        results.contains(&("call_0.t2.2".into(), "B".into())),
        "{results:?}"
    );
    assert_replays(dir.path(), &core);
}

#[test]
fn the_cache_key_is_a_fixed_length_digest_of_the_session_id() {
    let long = "s".repeat(128);
    let key = super::cache_key(&long);
    assert!(key.len() <= 64, "{key}");
    assert_eq!(key.len(), super::cache_key("a").len());
    assert_ne!(super::cache_key("a"), super::cache_key("b"));
    assert_eq!(super::cache_key("a"), super::cache_key("a"));
}

#[test]
fn a_call_is_lost_by_how_its_operation_failed_never_by_the_words() {
    use crate::tools::CallOutcome;
    let spec = corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true"));
    let ended = |f: &dyn Fn(&mut Operation)| {
        let mut op = Operation::new(OperationId::random(), spec.clone());
        f(&mut op);
        Ended::of(&CallOutcome::Submit, &[op.view()]).status
    };
    // Whatever the words, a loss is a loss...
    assert_eq!(
        ended(&|o| o.fail_lost("worker w1 went away")),
        CallEnd::Lost
    );
    assert_eq!(ended(&|o| o.fail_lost("")), CallEnd::Lost);
    // ... and words that read like one are not.
    assert_eq!(ended(&|o| o.fail("sandbox s1 was lost")), CallEnd::Failed);
    assert_eq!(ended(&|o| o.fail("the sandbox was lost")), CallEnd::Failed);
    let lost = OperationResult::with_outcome(Outcome::SandboxLost {
        reason: "gone".into(),
    });
    assert_eq!(ended(&|o| o.finish(lost.clone())), CallEnd::Lost);
}

#[test]
fn the_settings_alone_come_out_as_a_full_replay_leaves_them() {
    use crate::agent::record::Endpoint;
    use crate::llm::Api;
    let records = [
        Record::Start { config: config() },
        Record::Resume {
            at_unix_ms: 1,
            max_turns: Some(3),
            model: Some("m2".into()),
            endpoint: Some(Endpoint {
                base_url: "http://127.0.0.1:9/v1".into(),
                api: Api::Chat,
            }),
            tool_choice: None,
            context_window_tokens: Some(64_000),
            max_output_tokens: Some(2_000),
            reasoning_effort: Some("high".into()),
        },
        Record::Placed {
            worker: Some("http://127.0.0.1:7070".into()),
            worker_id: Some("w2".into()),
            sandbox_id: SandboxId::new("sb-g1").unwrap(),
            generation: 1,
            text: "moved".into(),
        },
        Record::Shrink {
            turn: 4,
            context_window_tokens: 16_000,
            error: "too long".into(),
        },
        Record::Forked {
            parent: "p".into(),
            sandbox_id: SandboxId::new("sb-child").unwrap(),
        },
    ];
    let mut state = State::new();
    let mut alone = None;
    for (i, rec) in records.iter().enumerate() {
        state.apply(rec);
        crate::agent::state::apply_to_config(&mut alone, rec);
        assert_eq!(alone, state.config, "after record {i}");
    }
    let c = alone.unwrap();
    assert_eq!(
        (c.model.as_str(), c.sandbox_id.as_str()),
        ("m2", "sb-child")
    );
    assert_eq!(c.budget.context_window_tokens, 16_000);
}

#[test]
fn a_call_id_a_model_repeats_is_counted_alike_in_the_state_and_the_listing() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i1", "go").unwrap();
    fx(&mut core);
    // Two calls under one id in one answer (a model's mistake): each is a
    // call of its own, and the listing's brief counts what the state
    // counts (the core checks the two agree after every record).
    core.model_done(
        1,
        Ok(calls(&[
            ("c1", "Bash", &bash("true")),
            ("c1", "Bash", &bash("false")),
        ])),
    )
    .unwrap();
    assert_eq!(core.state().tool_calls(), 2);
    let listed = crate::agent::Brief::of(core.state());
    assert_eq!(listed.tool_calls, 2);
    assert_replays(dir.path(), &core);
}

#[test]
fn egress_decisions_not_told_or_not_taken_are_recorded_as_a_gap() {
    let dir = tempfile::tempdir().unwrap();
    let mut core = new_core(dir.path(), "s");
    core.input("i", "go").unwrap();
    fx(&mut core);
    core.egress(&corral_proto::event::Egress {
        host: "pypi.org".into(),
        port: 443,
        decision: corral_proto::event::EgressDecision::Blocked,
        reason: "too_many_connections".into(),
        unreported: 40,
    })
    .unwrap();
    core.egress_unrecorded(7).unwrap();
    let log = std::fs::read_to_string(
        std::fs::read_dir(dir.path())
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path(),
    )
    .unwrap();
    assert!(log.contains("\"unreported\":40"), "{log}");
    assert!(
        log.contains("egress_unrecorded") && log.contains("\"count\":7"),
        "{log}"
    );
    assert_replays(dir.path(), &core);
}
