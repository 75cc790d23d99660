//! `corral session`: list, show, fork, export and remove sessions, through the
//! harness's front door. Exit codes: 0, 125 when it fails, 2 for a usage
//! error (an unknown session or turn, a bad id).

use std::io::{IsTerminal, Write};

use corral_harness::agent::{Ending, Record};
use corral_harness::session::LogError;
use corral_harness::sessions::SessionError;
use corral_harness::transfer::Unpacking;

use crate::cli::{ConnArgs, SessionCommand};
use crate::connect::{ConnectError, connect_to};
use crate::view::one_line;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    fn exit_code(&self) -> u8 {
        let log = match self {
            Error::Log(e) | Error::Session(SessionError::Log(e)) => Some(e),
            _ => None,
        };
        match (self, log) {
            (
                Error::Session(
                    SessionError::NoSuchTurn { .. }
                    | SessionError::Invalid(_)
                    | SessionError::NoApiKey { .. },
                ),
                _,
            )
            | (Error::Connect(ConnectError::Usage(_)), _)
            | (
                _,
                Some(
                    LogError::BadId(_)
                    | LogError::AlreadyExists(_)
                    | LogError::NotFound(_)
                    | LogError::BadForkPoint { .. },
                ),
            ) => super::EXIT_USAGE,
            _ => super::EXIT_CORRAL_ERROR,
        }
    }
}

pub async fn main(conn: &ConnArgs, cmd: &SessionCommand) -> u8 {
    match session_command(conn, cmd).await {
        Ok(()) => 0,
        // Its reader went away (`| head`): quietly, as SIGPIPE would.
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            e.exit_code()
        }
    }
}

