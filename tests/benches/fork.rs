//! A live fork against the same copy made by hand, in one run: a parent
//! with ~100 MiB in /workspace (10,000 small files and three large ones)
//! forked into 1 and into 8 children (the `ForkSandbox` call that `corral
//! sandbox fork` makes), against `corral cp` of its /workspace out to the
//! client's disk, then new sandboxes made and the tree copied into each
//! (all at once for 8; the tree lands in `/workspace/ws`). Both include
//! making the children. The fork's
//! figure of how long the parent was frozen is the worker's.
//!
//! Run: `cargo bench -p corral-e2e --bench fork` after `deploy/build.sh`
//! (the release `corral`, the static corral-init and the Debian image).
//! Prints a Markdown table.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::{Harness, binary, run_shell};
use corral_proto::{SandboxId, SandboxSpec};

const RUNS: usize = 3;

const POPULATE: &str = r#"
import os, random
random.seed(7)
os.chdir("/workspace")
for d in range(100):
    os.makedirs(f"tree/d{d:03}")
    for f in range(100):
        with open(f"tree/d{d:03}/f{f:03}", "wb") as fh:
            fh.write(random.randbytes(random.randint(1, 8192)))
for i in range(3):
    with open(f"big{i}", "wb") as fh:
        for _ in range(21):
            fh.write(random.randbytes(1 << 20))
print("populated")
"#;

fn spec() -> SandboxSpec {
    SandboxSpec {
        image: Some("corral-debian:latest".into()),
        ..SandboxSpec::default()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// What the children hold, checked against the parent's: a digest of
/// every file's path and contents.
async fn digest(h: &Harness, id: &SandboxId, dir: &str) -> Result<String> {
    run_shell(
        &h.client,
        id,
        &format!("cd {dir} && find . -type f | sort | xargs sha256sum | sha256sum"),
    )
    .await
}

async fn by_hand(h: &Harness, parent: &SandboxId, n: usize) -> Result<(Duration, Vec<SandboxId>)> {
    let corral = binary("corral")?;
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("ws");
    let started = Instant::now();
    let status = Command::new(&corral)
        .args(["--worker", &h.url, "cp", "--quiet"])
        .arg(format!("{parent}:/workspace"))
        .arg(&out)
        .status()?;
    ensure!(status.success(), "cp out");
    let ids: Vec<SandboxId> = (0..n).map(|_| SandboxId::random()).collect();
    let made = futures_util::future::join_all(
        ids.iter()
            .map(|id| h.client.create_sandbox(Some(id), spec())),
    )
    .await;
    for m in made {
        m?;
    }
    let copies: Vec<_> = ids
        .iter()
        .map(|id| {
            Command::new(&corral)
                .args(["--worker", &h.url, "cp", "--quiet"])
                .arg(&out)
                .arg(format!("{id}:/workspace/"))
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut c in copies {
        ensure!(c.wait()?.success(), "cp in");
    }
    Ok((started.elapsed(), ids))
}

#[tokio::main]
async fn main() -> Result<()> {
    let h = Harness::start().await?;
    let parent = h.sandbox_with(spec()).await?;
    let out = run_shell(
        &h.client,
        &parent,
        &format!("python3 -c '{POPULATE}'; du -sm /workspace"),
    )
    .await?;
    ensure!(out.contains("populated"), "{out}");
    let want = digest(&h, &parent, "/workspace").await?;

    let mut rows = Vec::new();
    for n in [1usize, 8] {
        let (mut fork, mut frozen, mut hand) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..RUNS {
            let started = Instant::now();
            let f = h.client.fork_sandbox(&parent, &[], n as u32).await?;
            fork.push(started.elapsed());
            frozen.push(f.frozen);
            ensure!(f.copied_bytes > 100 << 20, "{f:?}");
            for c in &f.children {
                ensure!(
                    digest(&h, &c.id, "/workspace").await? == want,
                    "a child differs"
                );
                h.client.destroy_sandbox(&c.id).await?;
            }
            let (took, ids) = by_hand(&h, &parent, n).await?;
            hand.push(took);
            for id in &ids {
                // The tree lands as /workspace/ws.
                let got = digest(&h, id, "/workspace/ws").await?;
                if got != want {
                    let ls = run_shell(&h.client, id, "ls -la /workspace | head").await?;
                    bail!("a copy by hand differs: {ls}");
                }
                h.client.destroy_sandbox(id).await?;
            }
        }
        rows.push((n, median(fork), median(frozen), median(hand)));
    }
    h.client
        .destroy_sandbox(&parent)
        .await
        .context("removing the parent")?;
    h.stop().await;

    println!(
        "| ~100 MiB in /workspace (10,000 files), median of {RUNS} | fork | parent frozen | corral cp out, create, cp in | by hand / fork |"
    );
    println!("|---|---|---|---|---|");
    for (n, fork, frozen, hand) in rows {
        println!(
            "| into {n} {} | {} | {} | {} | {:.1}x |",
            if n == 1 { "child" } else { "children" },
            ms(fork),
            ms(frozen),
            ms(hand),
            hand.as_secs_f64() / fork.as_secs_f64()
        );
    }
    Ok(())
}
