//! `corral run`: a session from the command line, through the harness's
//! front door ([`corral_harness::sessions`]). It picks the worker (the
//! recorded one for a resumed session, placement for a new one), shows
//! the events, feeds stdin lines as inputs when asked, and stops the
//! session on SIGINT/SIGTERM/SIGHUP. Exit codes: 0 done, 1 failed, 2 usage
//! error, 130 interrupted.

use std::path::Path;
use std::time::{Duration, Instant};

use corral_harness::agent::{Inbox, OnSandboxLost, StopMode};
use corral_harness::llm::Api;
use corral_harness::runner::{Run, RunEnd, RunOutcome};
use corral_harness::session::LogError;
use corral_harness::sessions::{RunOptions, STOP_PATIENCE, SessionError, Sessions};
use corral_harness::transfer::Unpacking;
use futures_util::StreamExt;

use crate::cli::{ApiKind, ConnArgs, LostPolicy, RunArgs};
use crate::connect::ConnectError;
use crate::view::View;

use super::run_input::{
    EXIT_FAILED, Line, StdinLines, exit_code_of, failed, input_of, is_json, load_request,
    next_input,
};

#[derive(Debug, thiserror::Error)]
pub(super) enum Error {
    /// Exit code 2.
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    fn exit_code(&self) -> u8 {
        use SessionError as S;
        match self {
            Error::Usage(_)
            | Error::Connect(ConnectError::Usage(_))
            | Error::Session(
                S::Invalid(_)
                | S::NoApiKey { .. }
                | S::Fleet(ConnectError::Usage(_))
                | S::NoSuchTurn { .. }
                | S::Log(
                    LogError::BadId(_)
                    | LogError::AlreadyExists(_)
                    | LogError::NotFound(_)
                    | LogError::BadForkPoint { .. },
                ),
            ) => super::EXIT_USAGE,
            _ => EXIT_FAILED,
        }
    }
}

/// `corral run` here (a session of a `corral run --control URL` goes to
/// [`super::remote`] instead: see `commands::dispatch`).
pub async fn main(conn: &ConnArgs, args: &RunArgs) -> u8 {
    let json = is_json(args);
    match run(conn, args, json).await {
        Ok(code) => code,
        Err(e) => {
            failed(&e, json);
            e.exit_code()
        }
    }
}

fn sessions_dir(flag: Option<&Path>) -> std::path::PathBuf {
    flag.map(Path::to_path_buf)
        .unwrap_or_else(|| corral_worker::process::default_state_dir("sessions"))
}

/// The session store of `--sessions-dir` (or the user's default).
pub fn sessions(flag: Option<&Path>) -> Sessions {
    Sessions::new(sessions_dir(flag))
}

fn api_key(args: &RunArgs) -> Result<Option<String>, Error> {
    super::run_input::key_from(args.api_key_file.as_deref()).map_err(Error::Usage)
}

pub(super) fn api_of(args: &RunArgs) -> Option<Api> {
    args.api.map(|a| match a {
        ApiKind::Responses => Api::Responses,
        ApiKind::Chat => Api::Chat,
    })
}

/// `--reasoning-effort` (clap takes only low, medium or high).
pub(super) fn effort_of(args: &RunArgs) -> Option<corral_harness::sessions::ReasoningEffort> {
    use corral_harness::sessions::ReasoningEffort;
    match args.reasoning_effort.as_deref() {
        Some("low") => Some(ReasoningEffort::Low),
        Some("medium") => Some(ReasoningEffort::Medium),
        Some("high") => Some(ReasoningEffort::High),
        _ => None,
    }
}

