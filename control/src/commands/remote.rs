//! `corral run --control URL`: the session runs on a control plane service
//! (`corral serve`) and is shown here exactly as a local run is: the same
//! views, the same events, the same exit codes. Stdin lines become inputs,
//! the first stop signal stops the session, a second leaves it; a service
//! that restarts meanwhile is waited for and watched again from the last
//! event seen. The session itself does not depend on this process: it goes
//! on if this process goes.

use std::path::Path;
use std::time::{Duration, Instant};

use corral_harness::agent::events::{Event, from_json_line};
use corral_harness::client::{ClientTls, Credentials};
use corral_harness::control::{ControlClient, ControlError, DEFAULT_RECONNECT_PATIENCE};
use corral_harness::transfer::Unpacking;
use corral_proto::pb;
use futures_util::StreamExt;

use super::run_input::{EXIT_FAILED, Line, StdinLines, exit_code_of, input_of, next_input};
use crate::cli::{ConnArgs, RunArgs};
use crate::view::View;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("the service sent an event this build cannot read: {0}")]
    Event(String),
    #[error("the service stayed unreachable for {} s: {error}", .patience.as_secs())]
    Lost {
        patience: Duration,
        error: ControlError,
    },
    #[error(
        "session {0} is not running on the service (its run ended without its last event; `corral run --control URL --session {0}` resumes it)"
    )]
    NotHosted(String),
    #[error("export: {0}")]
    Export(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => super::EXIT_USAGE,
            Error::Control(e) if e.reason() == Some(corral_proto::Reason::InvalidArgument) => {
                super::EXIT_USAGE
            }
            Error::Control(e) if e.reason() == Some(corral_proto::Reason::SessionNotFound) => {
                super::EXIT_USAGE
            }
            _ => EXIT_FAILED,
        }
    }
}

/// What cannot go with --control: paths of this machine the service
/// cannot read.
fn refuse_local_paths(args: &RunArgs) -> Result<(), Error> {
    let local = [
        ("--workspace", args.workspace.is_some()),
        ("--skills", args.skills.is_some()),
    ];
    for (flag, given) in local {
        if given {
            return Err(Error::Usage(format!(
                "{flag} names this machine's files; with --control the service's apply"
            )));
        }
    }
    Ok(())
}

fn credentials(conn: &ConnArgs, args: &RunArgs) -> Result<Credentials, Error> {
    service_credentials(conn, args.control_token_file.as_deref()).map_err(Error::Usage)
}

/// How to reach a control plane service: the token of `token_file`, else
/// the front door's key of CORRAL_API_KEY; the TLS of `--tls-*`.
pub(super) fn service_credentials(
    conn: &ConnArgs,
    token_file: Option<&Path>,
) -> Result<Credentials, String> {
    use std::os::unix::fs::MetadataExt;
    let token = match token_file {
        Some(path) => Some(corral_worker::process::read_token(path).map_err(|e| e.to_string())?),
        None => conn.api_key.clone().map(|k| k.0),
    };
    // A service on this machine gets the token only through a socket of
    // this user, root or the token file's owner, on every connection.
    let token_owner = token_file
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| m.uid());
    let read = |flag: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("{flag} {}: {e}", path.display()))
    };
    let ca_pem = match &conn.tls_ca {
        Some(ca) => Some(read("--tls-ca", ca)?),
        None => None,
    };
    // For a service that asks for client certificates (mutual TLS).
    let identity = match (&conn.tls_cert, &conn.tls_key) {
        (Some(cert), Some(key)) => Some((read("--tls-cert", cert)?, read("--tls-key", key)?)),
        _ => None,
    };
    let tls = (ca_pem.is_some() || identity.is_some()).then(|| ClientTls {
        ca_pem,
        identity,
        domain: conn.tls_server_name.clone(),
    });
    Ok(Credentials {
        token,
        tls,
        token_owner,
    })
}

/// The run's settings as its flags say (the service's defaults for what
/// they do not), sent as the service reads them.
fn settings(args: &RunArgs, api_key: Option<String>) -> pb::RunSettings {
    super::run::settings_of(args, api_key).to_pb()
}

/// `corral run --control URL`: as `corral run` says its exit code.
pub async fn main(conn: &ConnArgs, args: &RunArgs, url: &str) -> u8 {
    let json = super::run_input::is_json(args);
    match run(conn, args, url, json).await {
        Ok(code) => code,
        Err(e) => {
            super::run_input::failed(&e, json);
            e.exit_code()
        }
    }
}

