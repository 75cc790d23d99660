//! Traces on against off, in one run, over the same image and model
//! server: two workers, one started with `--otlp-endpoint` (exporting to a
//! real OTLP receiver of the bench's own), one without.
//! - operations per second at P8: eight clients each submit `true` and
//!   wait for its end, one after the other, in one sandbox; every submit
//!   carries a `traceparent` (the traced worker keeps it and makes a span
//!   when the operation ends; the other ignores it); timed over 160 each
//!   after 64 each unmeasured, so a window starts in its side's steady
//!   state (spans are exported in batches a second apart: the batch made
//!   before a window goes out inside it, as the window's own last goes out
//!   after it);
//! - a session's events per second: `corral run --json` of a session whose
//!   one turn makes 40 quick calls, with `--otlp-endpoint` on the traced
//!   side (the run's spans too), from the process's start to its result
//!   event read (results not batched: a grace of 0).
//!
//! The sides take turns going first; the tracing worker is also measured
//! with submits that carry no trace context (the same process, its spans
//! off), and a second worker without tracing is measured as the first is
//! (calibration: two sides that differ in nothing). Each series has a
//! sandbox of its own, so all have run as many operations at each round
//! (an operation costs more in a sandbox that has run many: see
//! docs/performance.md). Run: `cargo bench -p corral-e2e
//! --bench tracing` after `deploy/build.sh`. Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral_e2e::model::{ModelServer, Received, Reply, responses};
use corral_e2e::otlp::Receiver;
use corral_e2e::{WorkerProcess, free_port, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::{EventKind, OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};
use futures_util::StreamExt;
use serde_json::json;
use tokio::io::AsyncBufReadExt;

const ROUNDS: usize = 10;
const CLIENTS: usize = 8;
/// Operations each client runs before the window opens: more than a
/// batch interval's worth, so the window starts in the steady state of
/// its side (the spans before it being exported inside it, as its own
/// are after it).
const WARM_PER_CLIENT: usize = 64;
/// Operations each client runs in the measured window.
const OPS_PER_CLIENT: usize = 160;
const CALLS: usize = 40;

fn model(req: &Received) -> Reply {
    if req.text().contains("function_call_output") {
        return responses::text("Done.");
    }
    let calls: Vec<(String, String)> = (0..CALLS)
        .map(|i| (format!("c{i}"), json!({ "command": "true" }).to_string()))
        .collect();
    let list: Vec<(&str, &str, &str)> = calls
        .iter()
        .map(|(id, args)| (id.as_str(), "Bash", args.as_str()))
        .collect();
    responses::calls(&list)
}

/// A fresh W3C trace context.
fn traceparent() -> String {
    let t = uuid::Uuid::new_v4().simple().to_string();
    let s = &uuid::Uuid::new_v4().simple().to_string()[..16];
    format!("00-{t}-{s}-01")
}

/// One client's operations, each submitted (with a trace context when
/// `traced`) then waited for: `WARM_PER_CLIENT`, then (once every client
/// is there) `OPS_PER_CLIENT`.
async fn client_ops(
    client: WorkerClient,
    sb: SandboxId,
    traced: bool,
    window: std::sync::Arc<tokio::sync::Barrier>,
) -> Result<()> {
    for i in 0..WARM_PER_CLIENT + OPS_PER_CLIENT {
        if i == WARM_PER_CLIENT {
            window.wait().await;
        }
        let op = OperationId::random();
        let cursor = client.get_sandbox(&sb).await?.last_seq;
        let mut stream = client.watch(&sb, cursor, Some(&op)).await?;
        client
            .submit_traced(
                &sb,
                &op,
                OperationSpec::Shell(ShellSpec::new("true")),
                traced.then(traceparent).as_deref(),
            )
            .await?;
        loop {
            let e = stream.next().await.context("stream ended")??;
            if let EventKind::Finished(r) = e.kind {
                ensure!(r.outcome.is_success(), "{:?}", r.outcome);
                break;
            }
        }
    }
    Ok(())
}

/// Operations per second at P8 on `worker`'s sandbox `sb`.
async fn ops_per_second(worker: &WorkerProcess, sb: &SandboxId, traced: bool) -> Result<f64> {
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(worker.client().await?);
    }
    let window = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS + 1));
    let mut tasks = Vec::new();
    for client in clients {
        tasks.push(tokio::spawn(client_ops(
            client,
            sb.clone(),
            traced,
            window.clone(),
        )));
    }
    window.wait().await;
    let started = Instant::now();
    for t in tasks {
        t.await??;
    }
    Ok((CLIENTS * OPS_PER_CLIENT) as f64 / started.elapsed().as_secs_f64())
}