/// The run's settings as its flags say them, typed once: what `corral run`
/// runs with (its own defaults for what they do not say) and what `corral
/// run --control` sends (the service's defaults for those).
pub(super) fn settings_of(
    args: &RunArgs,
    api_key: Option<String>,
) -> corral_harness::host::Settings {
    corral_harness::host::Settings {
        base_url: args.base_url.clone(),
        api: api_of(args),
        api_key,
        // A template names its image: CORRAL_IMAGE's default is not asked
        // for beside it (an --image given is, and must match).
        image: match (&args.template, &args.image) {
            (Some(_), Some(i)) if std::env::var("CORRAL_IMAGE").ok().as_ref() == Some(i) => None,
            (_, image) => image.clone(),
        },
        template: args.template.clone(),
        reasoning_effort: effort_of(args),
        heartbeat_ms: args.heartbeat.map(|h| h.as_millis() as u64),
        keep_sandbox: args.keep_sandbox,
        on_sandbox_lost: lost_of(args),
        grace_ms: args.grace.map(|g| g.as_millis() as u64),
    }
}

pub(super) fn lost_of(args: &RunArgs) -> Option<OnSandboxLost> {
    args.on_sandbox_lost.map(|p| match p {
        LostPolicy::Fail => OnSandboxLost::Fail,
        LostPolicy::NewSandbox => OnSandboxLost::NewSandbox,
    })
}

async fn run(conn: &ConnArgs, args: &RunArgs, json: bool) -> Result<u8, Error> {
    let started = Instant::now();
    let request = load_request(args).map_err(Error::Usage)?;
    let store = sessions(args.sessions_dir.as_deref());
    let id = args.session.clone().unwrap_or_else(Sessions::new_id);
    let telemetry = match &args.otlp_endpoint {
        Some(e) => Some(
            corral_harness::telemetry::Telemetry::otlp(e, "corral")
                .map_err(|e| Error::Usage(format!("--otlp-endpoint: {e}")))?,
        ),
        None => None,
    };
    // Whatever the run's end, its spans go out before the command ends.
    let _flush = corral_harness::telemetry::FlushOnDrop(telemetry.clone());
    let s = settings_of(args, api_key(args)?);
    let opts = RunOptions {
        request,
        reasoning_effort: s.reasoning_effort.map(|e| e.as_str().to_string()),
        // A template names its image.
        image: match &s.template {
            Some(_) => s.image,
            None => Some(s.image.unwrap_or_else(|| DEFAULT_IMAGE.into())),
        },
        template: s.template,
        base_url: s.base_url,
        api: s.api,
        api_key: s.api_key,
        skills: args.skills.clone(),
        workspace: args.workspace.clone(),
        settings: corral_harness::agent::Settings {
            heartbeat: match s.heartbeat_ms.map(Duration::from_millis) {
                Some(h) if h.is_zero() => None,
                Some(h) => Some(h),
                None => Some(corral_harness::agent::coordinator::DEFAULT_HEARTBEAT),
            },
            grace: s.grace_ms.map_or(
                corral_harness::agent::coordinator::DEFAULT_GRACE,
                Duration::from_millis,
            ),
        },
        until_idle: true,
        worker_lost_after: Some(conn.worker_lost_after),
        on_sandbox_lost: s.on_sandbox_lost,
        telemetry,
        trace: None,
        tenant: None,
    };
    if store.exists(&id)? {
        warn_unchanged(&store, &id, args);
    }
    let end = RunEnd {
        export: args.export.as_ref().map(|dest| {
            (
                dest.clone(),
                args.out.apply(Unpacking::contents_from_sandbox()),
            )
        }),
        keep_sandbox: args.keep_sandbox,
    };
    // A session stays on the worker it was placed on; a new one is placed
    // among the workers of --worker; a lost one goes on elsewhere if it
    // asked to (see corral_harness::runner).
    let fleet = crate::connect::fleet(conn)?;
    let run = corral_harness::runner::run(&store, &fleet, &id, opts, end).await?;
    let mut view = View::new(json);
    let outcome = watch(run, &mut view, args.inputs_from_stdin).await?;
    let (mut code, result) = (
        exit_code_of(outcome.summary.ending),
        outcome.result_event(&id, started.elapsed()),
    );
    match outcome.exported {
        Some(Ok(moved)) => super::left_out(&moved),
        Some(Err(e)) => {
            super::report(&e);
            if code == super::run_input::EXIT_DONE {
                code = super::EXIT_CORRAL_ERROR;
            }
        }
        None => {}
    }
    view.show(&result)?;
    if view.is_closed() {
        // As a shell reports a command killed by SIGPIPE, and quietly.
        return Ok(141);
    }
    Ok(code)
}

