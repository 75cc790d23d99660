//! `corral exec`: exits with the command's exit code; 125 when Corral
//! itself fails, 128+N when stopped by signal N, 141 on a closed stdout.

use corral_proto::{SandboxId, TerminalSize};

use crate::cli::{ConnArgs, ExecArgs};
use corral_harness::placement::Attempt;

use crate::connect::{ConnectError, connect, connect_for, place, worker_urls};
use crate::exec::{self, ExecError, ExecRequest};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("{0}")]
    Invalid(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn main(conn: &ConnArgs, args: ExecArgs) -> u8 {
    match exec_command(conn, args).await {
        Ok(code) => code,
        Err(Error::Exec(ExecError::Stopped(sig))) => {
            super::warn(&format!(
                "stopped by {} before the command started",
                signal_name(sig)
            ));
            128u8.saturating_add(sig as u8)
        }
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

/// A stop signal's name, as `corral exec` reports it.
fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

async fn exec_command(conn: &ConnArgs, args: ExecArgs) -> Result<u8, Error> {
    // The stop signals are caught from the start: one that comes while a
    // worker or its engine is awaited ends this, and a second ends it from
    // any state.
    let mut stop = Box::pin(crate::signals::stop_signal());
    // As `docker exec -it`: keys cannot come from a pipe or a file (a
    // terminal's end of input is a key, which a file never sends).
    if args.tty && args.interactive && !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        return Err(Error::Connect(ConnectError::Usage(
            "the input device is not a TTY (give -i alone to send a pipe or a file)".into(),
        )));
    }
    let terminal = args
        .tty
        .then(|| crate::terminal::current_size().unwrap_or(TerminalSize { rows: 24, cols: 80 }));
    let mut req = ExecRequest {
        sandbox: args
            .sandbox
            .as_deref()
            .map(SandboxId::new)
            .transpose()
            .map_err(|e| Error::Invalid(e.to_string()))?,
        image: args.image.clone(),
        timeout: args.timeout,
        env: args.env_map(),
        workdir: args.workdir.clone(),
        use_bash: args.bash,
        argv: args.argv.clone(),
        keep_background: args.keep_background,
        stdin: args.interactive,
        terminal,
        idle_timeout: args.idle_timeout,
        worker_lost_after: conn.worker_lost_after,
        made_for_it: false,
        egress: corral_proto::egress::parse_rules(&args.egress, false)
            .map_err(|e| Error::Invalid(format!("--egress: {e}")))?,
    };
    // Several workers: the sandbox is found among them, or a new one is
    // placed.
    let mut made = None;
    let reached = async {
        let urls = worker_urls(conn).await?;
        let client = match (&req.sandbox, urls.len()) {
            (_, 0 | 1) => connect(conn).await?,
            (Some(id), _) => connect_for(conn, id).await?,
            (None, _) => {
                let id = SandboxId::random();
                let spec = req.sandbox_spec();
                let client = place(conn, &urls, &spec, |_, client| {
                    let (id, spec) = (id.clone(), spec.clone());
                    async move {
                        match client.create_sandbox(Some(&id), spec).await {
                            Ok(_) => Ok(client),
                            Err(e) if e.is_refusal() || e.is_transient() => {
                                Err(Attempt::Refused(e.to_string()))
                            }
                            Err(e) => Err(Attempt::Failed(Error::Connect(e.into()))),
                        }
                    }
                })
                .await?;
                made = Some(id);
                client
            }
        };
        Ok::<_, Error>(client)
    };
    let client = tokio::select! {
        client = reached => client?,
        sig = &mut stop => return Err(Error::Exec(ExecError::Stopped(sig))),
    };
    if let Some(id) = made {
        req.sandbox = Some(id);
        req.made_for_it = true;
    }
    let mut controls = exec::Controls::stop_on(stop);
    if args.interactive {
        controls.input = Some(Box::pin(tokio::io::stdin()));
    }
    // Keys go to the remote terminal as typed (Ctrl-C included) while it
    // runs; the local modes come back when this guard goes.
    let _raw = (args.tty && args.interactive)
        .then(crate::terminal::RawMode::enable)
        .flatten();
    if args.tty {
        controls.resize = crate::terminal::resizes()
            .ok()
            .map(|s| Box::pin(s) as std::pin::Pin<Box<_>>);
    }
    let mut out = tokio::io::stdout();
    let mut err = tokio::io::stderr();
    let ended = exec::exec(client, req, &mut out, &mut err, controls).await?;
    drop(_raw);
    use corral_proto::Outcome;
    let outcome = &ended.result.outcome;
    if ended.output_closed {
        // As a shell reports a command killed by SIGPIPE, and silently.
        return Ok(141);
    }
    match (outcome, ended.stopped_by) {
        (Outcome::Exited { .. } | Outcome::Signaled { .. }, _) => {}
        (Outcome::Canceled, Some(sig)) => {
            let name = signal_name(sig);
            let line = format!("corral: command canceled ({name})\n");
            tokio::io::AsyncWriteExt::write_all(&mut err, line.as_bytes()).await?;
            return Ok(128 + sig as u8);
        }
        // Canceled by someone else (`corral kill`, another client): said
        // so, with the code of a command killed (SIGKILL), not Ctrl-C's.
        (Outcome::Canceled, None) => {
            let line =
                "corral: the command was killed by a cancel from another client (corral kill)\n";
            tokio::io::AsyncWriteExt::write_all(&mut err, line.as_bytes()).await?;
            return Ok(137);
        }
        (other, _) => {
            // A spawn failure or a lost sandbox in the worker's words.
            let line = format!(
                "corral: command {}\n",
                crate::view::printable(&other.to_string())
            );
            tokio::io::AsyncWriteExt::write_all(&mut err, line.as_bytes()).await?;
        }
    }
    Ok(outcome.exit_status().clamp(0, 255) as u8)
}