/// A session's events per second on `worker` (traced with `otlp`).
async fn events_per_second(
    model: &ModelServer,
    worker: &WorkerProcess,
    otlp: Option<&str>,
) -> Result<f64> {
    let sessions = tempfile::tempdir()?;
    let id = unique_id("trb-");
    let mut args = vec!["--session", id.as_str()];
    if let Some(e) = otlp {
        args.extend(["--otlp-endpoint", e]);
    }
    args.push("calls");
    let mut cmd = corral_e2e::run::command(model, &worker.url, sessions.path(), &args);
    cmd.env("CORRAL_TOKEN_FILE", worker.token_file())
        .env("CORRAL_HEARTBEAT", "0")
        .env("CORRAL_GRACE", "0s");
    // To the result event in the reader's hands (what is exported after it,
    // at the process's exit, is not the session's time).
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut events = 0;
    let mut done = false;
    while let Some(line) = lines.next_line().await? {
        events += 1;
        if line.contains("\"type\":\"result\"") {
            done = line.contains("\"status\":\"done\"");
            break;
        }
    }
    let took = started.elapsed();
    let out = child.wait_with_output().await?;
    ensure!(
        done && out.status.success(),
        "corral run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(events as f64 / took.as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let receiver = Receiver::default();
    let endpoint = receiver.serve().await?;
    let (plain_state, traced_state, twin_state) = (
        tempfile::tempdir()?,
        tempfile::tempdir()?,
        tempfile::tempdir()?,
    );
    // Both log warnings only (a line per operation on a terminal is a
    // cost of its own, the same on both sides).
    let quiet = [("CORRAL_LOG", "warn")];
    let plain = WorkerProcess::spawn(
        plain_state.path(),
        &unique_id("trb-off"),
        free_port()?,
        &quiet,
        &[],
    )?;
    // A second worker without tracing, measured as the other side is: the
    // ratio of two sides that differ in nothing is what the bench can
    // tell apart on this machine.
    let twin = WorkerProcess::spawn(
        twin_state.path(),
        &unique_id("trb-off2"),
        free_port()?,
        &quiet,
        &[],
    )?;
    let traced = WorkerProcess::spawn(
        traced_state.path(),
        &unique_id("trb-on"),
        free_port()?,
        &quiet,
        &["--otlp-endpoint", &endpoint],
    )?;
    // A sandbox per measured series (off; on; on the tracing worker
    // without a traceparent): an operation costs more the more the
    // sandbox has run (see docs/performance.md), so every series' sandbox
    // has run as many.
    let mut sandboxes = Vec::new();
    for w in [&plain, &traced, &traced, &twin] {
        let sb = SandboxId::random();
        let spec = SandboxSpec {
            image: Some("corral-sandbox:latest".into()),
            ..SandboxSpec::default()
        };
        w.client().await?.create_sandbox(Some(&sb), spec).await?;
        sandboxes.push(sb);
    }
    let model = ModelServer::responding(model).await;
    // Warm both sides once.
    ops_per_second(&plain, &sandboxes[0], true).await?;
    ops_per_second(&traced, &sandboxes[1], true).await?;
    ops_per_second(&traced, &sandboxes[2], false).await?;
    ops_per_second(&twin, &sandboxes[3], true).await?;
    let (mut ops_off, mut ops_on, mut ops_same, mut ev_off, mut ev_on) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut ops_twin, mut ev_twin) = (vec![], vec![]);
    for round in 0..ROUNDS {
        // The sides take turns going first.
        for k in 0..3 {
            match (round + k) % 3 {
                0 => {
                    ops_on.push(ops_per_second(&traced, &sandboxes[1], true).await?);
                    ops_same.push(ops_per_second(&traced, &sandboxes[2], false).await?);
                    ev_on.push(events_per_second(&model, &traced, Some(&endpoint)).await?);
                }
                1 => {
                    ops_off.push(ops_per_second(&plain, &sandboxes[0], true).await?);
                    ev_off.push(events_per_second(&model, &plain, None).await?);
                }
                _ => {
                    ops_twin.push(ops_per_second(&twin, &sandboxes[3], true).await?);
                    ev_twin.push(events_per_second(&model, &twin, None).await?);
                }
            }
        }
    }
    // The spans did arrive (the bench measured real exports).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spans = receiver.spans();
    let ops = spans
        .iter()
        .filter(|s| s.service == "corral-worker")
        .count();
    let runs = spans
        .iter()
        .filter(|s| s.name == "invoke_agent corral")
        .count();
    ensure!(ops > 0 && runs > 0, "no spans arrived");
    let (ops_off, ops_on, ops_same) = (median(ops_off), median(ops_on), median(ops_same));
    let (ev_off, ev_on) = (median(ev_off), median(ev_on));
    let (ops_twin, ev_twin) = (median(ops_twin), median(ev_twin));
    println!(
        "| measure (median of {ROUNDS}) | tracing off | tracing on | on / off |\n|---|---|---|---|"
    );
    println!(
        "| operations per second, P8 (`true`) | {ops_off:.0} | {ops_on:.0} | {:.2}x |",
        ops_on / ops_off
    );
    println!(
        "| operations per second, P8, on the tracing worker: no traceparent / with | {ops_same:.0} | {ops_on:.0} | {:.2}x |",
        ops_on / ops_same
    );
    println!(
        "| a session's events per second (40 calls) | {ev_off:.0} | {ev_on:.0} | {:.2}x |",
        ev_on / ev_off
    );
    println!(
        "| calibration: operations per second, P8, two workers without tracing | {ops_off:.0} | {ops_twin:.0} | {:.2}x |",
        ops_twin / ops_off
    );
    println!(
        "| calibration: a session's events per second, two workers without tracing | {ev_off:.0} | {ev_twin:.0} | {:.2}x |",
        ev_twin / ev_off
    );
    println!("\n{ops} operation spans and {runs} run spans received.");
    for (w, sb) in [
        (&plain, &sandboxes[0]),
        (&traced, &sandboxes[1]),
        (&traced, &sandboxes[2]),
        (&twin, &sandboxes[3]),
    ] {
        let _ = w.client().await?.destroy_sandbox(sb).await;
    }
    Ok(())
}
