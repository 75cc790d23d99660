//! The worker loses its Docker engine: calls fail with a clear error, and
//! when the engine is back a running command finishes with all its output.
//!
//! The worker talks to Docker through a unix-socket proxy owned by the test;
//! dropping the proxy (listener and every connection) is, from the worker's
//! side, a dead daemon, without disturbing the engine other tests share.

use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_e2e::{Harness, collect};
use corral_harness::client::ClientError;
use corral_proto::{OperationId, OperationSpec, ShellSpec};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

const DOCKER_SOCK: &str = "/var/run/docker.sock";

/// Forwards connections to the real Docker socket until dropped.
struct Proxy {
    _tasks: JoinSet<()>,
}

fn start_proxy(path: &Path) -> anyhow::Result<Proxy> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    let mut tasks = JoinSet::new();
    let (conn_tx, mut conn_rx) = tokio::sync::mpsc::unbounded_channel::<UnixStream>();
    tasks.spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            if conn_tx.send(client).is_err() {
                return;
            }
        }
    });
    tasks.spawn(async move {
        let mut conns = JoinSet::new();
        while let Some(mut client) = conn_rx.recv().await {
            conns.spawn(async move {
                if let Ok(mut docker) = UnixStream::connect(DOCKER_SOCK).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut docker).await;
                }
            });
        }
        // Keep connections alive as long as this task; dropping it drops them.
        conns.join_all().await;
    });
    Ok(Proxy { _tasks: tasks })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_docker_engine_is_a_clear_error_and_commands_resume_when_it_returns()
-> anyhow::Result<()> {
    survive_outage(Duration::from_secs(2)).await
}

/// An outage longer than a minute: the worker waits and re-attaches; it
/// never declares a live sandbox lost because Docker did not answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_docker_outage_over_a_minute_loses_no_sandbox() -> anyhow::Result<()> {
    survive_outage(Duration::from_secs(65)).await
}

async fn survive_outage(outage: Duration) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let sock: PathBuf = dir.path().join("docker.sock");
    let proxy = start_proxy(&sock)?;
    let host = format!("unix://{}", sock.display());
    let h = Harness::start_with(|c| c.docker_host = Some(host.clone())).await?;
    let sb = h.sandbox().await?;
    let op = OperationId::random();
    let spec = OperationSpec::Shell(ShellSpec::new(
        "for i in $(seq 1 30); do echo tick $i; sleep 0.1; done",
    ));
    h.client.submit(&sb, &op, spec).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The engine "dies".
    drop(proxy);
    let _ = std::fs::remove_file(&sock);
    let err = h
        .client
        .create_sandbox(None, corral_proto::SandboxSpec::default())
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("created a sandbox without Docker"))?;
    let ClientError::Status(status) = &err else {
        anyhow::bail!("unexpected error {err}");
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("Docker engine:"),
        "{}",
        status.message()
    );

    // It comes back: the command's output arrives whole.
    tokio::time::sleep(outage).await;
    let _proxy = start_proxy(&sock)?;
    let (events, result) = collect(&h.client, &sb, &op, 0).await?;
    assert!(result.outcome.is_success(), "{:?}", result.outcome);
    let expected: String = (1..=30).map(|i| format!("tick {i}\n")).collect();
    assert_eq!(String::from_utf8(corral_e2e::stdout_of(&events))?, expected);
    assert!(matches!(
        h.client.get_sandbox(&sb).await?.state,
        corral_proto::SandboxState::Ready
    ));
    h.stop().await;
    Ok(())
}
