//! Corral's exec path against the obvious alternative, in one run, on the
//! same warm container:
//!
//! - round trip of `true`: gRPC + worker + corral-init, both as an agent
//!   loop does it (submit, then wait on an open event stream) and as
//!   `corral exec` does it (get cursor, submit, watch from the cursor) —
//!   against `docker exec` through bollard (create, start attached, read to
//!   the end, inspect the exit code);
//! - output throughput of a 200 MB command through each path;
//! - sandbox create-to-ready against bollard create + start.
//!
//! Run: `cargo bench -p corral-e2e --bench exec` (needs the sandbox image and
//! the static corral-init: `deploy/build.sh`). Prints a Markdown table.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bollard::exec::{CreateExecOptions, StartExecResults};
use corral_e2e::Harness;
use corral_harness::client::EventStream;
use corral_proto::{EventKind, OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};
use futures_util::StreamExt;

const ROUND_TRIPS: usize = 300;
const CREATES: usize = 15;
const THROUGHPUT_BYTES: u64 = 200_000_000;

struct Stats {
    samples: Vec<Duration>,
}

impl Stats {
    fn new(mut samples: Vec<Duration>) -> Self {
        samples.sort();
        Self { samples }
    }
    fn pct(&self, p: f64) -> Duration {
        let i = ((self.samples.len() as f64 - 1.0) * p).round() as usize;
        self.samples[i]
    }
    fn p50(&self) -> Duration {
        self.pct(0.5)
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn row(name: &str, s: &Stats) {
    println!(
        "| {name} | {} | {} | {} | {} |",
        ms(s.p50()),
        ms(s.pct(0.9)),
        ms(s.pct(0.99)),
        s.samples.len()
    );
}

async fn until_finished(stream: &mut EventStream, op: &OperationId) -> Result<u64> {
    let mut out = 0u64;
    while let Some(e) = stream.next().await {
        let e = e?;
        if e.operation_id.as_ref() != Some(op) {
            continue;
        }
        match e.kind {
            EventKind::Output { data, .. } => out += data.len() as u64,
            EventKind::Finished(r) => {
                anyhow::ensure!(r.outcome.is_success(), "{:?}", r.outcome);
                return Ok(out);
            }
            _ => {}
        }
    }
    anyhow::bail!("stream ended")
}

fn shell(cmd: &str) -> OperationSpec {
    let mut s = ShellSpec::new(cmd);
    s.output_limit_bytes = Some(64 << 10);
    OperationSpec::Shell(s)
}

/// submit + wait on an already open stream: the agent loop's path.
async fn corral_open_stream(
    h: &Harness,
    sb: &SandboxId,
    cmd: &str,
    n: usize,
) -> Result<(Stats, u64)> {
    let cursor = h.client.get_sandbox(sb).await?.last_seq;
    let mut stream = h.client.watch(sb, cursor, None).await?;
    let mut samples = Vec::with_capacity(n);
    let mut bytes = 0;
    for _ in 0..n {
        let op = OperationId::random();
        let t = Instant::now();
        h.client.submit(sb, &op, shell(cmd)).await?;
        bytes = until_finished(&mut stream, &op).await?;
        samples.push(t.elapsed());
    }
    Ok((Stats::new(samples), bytes))
}

/// get cursor + submit + watch from the cursor: `corral exec`'s path.
async fn corral_exec_path(h: &Harness, sb: &SandboxId, cmd: &str, n: usize) -> Result<Stats> {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let op = OperationId::random();
        let t = Instant::now();
        let cursor = h.client.get_sandbox(sb).await?.last_seq;
        h.client.submit(sb, &op, shell(cmd)).await?;
        let mut stream = h.client.watch(sb, cursor, Some(&op)).await?;
        until_finished(&mut stream, &op).await?;
        samples.push(t.elapsed());
    }
    Ok(Stats::new(samples))
}

async fn docker_exec(
    docker: &bollard::Docker,
    container: &str,
    cmd: &str,
    n: usize,
) -> Result<(Stats, u64)> {
    let mut samples = Vec::with_capacity(n);
    let mut bytes = 0;
    for _ in 0..n {
        let t = Instant::now();
        let exec = docker
            .create_exec(
                container,
                CreateExecOptions {
                    cmd: Some(vec!["/bin/sh", "-c", cmd]),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    ..Default::default()
                },
            )
            .await?;
        bytes = 0;
        if let StartExecResults::Attached { mut output, .. } =
            docker.start_exec(&exec.id, None).await?
        {
            while let Some(chunk) = output.next().await {
                bytes += chunk?.as_ref().len() as u64;
            }
        }
        let code = docker.inspect_exec(&exec.id).await?.exit_code;
        anyhow::ensure!(code == Some(0), "exit code {code:?}");
        samples.push(t.elapsed());
    }
    Ok((Stats::new(samples), bytes))
}

async fn corral_creates(h: &Harness, n: usize) -> Result<Stats> {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let id = SandboxId::new(corral_e2e::unique_id("bench"))?;
        let t = Instant::now();
        h.client
            .create_sandbox(Some(&id), SandboxSpec::default())
            .await?;
        samples.push(t.elapsed());
        h.client.destroy_sandbox(&id).await?;
    }
    Ok(Stats::new(samples))
}

