//! Coordinator overhead per turn: a scripted model that answers at once
//! with one Bash call, and operations that finish at once, driven through
//! the coordinator's core with a real session log (every record fsynced).
//!
//! Each turn is five records (response, call, operation, result, turn), one
//! translation, one render and one context build. The same run is compared
//! with its obvious floor: appending the same number of records to a bare
//! session log (the fsyncs alone). Then the whole log is replayed, as a
//! resumed session does.
//!
//! Run: `cargo bench -p corral-harness --bench coordinator`.

// A report printer: printing is its job.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use corral_harness::agent::{Core, Effect, Record, SessionConfig, replay};
use corral_harness::context::Budget;
use corral_harness::llm::{Item, Response, StopReason, Usage};
use corral_harness::ops::Operation;
use corral_harness::session::SessionLog;
use corral_proto::{Captured, OperationResult, Outcome, SandboxId};

const TURNS: u64 = 600;

fn config() -> SessionConfig {
    SessionConfig {
        model: "m".into(),
        system_prompt: "Fix the failing test.".into(),
        tools: None,
        sandbox_id: SandboxId::new("bench").unwrap(),
        image: None,
        template: None,
        budget: Budget::default(),
        max_output_tokens: None,
        reasoning_effort: None,
        max_turns: TURNS + 10,
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

fn call(turn: u64) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output: vec![Item::ToolCall {
            call_id: format!("call_{turn}").into(),
            name: "Bash".into(),
            arguments: format!("{{\"command\":\"grep -rn needle_{turn} src/\"}}").into(),
            provider_id: None,
        }],
        usage: Usage::default(),
    }
}

fn finished(op: &Operation, turn: u64) -> Operation {
    let mut op = op.clone();
    let mut r = OperationResult::with_outcome(Outcome::Exited { code: 0 });
    let out = format!("src/file_{turn}.rs:{turn}: needle\n").repeat(20);
    r.stdout = Captured {
        total_bytes: out.len() as u64,
        head: Bytes::from(out),
        tail: Bytes::new(),
        truncated: false,
    };
    op.finish(r);
    op
}

/// Per-turn durations of a session driven for `TURNS` turns.
fn coordinator(dir: &std::path::Path) -> Vec<Duration> {
    let log = SessionLog::create(dir, "bench").unwrap();
    let mut core = Core::create(log, config()).unwrap();
    core.input("i", "The build is broken; please fix it.")
        .unwrap();
    let mut times = Vec::with_capacity(TURNS as usize);
    let mut turn = first_send(&mut core).expect("a first turn");
    for _ in 0..TURNS {
        let start = Instant::now();
        core.model_done(turn, Ok(call(turn))).unwrap();
        let ops: Vec<Operation> = core
            .take_effects()
            .into_iter()
            .filter_map(|e| match e {
                Effect::Add(ops) => Some(ops),
                _ => None,
            })
            .flatten()
            .collect();
        for op in &ops {
            core.operation(finished(op, turn)).unwrap();
        }
        turn = first_send(&mut core).expect("the result wakes the model");
        times.push(start.elapsed());
    }
    times
}

fn first_send(core: &mut Core) -> Option<u64> {
    core.take_effects().into_iter().find_map(|e| match e {
        Effect::Send { turn, .. } => Some(turn),
        _ => None,
    })
}

/// The floor: the same number of fsynced appends, nothing else.
fn appends(dir: &std::path::Path, n: u64) -> Duration {
    let mut log = SessionLog::<Record>::create(dir, "floor").unwrap();
    let rec = Record::Turn { turn: 1 };
    let start = Instant::now();
    for _ in 0..n {
        log.append(&rec).unwrap();
    }
    start.elapsed()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let times = coordinator(dir.path());
    let total: Duration = times.iter().sum();
    let floor = appends(dir.path(), TURNS * 5);
    let early = {
        let mut t = times[..100].to_vec();
        t.sort();
        pct(&t, 0.5)
    };
    let late = {
        let mut t = times[times.len() - 100..].to_vec();
        t.sort();
        pct(&t, 0.5)
    };
    let mut sorted = times;
    sorted.sort();
    println!(
        "coordinator, {TURNS} turns of one Bash call each (5 fsynced records a turn), log in {}",
        dir.path().display()
    );
    println!(
        "  per turn: p50 {:.3} ms, p90 {:.3} ms; turns 1-100 p50 {:.3} ms, turns {}-{TURNS} p50 {:.3} ms",
        pct(&sorted, 0.5).as_secs_f64() * 1e3,
        pct(&sorted, 0.9).as_secs_f64() * 1e3,
        early.as_secs_f64() * 1e3,
        TURNS - 99,
        late.as_secs_f64() * 1e3
    );
    let start = Instant::now();
    let state = replay(dir.path(), "bench").unwrap();
    let replayed = start.elapsed();
    assert_eq!(state.turns(), TURNS + 1);
    println!(
        "  resume: replaying the whole log ({} records) took {:.1} ms",
        TURNS * 5 + 3,
        replayed.as_secs_f64() * 1e3
    );
    println!(
        "  {:.0} turns/s; the fsyncs alone ({} appends): {:.0} turns/s equivalent; coordinator / floor = {:.2}x",
        TURNS as f64 / total.as_secs_f64(),
        TURNS * 5,
        TURNS as f64 / floor.as_secs_f64(),
        total.as_secs_f64() / floor.as_secs_f64()
    );
}
