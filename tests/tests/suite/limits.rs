//! Limits hold: timeouts kill the whole process group, cancels are
//! idempotent, a flood of output streams with back-pressure while what is
//! kept stays capped, fork and memory bombs are contained and reported.

use std::time::Duration;

use corral_e2e::{Harness, WorkerProcess, collect, free_port, unique_id};
use corral_proto::{
    EventKind, OperationId, OperationSpec, Outcome, SandboxId, SandboxSpec, ShellSpec,
};
use futures_util::StreamExt;

fn shell(cmd: &str, timeout_ms: u64) -> OperationSpec {
    let mut s = ShellSpec::new(cmd);
    s.timeout_ms = Some(timeout_ms);
    OperationSpec::Shell(s)
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let (_, r) = h
        .run_spec(
            &sb,
            shell(
                "sleep 300 & echo $! > /tmp/bg; echo started; sleep 300",
                1000,
            ),
        )
        .await?;
    assert_eq!(r.outcome, Outcome::TimedOut);
    assert_eq!(r.outcome.exit_status(), 124);
    assert_eq!(r.stdout.to_lossy_string(), "started\n");
    let r = h
        .run(
            &sb,
            "kill -0 $(cat /tmp/bg) 2>/dev/null && echo alive || echo gone",
        )
        .await?;
    assert_eq!(
        r.stdout.to_lossy_string(),
        "gone\n",
        "the background child survived"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn cancel_is_idempotent() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let op = OperationId::random();
    h.client
        .submit(&sb, &op, shell("echo ready; sleep 300", 600_000))
        .await?;
    let mut events = h.client.watch(&sb, 0, Some(&op)).await?;
    // Wait until it runs.
    while let Some(e) = events.next().await {
        if matches!(e?.kind, EventKind::Output { .. }) {
            break;
        }
    }
    assert!(h.client.cancel(&sb, &op).await?);
    h.client.cancel(&sb, &op).await?;
    let (_, r) = collect(&h.client, &sb, &op, 0).await?;
    assert_eq!(r.outcome, Outcome::Canceled);
    assert!(
        !h.client.cancel(&sb, &op).await?,
        "finished: nothing to cancel"
    );
    assert!(
        !h.client.cancel(&sb, &OperationId::random()).await?,
        "unknown: no-op"
    );
    // The record says the same.
    assert_eq!(
        h.client
            .operation(&sb, &op)
            .await?
            .result
            .map(|r| r.outcome),
        Some(Outcome::Canceled)
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_200_mb_output_streams_with_back_pressure_and_bounded_memory() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("m"), free_port()?, &[], &[])?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let op = OperationId::random();
    let total: u64 = 200_000_000;
    // 200 chunks of 1 MB; after each, the command notes its progress in a
    // file, which a read_file (whose result needs no output credit) can see.
    let mut spec = ShellSpec::new(
        "i=0; while [ $i -lt 200 ]; do head -c 1000000 /dev/zero; i=$((i+1)); echo $i > /tmp/progress; done; echo done >&2",
    );
    spec.output_limit_bytes = Some(1 << 20);
    client.submit(&sb, &op, OperationSpec::Shell(spec)).await?;

    let mut stream = client.watch(&sb, 0, Some(&op)).await?;
    let mut received: u64 = 0;
    // Take one event, then stop reading for a while: the command must wait.
    if let Some(e) = stream.next().await {
        received += e?.output_len() as u64;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let probe = OperationId::random();
    let read = OperationSpec::ReadFile(corral_proto::ReadFileSpec {
        path: "/tmp/progress".into(),
        offset: 0,
        limit: 64,
        stream: false,
    });
    client.submit(&sb, &probe, read).await?;
    let probed = loop {
        let rec = client.operation(&sb, &probe).await?;
        if let Some(r) = rec.result {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let written_mb: u64 = String::from_utf8_lossy(&probed.file_data)
        .trim()
        .parse()
        .unwrap_or(0);
    let mut result = None;
    while let Some(e) = stream.next().await {
        let e = e?;
        received += match &e.kind {
            EventKind::Output {
                stream: corral_proto::OutputStream::Stdout,
                data,
            } => data.len() as u64,
            _ => 0,
        };
        if let EventKind::Finished(r) = e.kind {
            result = Some(*r);
            break;
        }
    }
    let r = result.expect("no result");
    assert_eq!(received, total, "the watcher must get every byte");
    assert_eq!(r.outcome, Outcome::Exited { code: 0 });
    assert_eq!(r.stdout.total_bytes, total);
    assert!(r.stdout.truncated);
    assert_eq!((r.stdout.head.len() + r.stdout.tail.len()) as u64, 1 << 20);
    assert_eq!(r.stderr.to_lossy_string(), "done\n");
    // Without back-pressure the command would have written most of its 200 MB
    // during the pause; with it, the credit window (4 MiB) plus what pipes,
    // gRPC and the loopback socket buffers hold (about 10 MB in all here).
    assert!(
        (1..40).contains(&written_mb),
        "output ran ahead of a paused watcher: {written_mb} MB written"
    );
    let peak = worker.peak_rss()?;
    assert!(peak < 160 << 20, "worker peak RSS {} MiB", peak >> 20);
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

#[tokio::test]
async fn a_fork_bomb_is_contained_and_the_worker_keeps_serving() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let bombed = h
        .sandbox_with(SandboxSpec {
            pids_limit: Some(64),
            ..Default::default()
        })
        .await?;
    let other = h.sandbox().await?;
    let op = OperationId::random();
    h.client
        .submit(&bombed, &op, shell("f(){ f | f & }; f; wait", 3000))
        .await?;
    // Meanwhile, the worker and the other sandbox are fine.
    let r = h.run(&other, "echo fine").await?;
    assert_eq!(r.stdout.to_lossy_string(), "fine\n");
    // Its main shell returns at once; the rest of its session is killed
    // with it (no need to wait for the timeout).
    let (_, r) = collect(&h.client, &bombed, &op, 0).await?;
    assert!(
        matches!(r.outcome, Outcome::Exited { .. } | Outcome::TimedOut),
        "{r:?}"
    );
    // The bomb is gone and the sandbox works again.
    let r = h.run(&bombed, "echo recovered").await?;
    assert_eq!(r.stdout.to_lossy_string(), "recovered\n");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_memory_bomb_is_killed_and_reported() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            // The limit is all three: 96 MiB.
            memory_bytes: Some(64 << 20),
            workspace_bytes: Some(16 << 20),
            tmp_bytes: Some(16 << 20),
            ..Default::default()
        })
        .await?;
    let r = h
        .run(&sb, "dd if=/dev/zero of=/dev/null bs=256M count=1")
        .await?;
    assert_eq!(r.outcome, Outcome::OutOfMemory, "{r:?}");
    assert_eq!(r.outcome.exit_status(), 137);
    let r = h.run(&sb, "echo still here").await?;
    assert_eq!(r.stdout.to_lossy_string(), "still here\n");
    h.stop().await;
    Ok(())
}

/// Filling the workspace fails the write (no space left) and the sandbox
/// goes on serving with its files: the memory limit covers the tmpfs
/// mounts full on top of the working memory, so nothing is OOM-killed.
#[tokio::test]
async fn a_filled_workspace_fails_the_write_and_the_sandbox_serves_on() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(corral_proto::SandboxSpec {
            memory_bytes: Some(64 << 20),
            workspace_bytes: Some(128 << 20),
            ..Default::default()
        })
        .await?;
    h.run(&sb, "echo kept > /workspace/note").await?;
    let r = h
        .run(
            &sb,
            "head -c 200000000 /dev/zero > /workspace/big; echo rc=$?; wc -c < /workspace/big",
        )
        .await?;
    let out = r.stdout.to_lossy_string();
    let err = r.stderr.to_lossy_string();
    assert!(out.starts_with("rc=1\n"), "the write failed: {out} / {err}");
    let size: u64 = out.lines().nth(1).unwrap_or("").trim().parse()?;
    assert!(size <= 128 << 20, "{size} bytes in a 128 MiB workspace");
    let r = h
        .run(&sb, "cat /workspace/note; rm /workspace/big; echo ok")
        .await?;
    assert_eq!(r.stdout.to_lossy_string(), "kept\nok\n");
    assert!(matches!(
        h.client.get_sandbox(&sb).await?.state,
        corral_proto::SandboxState::Ready
    ));
    h.stop().await;
    Ok(())
}

/// What a sandbox's operations leave on the worker is bounded by bytes as
/// well as by count, a finished write keeps no data, and a listing larger
/// than one gRPC message (40 MiB) comes whole, in pages: here six 8 MiB
/// writes and 72 commands that kept 1 MiB of output each (72 MiB: more
/// than the 64 MiB remembered, so the oldest are forgotten).
#[tokio::test]
async fn operations_past_one_message_are_listed_in_pages_and_bounded_in_bytes() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    for i in 0..6 {
        let write = OperationSpec::WriteFile(corral_proto::WriteFileSpec {
            path: format!("big{i}"),
            data: bytes::Bytes::from(vec![b'w'; 8 << 20]),
            mode: 0o644,
            append: false,
            stream: false,
        });
        let (_, r) = h.run_spec(&sb, write).await?;
        assert!(r.outcome.is_success(), "{r:?}");
    }
    let mut ids = Vec::new();
    for _ in 0..72 {
        let op = OperationId::random();
        let after = h.client.get_sandbox(&sb).await?.last_seq;
        h.client
            .submit(
                &sb,
                &op,
                shell("head -c 1048576 /dev/zero | tr '\\0' x", 60_000),
            )
            .await?;
        let (_, r) = collect(&h.client, &sb, &op, after).await?;
        assert!(r.outcome.is_success(), "{r:?}");
        ids.push(op);
    }
    let listed = h.client.list_operations(&sb).await?;
    let kept: u64 = listed
        .iter()
        .filter_map(|o| o.result.as_ref())
        .map(|r| (r.stdout.head.len() + r.stdout.tail.len()) as u64)
        .sum();
    assert!(
        kept > 40 << 20,
        "the listing is past one message: {kept} bytes"
    );
    assert!(
        kept <= corral_proto::limits::MAX_FINISHED_BYTES as u64,
        "kept {kept} bytes"
    );
    // The newest are all there, the oldest forgotten.
    let listed_ids: std::collections::HashSet<String> =
        listed.iter().map(|o| o.id.to_string()).collect();
    assert!(ids[40..].iter().all(|id| listed_ids.contains(id.as_str())));
    assert!(
        !listed_ids.contains(ids[0].as_str()),
        "the oldest command is forgotten"
    );
    for o in &listed {
        if let OperationSpec::WriteFile(w) = &o.spec {
            assert!(w.data.is_empty(), "a finished write keeps its data");
        }
    }
    h.stop().await;
    Ok(())
}

