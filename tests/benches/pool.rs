//! Create to first command, with a warm pool against without, in one run:
//! `CreateSandbox` then a `true` run to its end (through the worker's
//! gRPC, as a client does), each sandbox removed after; then a burst of 100
//! creates all at once, each with its first `true`: from a pool of 100,
//! without a pool, and 100 `docker run`s of the same image at once.
//!
//! Run: `cargo bench -p corral-e2e --bench pool` after `deploy/build.sh`.
//! Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corral_e2e::{Harness, run_shell};
use corral_proto::SandboxSpec;

const ONE_BY_ONE: usize = 60;
const BURST: usize = 100;
const POOL: u32 = 16;

fn pct(v: &[Duration], p: usize) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

async fn ready_members(h: &Harness, at_least: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while h
        .client
        .worker_info()
        .await?
        .pools
        .first()
        .context("no pool")?
        .ready
        < at_least
    {
        anyhow::ensure!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// One create and its first `true`, then the sandbox removed (not timed).
async fn once(h: &Harness) -> Result<Duration> {
    let started = Instant::now();
    let sb = h
        .client
        .create_sandbox(None, SandboxSpec::default())
        .await?;
    run_shell(&h.client, &sb.id, "true").await?;
    let took = started.elapsed();
    h.client.destroy_sandbox(&sb.id).await?;
    Ok(took)
}

/// `BURST` creates, each with its first `true`, all at once: how long
/// until all were ready, each one's time, and how many failed. The
/// sandboxes are removed after (not timed).
async fn burst(h: &Harness) -> Result<(Duration, Vec<Duration>, usize)> {
    let started = Instant::now();
    let runs = futures_util::future::join_all((0..BURST).map(|_| async {
        let t = Instant::now();
        let sb = h
            .client
            .create_sandbox(None, SandboxSpec::default())
            .await?;
        let ran = run_shell(&h.client, &sb.id, "true").await;
        Ok::<_, anyhow::Error>((t.elapsed(), sb.id, ran))
    }))
    .await;
    let all = started.elapsed();
    let mut each = Vec::new();
    let mut failed = 0;
    for r in runs {
        match r {
            Ok((took, id, ran)) => {
                if ran.is_ok() {
                    each.push(took);
                } else {
                    failed += 1;
                }
                h.client.destroy_sandbox(&id).await?;
            }
            Err(_) => failed += 1,
        }
    }
    Ok((all, each, failed))
}

/// `BURST` `docker run --rm IMAGE true` at once: how long until all ended,
/// and each one's time.
async fn docker_burst(image: &str) -> Result<(Duration, Vec<Duration>)> {
    let started = Instant::now();
    let runs = futures_util::future::join_all((0..BURST).map(|_| async {
        let t = Instant::now();
        let out = tokio::process::Command::new("docker")
            .args(["run", "--rm", "--network", "none", image, "true"])
            .output()
            .await?;
        anyhow::ensure!(out.status.success(), "{out:?}");
        Ok::<_, anyhow::Error>(t.elapsed())
    }))
    .await;
    let all = started.elapsed();
    Ok((all, runs.into_iter().collect::<Result<Vec<_>>>()?))
}

#[tokio::main]
async fn main() -> Result<()> {
    let template: corral_worker::pool::Template = format!("corral-sandbox:latest={POOL}")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let warm = Harness::start_with(|c| {
        c.pools = vec![template];
        c.max_sandboxes = 64;
    })
    .await?;
    let cold = Harness::start_with(|c| c.max_sandboxes = 64).await?;
    ready_members(&warm, POOL).await?;
    // One at a time, each from a pool with a member ready.
    let mut pooled = Vec::new();
    let mut plain = Vec::new();
    for _ in 0..ONE_BY_ONE {
        ready_members(&warm, 1).await?;
        pooled.push(once(&warm).await?);
        plain.push(once(&cold).await?);
    }
    let info = warm.client.worker_info().await?.pools[0].clone();
    println!("| create + first `true`, {ONE_BY_ONE} one at a time | p50 | p99 |");
    println!("|---|---|---|");
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!(
        "| warm pool (claimed) | {} | {} |",
        ms(pct(&pooled, 50)),
        ms(pct(&pooled, 99))
    );
    println!(
        "| no pool | {} | {} |",
        ms(pct(&plain, 50)),
        ms(pct(&plain, 99))
    );
    println!(
        "| no pool / warm pool | {:.1}x | {:.1}x |",
        pct(&plain, 50).as_secs_f64() / pct(&pooled, 50).as_secs_f64(),
        pct(&plain, 99).as_secs_f64() / pct(&pooled, 99).as_secs_f64()
    );
    println!();
    println!(
        "(pool: {} claims, {} misses; a member made in {} ms)",
        info.claims, info.misses, info.last_refill_ms
    );
    println!();
    warm.stop().await;
    cold.stop().await;
    // The burst: a pool sized for it, none, and `docker run`.
    let template: corral_worker::pool::Template = format!("corral-sandbox:latest={BURST}")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let sized = Harness::start_with(|c| {
        c.pools = vec![template];
        c.max_sandboxes = 2 * BURST as u32;
    })
    .await?;
    let filling = Instant::now();
    ready_members(&sized, BURST as u32).await?;
    let filled = filling.elapsed();
    let before = sized.client.worker_info().await?.pools[0].clone();
    let (warm_all, warm_each, warm_failed) = burst(&sized).await?;
    let after = sized.client.worker_info().await?.pools[0].clone();
    sized.stop().await;
    let cold = Harness::start_with(|c| c.max_sandboxes = 2 * BURST as u32).await?;
    let (cold_all, cold_each, cold_failed) = burst(&cold).await?;
    cold.stop().await;
    let (docker_all, docker_each) = docker_burst("corral-sandbox:latest").await?;
    println!("| {BURST} creates + first `true`, all at once | all ready | p50 | p99 | failed |");
    println!("|---|---|---|---|---|");
    println!(
        "| pool of {BURST} ({} claimed, {} made cold) | {} | {} | {} | {warm_failed} |",
        after.claims - before.claims,
        after.misses - before.misses,
        ms(warm_all),
        ms(pct(&warm_each, 50)),
        ms(pct(&warm_each, 99))
    );
    println!(
        "| no pool | {} | {} | {} | {cold_failed} |",
        ms(cold_all),
        ms(pct(&cold_each, 50)),
        ms(pct(&cold_each, 99))
    );
    println!(
        "| {BURST} `docker run --rm` at once | {} | {} | {} | 0 |",
        ms(docker_all),
        ms(pct(&docker_each, 50)),
        ms(pct(&docker_each, 99))
    );
    println!();
    println!(
        "(the pool of {BURST} filled in {:.1} s, four members at a time)",
        filled.as_secs_f64()
    );
    Ok(())
}