async fn run(conn: &ConnArgs, args: &RunArgs, url: &str, json: bool) -> Result<u8, Error> {
    refuse_local_paths(args)?;
    let request = super::run_input::load_request(args).map_err(Error::Usage)?;
    let api_key = super::run_input::key_from(args.api_key_file.as_deref()).map_err(Error::Usage)?;
    let creds = credentials(conn, args)?;
    let client = ControlClient::connect(url, &creds).await?;
    let request_json = if request == Default::default() {
        String::new()
    } else {
        serde_json::to_string(&request).map_err(|e| Error::Usage(e.to_string()))?
    };
    let req = pb::StartSessionRequest {
        session_id: args.session.clone().unwrap_or_default(),
        request_json,
        settings: Some(settings(args, api_key)),
    };
    // A service with no worker free just now, or restarting, is asked
    // again for a while: that is what those refusals ask of a client.
    let since = Instant::now();
    let start = loop {
        match client.start(req.clone()).await {
            Err(e)
                if (e.reason() == Some(corral_proto::Reason::NoWorker) || e.is_transient())
                    && since.elapsed() < DEFAULT_RECONNECT_PATIENCE =>
            {
                tracing::debug!(error = %e, "starting again shortly");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            r => break r,
        }
    };
    let (id, after) = match (start, &args.session) {
        (Ok(started), _) => (started.session_id, started.events_before),
        // Running there already (started by another client, or by this
        // one before it went away): its prompt, if any, goes in as an
        // input, and its run is watched from its start.
        (Err(e), Some(id)) if e.reason() == Some(corral_proto::Reason::SessionRunning) => (
            id.clone(),
            attach(&client, id, request.prompt.as_deref()).await?,
        ),
        (Err(e), _) => return Err(e.into()),
    };
    let mut view = View::new(json);
    let mut code = watch(&client, &id, after, &mut view, args.inputs_from_stdin).await?;
    if let Some(dest) = &args.export {
        let rules = args.out.apply(Unpacking::contents_from_sandbox());
        if let Err(e) = export(&client, &id, dest, rules).await {
            super::report(&e);
            if code == super::run_input::EXIT_DONE {
                code = super::EXIT_CORRAL_ERROR;
            }
        }
    }
    if view.is_closed() {
        return Ok(141);
    }
    Ok(code)
}

/// Joins a session the service runs already: its prompt, if any, goes in
/// as an input, and its run is watched from its start (the number of the
/// event before it is returned). A run still starting (resumed after the
/// service's restart, say) is waited for.
async fn attach(client: &ControlClient, id: &str, prompt: Option<&str>) -> Result<u64, Error> {
    let since = Instant::now();
    loop {
        let sent = match prompt {
            Some(p) => client.send_input(id, p).await.map(|_| ()),
            None => Ok(()),
        };
        let not_yet = match sent {
            Ok(()) => {
                let listed = client.list().await?;
                match listed.iter().find(|s| s.session_id == id && s.running) {
                    Some(info) => return Ok(info.run_events_after),
                    None => ControlError::Status(tonic::Status::failed_precondition(format!(
                        "session {id} is not running"
                    ))),
                }
            }
            Err(e) if e.reason() == Some(corral_proto::Reason::SessionNotRunning) => e,
            Err(e) => return Err(e.into()),
        };
        if since.elapsed() >= DEFAULT_RECONNECT_PATIENCE {
            return Err(not_yet.into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Shows the session's events from `after` until its run's last event;
/// returns the exit code that event means.
async fn watch(
    client: &ControlClient,
    id: &str,
    after: u64,
    view: &mut View,
    from_stdin: bool,
) -> Result<u8, Error> {
    use tokio::io::AsyncBufReadExt;
    let mut last = after;
    let mut stop_signals = std::pin::pin!(crate::signals::stop_signals());
    let mut stops = 0;
    let mut stdin_lines: Option<StdinLines> =
        from_stdin.then(|| tokio::io::BufReader::new(tokio::io::stdin()).lines());
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    // Since when the service has not answered (None: it answers).
    let mut unreachable_since: Option<Instant> = None;
    let mut stream = None;
    loop {
        if view.is_closed() && stops == 0 {
            // The JSON reader went away: stop as on SIGTERM, once.
            stops = 1;
            let _ = client.stop(id, false).await;
        }
        let events = match &mut stream {
            Some(s) => s,
            None => match client.watch(id, last).await {
                Ok(s) => stream.insert(s),
                Err(e) if e.is_transient() => {
                    wait_or_give_up(&mut unreachable_since, e).await?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            },
        };
        tokio::select! {
            biased;
            next = events.next() => match next {
                Some(Ok((seq, line))) => {
                    // The service answers (a stream that ends at once does
                    // not count).
                    unreachable_since = None;
                    last = seq;
                    let event = from_json_line(&line).map_err(Error::Event)?;
                    view.show(&event)?;
                    match &event {
                        Event::Result(r) => {
                            return Ok(exit_code_of(r.status));
                        }
                        Event::Error { .. } => return Ok(EXIT_FAILED),
                        _ => {}
                    }
                }
                Some(Err(e)) if e.is_transient() => {
                    stream = None;
                    wait_or_give_up(&mut unreachable_since, e).await?;
                }
                Some(Err(e)) => return Err(e.into()),
                // Ended without its last event: the run is not hosted now
                // (the service left it, to resume it at its next start).
                None => {
                    stream = None;
                    // Not hosted there (any more): its run will not end
                    // while watched.
                    if !client.list().await?.iter().any(|s| s.session_id == id && s.running) {
                        return Err(Error::NotHosted(id.to_string()));
                    }
                    let e = ControlError::Status(tonic::Status::unavailable(
                        "the session's events ended before its run did",
                    ));
                    wait_or_give_up(&mut unreachable_since, e).await?;
                }
            },
            Some(_) = stop_signals.next() => {
                stops += 1;
                if let Err(e) = client.stop(id, stops > 1).await {
                    tracing::warn!(error = %e, "the stop was not taken");
                }
            }
            line = next_input(&mut stdin_lines) => match input_of(line) {
                Line::Input(text) => {
                    if let Err(e) = client.send_input(id, &text).await {
                        tracing::warn!(error = %e, "an input was not taken");
                        stdin_lines = None;
                    }
                }
                Line::Blank => {}
                Line::End => stdin_lines = None,
            },
            _ = tick.tick() => {
                if let View::Terminal(t) = view {
                    t.tick()?;
                }
                view.check_reader();
            }
        }
    }
}

/// Waits a little before asking a service that did not answer again, or
/// gives up once it has not answered for [`DEFAULT_RECONNECT_PATIENCE`].
async fn wait_or_give_up(since: &mut Option<Instant>, e: ControlError) -> Result<(), Error> {
    let first = *since.get_or_insert_with(Instant::now);
    if first.elapsed() >= DEFAULT_RECONNECT_PATIENCE {
        return Err(Error::Lost {
            patience: DEFAULT_RECONNECT_PATIENCE,
            error: e,
        });
    }
    tracing::debug!(error = %e, "watching again shortly");
    tokio::time::sleep(Duration::from_millis(250)).await;
    Ok(())
}

/// Brings the session's /workspace into `dest` through the service, by
/// `rules` (what comes is the sandbox's, so hostile).
async fn export(
    client: &ControlClient,
    id: &str,
    dest: &Path,
    rules: Unpacking,
) -> Result<(), Error> {
    use tokio::io::AsyncWriteExt;
    let err = |e: String| Error::Export(e);
    std::fs::create_dir_all(dest).map_err(|e| err(format!("{}: {e}", dest.display())))?;
    // Whole on this machine before it is unpacked: a cut stream never
    // leaves half a tree.
    let tar = std::env::temp_dir().join(format!("corral-export-{}.tar", uuid::Uuid::new_v4()));
    let fetched = async {
        let mut file = tokio::fs::File::from_std(
            corral_harness::session::log::private_file()
                .write(true)
                .create_new(true)
                .open(&tar)
                .map_err(|e| err(format!("{}: {e}", tar.display())))?,
        );
        let mut chunks = client.export(id).await?;
        while let Some(chunk) = chunks.next().await {
            file.write_all(&chunk?)
                .await
                .map_err(|e| err(e.to_string()))?;
        }
        file.flush().await.map_err(|e| err(e.to_string()))?;
        corral_harness::transfer::unpack_saved(&tar, dest, rules)
            .await
            .map_err(|e| err(e.to_string()))
    }
    .await;
    let _ = std::fs::remove_file(&tar);
    let moved = fetched?;
    super::left_out(&moved);
    Ok(())
}
