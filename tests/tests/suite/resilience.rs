//! The worker against its own clients: a client that opens watches and
//! stops reading them cannot hold a sandbox's commands, and watches are
//! limited per sandbox and per worker.

use std::time::{Duration, Instant};

use corral_control::client::{ClientError, WorkerClient};
use corral_e2e::Harness;

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
