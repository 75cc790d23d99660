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
//! (calibration: two sides that differ in nothing). Besides rates, each
//! window counts CPU time: the worker's threads', the control plane's
//! (sessions) and the whole machine's, per operation or event, which the
//! machine's noise moves less than throughput, and the ratio the machine's
//! time gives when what tracing adds (the worker's and the control plane's
//! extra CPU) is added to the side without it. Each series has a
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

/// What one measured stretch took: its count (operations, or a session's
/// events), its wall time, and the CPU time, in nanoseconds, of the
/// worker, of the control plane's process (sessions only) and of the whole
/// machine.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    count: usize,
    secs: f64,
    worker: u64,
    control: u64,
    machine: u64,
}

impl Window {
    fn rate(&self) -> f64 {
        self.count as f64 / self.secs
    }
}

/// The CPU time each thread of a process has used, in nanoseconds (the
/// first field of `/proc/PID/task/TID/schedstat`): finer than the clock
/// ticks of `/proc/PID/stat`, which a session's quarter of a second on the
/// worker barely moves.
fn threads_ns(pid: u32) -> Result<std::collections::HashMap<u32, u64>> {
    let mut out = std::collections::HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?;
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread that ended meanwhile is skipped.
        if let Ok(s) = std::fs::read_to_string(task.path().join("schedstat"))
            && let Some(ns) = s.split_whitespace().next().and_then(|v| v.parse().ok())
        {
            out.insert(tid, ns);
        }
    }
    Ok(out)
}

/// The CPU time a process's threads used since `before` (threads started
/// meanwhile from zero; one that both started and ended meanwhile is not
/// seen: the worker's threads live as long as it does).
fn threads_ns_since(pid: u32, before: &std::collections::HashMap<u32, u64>) -> Result<u64> {
    Ok(threads_ns(pid)?
        .iter()
        .map(|(tid, ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum())
}

/// The busy CPU time of the whole machine (every CPU, idle and I/O wait
/// left out), in nanoseconds (counted in clock ticks).
fn machine_ns() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as u64;
    Ok((v.iter().sum::<u64>() - v[3] - v[4]) * (1_000_000_000 / hz))
}

/// The CPU time of the children this process has waited for, in
/// nanoseconds.
fn children_ns() -> u64 {
    let ru = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN);
    ru.map(|r| {
        let t = |v: nix::sys::time::TimeVal| {
            v.tv_sec() as u64 * 1_000_000_000 + v.tv_usec() as u64 * 1000
        };
        t(r.user_time()) + t(r.system_time())
    })
    .unwrap_or(0)
}

/// Operations at P8 on `worker`'s sandbox `sb`: their rate and what they
/// cost in CPU.
async fn ops_window(worker: &WorkerProcess, sb: &SandboxId, traced: bool) -> Result<Window> {
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
    let pid = worker.child.id();
    let (w0, m0) = (threads_ns(pid)?, machine_ns()?);
    let started = Instant::now();
    for t in tasks {
        t.await??;
    }
    Ok(Window {
        count: CLIENTS * OPS_PER_CLIENT,
        secs: started.elapsed().as_secs_f64(),
        worker: threads_ns_since(pid, &w0)?,
        control: 0,
        machine: machine_ns()? - m0,
    })
}

/// A session's events on `worker` (traced with `otlp`): their rate and
/// what the session cost in CPU.
async fn session_window(
    model: &ModelServer,
    worker: &WorkerProcess,
    otlp: Option<&str>,
) -> Result<Window> {
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
    let (w0, m0) = (threads_ns(worker.child.id())?, machine_ns()?);
    let c0 = children_ns();
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
    let (worker_ns, machine) = (
        threads_ns_since(worker.child.id(), &w0)?,
        machine_ns()? - m0,
    );
    let out = child.wait_with_output().await?;
    // Its whole life, the exporter's last flush at exit included (the
    // one child this process waits for meanwhile).
    let control = children_ns() - c0;
    ensure!(
        done && out.status.success(),
        "corral run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(Window {
        count: events,
        secs: took.as_secs_f64(),
        worker: worker_ns,
        control,
        machine,
    })
}

/// A row of the CPU table: what it counts, the off, on and calibration
/// windows, and which time.
type CpuRow<'a> = (
    &'a str,
    &'a [Window],
    &'a [Window],
    &'a [Window],
    fn(&Window) -> u64,
);

fn rates(w: &[Window]) -> Vec<f64> {
    w.iter().map(Window::rate).collect()
}

