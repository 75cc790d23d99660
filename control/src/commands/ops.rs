//! `corral ps`, `corral kill` and `corral logs`: a sandbox's operations,
//! looked at and stopped. Exit 0, 2 on a usage error, 125 when it fails.

use std::io::Write;

use corral_harness::client::{ClientError, WorkerClient};
use corral_harness::follow::{FollowError, Follower};
use corral_proto::init::OperationRecord;
use corral_proto::{EventKind, OperationId, OperationSpec, OutputStream, SandboxId};

use crate::cli::ConnArgs;
use crate::connect::{ConnectError, connect, connect_for};
use crate::view::one_line;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Follow(#[from] FollowError),
    #[error("{0}")]
    Invalid(String),
    /// Nothing to do: not a mistake in how the command was given.
    #[error("{0}")]
    NotRunning(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

fn finish(r: Result<(), Error>) -> u8 {
    match r {
        Ok(()) => 0,
        // Its reader went away (`| head`): quietly, as SIGPIPE would.
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Invalid(_) | Error::Connect(ConnectError::Usage(_)) => super::EXIT_USAGE,
                Error::NotRunning(_) => 1,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

fn sandbox_id(s: &str) -> Result<SandboxId, Error> {
    SandboxId::new(s).map_err(|e| Error::Invalid(e.to_string()))
}

pub async fn ps(conn: &ConnArgs, sandbox: &str, all: bool) -> u8 {
    finish(
        async {
            let sandbox = sandbox_id(sandbox)?;
            let worker = connect_for(conn, &sandbox).await?;
            let ops = worker.list_operations(&sandbox).await?;
            let mut out = std::io::stdout().lock();
            let rows: Vec<[String; 4]> =
                std::iter::once(["ID", "KIND", "STATE", "WHAT"].map(String::from))
                    .chain(ops.iter().filter(|o| all || o.result.is_none()).map(|o| {
                        [
                            o.id.to_string(),
                            o.spec.kind().into(),
                            state(o),
                            what(&o.spec),
                        ]
                    }))
                    // An ended operation's state carries the sandbox's or
                    // the worker's words (a spawn failure, a lost sandbox):
                    // escaped before the columns are measured.
                    .map(|r| r.map(|c| crate::view::printable(&c).into_owned()))
                    .collect();
            let widths: Vec<usize> = (0..3)
                .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
                .collect();
            for r in &rows {
                let line = format!(
                    "{:<w0$}  {:<w1$}  {:<w2$}  {}",
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    w0 = widths[0],
                    w1 = widths[1],
                    w2 = widths[2]
                );
                writeln!(out, "{line}")?;
            }
            Ok(())
        }
        .await,
    )
}

fn state(o: &OperationRecord) -> String {
    match &o.result {
        None => "running".into(),
        Some(r) => r.outcome.to_string(),
    }
}

fn what(spec: &OperationSpec) -> String {
    let text = match spec {
        OperationSpec::Shell(s) => s.command.clone(),
        OperationSpec::ReadFile(r) => r.path.clone(),
        OperationSpec::WriteFile(w) => w.path.clone(),
        OperationSpec::PutArchive(a) | OperationSpec::GetArchive(a) | OperationSpec::ListDir(a) => {
            a.path.clone()
        }
    };
    one_line(&text, 60)
}

pub async fn kill(conn: &ConnArgs, operation: &str, sandbox: Option<&str>) -> u8 {
    finish(
        async {
            let op = OperationId::new(operation).map_err(|e| Error::Invalid(e.to_string()))?;
            let sandbox = sandbox.map(sandbox_id).transpose()?;
            let worker = match &sandbox {
                Some(s) => connect_for(conn, s).await?,
                None => connect(conn).await?,
            };
            let sandbox = match sandbox {
                Some(s) => s,
                None => find(&worker, &op).await?,
            };
            if !worker.cancel(&sandbox, &op).await? {
                return Err(Error::NotRunning(format!(
                    "operation {op} of sandbox {sandbox} is not running"
                )));
            }
            Ok(())
        }
        .await,
    )
}

/// The sandbox of the worker that knows operation `op`.
async fn find(worker: &WorkerClient, op: &OperationId) -> Result<SandboxId, Error> {
    for sb in worker.list_sandboxes().await? {
        if worker.operation(&sb.id, op).await.is_ok() {
            return Ok(sb.id);
        }
    }
    Err(Error::Invalid(format!(
        "no sandbox of this worker knows operation {op}"
    )))
}

// Says on stderr what the journal no longer holds.
#[allow(clippy::print_stderr)]
pub async fn logs(conn: &ConnArgs, sandbox: &str, follow: bool) -> u8 {
    finish(
        async {
            let sandbox = sandbox_id(sandbox)?;
            let worker = connect_for(conn, &sandbox).await?;
            // Without -f, what there is now: up to the sandbox's last event.
            let until = worker.get_sandbox(&sandbox).await?.last_seq;
            if !follow && until == 0 {
                return Ok(());
            }
            let mut events = Follower::new(worker, sandbox, 0, None);
            let stop = crate::signals::stop_signal();
            tokio::pin!(stop);
            loop {
                let event = tokio::select! {
                    e = events.next() => e?,
                    _ = &mut stop => return Ok(()),
                };
                match &event.kind {
                    EventKind::Output { stream, data } => {
                        let written = match stream {
                            OutputStream::Stdout => {
                                let mut out = std::io::stdout().lock();
                                out.write_all(data).and_then(|()| out.flush())
                            }
                            OutputStream::Stderr => {
                                let mut err = std::io::stderr().lock();
                                err.write_all(data).and_then(|()| err.flush())
                            }
                        };
                        // `| head`: nobody reads any more (141, quietly).
                        written?;
                    }
                    EventKind::Gap { from, to } => {
                        eprintln!(
                            "corral: events {from}..={to} are no longer in the sandbox's journal"
                        );
                    }
                    EventKind::SandboxLost { reason } => {
                        return Err(Error::Invalid(format!("the sandbox was lost: {reason}")));
                    }
                    _ => {}
                }
                if !follow && event.seq >= until {
                    return Ok(());
                }
            }
        }
        .await,
    )
}