async fn session_command(conn: &ConnArgs, cmd: &SessionCommand) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    match cmd {
        SessionCommand::Rm {
            id,
            keep_sandbox,
            sessions_dir,
        } => {
            let store = super::run::sessions(sessions_dir.as_deref());
            // Held open (locked) throughout: a running session is not
            // removed under it.
            let stored = store.open(id)?;
            let worker = match stored.config() {
                // The worker it was placed on: recorded, or (none recorded)
                // the local one, whatever `--worker` says now.
                Some(config) if !*keep_sandbox => Some(
                    session_worker(conn, config.worker.as_deref(), config.worker_id.as_deref())
                        .await?,
                ),
                // Kept, or never started (no sandbox was recorded).
                _ => None,
            };
            // The sandboxes of earlier generations (replaced after a loss,
            // they may live on a worker that came back).
            let earlier = if *keep_sandbox {
                Vec::new()
            } else {
                earlier_generations(&store, id)?
            };
            store.remove(stored, worker).await?;
            for (at, sandbox) in earlier {
                let gone = async {
                    let c = connect_to(conn, at.as_deref()).await?;
                    c.destroy_sandbox(&sandbox)
                        .await
                        .map_err(ConnectError::from)?;
                    Ok::<_, Error>(())
                };
                let limit = crate::connect::ASK_TIMEOUT;
                match tokio::time::timeout(limit, gone).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => super::warn(&format!(
                        "sandbox {sandbox} of an earlier generation was not removed ({e}); its worker removes it once idle"
                    )),
                    Err(_) => super::warn(&format!(
                        "sandbox {sandbox} of an earlier generation was not removed (its worker did not answer within {} s); its worker removes it once idle",
                        limit.as_secs()
                    )),
                }
            }
        }
        SessionCommand::Ls { sessions_dir } => {
            let store = super::run::sessions(sessions_dir.as_deref());
            writeln!(
                out,
                "{:<24} {:>5} {:>6} {:<10} LAST",
                "ID", "TURNS", "CALLS", "STATE"
            )?;
            for corral_harness::sessions::Listed { id, brief } in store.list()? {
                match brief {
                    Ok(s) => {
                        let state = match s.last_end {
                            _ if s.fresh_fork => "forked",
                            Some(Ending::Done) => "done",
                            Some(Ending::Failed) => "failed",
                            Some(Ending::Interrupted) => "interrupted",
                            // No run finished since the last one began:
                            // one runs, or was killed (rerun to resume).
                            None => "unfinished",
                        };
                        writeln!(
                            out,
                            "{:<24} {:>5} {:>6} {:<10} {}",
                            id,
                            s.turns,
                            s.tool_calls,
                            state,
                            one_line(&s.final_text, 60)
                        )?;
                    }
                    Err(e) => writeln!(out, "{id:<24} (unreadable: {e})")?,
                }
            }
        }
        SessionCommand::Show {
            id,
            sessions_dir,
            json,
        } => {
            let store = super::run::sessions(sessions_dir.as_deref());
            for rec in store.records(id)? {
                let (seq, rec) = rec?;
                if *json {
                    let line = serde_json::json!({"seq": seq, "record": rec});
                    writeln!(out, "{line}")?;
                } else {
                    writeln!(out, "{seq:>6} {}", describe(&rec))?;
                }
            }
        }
        SessionCommand::Timeline {
            id,
            sessions_dir,
            json,
            html,
            width,
        } => {
            use corral_harness::timeline;
            let store = super::run::sessions(sessions_dir.as_deref());
            let t = timeline::of_session(&store, id)?;
            if *json {
                let text = serde_json::to_string_pretty(&t)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                writeln!(out, "{text}")?;
            } else if let Some(path) = html {
                std::fs::write(path, timeline::html::render(&t))?;
            } else {
                let width = width.map(usize::from).unwrap_or_else(|| {
                    crate::terminal::window_size(&std::io::stdout())
                        .map(|s| usize::from(s.cols))
                        .filter(|&c| c >= 40)
                        .unwrap_or(120)
                });
                out.write_all(timeline::text::render(&t, width).as_bytes())?;
            }
        }
        SessionCommand::Fork {
            id,
            new_id,
            turn,
            sessions_dir,
            otlp_endpoint,
        } => {
            let telemetry = match otlp_endpoint {
                Some(e) => Some(
                    corral_harness::telemetry::Telemetry::otlp(e, "corral")
                        .map_err(|e| std::io::Error::other(format!("--otlp-endpoint: {e}")))?,
                ),
                None => None,
            };
            let _flush = corral_harness::telemetry::FlushOnDrop(telemetry.clone());
            let store = super::run::sessions(sessions_dir.as_deref());
            // The child's sandbox is made now, on the parent's worker, with
            // a copy of the parent's workspace.
            let config = store.config_of(id)?;
            let worker =
                session_worker(conn, config.worker.as_deref(), config.worker_id.as_deref()).await?;
            store
                .fork_with_workspace(id, new_id, *turn, worker, telemetry.as_ref())
                .await?;
            writeln!(out, "{new_id}")?;
        }
        SessionCommand::Export {
            id,
            dest,
            atif: true,
            sessions_dir,
            ..
        } => {
            let store = super::run::sessions(sessions_dir.as_deref());
            let trajectory = corral_harness::atif::trajectory(&store, id)?;
            let mut text = serde_json::to_string_pretty(&trajectory)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            text.push('\n');
            if dest.as_os_str() == "-" {
                out.write_all(text.as_bytes())?;
            } else {
                std::fs::write(dest, text)?;
            }
        }
        SessionCommand::Export {
            id,
            dest,
            diff,
            out: limits,
            sessions_dir,
            ..
        } => {
            let store = super::run::sessions(sessions_dir.as_deref());
            let config = store.config_of(id)?;
            let worker =
                session_worker(conn, config.worker.as_deref(), config.worker_id.as_deref()).await?;
            // The patch may go to stdout (`-`), written from another thread.
            drop(out);
            if *diff {
                // A patch is the sandbox's words: on a terminal, its control
                // characters are shown, never obeyed (to a pipe or a file it
                // goes as it is, for `git apply`).
                let terminal = dest.as_os_str() == "-" && std::io::stdout().is_terminal();
                let shown = terminal.then(|| {
                    Box::new(crate::view::PrintableWriter::new(std::io::stdout()))
                        as Box<dyn tokio::io::AsyncWrite + Unpin + Send>
                });
                store.export_diff_with(id, worker, dest, shown).await?;
            } else {
                let rules = limits.apply(Unpacking::contents_from_sandbox());
                let moved = store.export(id, worker, dest, rules).await?;
                super::left_out(&moved);
            }
        }
    }
    Ok(())
}

/// Where each sandbox of a session's earlier generations was: its worker
/// (`None`: the local one) and id, oldest first (the current one left out).
fn earlier_generations(
    store: &corral_harness::sessions::Sessions,
    id: &str,
) -> Result<Vec<(Option<String>, corral_proto::SandboxId)>, Error> {
    let mut all = Vec::new();
    for rec in store.records(id)? {
        match rec?.1 {
            Record::Start { config } => all.push((config.worker, config.sandbox_id)),
            Record::Placed {
                worker, sandbox_id, ..
            } => all.push((worker, sandbox_id)),
            _ => {}
        }
    }
    all.pop();
    Ok(all)
}

