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

use corral_harness::client::{ClientError, Credentials, EventStream, WorkerClient};

/// How long `corral exec` keeps trying to reach a worker that went away.
pub const RECONNECT_WINDOW: Duration = Duration::from_secs(120);
/// How long a sandbox made for one `corral exec` outlives a client that is
/// gone for good (killed, its machine lost): then its worker removes it.
pub const EPHEMERAL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
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
    Client(#[from] ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Output(#[from] std::io::Error),
    #[error("the worker at {url} stayed unreachable for {secs} s: {last}")]
    GaveUp {
        url: String,
        secs: u64,
        last: String,
    },
}

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

/// Connects to the worker again and again until `deadline`.
async fn reconnect(
    url: &str,
    creds: &Credentials,
    deadline: tokio::time::Instant,
) -> Result<WorkerClient, ExecError> {
    let mut delay = Duration::from_millis(100);
    loop {
        match WorkerClient::connect_with(url, creds).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() + delay > deadline => {
                return Err(ExecError::GaveUp {
                    url: url.to_string(),
                    secs: RECONNECT_WINDOW.as_secs(),
                    last: e.to_string(),
                });
            }
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Runs `call` until it succeeds, retrying transient failures (with a fresh
/// connection) until the reconnect window closes.
async fn with_retry<T, F, Fut>(
    client: &mut WorkerClient,
    creds: &Credentials,
    mut call: F,
) -> Result<T, ExecError>
where
    F: FnMut(WorkerClient) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let deadline = tokio::time::Instant::now() + RECONNECT_WINDOW;
    loop {
        match call(client.clone()).await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "transient failure; reconnecting");
                tokio::time::sleep(Duration::from_millis(200)).await;
                let url = client.url().to_string();
                *client = reconnect(&url, creds, deadline).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs the command and returns how it ended. Output goes to `out`/`err` as
/// it is produced, input comes from `controls`. When the stop resolves, or
/// `out` is closed, the command is canceled (and its end still awaited). A
/// sandbox created here is removed afterwards.
pub async fn exec(
    mut client: WorkerClient,
    creds: &Credentials,
    req: ExecRequest,
    out: &mut (impl AsyncWrite + Unpin),
    err: &mut (impl AsyncWrite + Unpin),
    controls: Controls,
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
    shell.timeout_ms = req.timeout.map(|t| t.as_millis() as u64);
    shell.use_bash = req.use_bash;
    shell.keep_background = req.keep_background;
    shell.stdin = req.stdin;
    shell.terminal = req.terminal;
    let spec = OperationSpec::Shell(shell);
    spec.validate()
        .map_err(|e| ExecError::Invalid(e.to_string()))?;

    let (sandbox, temporary) = match &req.sandbox {
        Some(id) => (id.clone(), false),
        None => {
            let id = SandboxId::random();
            let sb_spec = SandboxSpec {
                image: req.image.clone(),
                idle_timeout_ms: Some(req.idle_timeout.as_millis().max(1) as u64),
                ..SandboxSpec::default()
            };
            let id2 = id.clone();
            with_retry(&mut client, creds, |c| {
                let (id, spec) = (id2.clone(), sb_spec.clone());
                async move { c.create_sandbox(Some(&id), spec).await }
            })
            .await?;
            (id, true)
        }
    };
    let result = run_op(&mut client, creds, &sandbox, spec, out, err, controls).await;
    if temporary {
        let id = sandbox.clone();
        let removed = with_retry(&mut client, creds, |c| {
            let id = id.clone();
            async move { c.destroy_sandbox(&id).await }
        })
        .await;
        if let Err(e) = removed {
            tracing::warn!(sandbox = %sandbox, error = %e, "could not remove the sandbox");
        }
    }
    result
}

async fn run_op(
    client: &mut WorkerClient,
    creds: &Credentials,
    sandbox: &SandboxId,
    spec: OperationSpec,
    out: &mut (impl AsyncWrite + Unpin),
    err: &mut (impl AsyncWrite + Unpin),
    controls: Controls,
) -> Result<Ended, ExecError> {
    let op = OperationId::random();
    // Everything of this operation comes after the sandbox's current seq.
    let sb = sandbox.clone();
    let mut cursor = with_retry(client, creds, |c| {
        let sb = sb.clone();
        async move { c.get_sandbox(&sb).await }
    })
    .await?
    .last_seq;
    let (sb, op2) = (sandbox.clone(), op.clone());
    with_retry(client, creds, |c| {
        let (sb, op, spec) = (sb.clone(), op2.clone(), spec.clone());
        async move { c.submit(&sb, &op, spec).await }
    })
    .await?;

    let Controls {
        mut stop,
        input,
        resize,
    } = controls;
    let (feed_client, feed_op) = (client.clone(), op.clone());
    let mut feeding = std::pin::pin!(async move {
        match input {
            Some(input) => feed(feed_client, creds, sandbox, &feed_op, input).await,
            None => std::future::pending().await,
        }
    });
    let mut input_done = false;
    let mut resize = resize;
    let mut stream: Option<EventStream> = None;
    let mut stopped_by: Option<i32> = None;
    let mut output_closed = false;
    let mut canceled = false;
    let mut lost_since: Option<tokio::time::Instant> = None;
    let ended = |result: OperationResult, stopped_by, output_closed| Ended {
        result,
        stopped_by,
        output_closed,
    };
    loop {
        if stream.is_none() {
            match client.watch(sandbox, cursor, Some(&op)).await {
                Ok(s) => stream = Some(s),
                Err(e) if e.is_transient() => {
                    let since = *lost_since.get_or_insert_with(tokio::time::Instant::now);
                    let url = client.url().to_string();
                    *client = reconnect(&url, creds, since + RECONNECT_WINDOW).await?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let Some(s) = stream.as_mut() else { continue };
        let next = tokio::select! {
            next = s.next() => next,
            sig = &mut stop, if stopped_by.is_none() => {
                stopped_by = Some(sig);
                if !canceled {
                    canceled = true;
                    cancel(client, creds, sandbox, &op).await?;
                }
                continue;
            }
            fed = &mut feeding, if !input_done => {
                input_done = true;
                if let Err(e) = fed {
                    let note = format!("corral: input: {e}\n");
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
                if let Err(e) = client.resize_terminal(sandbox, &op, size).await {
                    tracing::debug!(error = %e, "resizing the terminal failed");
                }
                continue;
            }
        };
        match next {
            Some(Ok(event)) => {
                lost_since = None;
                cursor = cursor.max(event.seq);
                match event.kind {
                    EventKind::Output { stream, data } => {
                        let written = match stream {
                            OutputStream::Stdout if output_closed => Ok(()),
                            OutputStream::Stdout => write_flush(out, &data).await,
                            OutputStream::Stderr => write_flush(err, &data).await,
                        };
                        match written {
                            Ok(()) => {}
                            // Nobody reads the output any more (`| head`):
                            // the command is stopped, as a pipe would stop
                            // it, and the rest of its output dropped.
                            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                                if stream == OutputStream::Stdout {
                                    output_closed = true;
                                }
                                if !canceled {
                                    canceled = true;
                                    cancel(client, creds, sandbox, &op).await?;
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
                    EventKind::Started { .. } => {}
                }
            }
            Some(Err(e)) if !e.is_transient() => return Err(e.into()),
            // The stream broke or the worker closed it: reconnect and resume
            // from the cursor. Nothing is lost or repeated.
            Some(Err(_)) | None => {
                stream = None;
                let since = *lost_since.get_or_insert_with(tokio::time::Instant::now);
                tokio::time::sleep(Duration::from_millis(100)).await;
                let url = client.url().to_string();
                *client = reconnect(&url, creds, since + RECONNECT_WINDOW).await?;
            }
        }
    }
}

async fn write_flush(w: &mut (impl AsyncWrite + Unpin), data: &[u8]) -> std::io::Result<()> {
    w.write_all(data).await?;
    w.flush().await
}

async fn cancel(
    client: &mut WorkerClient,
    creds: &Credentials,
    sandbox: &SandboxId,
    op: &OperationId,
) -> Result<(), ExecError> {
    let (sb, op) = (sandbox.clone(), op.clone());
    with_retry(client, creds, |c| {
        let (sb, op) = (sb.clone(), op.clone());
        async move { c.cancel(&sb, &op).await }
    })
    .await?;
    Ok(())
}

/// Sends `input` to the operation's stdin chunk by chunk, each placed by
/// its offset (so a call repeated after a reconnect adds nothing twice),
/// and ends it at end of input. Stops early when the command takes no more.
async fn feed(
    mut client: WorkerClient,
    creds: &Credentials,
    sandbox: &SandboxId,
    op: &OperationId,
    mut input: Pin<Box<dyn AsyncRead + Send>>,
) -> Result<(), ExecError> {
    let mut buf = vec![0u8; INPUT_CHUNK];
    let mut offset = 0u64;
    loop {
        let n = input.read(&mut buf).await?;
        let eof = n == 0;
        let chunk = Bytes::copy_from_slice(&buf[..n]);
        let (sb, op) = (sandbox.clone(), op.clone());
        let (_, closed) = with_retry(&mut client, creds, |c| {
            let (sb, op, chunk) = (sb.clone(), op.clone(), chunk.clone());
            async move { c.write_input(&sb, &op, offset, chunk, eof).await }
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
