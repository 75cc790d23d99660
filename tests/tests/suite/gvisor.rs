//! Sandboxes under gVisor (`runsc`, Debian's package), registered with the
//! Docker engine as the runtime `runsc` (`.ci/run` sets it up). The
//! supervisor's protections hold there too, and the figures against runc
//! are printed for docs/performance.md.

use std::time::{Duration, Instant};

use corral_e2e::Harness;
use corral_proto::{SandboxId, SandboxSpec};

async fn runsc_registered() -> anyhow::Result<()> {
    let docker = bollard::Docker::connect_with_defaults()?;
    let info = docker.info().await?;
    let has = info.runtimes.unwrap_or_default().contains_key("runsc");
    anyhow::ensure!(
        has,
        "the Docker engine has no runtime \"runsc\": install Debian's runsc and register it in /etc/docker/daemon.json (.ci/run does both)"
    );
    Ok(())
}

fn under(runtime: &str) -> SandboxSpec {
    SandboxSpec {
        runtime: Some(runtime.into()),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_sandbox_under_gvisor_serves_and_its_supervisor_is_out_of_reach() -> anyhow::Result<()> {
    runsc_registered().await?;
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let sb = h.sandbox_with(under("runsc")).await?;
    let r = h
        .run(
            &sb,
            "dmesg | head -1; id -un; echo hi > /workspace/f; cat /workspace/f",
        )
        .await?;
    let out = r.stdout.to_lossy_string();
    assert!(
        out.contains("gVisor") && out.ends_with("sandbox\nhi\n"),
        "{out}"
    );
    // The forgery once possible under gVisor: writing into the supervisor's
    // line to the worker. And signals.
    let r = h
        .run(
            &sb,
            "for fd in 0 1 2; do printf 'forged' > /proc/1/fd/$fd 2>/dev/null && echo wrote-$fd; done; \
             kill -TERM 1 2>/dev/null && echo signaled; echo done",
        )
        .await?;
    assert_eq!(r.stdout.to_lossy_string(), "done\n", "{r:?}");
    let r = h.run(&sb, "echo serving").await?;
    assert_eq!(r.stdout.to_lossy_string(), "serving\n");
    h.stop().await;
    Ok(())
}

/// A runtime the worker's operator did not allow is refused.
#[tokio::test]
async fn gvisor_is_used_only_where_the_worker_allows_it() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let err = h
        .client
        .create_sandbox(None, under("runsc"))
        .await
        .unwrap_err();
    let corral_harness::client::ClientError::Status(s) = err else {
        panic!("not a status: {err}");
    };
    assert_eq!(s.code(), tonic::Code::PermissionDenied);
    assert!(
        s.message().contains("--allow-runtime runsc"),
        "{}",
        s.message()
    );
    h.stop().await;
    Ok(())
}

async fn figures(h: &Harness, sb: &SandboxId) -> anyhow::Result<(Duration, f64)> {
    for _ in 0..3 {
        h.run(sb, "true").await?;
    }
    let mut times = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        h.run(sb, "true").await?;
        times.push(t.elapsed());
    }
    times.sort();
    let t = Instant::now();
    let r = h.run(sb, "head -c 200000000 /dev/zero").await?;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(r.stdout.total_bytes == 200_000_000, "{r:?}");
    Ok((times[times.len() / 2], 200.0 / 1.048_576 / secs))
}

/// Prints `exec true` and 200 MB of output under runc and under runsc.
#[tokio::test]
async fn figures_under_runc_and_gvisor() -> anyhow::Result<()> {
    runsc_registered().await?;
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let runc = h.sandbox().await?;
    let runsc = h.sandbox_with(under("runsc")).await?;
    let (a, b) = (figures(&h, &runc).await?, figures(&h, &runsc).await?);
    eprintln!(
        "runc: exec true p50 {:.1} ms, 200 MB at {:.0} MiB/s; runsc: exec true p50 {:.1} ms, 200 MB at {:.0} MiB/s",
        a.0.as_secs_f64() * 1e3,
        a.1,
        b.0.as_secs_f64() * 1e3,
        b.1
    );
    h.stop().await;
    Ok(())
}
