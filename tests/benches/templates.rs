//! A template's warm pool against `docker run` of the same image, and a
//! template's unchanged rebuild against `docker build`, in one run.
//!
//! The template serves HTTP (`python3 -m http.server`, ready once its page
//! answers). Corral: a `CreateSandbox` of the template claimed from its
//! pool (members started and ready) and a first command that fetches the
//! page, through the worker's gRPC as a client does. Docker: `docker run
//! -d` of the template's image with the same start command, then `docker
//! exec` of the same fetch until it succeeds (the readiness wait and the
//! first command at once). Each sandbox or container removed after (not
//! timed). Then the same template built again with nothing changed, by
//! `corral template build`, against `docker build` of the same context on
//! the same engine (its layers cached), both as commands.
//!
//! Run: `cargo bench -p corral-e2e --bench templates` after
//! `deploy/build.sh` (and `deploy/images/build-debian.sh`). Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral_e2e::{Harness, binary, run_shell};
use corral_proto::SandboxSpec;

const ONE_BY_ONE: usize = 20;
const REBUILDS: usize = 7;
const POOL: u32 = 4;
const START: &str = "cd /srv && exec python3 -m http.server 8000";
const FETCH: &str = "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/index.html').read()\"";

fn pct(v: &[Duration], p: usize) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn ready_members(h: &Harness, at_least: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let pools = h.client.worker_info().await?.pools;
        if pools.first().context("no pool")?.ready >= at_least {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output()?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn build(h: &Harness, ctx: &std::path::Path) -> Result<String> {
    run(Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&h.url)
        .args(["template", "build", "web"])
        .arg(ctx)
        .args([
            "--start",
            START,
            "--ready-http",
            "8000/index.html",
            "--quiet",
        ])
        .env_remove("CORRAL_WORKER"))
}

/// `docker run` of the image with the start command, then its first
/// command once the server answers (`then`: a command after that one).
fn docker_once(image: &str, then: Option<&str>) -> Result<Duration> {
    let started = Instant::now();
    let id = run(Command::new("docker").args([
        "run",
        "-d",
        "--network",
        "none",
        "--label",
        "corral.bench=templates",
        image,
        "sh",
        "-c",
        START,
    ]))?;
    let id = id.trim().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = Command::new("docker")
            .args(["exec", &id, "sh", "-c", FETCH])
            .output()?
            .status
            .success();
        if ok {
            break;
        }
        ensure!(Instant::now() < deadline, "the server never answered");
    }
    if let Some(cmd) = then {
        run(Command::new("docker").args(["exec", &id, "sh", "-c", cmd]))?;
    }
    let took = started.elapsed();
    run(Command::new("docker").args(["rm", "-f", &id]))?;
    Ok(took)
}