fn describe(rec: &Record) -> String {
    let detail = match rec {
        Record::Start { config } => {
            format!("model {} · sandbox {}", config.model, config.sandbox_id)
        }
        Record::Forked { parent, sandbox_id } => format!("from {parent} · sandbox {sandbox_id}"),
        Record::Resume {
            max_turns,
            model,
            endpoint,
            tool_choice,
            context_window_tokens,
            max_output_tokens,
            reasoning_effort,
            ..
        } => {
            let mut changed = Vec::new();
            if let Some(n) = max_turns {
                changed.push(format!("at most {n} turns this run"));
            }
            if let Some(m) = model {
                changed.push(format!("model {m}"));
            }
            if let Some(e) = endpoint {
                let api = match e.api {
                    corral_harness::llm::Api::Responses => "responses",
                    corral_harness::llm::Api::Chat => "chat",
                };
                changed.push(format!("endpoint {} ({api})", e.base_url));
            }
            if let Some(t) = tool_choice {
                let t = match t {
                    corral_harness::llm::ToolChoice::Auto => "auto",
                    corral_harness::llm::ToolChoice::Required => "required",
                    corral_harness::llm::ToolChoice::None => "none",
                    corral_harness::llm::ToolChoice::Tool(name) => name.as_str(),
                };
                changed.push(format!("tool choice {t}"));
            }
            if let Some(w) = context_window_tokens {
                changed.push(format!("window {w} tokens"));
            }
            if let Some(m) = max_output_tokens {
                changed.push(format!("answers of at most {m} tokens"));
            }
            if let Some(r) = reasoning_effort {
                changed.push(format!("reasoning effort {r}"));
            }
            if changed.is_empty() {
                "nothing changed".into()
            } else {
                changed.join(" · ")
            }
        }
        Record::History { role, text } => format!("{}: {}", role.as_str(), one_line(text, 100)),
        Record::Input { text, .. } | Record::Heartbeat { text } => one_line(text, 100),
        Record::Turn { turn } => format!("#{turn}"),
        Record::Response { turn, response } => format!(
            "#{turn} {:?} {} call(s): {}",
            response.stop,
            response.tool_calls().count(),
            one_line(&response.text(), 80)
        ),
        Record::ModelFailure { turn, error, .. } => format!("#{turn} {error}"),
        Record::Shrink {
            turn,
            context_window_tokens,
            ..
        } => format!("#{turn} refused as too long; window now {context_window_tokens} tokens"),
        Record::Call {
            call_id,
            tool,
            outcome,
            ..
        } => format!("{call_id} {tool} {outcome:?}")
            .chars()
            .take(120)
            .collect(),
        Record::Operation { snapshot } => format!("{} {:?}", snapshot.id, snapshot.status),
        Record::Result {
            call_id,
            output,
            running,
        } => {
            let mut text = corral_harness::llm::ToolOutput::text_of(output);
            let images = corral_harness::llm::ToolOutput::images_in(output);
            if images > 0 {
                text.push_str(&format!(" [{images} image(s)]"));
            }
            if *running {
                format!("{call_id} (running: placeholder)")
            } else {
                format!("{call_id} {}", one_line(&text, 100))
            }
        }
        Record::Stop { mode, cause } => format!("{mode:?} ({cause:?})"),
        Record::SandboxLost { reason } => reason.clone(),
        Record::Placed {
            worker,
            sandbox_id,
            generation,
            ..
        } => format!(
            "{sandbox_id} (generation {generation}) on {}",
            worker.as_deref().unwrap_or("the local worker")
        ),
        Record::Egress {
            host,
            port,
            decision,
            reason,
            unreported,
        } => {
            let line = format!("{decision} {host}:{port} {reason}");
            match unreported {
                0 => line.trim_end().to_string(),
                n => format!("{} ({n} decisions before it not told)", line.trim_end()),
            }
        }
        Record::EgressUnrecorded { count } => {
            format!("{count} decisions came too fast to be recorded")
        }
        Record::Finished { ending } => format!("{ending:?}"),
    };
    // Most of a record is the model's, the sandbox's or a worker's words
    // (a tool name, a call id, an endpoint's error, a lost sandbox's
    // reason): shown, never obeyed.
    format!("{:<13} {}", rec.kind(), crate::view::printable(&detail))
}

/// The worker a stored session was placed on (`None`: the local one).
/// The worker a session was placed on (recorded, or the local one when
/// none was), found again by its id among `--worker`'s if its address
/// changed, as `corral run` finds it.
async fn session_worker(
    conn: &ConnArgs,
    url: Option<&str>,
    worker_id: Option<&str>,
) -> Result<corral_harness::client::WorkerClient, Error> {
    let fleet = crate::connect::fleet(conn)?;
    let urls = fleet.urls().await?;
    Ok(fleet.connect_recorded(&urls, url, worker_id).await?)
}

#[cfg(test)]
mod tests {
    use corral_harness::agent::Record;

    #[test]
    fn a_records_line_shows_the_models_and_the_workers_words_escaped() {
        let hostile = "x\x1b]0;owned\x07\u{9b}31m";
        for rec in [
            Record::Call {
                call_id: hostile.into(),
                tool: hostile.into(),
                arguments: "{}".into(),
                turn: 1,
                at_unix_ms: 0,
                outcome: corral_harness::tools::CallOutcome::Error {
                    text: hostile.into(),
                },
                operations: Vec::new(),
            },
            Record::SandboxLost {
                reason: hostile.into(),
            },
        ] {
            let line = super::describe(&rec);
            assert!(!line.chars().any(|c| c.is_control()), "{line:?}");
        }
    }
}
