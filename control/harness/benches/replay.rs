//! Replay of a session log: what a resumed session, `session ls` and a
//! fork do with a log of 1,000, 10,000 and 100,000 records. Each turn is
//! five records (turn, response with one Bash call, call, operation
//! result, tool result), applied to the session state as a resume does.
//!
//! The log is read once as a stream ([`replay`]); the obvious alternative,
//! measured in the same run, is the paged replay it replaced: each page of
//! 256 records read again from the top of the file, which makes a full
//! replay quadratic in the log's length (run up to 10,000 records; at
//! 100,000 it would take minutes).
//!
//! Run: `cargo bench -p corral-harness --bench replay`.

// A report printer: printing is its job.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use corral_harness::agent::record::{CallOutcome, OpEntry, OpSnapshot};
use corral_harness::agent::{Record, SessionConfig, State, replay};
use corral_harness::context::Budget;
use corral_harness::llm::{Item, Response, StopReason, ToolOutput, Usage};
use corral_harness::ops::OpStatus;
use corral_harness::session::SessionLog;
use corral_proto::{
    Captured, OperationId, OperationResult, OperationSpec, Outcome, SandboxId, ShellSpec,
};

const SIZES: [u64; 3] = [1_000, 10_000, 100_000];
/// The paged replay is run up to this size.
const PAGED_UP_TO: u64 = 10_000;
const PAGE: usize = 256;

fn config(turns: u64) -> SessionConfig {
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
        max_turns: turns + 10,
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

/// The five records of turn `turn`.
fn turn_records(turn: u64) -> [Record; 5] {
    let call_id = format!("call_{turn}");
    let command = format!("grep -rn needle_{turn} src/");
    let op = OperationId::random();
    let out = format!("src/file_{turn}.rs:{turn}: needle\n").repeat(20);
    let mut result = OperationResult::with_outcome(Outcome::Exited { code: 0 });
    result.stdout = Captured {
        total_bytes: out.len() as u64,
        head: Bytes::from(out.clone()),
        tail: Bytes::new(),
        truncated: false,
    };
    [
        Record::Turn { turn },
        Record::Response {
            turn,
            response: Response {
                id: None,
                stop: StopReason::Complete,
                output: vec![Item::ToolCall {
                    call_id: call_id.as_str().into(),
                    name: "Bash".into(),
                    arguments: format!("{{\"command\":\"{command}\"}}").into(),
                    provider_id: None,
                }],
                usage: Usage::default(),
            },
        },
        Record::Call {
            call_id: call_id.clone(),
            tool: "Bash".into(),
            arguments: format!("{{\"command\":\"{command}\"}}"),
            turn,
            at_unix_ms: 1_700_000_000_000 + turn as i64,
            outcome: CallOutcome::Submit,
            operations: vec![OpEntry {
                id: op.clone(),
                spec: OperationSpec::Shell(ShellSpec::new(command)),
            }],
        },
        Record::Operation {
            snapshot: OpSnapshot {
                id: op,
                status: OpStatus::Completed,
                result: Some(result),
                failure: None,
                lost: false,
            },
        },
        Record::Result {
            call_id,
            output: vec![ToolOutput::Text { text: out.into() }],
            running: false,
        },
    ]
}

/// Writes a session of about `records` records (the fsyncs of a live
/// session are not what is measured here).
fn write_session(dir: &Path, id: &str, records: u64) {
    drop(SessionLog::<Record>::create(dir, id).unwrap());
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(corral_harness::session::log::path_of(dir, id))
        .unwrap();
    let mut out = std::io::BufWriter::new(file);
    let mut seq = 0u64;
    let mut line = |rec: &Record| {
        seq += 1;
        let l = serde_json::json!({ "seq": seq, "record": rec });
        writeln!(out, "{l}").unwrap();
    };
    let turns = (records - 2) / 5;
    line(&Record::Start {
        config: config(turns),
    });
    line(&Record::Input {
        input_id: "i".into(),
        text: "The build is broken; please fix it.".into(),
    });
    for turn in 1..=turns {
        for rec in turn_records(turn) {
            line(&rec);
        }
    }
    out.flush().unwrap();
}

/// The replay this code replaced: each page read again from the top.
fn paged_replay(dir: &Path, id: &str) -> State {
    let mut state = State::new();
    let mut after = 0usize;
    loop {
        let page: Vec<_> = SessionLog::<Record>::records(dir, id)
            .unwrap()
            .skip(after)
            .take(PAGE + 1)
            .map(Result::unwrap)
            .collect();
        let more = page.len() > PAGE;
        for (_, rec) in page.iter().take(PAGE) {
            state.apply(rec);
        }
        if !more {
            return state;
        }
        after += PAGE;
    }
}

fn best_of(runs: usize, mut f: impl FnMut() -> u64) -> (Duration, u64) {
    let mut best = Duration::MAX;
    let mut turns = 0;
    for _ in 0..runs {
        let start = Instant::now();
        turns = f();
        best = best.min(start.elapsed());
    }
    (best, turns)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    println!("session log replay (state rebuilt record by record), best of 3");
    println!(
        "{:>9} {:>10} {:>12} {:>14} {:>12} {:>8}",
        "records", "MiB", "stream ms", "µs/record", "paged ms", "paged/stream"
    );
    for n in SIZES {
        let id = format!("s{n}");
        write_session(dir.path(), &id, n);
        let bytes = std::fs::metadata(corral_harness::session::log::path_of(dir.path(), &id))
            .unwrap()
            .len();
        let runs = if n >= 100_000 { 1 } else { 3 };
        let (stream, turns) = best_of(runs, || replay(dir.path(), &id).unwrap().turns());
        assert_eq!(turns, (n - 2) / 5);
        let paged = (n <= PAGED_UP_TO).then(|| {
            best_of(runs, || {
                let s = paged_replay(dir.path(), &id);
                s.turns()
            })
        });
        if let Some((_, t)) = paged {
            assert_eq!(t, turns);
        }
        let records = (n - 2) / 5 * 5 + 2;
        println!(
            "{:>9} {:>10.1} {:>12.1} {:>14.2} {:>12} {:>8}",
            records,
            bytes as f64 / (1 << 20) as f64,
            stream.as_secs_f64() * 1e3,
            stream.as_secs_f64() * 1e6 / records as f64,
            paged.map_or("-".into(), |(d, _)| format!("{:.1}", d.as_secs_f64() * 1e3)),
            paged.map_or("-".into(), |(d, _)| format!(
                "{:.1}x",
                d.as_secs_f64() / stream.as_secs_f64()
            )),
        );
    }
}