/// `--memory` is working memory, to which the container's limit adds the
/// tmpfs sizes (a full workspace fails a write, it kills nothing); with
/// `memory_includes_files` it is one limit for processes and files, as
/// `docker run --memory`: 600 MiB cannot be allocated under 256 MiB.
/// Stats tell the files from the working memory.
#[tokio::test]
async fn memory_is_working_memory_unless_it_includes_the_files() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let spec = |includes: bool| SandboxSpec {
        image: Some("corral-debian:latest".into()),
        memory_bytes: Some(256 << 20),
        memory_includes_files: includes,
        ..SandboxSpec::default()
    };
    let alloc = "python3 -c \"b = b'x' * (600 << 20); print('allocated', len(b) >> 20)\"";
    let loose = h.sandbox_with(spec(false)).await?;
    let r = h.run(&loose, alloc).await?;
    assert_eq!(r.stdout.to_lossy_string(), "allocated 600\n", "{r:?}");
    let strict = h.sandbox_with(spec(true)).await?;
    let r = h.run(&strict, alloc).await?;
    assert!(
        !r.outcome.is_success(),
        "600 MiB under a strict 256 MiB: {r:?}"
    );
    assert!(!r.stdout.to_lossy_string().contains("allocated"), "{r:?}");
    let limit = |sb: &SandboxId| {
        let sb = sb.clone();
        let c = h.client.clone();
        async move { anyhow::Ok(c.sandbox_stats(&sb).await?.memory_limit_bytes) }
    };
    assert_eq!(limit(&strict).await?, 256 << 20);
    assert_eq!(limit(&loose).await?, (256 << 20) + (1 << 30) + (256 << 20));
    // 64 MiB of files: counted as files, not as working memory.
    let r = h
        .run(&loose, "head -c 67108864 /dev/zero > /workspace/f")
        .await?;
    assert!(r.outcome.is_success(), "{r:?}");
    let s = h.client.sandbox_stats(&loose).await?;
    assert!(s.files_bytes >= 64 << 20, "{s:?}");
    assert!(s.memory_bytes - s.files_bytes < 32 << 20, "{s:?}");
    h.stop().await;
    Ok(())
}

