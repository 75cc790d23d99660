//! `corral exec`: run one command in a sandbox, stream its output live,
//! survive a worker restart, and report how it ended.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use corral_proto::{
    EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream, SandboxId,
    SandboxSpec, ShellSpec, TerminalSize,
};
use futures_util::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use corral_harness::follow::{self, FollowError, Follower};
use corral_harness::worker_api::WorkerApi;

/// How often `corral exec` says it is waiting for a worker that went away.
const WAITING_NOTICE: Duration = Duration::from_secs(5);
/// Largest chunk of input sent in one call.
const INPUT_CHUNK: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct ExecRequest {
    pub sandbox: Option<SandboxId>,
    pub image: Option<String>,
    pub timeout: Option<Duration>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub use_bash: bool,
    pub argv: Vec<String>,
    pub keep_background: bool,
    /// The command reads `Controls::input` as its stdin.
    pub stdin: bool,
    /// The command runs on a pseudo-terminal of this size.
    pub terminal: Option<TerminalSize>,
    /// For a sandbox made for this command: removed by its worker once no
    /// client has used it for this long.
    pub idle_timeout: Duration,
    /// How long the worker may stay unreachable before the sandbox is
    /// taken for lost (`--worker-lost-after`).
    pub worker_lost_after: Duration,
    /// `sandbox` was made for this command (by a placement): it is removed
    /// afterwards, as one made here would be.
    pub made_for_it: bool,
    /// Egress rules of a sandbox made for this command.
    pub egress: Vec<corral_proto::egress::Rule>,
}

impl ExecRequest {
    /// The spec of a sandbox made for this command.
    pub fn sandbox_spec(&self) -> SandboxSpec {
        SandboxSpec {
            image: self.image.clone(),
            idle_timeout_ms: Some(self.idle_timeout.as_millis().max(1) as u64),
            egress: self.egress.clone(),
            ..SandboxSpec::default()
        }
    }
}

/// What reaches a running command from outside.
pub struct Controls {
    /// Resolves (with the signal's number) when the command is to be
    /// stopped.
    pub stop: Pin<Box<dyn Future<Output = i32> + Send>>,
    /// The command's input, when it takes one.
    pub input: Option<Pin<Box<dyn AsyncRead + Send>>>,
    /// New sizes of the terminal.
    pub resize: Option<Pin<Box<dyn Stream<Item = TerminalSize> + Send>>>,
}

impl Controls {
    /// Stopped by `stop` only: no input, no terminal.
    pub fn stop_on(stop: impl Future<Output = i32> + Send + 'static) -> Self {
        Self {
            stop: Box::pin(stop),
            input: None,
            resize: None,
        }
    }
}