/// Microseconds of `field`'s CPU time per counted thing, over windows.
fn per(w: &[Window], field: fn(&Window) -> u64) -> f64 {
    let ns: u64 = w.iter().map(field).sum();
    let count: usize = w.iter().map(|w| w.count).sum();
    ns as f64 / 1000.0 / count as f64
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
    ops_window(&plain, &sandboxes[0], true).await?;
    ops_window(&traced, &sandboxes[1], true).await?;
    ops_window(&traced, &sandboxes[2], false).await?;
    ops_window(&twin, &sandboxes[3], true).await?;
    let (mut ops_off, mut ops_on, mut ops_same, mut ev_off, mut ev_on) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut ops_twin, mut ev_twin) = (vec![], vec![]);
    for round in 0..ROUNDS {
        // The sides take turns going first.
        for k in 0..3 {
            match (round + k) % 3 {
                0 => {
                    ops_on.push(ops_window(&traced, &sandboxes[1], true).await?);
                    ops_same.push(ops_window(&traced, &sandboxes[2], false).await?);
                    ev_on.push(session_window(&model, &traced, Some(&endpoint)).await?);
                }
                1 => {
                    ops_off.push(ops_window(&plain, &sandboxes[0], true).await?);
                    ev_off.push(session_window(&model, &plain, None).await?);
                }
                _ => {
                    ops_twin.push(ops_window(&twin, &sandboxes[3], true).await?);
                    ev_twin.push(session_window(&model, &twin, None).await?);
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
    // A round's two sides ran minutes apart at most, so the ratio within
    // a round is the one the machine's drift moves least: its median is
    // the figure, its spread what the machine allows.
    println!(
        "| rate (median of {ROUNDS} rounds) | tracing off | tracing on | on / off (median of the rounds' ratios) | lowest, highest |\n|---|---|---|---|---|"
    );
    let rows: [(&str, &[Window], &[Window]); 5] = [
        ("operations per second, P8 (`true`)", &ops_off, &ops_on),
        (
            "operations per second, P8, on the tracing worker: no traceparent / with",
            &ops_same,
            &ops_on,
        ),
        ("a session's events per second (40 calls)", &ev_off, &ev_on),
        (
            "calibration: operations per second, two workers without tracing",
            &ops_off,
            &ops_twin,
        ),
        (
            "calibration: a session's events per second, two workers without tracing",
            &ev_off,
            &ev_twin,
        ),
    ];
    for (what, off, on) in rows {
        let (a, b) = (median(rates(off)), median(rates(on)));
        let mut r: Vec<f64> = off
            .iter()
            .zip(on)
            .map(|(x, y)| y.rate() / x.rate())
            .collect();
        r.sort_by(f64::total_cmp);
        println!(
            "| {what} | {a:.0} | {b:.0} | {:.2}x | {:.2}x, {:.2}x |",
            r[r.len() / 2],
            r[0],
            r[r.len() - 1]
        );
    }
    // What tracing costs in CPU, summed over every round: the work that
    // differs between the sides is the worker's (and the control plane's
    // in a session); the sandbox's is the same.
    println!(
        "\n| CPU time, microseconds (all {ROUNDS} rounds) | tracing off | tracing on | on - off | calibration: off 2 - off |\n|---|---|---|---|---|"
    );
    let cpu: [CpuRow; 5] = [
        (
            "the worker, per operation",
            &ops_off,
            &ops_on,
            &ops_twin,
            |w| w.worker,
        ),
        (
            "the machine, per operation",
            &ops_off,
            &ops_on,
            &ops_twin,
            |w| w.machine,
        ),
        (
            "the worker, per session event",
            &ev_off,
            &ev_on,
            &ev_twin,
            |w| w.worker,
        ),
        (
            "the control plane (`corral run`), per session event",
            &ev_off,
            &ev_on,
            &ev_twin,
            |w| w.control,
        ),
        (
            "the machine, per session event",
            &ev_off,
            &ev_on,
            &ev_twin,
            |w| w.machine,
        ),
    ];
    for (what, off, on, twin, field) in cpu {
        let (a, b, c) = (per(off, field), per(on, field), per(twin, field));
        println!(
            "| {what} | {a:.0} | {b:.0} | {:+.0} ({:+.1}%) | {:+.0} ({:+.1}%) |",
            b - a,
            (b - a) / a * 100.0,
            c - a,
            (c - a) / a * 100.0
        );
    }
    // What tracing costs the machine, from what differs between the
    // sides: the worker's CPU (and the control plane's, in a session),
    // measured per process, added to what the side without tracing spent
    // in all (the sandbox, the engine and the clients do the same work on
    // both sides, and the machine's total moves by more than the
    // difference from one window to the next: the calibration row).
    println!(
        "\n| by CPU: the machine's time per unit without tracing / with what tracing adds (worker, control plane) | on / off | calibration: off 2 / off |\n|---|---|---|"
    );
    let by_cpu = |off: &[Window], on: &[Window]| {
        let base = per(off, |w| w.machine);
        let extra = (per(on, |w| w.worker) - per(off, |w| w.worker))
            + (per(on, |w| w.control) - per(off, |w| w.control));
        base / (base + extra)
    };
    for (what, off, on, twin) in [
        ("operations per second, P8", &ops_off, &ops_on, &ops_twin),
        ("a session's events per second", &ev_off, &ev_on, &ev_twin),
    ] {
        println!(
            "| {what} | {:.3}x | {:.3}x |",
            by_cpu(off, on),
            by_cpu(off, twin)
        );
    }
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