#[tokio::main]
async fn main() -> Result<()> {
    let ctx = tempfile::tempdir()?;
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM corral-debian:latest\nCOPY nonce /srv/nonce\nRUN echo ready > /srv/index.html\nWORKDIR /srv\n",
    )?;
    std::fs::write(ctx.path().join("nonce"), corral_e2e::unique_id("bench"))?;
    let pool: corral_worker::pool::Template = format!("template:web={POOL}")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let h = Harness::start_with(|c| {
        c.policy.allow_build = true;
        c.pools = vec![pool];
        c.max_sandboxes = 32;
    })
    .await?;
    let first = Instant::now();
    let said = build(&h, ctx.path())?;
    let first = first.elapsed();
    let image = said
        .split_whitespace()
        .find(|w| w.starts_with("corral-build:"))
        .context("no image named")?
        .to_string();
    ready_members(&h, POOL).await?;

    let spec = SandboxSpec {
        template: Some("web".into()),
        ..SandboxSpec::default()
    };
    let (mut pooled, mut docker) = (Vec::new(), Vec::new());
    let (mut pooled_true, mut docker_true) = (Vec::new(), Vec::new());
    for _ in 0..ONE_BY_ONE {
        ready_members(&h, 1).await?;
        let started = Instant::now();
        let sb = h.client.create_sandbox(None, spec.clone()).await?;
        run_shell(&h.client, &sb.id, &format!("{FETCH} && echo ok")).await?;
        pooled.push(started.elapsed());
        h.client.destroy_sandbox(&sb.id).await?;
        docker.push(docker_once(&image, None)?);
        // The first command `true`: the template's readiness is the
        // worker's to wait for, Docker's the client's.
        ready_members(&h, 1).await?;
        let started = Instant::now();
        let sb = h.client.create_sandbox(None, spec.clone()).await?;
        run_shell(&h.client, &sb.id, "true").await?;
        pooled_true.push(started.elapsed());
        h.client.destroy_sandbox(&sb.id).await?;
        docker_true.push(docker_once(&image, Some("true"))?);
    }
    let info = h.client.worker_info().await?.pools[0].clone();
    println!(
        "| a template's server answering a first command, {ONE_BY_ONE} one at a time | p50 | p99 |"
    );
    println!("|---|---|---|");
    println!(
        "| Corral, from the template's warm pool | {} | {} |",
        ms(pct(&pooled, 50)),
        ms(pct(&pooled, 99))
    );
    println!(
        "| `docker run -d` + `docker exec` until it answers | {} | {} |",
        ms(pct(&docker, 50)),
        ms(pct(&docker, 99))
    );
    println!(
        "| docker / Corral | {:.1}x | {:.1}x |",
        pct(&docker, 50).as_secs_f64() / pct(&pooled, 50).as_secs_f64(),
        pct(&docker, 99).as_secs_f64() / pct(&pooled, 99).as_secs_f64()
    );
    println!();
    println!("| the same, then `true` as the first command | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| Corral, from the template's warm pool | {} | {} |",
        ms(pct(&pooled_true, 50)),
        ms(pct(&pooled_true, 99))
    );
    println!(
        "| `docker run -d`, `docker exec` until it answers, `docker exec true` | {} | {} |",
        ms(pct(&docker_true, 50)),
        ms(pct(&docker_true, 99))
    );
    println!(
        "| docker / Corral | {:.1}x | {:.1}x |",
        pct(&docker_true, 50).as_secs_f64() / pct(&pooled_true, 50).as_secs_f64(),
        pct(&docker_true, 99).as_secs_f64() / pct(&pooled_true, 99).as_secs_f64()
    );
    println!();
    println!(
        "(pool: {} claims, {} misses; a member started and ready in {} ms; the first build {:.1} s)",
        info.claims,
        info.misses,
        info.last_refill_ms,
        first.as_secs_f64()
    );
    println!();

    // Nothing changed: built again, each way, interleaved.
    run(Command::new("docker")
        .arg("build")
        .arg("-q")
        .arg(ctx.path()))?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..REBUILDS {
        let t = Instant::now();
        let said = build(&h, ctx.path())?;
        ours.push(t.elapsed());
        ensure!(said.contains("nothing built"), "{said}");
        let t = Instant::now();
        run(Command::new("docker")
            .arg("build")
            .arg("-q")
            .arg(ctx.path()))?;
        theirs.push(t.elapsed());
    }
    println!("| the template built again, nothing changed, {REBUILDS} times | p50 | max |");
    println!("|---|---|---|");
    println!(
        "| `corral template build` | {} | {} |",
        ms(pct(&ours, 50)),
        ms(pct(&ours, 100))
    );
    println!(
        "| `docker build` (its cache) | {} | {} |",
        ms(pct(&theirs, 50)),
        ms(pct(&theirs, 100))
    );
    println!(
        "| Corral / docker | {:.2}x | |",
        pct(&ours, 50).as_secs_f64() / pct(&theirs, 50).as_secs_f64()
    );
    h.stop().await;
    Ok(())
}