/// A sandbox says the limits it runs with: its spec's, or else the worker's
/// defaults (not zeros), and they are the ones in force.
#[tokio::test]
async fn a_sandbox_says_the_limits_it_runs_with() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| {
        c.policy = corral_worker::policy::permissive();
        c.defaults.memory_bytes = 384 << 20;
        c.defaults.cpu_millis = 1500;
        c.defaults.pids_limit = 200;
    })
    .await?;
    let plain = h.sandbox().await?;
    let info = h.client.get_sandbox(&plain).await?;
    let want = corral_proto::Limits {
        memory_bytes: 384 << 20,
        cpu_millis: 1500,
        pids_limit: 200,
    };
    assert_eq!(info.limits, want);
    assert_eq!(info.spec.cpu_millis, None, "the spec stays as asked");
    assert_eq!(h.client.sandbox_stats(&plain).await?.pids_limit, 200);
    let asked = h
        .sandbox_with(SandboxSpec {
            memory_bytes: Some(256 << 20),
            memory_includes_files: true,
            cpu_millis: Some(500),
            pids_limit: Some(64),
            ..SandboxSpec::default()
        })
        .await?;
    let info = h.client.get_sandbox(&asked).await?;
    assert_eq!(
        info.limits,
        corral_proto::Limits {
            memory_bytes: 256 << 20,
            cpu_millis: 500,
            pids_limit: 64,
        }
    );
    let stats = h.client.sandbox_stats(&asked).await?;
    assert_eq!(
        (stats.memory_limit_bytes, stats.pids_limit),
        (256 << 20, 64)
    );
    // Listed the same way.
    let listed = h.client.list_sandboxes().await?;
    let of = |id: &SandboxId| listed.iter().find(|s| &s.id == id).map(|s| s.limits);
    assert_eq!(of(&plain), Some(want));
    h.stop().await;
    Ok(())
}
