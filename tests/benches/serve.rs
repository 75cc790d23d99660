//! A session through `corral serve` against the same session run locally
//! by `corral run`, in one run, over the same worker and model server:
//! - start to first model request: from the client's start (the `corral
//!   run` process spawned; `StartSession` sent) to the model server getting
//!   the session's first request (a sandbox created in between, both ways);
//! - events per second: a session whose one turn makes 40 quick tool calls
//!   (about 130 events), from start to its result event in the client's
//!   hands (`corral run --json` read line by line; `WatchSession` read by
//!   the harness's client), results not batched (a grace of 0) on either
//!   side.
//!
//! Run: `cargo bench -p corral-e2e --bench serve` after `deploy/build.sh`.
//! Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral_e2e::model::{ModelServer, Received, Reply, responses};
use corral_e2e::serve::Setup;
use corral_e2e::unique_id;
use corral_proto::pb;
use futures_util::StreamExt;
use serde_json::json;
use tokio::io::AsyncBufReadExt;

const ROUNDS: usize = 12;
const CALLS: usize = 40;

/// When each session's first request came.
type Firsts = Arc<Mutex<std::collections::HashMap<String, Instant>>>;

/// The model: for a prompt `calls`, 40 `true` calls in one turn; for any
/// other, a text answer. Each session's first request is timed.
fn model(firsts: Firsts) -> impl FnMut(&Received) -> Reply + Send + 'static {
    move |req: &Received| {
        let text = req.text();
        let prompt = req.body["input"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| i["role"] == "user")
            .find_map(|i| i["content"].as_str())
            .unwrap_or_default()
            .to_string();
        if let Ok(mut f) = firsts.lock() {
            f.entry(prompt.clone()).or_insert_with(Instant::now);
        }
        if text.contains("function_call_output") || !prompt.starts_with("calls") {
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
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A local `corral run --json` of `prompt`: (time to first request, events,
/// time to the result).
async fn local(
    setup: &Setup,
    firsts: &Firsts,
    prompt: &str,
) -> Result<(Duration, usize, Duration)> {
    let mut cmd = corral_e2e::run::command(
        &setup.model,
        &setup.workers[0].url,
        setup.sessions.path(),
        &[prompt],
    );
    // No batching of results: the events come as fast as they can.
    cmd.env("CORRAL_TOKEN_FILE", &setup.token)
        .env("CORRAL_HEARTBEAT", "0")
        .env("CORRAL_GRACE", "0s");
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut events = 0;
    while let Some(line) = lines.next_line().await? {
        events += 1;
        if line.contains("\"type\":\"result\"") {
            break;
        }
    }
    let ended = started.elapsed();
    let out = child.wait_with_output().await?;
    ensure!(
        out.status.success(),
        "corral run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = firsts
        .lock()
        .ok()
        .and_then(|f| f.get(prompt).copied())
        .context("no request")?;
    Ok((first - started, events, ended))
}

/// The same through the service.
async fn served(
    setup: &Setup,
    firsts: &Firsts,
    prompt: &str,
) -> Result<(Duration, usize, Duration)> {
    let client = setup.client().await?;
    let started = Instant::now();
    let r = client
        .start(pb::StartSessionRequest {
            session_id: unique_id("s-"),
            request_json: json!({ "prompt": prompt }).to_string(),
            settings: Some(pb::RunSettings {
                keep_sandbox: true,
                grace_ms: Some(0),
                ..Default::default()
            }),
        })
        .await?;
    let mut stream = client.watch(&r.session_id, r.events_before).await?;
    let mut events = 0;
    while let Some(item) = stream.next().await {
        let (_, line) = item?;
        events += 1;
        if line.contains("\"type\":\"result\"") {
            break;
        }
    }
    let ended = started.elapsed();
    let first = firsts
        .lock()
        .ok()
        .and_then(|f| f.get(prompt).copied())
        .context("no request")?;
    Ok((first - started, events, ended))
}

#[tokio::main]
async fn main() -> Result<()> {
    let firsts: Firsts = Arc::default();
    let setup = Setup::start_with(
        1,
        8,
        ModelServer::responding(model(firsts.clone())).await,
        false,
        0,
    )
    .await?;
    // Warm both paths (images, the first connections).
    local(&setup, &firsts, &format!("text {}", unique_id("w"))).await?;
    served(&setup, &firsts, &format!("text {}", unique_id("w"))).await?;

    let (mut l_first, mut s_first, mut l_rate, mut s_rate) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        // Interleaved, so drift in the machine touches both alike.
        let (f, _, _) = local(&setup, &firsts, &format!("text {}", unique_id("l"))).await?;
        l_first.push(f.as_secs_f64() * 1e3);
        let (f, _, _) = served(&setup, &firsts, &format!("text {}", unique_id("s"))).await?;
        s_first.push(f.as_secs_f64() * 1e3);
        let (_, n, t) = local(&setup, &firsts, &format!("calls {}", unique_id("l"))).await?;
        l_rate.push(n as f64 / t.as_secs_f64());
        let (_, n, t) = served(&setup, &firsts, &format!("calls {}", unique_id("s"))).await?;
        s_rate.push(n as f64 / t.as_secs_f64());
        // Sandboxes are kept (not timed): the round's are removed.
        let worker = setup.worker(&setup.workers[0].url).await?;
        for sb in worker.list_sandboxes().await? {
            worker.destroy_sandbox(&sb.id).await?;
        }
    }
    let (lf, sf) = (median(l_first), median(s_first));
    let (lr, sr) = (median(l_rate), median(s_rate));
    println!(
        "| measure ({ROUNDS} sessions each, medians) | local `corral run` | through `corral serve` | ratio |"
    );
    println!("|---|---|---|---|");
    println!(
        "| start to first model request | {lf:.1} ms | {sf:.1} ms | {:.2}x the time |",
        sf / lf
    );
    println!(
        "| events per second ({CALLS} calls in one turn) | {lr:.0} | {sr:.0} | {:.2}x the rate |",
        sr / lr
    );
    Ok(())
}