/// What a resume does not change, said (the model, endpoint, turn limit,
/// tool choice, window, answer bound and reasoning effort it can).
fn warn_unchanged(store: &Sessions, id: &str, args: &RunArgs) {
    let Ok(config) = store.config_of(id) else {
        return;
    };
    if args.workspace.is_some() {
        tracing::warn!("--workspace applies to new sessions; this one keeps its files");
    }
    if let Some(image) = &args.image
        && config.image.as_deref() != Some(image.as_str())
    {
        tracing::warn!(
            image = %image,
            keeps = config.image.as_deref().unwrap_or("the worker's default"),
            "--image applies to new sessions; this one keeps its image"
        );
    }
    if args.system_prompt.is_some() {
        tracing::warn!("--system-prompt applies to new sessions; this one keeps its prompt");
    }
}

/// The image of a new session's sandbox unless `--image` says otherwise:
/// every client's default (a Debian with python3, pip, git and a C
/// toolchain, deploy/images/build-debian.sh).
pub const DEFAULT_IMAGE: &str = corral_proto::sandbox::DEFAULT_IMAGE;

/// Resolves at the deadline, if there is one.
async fn deadline(at: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match at {
        Some(sleep) => sleep.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Shows the run's events until it ends. A stop signal asks the session
/// to stop; it is left after [`STOP_PATIENCE`] or a second signal (the run
/// still ends as asked: export, suspend).
async fn watch(run: Run, view: &mut View, from_stdin: bool) -> Result<RunOutcome, Error> {
    use tokio::io::AsyncBufReadExt;
    let mut run = run;
    // Owned here: if showing an event fails (stdout closed), the run is
    // aborted with this handle; the log lets a rerun resume.
    let mut task = tokio_util::task::AbortOnDropHandle::new(std::mem::replace(
        &mut run.task,
        tokio::spawn(std::future::pending()),
    ));
    let mut interrupts = 0;
    let mut give_up: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    let mut stop_signals = std::pin::pin!(crate::signals::stop_signals());
    let mut stdin_lines: Option<StdinLines> =
        from_stdin.then(|| tokio::io::BufReader::new(tokio::io::stdin()).lines());
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    let mut closed_told = false;
    let outcome = loop {
        // The reader of the JSON stream went away: stop as on SIGTERM
        // (the run is stopped, suspended and recorded), once.
        if view.is_closed() && !closed_told {
            closed_told = true;
            interrupts += 1;
            give_up = Some(Box::pin(tokio::time::sleep(STOP_PATIENCE)));
            let _ = run.inputs.try_send(Inbox::Stop(StopMode::Hard));
        }
        tokio::select! {
            biased;
            Some(e) = run.events.recv() => view.show(&e)?,
            res = &mut task => {
                // Drain what the run said before it ended.
                while let Ok(e) = run.events.try_recv() {
                    view.show(&e)?;
                }
                break res.map_err(|e| SessionError::Task(e.to_string()))??;
            }
            () = deadline(&mut give_up) => {
                give_up = None;
                run.leave(format!(
                    "stopped: its calls did not end within {} s; left without them (the log lets a rerun resume)",
                    STOP_PATIENCE.as_secs()
                ));
            }
            Some(_) = stop_signals.next() => {
                interrupts += 1;
                if interrupts > 1 {
                    give_up = None;
                    run.leave("interrupted twice: left without waiting for operations to stop".into());
                    continue;
                }
                give_up = Some(Box::pin(tokio::time::sleep(STOP_PATIENCE)));
                // The inbox is bounded: a session too busy to take the stop
                // at once still gets left at the deadline.
                let _ = run.inputs.try_send(Inbox::Stop(StopMode::Hard));
            }
            line = next_input(&mut stdin_lines) => match input_of(line) {
                Line::Input(text) => {
                    let input = Inbox::Input { input_id: uuid::Uuid::new_v4().to_string(), text };
                    if let Err(e) = run.send(input).await {
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
    };
    Ok(outcome)
}
