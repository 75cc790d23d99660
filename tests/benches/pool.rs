//! Create to first command, with a warm pool against without, in one run:
//! `CreateSandbox` then a `true` run to its end (through the worker's
//! gRPC, as a client does), each sandbox removed after; then a burst of 100
//! creates, 16 at once, each with its first `true`.
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
const AT_ONCE: usize = 16;
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

async fn burst(h: &Harness) -> Result<(Duration, Vec<Duration>)> {
    use futures_util::StreamExt;
    let started = Instant::now();
    // A rolling 16 at once: each that ends makes room for the next.
    let runs = futures_util::stream::iter(0..BURST)
        .map(|_| async {
            let t = Instant::now();
            let sb = h
                .client
                .create_sandbox(None, SandboxSpec::default())
                .await?;
            run_shell(&h.client, &sb.id, "true").await?;
            let took = t.elapsed();
            h.client.destroy_sandbox(&sb.id).await?;
            Ok::<_, anyhow::Error>(took)
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let all = runs.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((started.elapsed(), all))
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
    ready_members(&warm, POOL).await?;
    let before = warm.client.worker_info().await?.pools[0].clone();
    let (warm_all, warm_each) = burst(&warm).await?;
    let after = warm.client.worker_info().await?.pools[0].clone();
    let (cold_all, cold_each) = burst(&cold).await?;
    println!("| {BURST} creates + first `true`, {AT_ONCE} at once | all | p50 | p99 |");
    println!("|---|---|---|---|");
    println!(
        "| warm pool of {POOL} ({} claimed, {} made cold) | {:.2} s | {} | {} |",
        after.claims - before.claims,
        after.misses - before.misses,
        warm_all.as_secs_f64(),
        ms(pct(&warm_each, 50)),
        ms(pct(&warm_each, 99))
    );
    println!(
        "| no pool | {:.2} s | {} | {} |",
        cold_all.as_secs_f64(),
        ms(pct(&cold_each, 50)),
        ms(pct(&cold_each, 99))
    );
    warm.stop().await;
    cold.stop().await;
    Ok(())
}
