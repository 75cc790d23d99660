//! `corral cp` against `docker cp`, in one run: 1 GiB into a sandbox and
//! back out, against the same file into and out of a plain container of
//! the same image (its writable layer; a Corral sandbox's root is read-only,
//! so `docker cp` cannot reach it). Both sides are the command-line tools,
//! run as processes, so each figure is what a user waits for.
//!
//! Then a session's suspension and resumption with a 100 MB workspace,
//! through the harness's front door: suspend (the workspace saved beside
//! the log, the sandbox removed) and resume (a new sandbox, the files put
//! back, up to the point where the run starts).
//!
//! Run: `cargo bench -p corral-e2e --bench cp` after `deploy/build.sh` (the
//! release `corral`, the static corral-init and the sandbox image). Prints
//! Markdown tables.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use corral_e2e::{Harness, binary};
use corral_proto::SandboxSpec;

const BYTES: u64 = 1 << 30;
const RUNS: usize = 3;

fn run(cmd: &mut Command) -> Result<Duration> {
    let started = Instant::now();
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    let took = started.elapsed();
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn same_file(a: &Path, b: &Path) -> Result<()> {
    let status = Command::new("cmp").arg(a).arg(b).status()?;
    anyhow::ensure!(
        status.success(),
        "{} and {} differ",
        a.display(),
        b.display()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("one-gib");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("head -c {BYTES} /dev/urandom > {}", file.display()))
        .status()?;
    anyhow::ensure!(status.success(), "making the file");
    let back = dir.path().join("back");
    let (file_s, back_s) = (file.display().to_string(), back.display().to_string());

    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            workspace_bytes: Some(BYTES + (256 << 20)),
            ..SandboxSpec::default()
        })
        .await?;
    let corral = binary("corral")?;
    let cp = |src: &str, dest: &str| {
        let mut c = Command::new(&corral);
        c.args(["--worker", &h.url, "cp", "--quiet", src, dest]);
        c
    };
    let (mut corral_in, mut corral_out) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        corral_in.push(run(&mut cp(&file_s, &format!("{}:f", sb.as_str())))?);
        let _ = std::fs::remove_file(&back);
        corral_out.push(run(&mut cp(&format!("{}:f", sb.as_str()), &back_s))?);
        same_file(&file, &back)?;
    }
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;

    let name = format!("corral-bench-cp-{}", std::process::id());
    run(Command::new("docker").args([
        "run",
        "-d",
        "--name",
        &name,
        "--entrypoint",
        "/bin/busybox",
        "corral-sandbox:latest",
        "sleep",
        "3600",
    ]))?;
    let (mut docker_in, mut docker_out) = (Vec::new(), Vec::new());
    let measured = (|| -> Result<()> {
        for _ in 0..RUNS {
            docker_in.push(run(Command::new("docker").args([
                "cp",
                &file_s,
                &format!("{name}:/tmp/f"),
            ]))?);
            let _ = std::fs::remove_file(&back);
            docker_out.push(run(Command::new("docker").args([
                "cp",
                &format!("{name}:/tmp/f"),
                &back_s,
            ]))?);
            same_file(&file, &back)?;
        }
        Ok(())
    })();
    let _ = Command::new("docker").args(["rm", "-f", &name]).output();
    measured?;

    let (suspends, resumes) = suspend_and_resume().await?;

    let rate = |d: Duration| BYTES as f64 / (1 << 20) as f64 / d.as_secs_f64();
    println!("| 1 GiB, median of {RUNS} | corral cp | docker cp | docker / corral |");
    println!("|---|---|---|---|");
    for (what, c, d) in [
        ("into the sandbox", median(corral_in), median(docker_in)),
        ("out of the sandbox", median(corral_out), median(docker_out)),
    ] {
        println!(
            "| {what} | {:.2} s ({:.0} MiB/s) | {:.2} s ({:.0} MiB/s) | {:.2}x |",
            c.as_secs_f64(),
            rate(c),
            d.as_secs_f64(),
            rate(d),
            d.as_secs_f64() / c.as_secs_f64()
        );
    }
    println!();
    println!("| session with 100 MB in /workspace, median of {RUNS} | time |");
    println!("|---|---|");
    println!(
        "| suspend (workspace saved, sandbox removed) | {:.2} s |",
        median(suspends).as_secs_f64()
    );
    println!(
        "| resume (new sandbox, workspace back) | {:.2} s |",
        median(resumes).as_secs_f64()
    );
    Ok(())
}

const WORKSPACE_BYTES: u64 = 100_000_000;

/// Suspends and resumes one session RUNS times with 100 MB in its
/// workspace; returns the times of each.
async fn suspend_and_resume() -> Result<(Vec<Duration>, Vec<Duration>)> {
    use corral_e2e::model::{ModelServer, responses};
    use corral_harness::llm::Api;
    use corral_harness::sessions::{RunOptions, SessionRequest, Sessions};
    let h = Harness::start().await?;
    let model = ModelServer::start((0..=RUNS).map(|_| responses::text("ok")).collect()).await;
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    let opts = |prompt: &str| RunOptions {
        request: SessionRequest {
            prompt: Some(prompt.into()),
            ..SessionRequest::default()
        },
        base_url: Some(model.url.clone()),
        api: Some(Api::Responses),
        api_key: Some("k".into()),
        until_idle: true,
        ..RunOptions::default()
    };
    let new = store.prepare("bench", opts("start"))?;
    let handle = store.start(new, h.worker.clone()).await?;
    let sandbox = handle.config.sandbox_id.clone();
    handle.task.await??;
    let made = h
        .run(
            &sandbox,
            &format!("head -c {WORKSPACE_BYTES} /dev/urandom > /workspace/blob"),
        )
        .await?;
    anyhow::ensure!(made.outcome.is_success(), "{made:?}");
    let (mut suspends, mut resumes) = (Vec::new(), Vec::new());
    for i in 0..RUNS {
        let stored = store.open("bench")?;
        let started = Instant::now();
        store.suspend(&stored, h.worker.clone()).await?;
        suspends.push(started.elapsed());
        drop(stored);
        let stored = store.open("bench")?;
        let started = Instant::now();
        let handle = store
            .resume(stored, h.worker.clone(), opts(&format!("again {i}")))
            .await?;
        resumes.push(started.elapsed());
        handle.task.await??;
        let size = h.run(&sandbox, "wc -c < /workspace/blob").await?;
        anyhow::ensure!(
            size.stdout.to_lossy_string().trim() == WORKSPACE_BYTES.to_string(),
            "the workspace came back different: {size:?}"
        );
    }
    h.stop().await;
    Ok((suspends, resumes))
}