async fn docker_creates(docker: &bollard::Docker, n: usize) -> Result<Stats> {
    use bollard::models::{ContainerCreateBody, HostConfig};
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("corral-bench-plain-{}-{i}", std::process::id());
        let body = ContainerCreateBody {
            image: Some("corral-sandbox:latest".into()),
            cmd: Some(vec!["/bin/sleep".into(), "3600".into()]),
            labels: Some([("corral.managed".to_string(), "1".to_string())].into()),
            host_config: Some(HostConfig {
                network_mode: Some("none".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let opts = bollard::query_parameters::CreateContainerOptionsBuilder::default()
            .name(&name)
            .build();
        let t = Instant::now();
        let c = docker.create_container(Some(opts), body).await?;
        docker.start_container(&c.id, None).await?;
        samples.push(t.elapsed());
        let rm = bollard::query_parameters::RemoveContainerOptionsBuilder::default()
            .force(true)
            .build();
        docker.remove_container(&c.id, Some(rm)).await?;
    }
    Ok(Stats::new(samples))
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let h = Harness::start()
            .await
            .context("start the worker (deploy/build.sh first?)")?;
        let docker = bollard::Docker::connect_with_defaults()?;
        let sb = h.sandbox().await?;
        let container = h.client.get_sandbox(&sb).await?.container_id;

        // Warm up both paths.
        corral_open_stream(&h, &sb, "true", 20).await?;
        docker_exec(&docker, &container, "true", 5).await?;

        let (open, _) = corral_open_stream(&h, &sb, "true", ROUND_TRIPS).await?;
        let exec_path = corral_exec_path(&h, &sb, "true", ROUND_TRIPS).await?;
        let (dexec, _) = docker_exec(&docker, &container, "true", ROUND_TRIPS / 3).await?;

        let flood = format!("head -c {THROUGHPUT_BYTES} /dev/zero");
        let (corral_tp, got) = corral_open_stream(&h, &sb, &flood, 3).await?;
        anyhow::ensure!(got == THROUGHPUT_BYTES, "corral delivered {got} bytes");
        let (docker_tp, got) = docker_exec(&docker, &container, &flood, 3).await?;
        anyhow::ensure!(got == THROUGHPUT_BYTES, "docker delivered {got} bytes");

        let creates = corral_creates(&h, CREATES).await?;
        let plain = docker_creates(&docker, CREATES).await?;

        println!("| measurement | p50 | p90 | p99 | samples |");
        println!("|---|---|---|---|---|");
        row(
            "`true`: submit + wait on open stream (gRPC + worker + corral-init)",
            &open,
        );
        row(
            "`true`: `corral exec` path (cursor + submit + watch)",
            &exec_path,
        );
        row("`true`: `docker exec` through bollard", &dexec);
        row("200 MB output through Corral", &corral_tp);
        row("200 MB output through `docker exec`", &docker_tp);
        row("sandbox create-to-ready (Corral)", &creates);
        row("bollard create + start (plain container)", &plain);
        let mibs = |s: &Stats| THROUGHPUT_BYTES as f64 / (1 << 20) as f64 / s.p50().as_secs_f64();
        println!();
        println!(
            "- `docker exec` / Corral round trip (open stream): **{:.1}x** faster through Corral",
            dexec.p50().as_secs_f64() / open.p50().as_secs_f64()
        );
        println!(
            "- `docker exec` / `corral exec` path: **{:.1}x**",
            dexec.p50().as_secs_f64() / exec_path.p50().as_secs_f64()
        );
        println!(
            "- throughput: Corral {:.0} MiB/s, `docker exec` {:.0} MiB/s (ratio {:.2})",
            mibs(&corral_tp),
            mibs(&docker_tp),
            mibs(&corral_tp) / mibs(&docker_tp)
        );
        println!(
            "- create-to-ready / plain create+start: **{:.2}x**",
            creates.p50().as_secs_f64() / plain.p50().as_secs_f64()
        );
        h.stop().await;
        Ok(())
    })
}
