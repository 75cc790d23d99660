//! Placement among 1,000 workers: power of two choices (the default)
//! against probing every worker, in one run, on the same fleet of
//! in-process fake workers (real tonic servers on loopback answering
//! `GetWorkerInfo`): most answer at once, some after 200 ms, a few never
//! (black-holed: a listener that never accepts). The fleet is 90% full on
//! average and some workers are full or draining.
//!
//! Reports probes (RPCs) per placement and placement latency p50/p99 for
//! each, and their ratios. Run: `cargo bench -p corral-e2e --bench
//! placement`. Prints a Markdown table.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::Result;
use corral_e2e::fake::{FakeWorker, black_hole, serve};
use corral_harness::client::Credentials;
use corral_harness::placement::{Attempt, Placer};

const WORKERS: usize = 1000;
const SLOW: usize = 20;
const BLACK_HOLED: usize = 5;
const CAPACITY: u32 = 100;

struct Figures {
    probes: f64,
    p50: Duration,
    p99: Duration,
    failed: usize,
}

async fn measure(placer: &Placer, urls: &[String], placements: usize) -> Figures {
    let mut took = Vec::with_capacity(placements);
    let (mut probes, mut failed) = (0usize, 0usize);
    for _ in 0..placements {
        let started = Instant::now();
        let placed = placer
            .place(urls, |_, _| async { Ok::<(), Attempt<String>>(()) })
            .await;
        took.push(started.elapsed());
        match placed {
            Ok(p) => probes += p.probes,
            Err(_) => failed += 1,
        }
    }
    took.sort();
    let at = |q: f64| took[((took.len() as f64 - 1.0) * q).round() as usize];
    Figures {
        probes: probes as f64 / (placements - failed).max(1) as f64,
        p50: at(0.5),
        p99: at(0.99),
        failed,
    }
}

fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    raise_open_file_limit();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut urls = Vec::with_capacity(WORKERS);
    let mut servers = Vec::new();
    let mut holes = Vec::new();
    for i in 0..WORKERS {
        if i % (WORKERS / BLACK_HOLED) == 7 {
            let (url, listener) = black_hole()?;
            urls.push(url);
            holes.push(listener);
            continue;
        }
        // Fullness spread around 90%: a few full, one in fifty draining.
        let sandboxes = (80 + (i * 37) % 21) as u32;
        let worker = FakeWorker {
            max_sandboxes: CAPACITY,
            sandboxes: sandboxes.min(CAPACITY),
            draining: i % 50 == 3,
            delay: if i % (WORKERS / SLOW) == 11 {
                Duration::from_millis(200)
            } else {
                Duration::ZERO
            },
            runs: None,
        };
        let (url, task) = serve(worker, stop.clone()).await?;
        urls.push(url);
        servers.push(task);
    }
    let p2c = Placer::new(Credentials::default());
    let mut all = Placer::new(Credentials::default());
    all.probe_all_up_to = usize::MAX;
    // Warm-up (first connections, allocations).
    measure(&p2c, &urls, 20).await;
    let two = measure(&p2c, &urls, 500).await;
    let every = measure(&all, &urls, 20).await;
    println!(
        "Placement among {WORKERS} workers ({SLOW} answering after 200 ms, {BLACK_HOLED} black-holed, probe timeout 1 s):\n"
    );
    println!("| policy | probes per placement | p50 | p99 | failed |");
    println!("|---|---|---|---|---|");
    for (name, f) in [("power of two choices", &two), ("probe all", &every)] {
        println!(
            "| {name} | {:.2} | {:.1} ms | {:.1} ms | {} |",
            f.probes,
            f.p50.as_secs_f64() * 1e3,
            f.p99.as_secs_f64() * 1e3,
            f.failed
        );
    }
    println!(
        "\nprobe all / power of two: {:.0}x the probes, {:.0}x the p50, {:.1}x the p99",
        every.probes / two.probes,
        every.p50.as_secs_f64() / two.p50.as_secs_f64(),
        every.p99.as_secs_f64() / two.p99.as_secs_f64()
    );
    stop.cancel();
    for s in servers {
        let _ = s.await;
    }
    drop(holes);
    Ok(())
}