/// How a command ended, as `corral exec` reports it.
#[derive(Debug)]
pub struct Ended {
    pub result: OperationResult,
    /// The signal that stopped it, if one did.
    pub stopped_by: Option<i32>,
    /// Its output could not be written (a closed pipe): it was stopped.
    pub output_closed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Worker(#[from] FollowError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Output(#[from] std::io::Error),
    /// A stop signal (its number) came before the command started.
    #[error("stopped by signal {0} before the command started")]
    Stopped(i32),
}

/// How long a command stopped before it started waits for what it had asked
/// of its worker to be taken back (a sandbox made for it, an operation
/// submitted): a worker waiting for its engine may never answer.
const UNDO_WAIT: Duration = Duration::from_secs(3);

/// Quotes `argv` for `/bin/sh -c` so each word arrives as it was given.
pub fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+%@".contains(&b));
            if plain {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs the command and returns how it ended. Output goes to `out`/`err` as
/// it is produced, input comes from `controls`. When the stop resolves, or
/// `out` is closed, the command is canceled (and its end still awaited). A
/// sandbox created here is removed afterwards.
pub async fn exec<W: WorkerApi>(
    worker: W,
    req: ExecRequest,
    out: &mut (impl AsyncWrite + Unpin),
    err: &mut (impl AsyncWrite + Unpin),
    mut controls: Controls,
) -> Result<Ended, ExecError> {
    if req.argv.is_empty() {
        return Err(ExecError::Invalid(
            "no command given (corral exec -- CMD [ARG...])".into(),
        ));
    }
    // `exec`: the command is the shell's process itself, as under `docker
    // exec` (its signals reach it, and no shell stands between).
    let mut shell = ShellSpec::new(format!("exec {}", shell_join(&req.argv)));
    shell.env = req.env.clone();
    shell.workdir = req.workdir.clone();
    // No timeout asked (or 0): none but the worker's cap, as `docker exec`.
    shell.timeout_ms = Some(
        req.timeout
            .filter(|t| !t.is_zero())
            .map_or(corral_proto::limits::MAX_TIMEOUT_MS, |t| {
                u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
            }),
    );
    shell.use_bash = req.use_bash;
    shell.keep_background = req.keep_background;
    shell.stdin = req.stdin;
    shell.terminal = req.terminal;
    let spec = OperationSpec::Shell(shell);
    spec.validate()
        .map_err(|e| ExecError::Invalid(e.to_string()))?;

    let (sandbox, temporary) = match &req.sandbox {
        Some(id) => (id.clone(), req.made_for_it),
        None => {
            let id = SandboxId::random();
            let sb_spec = req.sandbox_spec();
            // A stop signal while the sandbox is made (its worker may wait
            // for its engine) ends this at once; the sandbox goes if it came.
            let made = tokio::select! {
                made = follow::retry(&worker, req.worker_lost_after, || {
                    worker.create_sandbox(&id, &sb_spec)
                }) => made.map(drop).map_err(ExecError::from),
                sig = &mut controls.stop => Err(ExecError::Stopped(sig)),
            };
            if let Err(ExecError::Stopped(_)) = &made {
                let _ = tokio::time::timeout(UNDO_WAIT, worker.destroy_sandbox(&id)).await;
            }
            made?;
            (id, true)
        }
    };
    let patience = req.worker_lost_after;
    let result = run_op(&worker, &sandbox, spec, out, err, controls, patience).await;
    // A worker lost is not waited for again: its idle timeout removes
    // the sandbox if it ever comes back.
    let lost = matches!(result, Err(ExecError::Worker(FollowError::GaveUp { .. })));
    if temporary && !lost {
        let removed = follow::retry(&worker, patience, || worker.destroy_sandbox(&sandbox)).await;
        if let Err(e) = removed {
            tracing::warn!(sandbox = %sandbox, error = %e, "could not remove the sandbox");
        }
    }
    result
}

async fn run_op<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    spec: OperationSpec,
    out: &mut (impl AsyncWrite + Unpin),
    err: &mut (impl AsyncWrite + Unpin),
    controls: Controls,
    patience: Duration,
) -> Result<Ended, ExecError> {
    let op = OperationId::random();
    let Controls {
        mut stop,
        input,
        resize,
    } = controls;
    // Followed before it is submitted: everything of this operation comes
    // after the sandbox's current seq, and an open watcher holds the
    // sandbox's output for this reader rather than let the journal drop it.
    // A stop signal before it is submitted ends this at once.
    let started = async {
        let (record, events) =
            follow::retry(worker, patience, || worker.run(sandbox, &op, &spec)).await?;
        let after = record.first_seq.saturating_sub(1);
        Ok::<_, ExecError>(
            Follower::on_stream(worker.clone(), sandbox.clone(), op.clone(), after, events)
                .with_patience(patience),
        )
    };
    let mut events = tokio::select! {
        started = started => started?,
        sig = &mut stop => {
            let _ = tokio::time::timeout(UNDO_WAIT, worker.cancel(sandbox, &op)).await;
            return Err(ExecError::Stopped(sig));
        }
    };
    let feed_op = op.clone();
    let mut feeding = std::pin::pin!(async move {
        match input {
            Some(input) => feed(worker, sandbox, &feed_op, input, patience).await,
            None => std::future::pending().await,
        }
    });
    let mut input_done = false;
    let mut resize = resize;
    let mut stopped_by: Option<i32> = None;
    let mut output_closed = false;
    let mut canceled = false;
    let mut notices =
        tokio::time::interval_at(tokio::time::Instant::now() + WAITING_NOTICE, WAITING_NOTICE);
    let ended = |result: OperationResult, stopped_by, output_closed| Ended {
        result,
        stopped_by,
        output_closed,
    };
    loop {
        let next = tokio::select! {
            next = events.next() => next?,
            _ = notices.tick() => {
                // Said while it waits, so a silent terminal is never a
                // mystery.
                if let Some(lost) = events.unreachable_for() {
                    let note = format!(
                        "corral: waiting for {} (unreachable for {}s; the sandbox is taken for lost after {}s)\n",
                        worker.name(),
                        lost.as_secs(),
                        patience.as_secs()
                    );
                    let _ = err.write_all(note.as_bytes()).await;
                }
                continue;
            }
            sig = &mut stop, if stopped_by.is_none() => {
                stopped_by = Some(sig);
                if !canceled {
                    canceled = true;
                    cancel(worker, sandbox, &op, patience).await?;
                }
                continue;
            }
            fed = &mut feeding, if !input_done => {
                input_done = true;
                if let Err(e) = fed {
                    let note = format!("corral: input: {}\n", crate::view::printable(&e.to_string()));
                    let _ = err.write_all(note.as_bytes()).await;
                }
                continue;
            }
            Some(size) = async {
                match resize.as_mut() {
                    Some(r) => r.next().await,
                    None => std::future::pending().await,
                }
            } => {
                // Best effort: a size lost to a blink is set again by the
                // next change.
                if let Err(e) = worker.resize_terminal(sandbox, &op, size).await {
                    tracing::debug!(error = %e, "resizing the terminal failed");
                }
                continue;
            }
        };
        match next.kind {
            EventKind::Output { stream, data } => {
                let written = match stream {
                    OutputStream::Stdout if output_closed => Ok(()),
                    OutputStream::Stdout => write_flush(out, &data).await,
                    OutputStream::Stderr => write_flush(err, &data).await,
                };
                match written {
                    Ok(()) => {}
                    // Nobody reads the output any more (`| head`): the
                    // command is stopped, as a pipe would stop it, and the
                    // rest of its output dropped.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                        if stream == OutputStream::Stdout {
                            output_closed = true;
                        }
                        if !canceled {
                            canceled = true;
                            cancel(worker, sandbox, &op, patience).await?;
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            EventKind::Finished(result) => {
                return Ok(ended(*result, stopped_by, output_closed));
            }
            EventKind::Gap { from, to } => {
                let note = format!(
                    "corral: output events {from}..={to} were dropped by the worker's capped journal\n"
                );
                let _ = err.write_all(note.as_bytes()).await;
            }
            EventKind::SandboxLost { reason } => {
                let result = OperationResult::with_outcome(Outcome::SandboxLost { reason });
                return Ok(ended(result, stopped_by, output_closed));
            }
            // Not of this command's watch (it follows one operation).
            EventKind::Started { .. } | EventKind::Egress(_) | EventKind::Port(_) => {}
        }
    }
}

async fn write_flush(w: &mut (impl AsyncWrite + Unpin), data: &[u8]) -> std::io::Result<()> {
    w.write_all(data).await?;
    w.flush().await
}

async fn cancel<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    op: &OperationId,
    patience: Duration,
) -> Result<(), ExecError> {
    follow::retry(worker, patience, || worker.cancel(sandbox, op)).await?;
    Ok(())
}

/// Sends `input` to the operation's stdin chunk by chunk, each placed by
/// its offset (so a call repeated after a reconnect adds nothing twice),
/// and ends it at end of input. Stops early when the command takes no more.
async fn feed<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    op: &OperationId,
    mut input: Pin<Box<dyn AsyncRead + Send>>,
    patience: Duration,
) -> Result<(), ExecError> {
    let mut buf = vec![0u8; INPUT_CHUNK];
    let mut offset = 0u64;
    loop {
        let n = input.read(&mut buf).await?;
        let eof = n == 0;
        let chunk = Bytes::copy_from_slice(&buf[..n]);
        let (_, closed) = follow::retry(worker, patience, || {
            worker.write_input(sandbox, op, offset, chunk.clone(), eof)
        })
        .await?;
        offset += n as u64;
        if eof || closed {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_survive_the_shell() {
        let argv: Vec<String> = ["echo", "a b", "it's", "$HOME", "", "x=1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(shell_join(&argv), r#"echo 'a b' 'it'\''s' '$HOME' '' x=1"#);
    }
}
