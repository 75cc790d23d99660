//! Whether a command costs the same in a sandbox's first minute as after
//! tens of thousands of commands: one sandbox, windows of `true`s back to
//! back (`RunOperation`, one call each, as the SDK's `run`), and after each
//! window its rate, the CPU its supervisor (the container's PID 1) spent
//! per command, the supervisor's resident memory and mappings, and the
//! worker's resident memory (the worker runs in this process).
//!
//! Run: `cargo bench -p corral-e2e --bench history` after
//! `deploy/build.sh`; `-- --windows 40 --per-window 1000` (the defaults);
//! `--against-init PATH` measures another build's static `corral-init` in
//! the same run, window for window (a second worker in this process).
//! Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::Instant;

use anyhow::{Context, Result, ensure};
use corral_e2e::{Harness, run_shell};

struct Args {
    windows: usize,
    per_window: usize,
    /// Another build's static corral-init, measured in the same run.
    against_init: Option<std::path::PathBuf>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        windows: 40,
        per_window: 1000,
        against_init: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value =
            || -> Result<usize> { Ok(it.next().context("a number after the flag")?.parse()?) };
        match arg.as_str() {
            "--windows" => a.windows = value()?,
            "--per-window" => a.per_window = value()?,
            "--against-init" => {
                a.against_init = Some(it.next().context("a path after --against-init")?.into())
            }
            // cargo bench passes `--bench`.
            _ => {}
        }
    }
    ensure!(a.windows >= 2 && a.per_window >= 1, "two windows at least");
    Ok(a)
}

/// `VmRSS` of `/proc/PID/status`, in KiB.
fn rss_kib(pid: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("VmRSS without a number")?
        .parse()?)
}

/// How many mappings the process has (what a fork copies besides pages).
fn mappings(pid: &str) -> Result<usize> {
    Ok(std::fs::read_to_string(format!("/proc/{pid}/maps"))?
        .lines()
        .count())
}

/// User + system CPU time of the process so far, in clock ticks.
fn cpu_ticks(pid: &str) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name, which may hold spaces, in parentheses.
    let rest = &stat[stat.rfind(')').context("stat without a name")? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); 3 is fields[0].
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

/// Clock ticks of `/proc/PID/stat` per second: USER_HZ, 100 on every
/// Linux this runs on (x86_64 and arm64 fix it at 100).
const TICKS_PER_SECOND: f64 = 100.0;

/// One worker and its sandbox, as measured.
struct Subject {
    name: String,
    h: Harness,
    sandbox: corral_proto::SandboxId,
    /// The supervisor's pid on this host.
    pid: String,
    rates: Vec<f64>,
    rss: Vec<u64>,
}

async fn subject(name: &str, init: Option<&std::path::Path>) -> Result<Subject> {
    let init = init.map(std::path::Path::to_path_buf);
    let h = Harness::start_with(|c| {
        if init.is_some() {
            c.init_binary = init;
        }
    })
    .await
    .context("start the worker (deploy/build.sh first?)")?;
    let docker = bollard::Docker::connect_with_defaults()?;
    let sandbox = h.sandbox().await?;
    let container = h.client.get_sandbox(&sandbox).await?.container_id;
    let pid = docker
        .inspect_container(&container, None)
        .await?
        .state
        .and_then(|s| s.pid)
        .filter(|p| *p > 0)
        .context("the container's PID 1")?
        .to_string();
    // Warm up.
    for _ in 0..50 {
        run_shell(&h.client, &sandbox, "true").await?;
    }
    Ok(Subject {
        name: name.into(),
        h,
        sandbox,
        pid,
        rates: Vec::new(),
        rss: Vec::new(),
    })
}

fn main() -> Result<()> {
    let args = args()?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let mut subjects = vec![subject("this build", None).await?];
        if let Some(other) = &args.against_init {
            subjects.push(subject(&format!("`{}`", other.display()), Some(other)).await?);
        }
        let me = std::process::id().to_string();
        println!(
            "| window | supervisor | runs/s | supervisor CPU per run | supervisor RSS | supervisor mappings | worker RSS |"
        );
        println!("|---|---|---|---|---|---|---|");
        // Interleaved: each window of one, then of the other.
        for w in 1..=args.windows {
            for s in &mut subjects {
                let cpu_before = cpu_ticks(&s.pid)?;
                let started = Instant::now();
                for _ in 0..args.per_window {
                    run_shell(&s.h.client, &s.sandbox, "true").await?;
                }
                let took = started.elapsed().as_secs_f64();
                let cpu = (cpu_ticks(&s.pid)? - cpu_before) as f64 / TICKS_PER_SECOND;
                let rate = args.per_window as f64 / took;
                let (rss, maps, worker) = (rss_kib(&s.pid)?, mappings(&s.pid)?, rss_kib(&me)?);
                println!(
                    "| {w} | {} | {rate:.0} | {:.0} µs | {:.1} MiB | {maps} | {:.1} MiB |",
                    s.name,
                    cpu / args.per_window as f64 * 1e6,
                    rss as f64 / 1024.0,
                    worker as f64 / 1024.0
                );
                s.rates.push(rate);
                s.rss.push(rss);
            }
        }
        println!();
        for s in &subjects {
            let (first, last) = (s.rates[0], s.rates[s.rates.len() - 1]);
            let mean = s.rates.iter().sum::<f64>() / s.rates.len() as f64;
            // Warm-up: the first quarter of the windows.
            let warm_at = (s.rss.len() / 4).max(1);
            println!(
                "- {}: last window / first **{:.2}x** ({last:.0} against {first:.0} runs/s; mean {mean:.0}; {} runs); supervisor RSS after window {warm_at} {:.1} MiB, at the end {:.1} MiB",
                s.name,
                last / first,
                args.windows * args.per_window,
                s.rss[warm_at - 1] as f64 / 1024.0,
                s.rss[s.rss.len() - 1] as f64 / 1024.0
            );
        }
        for s in subjects {
            s.h.client.destroy_sandbox(&s.sandbox).await?;
            s.h.stop().await;
        }
        Ok(())
    })
}
