//! `corral exec`: run one command in a sandbox, stream its output live,
//! survive a worker restart, and report how it ended.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use corral_proto::{
    EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream, SandboxId,
    SandboxSpec, ShellSpec,
};
use futures_util::StreamExt;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::client::{ClientError, Credentials, EventStream, WorkerClient};

/// How long `corral exec` keeps trying to reach a worker that went away.
pub const RECONNECT_WINDOW: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
pub struct ExecRequest {
    pub sandbox: Option<SandboxId>,
    pub image: Option<String>,
    pub timeout: Option<Duration>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub use_bash: bool,
    pub argv: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("writing output: {0}")]
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
/// it is produced. When `interrupt` resolves the command is canceled (and
/// its end still awaited). A sandbox created here is removed afterwards.
pub async fn exec(
    mut client: WorkerClient,
    creds: &Credentials,
    req: ExecRequest,
    out: &mut (impl AsyncWrite + Unpin),
    err: &mut (impl AsyncWrite + Unpin),
    interrupt: impl Future<Output = ()>,
) -> Result<OperationResult, ExecError> {
    if req.argv.is_empty() {
        return Err(ExecError::Invalid(
            "no command given (corral exec -- CMD [ARG...])".into(),
        ));
    }
    let mut shell = ShellSpec::new(shell_join(&req.argv));
    shell.env = req.env.clone();
    shell.workdir = req.workdir.clone();
    shell.timeout_ms = req.timeout.map(|t| t.as_millis() as u64);
    shell.use_bash = req.use_bash;
    let spec = OperationSpec::Shell(shell);
    spec.validate()
        .map_err(|e| ExecError::Invalid(e.to_string()))?;

    let (sandbox, temporary) = match &req.sandbox {
        Some(id) => (id.clone(), false),
        None => {
            let id = SandboxId::random();
            let sb_spec = SandboxSpec {
                image: req.image.clone(),
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
    let result = run_op(&mut client, creds, &sandbox, spec, out, err, interrupt).await;
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
    interrupt: impl Future<Output = ()>,
) -> Result<OperationResult, ExecError> {
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

    let mut stream: Option<EventStream> = None;
    let mut interrupt = std::pin::pin!(interrupt);
    let mut interrupted = false;
    let mut lost_since: Option<tokio::time::Instant> = None;
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
            () = &mut interrupt, if !interrupted => {
                interrupted = true;
                let (sb, op) = (sandbox.clone(), op.clone());
                with_retry(client, creds, |c| {
                    let (sb, op) = (sb.clone(), op.clone());
                    async move { c.cancel(&sb, &op).await }
                })
                .await?;
                continue;
            }
        };
        match next {
            Some(Ok(event)) => {
                lost_since = None;
                cursor = cursor.max(event.seq);
                match event.kind {
                    EventKind::Output { stream, data } => {
                        let w: &mut (dyn AsyncWrite + Unpin) = match stream {
                            OutputStream::Stdout => out,
                            OutputStream::Stderr => err,
                        };
                        w.write_all(&data).await?;
                        w.flush().await?;
                    }
                    EventKind::Finished(result) => return Ok(*result),
                    EventKind::Gap { from, to } => {
                        let note = format!(
                            "corral: output events {from}..={to} were dropped by the worker's capped journal\n"
                        );
                        err.write_all(note.as_bytes()).await?;
                    }
                    EventKind::SandboxLost { reason } => {
                        return Ok(OperationResult::with_outcome(Outcome::SandboxLost {
                            reason,
                        }));
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
