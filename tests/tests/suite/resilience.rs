//! The worker against its own clients: a client that opens watches and
//! stops reading them cannot hold a sandbox's commands, and watches are
//! limited per sandbox and per worker.

use std::time::{Duration, Instant};

use corral_e2e::Harness;
use corral_harness::client::{ClientError, WorkerClient};

/// A watcher whose client never reads holds the window back; after the
/// stall limit it is dropped, and the command runs on to its end.
#[tokio::test]
async fn a_watcher_that_stops_reading_does_not_stall_commands() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| c.sandbox_limits.watch_stall = Duration::from_secs(1)).await?;
    let sb = h.sandbox().await?;
    // Its own connection: an unread stream also holds its connection's
    // HTTP/2 window.
    let stranger = WorkerClient::connect(&h.url, None).await?;
    let idle = stranger.watch(&sb, 0, None).await?;
    let started = Instant::now();
    // 24 MB: six times the flow-control window.
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        h.run(&sb, "head -c 24000000 /dev/zero | tr '\\0' x; echo"),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the command was held back by a watcher that does not read"))??;
    assert_eq!(r.stdout.total_bytes, 24_000_001);
    // Ordinary commands are answered at once afterwards.
    let t = Instant::now();
    h.run(&sb, "true").await?;
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(idle);
    eprintln!("24 MB past a stalled watcher in {:?}", started.elapsed());
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn watchers_are_limited_per_sandbox_and_per_worker() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| {
        c.sandbox_limits.max_watchers = 3;
        c.max_watchers = 5;
    })
    .await?;
    let (a, b) = (h.sandbox().await?, h.sandbox().await?);
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(h.client.watch(&a, 0, None).await?);
    }
    let refused = |e: ClientError| match e {
        ClientError::Status(s) => (s.code(), s.message().to_string()),
        other => panic!("not a status: {other}"),
    };
    let (code, msg) = refused(h.client.watch(&a, 0, None).await.err().unwrap());
    assert_eq!(code, tonic::Code::ResourceExhausted, "{msg}");
    assert!(msg.contains("watchers"), "{msg}");
    open.push(h.client.watch(&b, 0, None).await?);
    open.push(h.client.watch(&b, 0, None).await?);
    let (code, msg) = refused(h.client.watch(&b, 0, None).await.err().unwrap());
    assert_eq!(code, tonic::Code::ResourceExhausted, "{msg}");
    // A closed watch frees its place.
    drop(open.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match h.client.watch(&b, 0, None).await {
            Ok(s) => {
                open.push(s);
                break;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "the place was never freed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(open);
    h.stop().await;
    Ok(())
}

fn rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS"))?;
    Ok(kb * 1024)
}

/// A hostile client's 6,000 idle watches (of its own sandbox) and 1,100
/// connections that never speak: a normal client's `exec true` in its own
/// sandbox is still answered promptly, and the worker's memory stays
/// bounded. Prints the figures for docs/performance.md.
#[tokio::test]
async fn a_flood_of_watchers_and_silent_connections_leaves_the_worker_serving() -> anyhow::Result<()>
{
    use corral_e2e::{WorkerProcess, free_port, unique_id};
    use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};
    let state = tempfile::tempdir()?;
    let port = free_port()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("fl"),
        port,
        &[],
        &[
            // Room for the 6,000 and for the normal client's own.
            "--max-watchers",
            "6100",
            "--max-watchers-per-sandbox",
            "6100",
            "--handshake-timeout",
            "3s",
        ],
    )?;
    let pid = worker.child.id();
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let theirs = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&theirs), SandboxSpec::default())
        .await?;
    let exec_true = |client: WorkerClient, sb: SandboxId| async move {
        let op = OperationId::random();
        let t = Instant::now();
        let after = client.get_sandbox(&sb).await?.last_seq;
        client
            .submit(&sb, &op, OperationSpec::Shell(ShellSpec::new("true")))
            .await?;
        corral_e2e::collect(&client, &sb, &op, after).await?;
        anyhow::Ok(t.elapsed())
    };
    for _ in 0..5 {
        exec_true(client.clone(), sb.clone()).await?;
    }
    let before = rss(pid)?;

    // 1,100 connections that never say a word.
    let mut silent = Vec::new();
    for _ in 0..1100 {
        silent.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await?);
    }
    // 6,000 watches over 30 connections, never read.
    let token = worker.token();
    let mut watches = Vec::new();
    for _ in 0..30 {
        let c = WorkerClient::connect(&worker.url, Some(&token)).await?;
        for _ in 0..200 {
            watches.push(c.watch(&theirs, 0, None).await?);
        }
    }
    let during = rss(pid)?;
    let mut times = Vec::new();
    for _ in 0..20 {
        times.push(exec_true(client.clone(), sb.clone()).await?);
    }
    times.sort();
    let (p50, max) = (times[times.len() / 2], times[times.len() - 1]);
    eprintln!(
        "flood: 6,000 watches + 1,100 silent connections: exec true p50 {:.1} ms, max {:.1} ms; worker RSS {} MiB before, {} MiB during",
        p50.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3,
        before >> 20,
        during >> 20
    );
    assert!(
        p50 < Duration::from_millis(100),
        "exec true took {p50:?} (p50)"
    );
    assert!(
        during < before + (512 << 20),
        "RSS grew from {before} to {during}"
    );
    // A new client still gets in while the silent ones wait.
    let late = WorkerClient::connect(&worker.url, Some(&token)).await?;
    assert!(!late.list_sandboxes().await?.is_empty());
    // The silent connections are closed once the handshake time is up.
    let mut closed = 0;
    for s in silent.iter_mut().take(50) {
        use tokio::io::AsyncReadExt;
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 50, "silent connections stay open");
    drop(watches);
    drop(silent);
    client.destroy_sandbox(&sb).await?;
    client.destroy_sandbox(&theirs).await?;
    Ok(())
}
