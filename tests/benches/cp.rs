//! `corral cp` against `docker cp`, in one run: 1 GiB into a sandbox and
//! back out, against the same file into and out of a plain container of
//! the same image (its writable layer; a Corral sandbox's root is read-only,
//! so `docker cp` cannot reach it). Both sides are the command-line tools,
//! run as processes, so each figure is what a user waits for.
//!
//! Run: `cargo bench -p corral-e2e --bench cp` after `deploy/build.sh` (the
//! release `corral`, the static corral-init and the sandbox image). Prints
//! a Markdown table.

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
    Ok(())
}
