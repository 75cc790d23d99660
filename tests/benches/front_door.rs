//! What the front door costs: `run("true")` in one call (`RunOperation`:
//! the submit and the watch of its end, what the SDK's `run` and `corral
//! exec` do) and in three (the sandbox's last event asked for, the command
//! submitted, its end watched: what they did before), and create → first
//! command, through `corral serve --tenants` with a
//! tenant's key against the same worker reached directly with its token, in
//! one run, interleaved.
//!
//! Run: `cargo bench -p corral-e2e --bench front_door` after
//! `deploy/build.sh`. Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral_e2e::serve::Setup;
use corral_e2e::{run_shell, run_shell_in_three};
use corral_harness::client::WorkerClient;
use corral_proto::SandboxSpec;

const RUNS: usize = 300;
const CREATES: usize = 12;

struct Stats(Vec<Duration>);

impl Stats {
    fn pct(&self, p: f64) -> Duration {
        let mut s = self.0.clone();
        s.sort();
        s[((s.len() as f64 - 1.0) * p).round() as usize]
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn row(name: &str, s: &Stats) {
    println!(
        "| {name} | {} | {} | {} |",
        ms(s.pct(0.5)),
        ms(s.pct(0.9)),
        s.0.len()
    );
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        image: Some("corral-sandbox:latest".into()),
        ..SandboxSpec::default()
    }
}

async fn create_then_true(client: &WorkerClient) -> Result<Duration> {
    let started = Instant::now();
    let sb = client.create_sandbox(None, spec()).await?.id;
    run_shell(client, &sb, "true").await?;
    let took = started.elapsed();
    client.destroy_sandbox(&sb).await?;
    Ok(took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    let tenants = tempfile::tempdir()?;
    let made = std::process::Command::new(corral_e2e::binary("corral")?)
        .arg("admin")
        .arg("--tenants")
        .arg(tenants.path())
        .args(["key", "create", "--tenant", "bench", "--scope", "run"])
        .output()?;
    ensure!(made.status.success(), "{made:?}");
    let key = String::from_utf8(made.stdout)?.trim().to_string();
    setup.kill_service();
    setup.service_args = vec!["--tenants".into(), tenants.path().display().to_string()];
    setup.start_service()?;
    let direct = setup.worker(&setup.workers[0].url).await?;
    let door = WorkerClient::connect(&setup.url(), Some(&key)).await?;
    let on_direct = direct.create_sandbox(None, spec()).await?.id;
    let on_door = door.create_sandbox(None, spec()).await?.id;
    for _ in 0..20 {
        run_shell(&direct, &on_direct, "true").await?;
        run_shell(&door, &on_door, "true").await?;
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut a3, mut b3) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let t = Instant::now();
        run_shell(&direct, &on_direct, "true").await?;
        a.push(t.elapsed());
        let t = Instant::now();
        run_shell(&door, &on_door, "true").await?;
        b.push(t.elapsed());
        let t = Instant::now();
        run_shell_in_three(&direct, &on_direct, "true").await?;
        a3.push(t.elapsed());
        let t = Instant::now();
        run_shell_in_three(&door, &on_door, "true").await?;
        b3.push(t.elapsed());
    }
    let (mut ca, mut cb) = (Vec::new(), Vec::new());
    for _ in 0..CREATES {
        ca.push(create_then_true(&direct).await.context("direct")?);
        cb.push(create_then_true(&door).await.context("front door")?);
    }
    direct.destroy_sandbox(&on_direct).await?;
    door.destroy_sandbox(&on_door).await?;
    let (a, b, ca, cb) = (Stats(a), Stats(b), Stats(ca), Stats(cb));
    let (a3, b3) = (Stats(a3), Stats(b3));
    println!("| measurement | p50 | p90 | samples |");
    println!("|---|---|---|---|");
    row("`run(\"true\")` in one call, direct to the worker", &a);
    row("`run(\"true\")` in one call, through the front door", &b);
    row("`run(\"true\")` in three calls, direct", &a3);
    row(
        "`run(\"true\")` in three calls, through the front door",
        &b3,
    );
    row("create → first `true`, direct", &ca);
    row("create → first `true`, through the front door", &cb);
    println!();
    println!(
        "The front door adds {} to a run in one call at p50 ({:.2}x), {} to one in three, {} to create → first command.",
        ms(b.pct(0.5).saturating_sub(a.pct(0.5))),
        b.pct(0.5).as_secs_f64() / a.pct(0.5).as_secs_f64(),
        ms(b3.pct(0.5).saturating_sub(a3.pct(0.5))),
        ms(cb.pct(0.5).saturating_sub(ca.pct(0.5)))
    );
    Ok(())
}
