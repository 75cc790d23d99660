//! `corral run` and `corral session`: a session from the command line.
//!
//! `run` creates the session (or resumes it), makes sure its sandbox
//! exists, starts an operation manager and the coordinator, and shows what
//! happens: a live view on a terminal, or versioned JSON events (one per
//! line, ending with a `result` event) with `--json` or when stdout is not a
//! terminal. Exit codes: 0 done, 1 failed, 2 usage error, 130 interrupted.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corral_proto::{SandboxId, SandboxSpec};
use futures_util::StreamExt;
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::cli::{ApiKind, ConnArgs, RunArgs, SessionCommand};
use crate::run::{Connection, RunError, connect_to, place, worker_urls};
use corral_harness::agent::core::replay;
use corral_harness::agent::events::{Event, RunResult, to_json_line};
use corral_harness::agent::record::{Endpoint, Overrides, SkillDef};
use corral_harness::agent::{
    Coordinator, Core, Ending, Inbox, Record, SessionConfig, Settings, StopMode, Summary,
};
use corral_harness::client::ClientError;
use corral_harness::context::Budget;
use corral_harness::llm::{Api, LlmClient, LlmConfig, Role, ToolChoice};
use corral_harness::ops::{Backend, Manager, OperationManager, RemoteBackend};
use corral_harness::session::SessionLog;

pub const EXIT_DONE: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_INTERRUPTED: u8 = 130;

/// Default model when neither the flag nor the request names one.
pub const DEFAULT_MODEL: &str = "gpt-5-mini";
pub const DEFAULT_MAX_TURNS: u64 = 100;

/// `--request`: everything a run can be given as JSON.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// Tools offered (default: all).
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// low | medium | high.
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// auto | required | none | a tool's name.
    #[serde(default)]
    pub tool_choice: Option<String>,
    #[serde(default)]
    pub limits: Limits,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: MessageRole,
    pub content: String,
    /// De-duplicates the message across reruns of a session (default: its
    /// position and content).
    #[serde(default)]
    pub message_id: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MessageRole {
    User,
    Assistant,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }
}

#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub max_turns: Option<u64>,
    pub max_output_tokens: Option<u32>,
    pub context_window_tokens: Option<u64>,
    pub max_tool_result_chars: Option<usize>,
}

/// Parses a `--request` document.
pub fn parse_request(text: &str) -> Result<RunRequest, String> {
    serde_json::from_str(text).map_err(|e| format!("--request: {e}"))
}

fn sessions_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .unwrap_or_else(|| corral_worker::cli::default_state_dir("sessions"))
}

fn usage(msg: impl Into<String>) -> RunError {
    RunError::Usage(msg.into())
}

fn failed(msg: impl Into<String>) -> RunError {
    RunError::Failed(msg.into())
}

fn load_request(args: &RunArgs) -> Result<RunRequest, RunError> {
    let mut req = match args.request.as_deref() {
        None => RunRequest::default(),
        Some("-") => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| usage(format!("--request -: {e}")))?;
            parse_request(&s).map_err(usage)?
        }
        Some(path) => {
            let s = std::fs::read_to_string(path)
                .map_err(|e| usage(format!("--request {path}: {e}")))?;
            parse_request(&s).map_err(usage)?
        }
    };
    if args.inputs_from_stdin && args.request.as_deref() == Some("-") {
        return Err(usage("--request - and --inputs-from-stdin both want stdin"));
    }
    if let Some(p) = &args.prompt {
        if req.prompt.is_some() {
            return Err(usage(
                "give the prompt either as an argument or in --request, not both",
            ));
        }
        req.prompt = Some(p.clone());
    }
    if let Some(p) = &req.prompt
        && p.trim().is_empty()
    {
        return Err(usage("the prompt is empty"));
    }
    Ok(req)
}

fn api_key(args: &RunArgs) -> Result<Option<String>, RunError> {
    if let Some(path) = &args.api_key_file {
        let key = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("--api-key-file {}: {e}", path.display())))?;
        let key = key.trim().to_string();
        if key.is_empty() {
            return Err(usage(format!(
                "--api-key-file {}: the file is empty",
                path.display()
            )));
        }
        return Ok(Some(key));
    }
    Ok(std::env::var("OPENAI_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty()))
}

fn new_session_id() -> String {
    format!("s-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// What the watcher prints.
enum View {
    Json(std::io::Stdout),
    Terminal(TerminalView),
}

struct TerminalView {
    running: Vec<(String, String, Instant)>,
    mid_line: bool,
}

fn one_line(s: &str, max: usize) -> String {
    let line = s.lines().next().unwrap_or("");
    let mut out: String = line.chars().take(max).collect();
    if line.chars().count() > max || s.lines().nth(1).is_some() {
        out.push('…');
    }
    out
}

impl TerminalView {
    fn show(&mut self, e: &Event) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        if let Event::TextDelta { text, .. } = e {
            out.write_all(text.as_bytes())?;
            out.flush()?;
            self.mid_line = !text.ends_with('\n');
            return Ok(());
        }
        if self.mid_line {
            writeln!(out)?;
            self.mid_line = false;
        }
        match e {
            Event::SessionStarted {
                session_id,
                resumed,
                sandbox_id,
                model,
                worker,
            } => writeln!(
                err,
                "corral: session {session_id}{} · sandbox {sandbox_id} on {} · model {model}",
                if *resumed { " (resumed)" } else { "" },
                worker.as_deref().unwrap_or("the embedded worker")
            )?,
            Event::TurnStarted { turn, changes, .. } => {
                write!(err, "── turn {turn}")?;
                if !changes.is_empty() {
                    write!(
                        err,
                        " ({} context changes to fit the budget)",
                        changes.len()
                    )?;
                }
                writeln!(err)?;
            }
            Event::ModelRetry {
                attempt, reason, ..
            } => writeln!(err, "   retrying (attempt {attempt}): {reason}")?,
            Event::Steered { turn } => writeln!(err, "   turn {turn} canceled by a new input")?,
            Event::ToolCall {
                call_id,
                tool,
                arguments,
                error,
            } => match error {
                Some(e) => writeln!(err, "✗ {tool}: {}", one_line(e, 160))?,
                None => {
                    writeln!(err, "▸ {tool} {}", one_line(arguments, 160))?;
                    self.running
                        .push((call_id.clone(), tool.clone(), Instant::now()));
                }
            },
            Event::ToolResult {
                call_id,
                tool,
                text,
                ..
            } => {
                let took = self
                    .running
                    .iter()
                    .position(|(c, _, _)| c == call_id)
                    .map(|i| self.running.remove(i).2.elapsed());
                let took = took.map_or(String::new(), |d| format!(" ({:.1}s)", d.as_secs_f64()));
                writeln!(err, "✓ {tool}{took}: {}", one_line(text, 160))?;
            }
            Event::Heartbeat { .. } => writeln!(err, "♥ heartbeat sent to the model")?,
            Event::ModelFailed { error, .. } => writeln!(err, "model failed: {error}")?,
            Event::TurnCompleted { .. } | Event::TextDelta { .. } | Event::Error { .. } => {}
            Event::Result(r) => {
                writeln!(
                    err,
                    "corral: {} · {} turns · {} tool calls · {} tokens in, {} out · {:.1}s{}",
                    r.status,
                    r.turns,
                    r.tool_calls,
                    r.usage.input_tokens,
                    r.usage.output_tokens,
                    r.duration_ms as f64 / 1000.0,
                    r.error
                        .as_ref()
                        .map(|e| format!(" · {e}"))
                        .unwrap_or_default()
                )?;
            }
        }
        Ok(())
    }

    fn tick(&self) -> std::io::Result<()> {
        if self.running.is_empty() || self.mid_line {
            return Ok(());
        }
        let list: Vec<String> = self
            .running
            .iter()
            .map(|(_, tool, t)| format!("{tool} {}s", t.elapsed().as_secs()))
            .collect();
        writeln!(
            std::io::stderr().lock(),
            "   … running: {}",
            list.join(", ")
        )
    }
}

impl View {
    fn show(&mut self, e: &Event) -> Result<(), RunError> {
        match self {
            View::Json(out) => {
                let mut out = out.lock();
                out.write_all(to_json_line(e).as_bytes())?;
                out.flush()?;
            }
            View::Terminal(t) => t.show(e)?,
        }
        Ok(())
    }
}

/// `corral run`.
pub async fn run_agent(conn: &ConnArgs, args: &RunArgs) -> Result<u8, RunError> {
    let out = run_agent_inner(conn, args).await;
    if let Err(e) = &out
        && (args.json || !std::io::stdout().is_terminal())
    {
        // A JSON reader learns why the run failed from its own stream too.
        let line = to_json_line(&Event::Error {
            message: corral_harness::client::source_chain(e),
        });
        let mut stdout = std::io::stdout().lock();
        let _ = stdout
            .write_all(line.as_bytes())
            .and_then(|()| stdout.flush());
    }
    out
}

async fn run_agent_inner(conn: &ConnArgs, args: &RunArgs) -> Result<u8, RunError> {
    let started = Instant::now();
    let req = load_request(args)?;
    let dir = sessions_dir(args.sessions_dir.as_deref());
    let id = match &args.session {
        Some(s) => s.clone(),
        None => new_session_id(),
    };
    corral_harness::session::log::check_id(&id).map_err(|e| usage(e.to_string()))?;
    let exists = corral_harness::session::log::path_of(&dir, &id).exists();
    if !exists && req.prompt.is_none() && req.messages.is_empty() {
        return Err(usage(
            "nothing to do: give a prompt (or --request with a prompt or messages)",
        ));
    }
    let key = api_key(args)?;
    if !exists {
        // A new session checks its endpoint before anything is made; a
        // resumed one once its recorded endpoint is known.
        check_key(
            &Endpoint::merge(None, args.base_url.clone(), api_of(args)),
            &key,
        )?;
    }

    // A session stays on the worker it was placed on; a new one goes to
    // the worker of --worker with the most room.
    let urls = worker_urls(conn);
    let worker = if exists {
        // The start record (the first) says; the whole log is replayed later.
        let recorded = SessionLog::<Record>::replay(&dir, &id, 0, 1)
            .ok()
            .and_then(|p| match p.records.into_iter().next() {
                Some((_, Record::Start { config })) => config.worker,
                _ => None,
            });
        match recorded {
            Some(w) => {
                if !urls.is_empty() && !urls.contains(&w) {
                    tracing::warn!(worker = %w, "the session stays on the worker it was placed on");
                }
                Some(w)
            }
            None => urls.first().cloned(),
        }
    } else if urls.len() > 1 {
        Some(place(conn, &urls).await?)
    } else {
        urls.first().cloned()
    };
    let connection = connect_to(conn, worker.as_deref()).await?;
    drive(
        &connection,
        args,
        &req,
        &dir,
        &id,
        exists,
        key,
        started,
        worker,
    )
    .await
}

fn api_of(args: &RunArgs) -> Option<Api> {
    args.api.map(|a| match a {
        ApiKind::Responses => Api::Responses,
        ApiKind::Chat => Api::Chat,
    })
}

fn check_key(endpoint: &Endpoint, key: &Option<String>) -> Result<(), RunError> {
    if key.is_none() && endpoint.base_url.contains("api.openai.com") {
        return Err(usage(
            "no API key: set OPENAI_API_KEY or pass --api-key-file (endpoints that need no key: --base-url)",
        ));
    }
    Ok(())
}

/// A tool choice that names a tool must name one the session offers.
fn check_tool_choice(config: &SessionConfig) -> Result<(), RunError> {
    let Some(ToolChoice::Tool(name)) = &config.tool_choice else {
        return Ok(());
    };
    let offered: Vec<String> = corral_harness::agent::core::registry_for(config)
        .tools()
        .into_iter()
        .map(|t| t.name)
        .collect();
    if offered.contains(name) {
        return Ok(());
    }
    Err(usage(format!(
        "--tool-choice {name}: the session offers no such tool (auto, required, none, or one of: {})",
        offered.join(", ")
    )))
}

fn sandbox_spec(config: &SessionConfig) -> SandboxSpec {
    SandboxSpec {
        image: config.image.clone(),
        ..SandboxSpec::default()
    }
}

/// The settings of a new session: flags first, then the request, then
/// defaults.
fn new_config(
    args: &RunArgs,
    req: &RunRequest,
    id: &str,
    skills: &[corral_harness::tools::skills::Skill],
) -> SessionConfig {
    let budget = Budget {
        context_window_tokens: req
            .limits
            .context_window_tokens
            .unwrap_or(Budget::default().context_window_tokens),
        max_tool_result_chars: req
            .limits
            .max_tool_result_chars
            .unwrap_or(Budget::default().max_tool_result_chars),
        ..Budget::default()
    };
    SessionConfig {
        model: args
            .model
            .clone()
            .or_else(|| req.model.clone())
            .unwrap_or_else(|| DEFAULT_MODEL.to_string()),
        system_prompt: args
            .system_prompt
            .clone()
            .or_else(|| req.system_prompt.clone())
            .unwrap_or_else(|| {
                corral_harness::context::DEFAULT_SYSTEM_PROMPT
                    .trim_end()
                    .to_string()
            }),
        tools: req.tools.clone(),
        sandbox_id: SandboxId::new(format!(
            "{}-{}",
            id.chars().take(40).collect::<String>(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .unwrap_or_else(|_| SandboxId::random()),
        image: args.image.clone(),
        budget,
        max_output_tokens: req.limits.max_output_tokens,
        reasoning_effort: args
            .reasoning_effort
            .clone()
            .or_else(|| req.reasoning_effort.map(|e| e.as_str().to_string())),
        max_turns: args
            .max_turns
            .or(req.limits.max_turns)
            .unwrap_or(DEFAULT_MAX_TURNS),
        skills: skills.iter().map(SkillDef::from_skill).collect(),
        worker: None,
        endpoint: Some(Endpoint::merge(None, args.base_url.clone(), api_of(args))),
        tool_choice: args
            .tool_choice
            .as_deref()
            .or(req.tool_choice.as_deref())
            .map(ToolChoice::parse),
    }
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    connection: &Connection,
    args: &RunArgs,
    req: &RunRequest,
    dir: &Path,
    id: &str,
    exists: bool,
    key: Option<String>,
    started: Instant,
    worker: Option<String>,
) -> Result<u8, RunError> {
    let (skills, skill_files) = match (&args.skills, exists) {
        (Some(dir), false) => {
            let skills = corral_harness::tools::skills::discover(dir).map_err(usage)?;
            let files = skill_files(dir)?;
            (skills, files)
        }
        (Some(_), true) => {
            tracing::warn!("--skills applies to new sessions; this one keeps its recorded skills");
            (Vec::new(), Vec::new())
        }
        (None, _) => (Vec::new(), Vec::new()),
    };
    let client = &connection.client;
    let core = if exists {
        let (log, recovery) = SessionLog::<Record>::open(dir, id)?;
        if recovery.torn_bytes > 0 {
            tracing::warn!(
                session = id,
                bytes = recovery.torn_bytes,
                "the session log ended in a torn record (a crash mid-write); it was cut off"
            );
        }
        let overrides = Overrides {
            max_turns: args.max_turns.or(req.limits.max_turns),
            model: args.model.clone().or_else(|| req.model.clone()),
            base_url: args.base_url.clone(),
            api: api_of(args),
        };
        let mut core = Core::resume(dir, log, overrides)?;
        let config = core.config().clone();
        check_key(&Endpoint::merge(config.endpoint.as_ref(), None, None), &key)?;
        let existed = match client.get_sandbox(&config.sandbox_id).await {
            Ok(_) => true,
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => false,
            Err(e) => return Err(e.into()),
        };
        client
            .create_sandbox(Some(&config.sandbox_id), sandbox_spec(&config))
            .await?;
        if !existed {
            tracing::warn!(sandbox = %config.sandbox_id, "the session's sandbox is gone; a new one replaces it");
            core.sandbox_replaced()?;
        }
        core
    } else {
        let mut config = new_config(args, req, id, &skills);
        config.worker = worker.clone();
        check_tool_choice(&config)?;
        // The sandbox first: a session is not recorded with a sandbox that
        // cannot be made (an unknown image, say).
        client
            .create_sandbox(Some(&config.sandbox_id), sandbox_spec(&config))
            .await?;
        let created = SessionLog::<Record>::create(dir, id)
            .map_err(RunError::from)
            .and_then(|log| Ok(Core::create(log, config.clone())?));
        match created {
            Ok(core) => core,
            Err(e) => {
                let _ = client.destroy_sandbox(&config.sandbox_id).await;
                return Err(e);
            }
        }
    };
    let config = core.config().clone();
    // Sessions recorded before endpoints were kept use the defaults.
    let endpoint = Endpoint::merge(config.endpoint.as_ref(), None, None);
    let mut llm_config = LlmConfig::new(endpoint.base_url, endpoint.api);
    llm_config.api_key = key;
    let llm = Arc::new(LlmClient::new(llm_config).map_err(|e| failed(e.to_string()))?);
    install_files(&connection.client, &config.sandbox_id, skill_files).await?;
    let settings = Settings {
        heartbeat: (!args.heartbeat.is_zero()).then_some(args.heartbeat),
        grace: args.grace,
    };
    let json = args.json || !std::io::stdout().is_terminal();
    let mut view = if json {
        View::Json(std::io::stdout())
    } else {
        View::Terminal(TerminalView {
            running: Vec::new(),
            mid_line: false,
        })
    };
    view.show(&Event::SessionStarted {
        session_id: id.to_string(),
        resumed: exists,
        sandbox_id: config.sandbox_id.to_string(),
        model: config.model.clone(),
        worker: worker.clone(),
    })?;
    let run = Attended {
        llm,
        req,
        settings,
        inputs_from_stdin: args.inputs_from_stdin,
        view: &mut view,
    };
    let sandbox = config.sandbox_id.clone();
    let backend = RemoteBackend::with_credentials(
        connection.client.url().to_string(),
        connection.creds.clone(),
    );
    let summary = run_on(backend, sandbox, core, run).await?;
    let (status, code) = match summary.ending {
        Ending::Done => ("done", EXIT_DONE),
        Ending::Failed => ("failed", EXIT_FAILED),
        Ending::Interrupted => ("interrupted", EXIT_INTERRUPTED),
    };
    view.show(&Event::Result(RunResult {
        status,
        session_id: id.to_string(),
        final_text: summary.final_text,
        error: summary.error,
        turns: summary.turns,
        tool_calls: summary.tool_calls,
        usage: summary.usage,
        duration_ms: started.elapsed().as_millis() as u64,
    }))?;
    Ok(code)
}

type StdinLines = tokio::io::Lines<tokio::io::BufReader<tokio::io::Stdin>>;

/// The next line of stdin, when it is read for inputs.
async fn next_input(lines: &mut Option<StdinLines>) -> std::io::Result<Option<String>> {
    match lines {
        Some(l) => l.next_line().await,
        None => std::future::pending().await,
    }
}

/// What a session run needs besides its core and its operations.
struct Attended<'a> {
    llm: Arc<LlmClient>,
    req: &'a RunRequest,
    settings: Settings,
    inputs_from_stdin: bool,
    view: &'a mut View,
}

/// Runs the session with an operation manager over `backend`, and stops
/// the manager afterwards (operations keep running on the worker).
async fn run_on<B: Backend>(
    backend: B,
    sandbox: SandboxId,
    core: Core,
    run: Attended<'_>,
) -> Result<Summary, RunError> {
    let (manager, updates) = Manager::start(backend, sandbox);
    let manager = Arc::new(manager);
    let summary = session(core, manager.clone(), updates, run).await;
    if let Ok(m) = Arc::try_unwrap(manager) {
        m.shutdown().await;
    }
    summary
}

async fn session<M: OperationManager + 'static>(
    mut core: Core,
    manager: Arc<M>,
    updates: mpsc::Receiver<corral_harness::ops::Operation>,
    run: Attended<'_>,
) -> Result<Summary, RunError> {
    let Attended {
        llm,
        req,
        settings,
        inputs_from_stdin,
        view,
    } = run;
    use tokio::io::AsyncBufReadExt;
    // A `corral run` ends once the session is idle.
    core.stop(
        StopMode::WhenIdle,
        corral_harness::agent::StopCause::Requested,
    )?;
    let resumed = core.state().turns() > 0 || core.state().last_input.is_some();
    for (i, m) in req.messages.iter().enumerate() {
        match m.role {
            // Same request again, same ids: nothing is asked twice.
            MessageRole::User => {
                let id = m.message_id.clone().unwrap_or_else(|| {
                    format!(
                        "message-{i}-{:016x}",
                        corral_harness::llm::conform::fnv1a(m.content.as_bytes())
                    )
                });
                core.add_input(&id, &m.content)?;
            }
            MessageRole::Assistant if resumed => {
                tracing::warn!(
                    "assistant messages of --request apply to new sessions only; skipped"
                );
            }
            MessageRole::Assistant => core.history(Role::Assistant, &m.content)?,
        }
    }
    if let Some(prompt) = &req.prompt {
        // Rerunning a command that did not finish, with the same prompt,
        // resumes it rather than asking again.
        let repeat = core
            .state()
            .last_input
            .as_ref()
            .is_some_and(|(text, answered)| text == prompt && !answered);
        if !repeat {
            core.add_input(&uuid::Uuid::new_v4().to_string(), prompt)?;
        }
    }
    core.kick()?;
    let (events_tx, mut events) = mpsc::channel(1024);
    let (coordinator, inbox) = Coordinator::new(core, manager, updates, llm, events_tx, settings);
    // Owned here: if showing an event fails (stdout closed), the session
    // task is aborted with this handle; the log lets a rerun resume.
    let mut task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(coordinator.run()));
    let mut interrupts = 0;
    // After a stop, how long the session may take to end its calls before
    // it is left anyway (a wedged call, an unreachable worker).
    let mut give_up: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    let mut stop_signals = std::pin::pin!(crate::run::stop_signals());
    let mut stdin_lines: Option<StdinLines> =
        inputs_from_stdin.then(|| tokio::io::BufReader::new(tokio::io::stdin()).lines());
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    let summary = loop {
        tokio::select! {
            biased;
            Some(e) = events.recv() => view.show(&e)?,
            res = &mut task => {
                // Drain what the loop said before it ended.
                while let Ok(e) = events.try_recv() {
                    view.show(&e)?;
                }
                break res.map_err(|e| failed(format!("the session task failed: {e}")))??;
            }
            () = deadline(&mut give_up) => {
                task.abort();
                return Ok(left_unfinished(format!(
                    "stopped: its calls did not end within {} s; left without them (the log lets a rerun resume)",
                    STOP_PATIENCE.as_secs()
                )));
            }
            Some(_) = stop_signals.next() => {
                interrupts += 1;
                if interrupts > 1 {
                    task.abort();
                    return Ok(left_unfinished(
                        "interrupted twice: left without waiting for operations to stop".into(),
                    ));
                }
                give_up = Some(Box::pin(tokio::time::sleep(STOP_PATIENCE)));
                // The inbox is bounded: a session too busy to take the stop
                // at once still gets left at the deadline.
                let _ = inbox.try_send(Inbox::Stop(StopMode::Hard));
            }
            line = next_input(&mut stdin_lines) => match line {
                Ok(Some(text)) if !text.trim().is_empty() => {
                    let input = Inbox::Input { input_id: uuid::Uuid::new_v4().to_string(), text };
                    let _ = inbox.send(input).await;
                }
                Ok(Some(_)) => {}
                Ok(None) => stdin_lines = None,
                Err(e) => {
                    tracing::warn!(error = %e, "stdin cannot be read; no more inputs from it");
                    stdin_lines = None;
                }
            },
            _ = tick.tick() => {
                if let View::Terminal(t) = view {
                    t.tick()?;
                }
            }
        }
    };
    Ok(summary)
}

/// Most bytes of skill files copied into a sandbox.
const MAX_SKILL_FILES_BYTES: u64 = 32 << 20;
const MAX_SKILL_FILES: usize = 2_000;

/// Every regular file under `dir`, as (path in the sandbox, contents).
fn skill_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, RunError> {
    let mut out = Vec::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| usage(format!("{}: {e}", d.display())))?;
        for e in entries {
            let e = e.map_err(|e| usage(format!("{}: {e}", d.display())))?;
            let path = e.path();
            let kind = e
                .file_type()
                .map_err(|e| usage(format!("{}: {e}", path.display())))?;
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let data =
                    std::fs::read(&path).map_err(|e| usage(format!("{}: {e}", path.display())))?;
                total += data.len() as u64;
                if total > MAX_SKILL_FILES_BYTES || out.len() >= MAX_SKILL_FILES {
                    return Err(usage(format!(
                        "{}: the skills are over {} files or {} MiB",
                        dir.display(),
                        MAX_SKILL_FILES,
                        MAX_SKILL_FILES_BYTES >> 20
                    )));
                }
                let rel = path
                    .strip_prefix(dir)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .into_owned();
                out.push((
                    format!(
                        "{}/{rel}",
                        corral_harness::tools::skills::SANDBOX_SKILLS_DIR
                    ),
                    data,
                ));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Writes files into the sandbox, one write operation each, and waits for
/// every one of them.
async fn install_files(
    client: &corral_harness::client::WorkerClient,
    sandbox: &SandboxId,
    files: Vec<(String, Vec<u8>)>,
) -> Result<(), RunError> {
    use corral_proto::{OperationId, OperationSpec, Outcome, WriteFileSpec};
    for (path, data) in files {
        let id = OperationId::random();
        let spec = OperationSpec::WriteFile(WriteFileSpec::new(path.clone(), data));
        let mut record = client.submit(sandbox, &id, spec).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let result = loop {
            if let Some(r) = record.result.take() {
                break r;
            }
            if Instant::now() > deadline {
                return Err(failed(format!(
                    "copying {path} into the sandbox took over 60 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            record = client.operation(sandbox, &id).await?;
        };
        match result.outcome {
            Outcome::Exited { code: 0 } => {}
            other => return Err(failed(format!("copying {path} into the sandbox: {other}"))),
        }
    }
    Ok(())
}

/// Resolves at the deadline, if there is one.
async fn deadline(at: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match at {
        Some(sleep) => sleep.as_mut().await,
        None => std::future::pending().await,
    }
}

/// How long a stopped run waits for its calls to end.
pub const STOP_PATIENCE: Duration = Duration::from_secs(10);

fn left_unfinished(error: String) -> Summary {
    Summary {
        ending: Ending::Interrupted,
        final_text: String::new(),
        error: Some(error),
        turns: 0,
        tool_calls: 0,
        usage: Default::default(),
    }
}

/// `corral session ...`.
pub async fn run_session_command(conn: &ConnArgs, cmd: &SessionCommand) -> Result<u8, RunError> {
    if let SessionCommand::Rm {
        id,
        keep_sandbox,
        sessions_dir: d,
    } = cmd
    {
        remove_session(conn, &sessions_dir(d.as_deref()), id, *keep_sandbox).await?;
        return Ok(EXIT_DONE);
    }
    let mut out = std::io::stdout().lock();
    match cmd {
        SessionCommand::Rm { .. } => {}
        SessionCommand::Ls { sessions_dir: d } => {
            let dir = sessions_dir(d.as_deref());
            let mut ids: Vec<String> = match std::fs::read_dir(&dir) {
                Ok(rd) => rd
                    .filter_map(Result::ok)
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.strip_suffix(".jsonl"))
                            .map(String::from)
                    })
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(failed(format!("{}: {e}", dir.display()))),
            };
            ids.sort();
            writeln!(
                out,
                "{:<24} {:>5} {:>6} {:<10} LAST",
                "ID", "TURNS", "CALLS", "STATE"
            )?;
            for id in ids {
                match replay(&dir, &id) {
                    Ok(s) => {
                        let state = match s.last_end {
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
                            s.turns(),
                            s.tool_calls(),
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
            sessions_dir: d,
            json,
        } => {
            let dir = sessions_dir(d.as_deref());
            let mut after = 0;
            loop {
                let page = SessionLog::<Record>::replay(&dir, id, after, 256)?;
                for (seq, rec) in &page.records {
                    if *json {
                        let line = serde_json::json!({"seq": seq, "record": rec});
                        writeln!(out, "{line}")?;
                    } else {
                        writeln!(out, "{seq:>6} {}", describe(rec))?;
                    }
                }
                match page.next {
                    Some(n) => after = n,
                    None => break,
                }
            }
        }
        SessionCommand::Fork {
            id,
            new_id,
            turn,
            sessions_dir: d,
        } => {
            let dir = sessions_dir(d.as_deref());
            corral_harness::sessions::fork(&dir, id, new_id, *turn)?;
            writeln!(out, "{new_id}")?;
        }
    }
    Ok(EXIT_DONE)
}

/// `corral session rm`: holds the session's lock (so a running session is
/// not removed under it), removes its sandbox from the worker it was placed
/// on, then its log.
async fn remove_session(
    conn: &ConnArgs,
    dir: &Path,
    id: &str,
    keep_sandbox: bool,
) -> Result<(), RunError> {
    let (log, _) = SessionLog::<Record>::open(dir, id)?;
    if !keep_sandbox {
        let state = replay(dir, id)?;
        if let Some(config) = state.config {
            // The worker it was placed on: recorded, or (none recorded)
            // the local one, whatever `--worker` says now.
            let connection = connect_to(conn, config.worker.as_deref()).await?;
            let removed = connection.client.destroy_sandbox(&config.sandbox_id).await;
            match removed {
                Ok(_) => {}
                Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let path = corral_harness::session::log::path_of(dir, id);
    std::fs::remove_file(&path).map_err(|e| failed(format!("{}: {e}", path.display())))?;
    drop(log);
    Ok(())
}

fn describe(rec: &Record) -> String {
    let detail = match rec {
        Record::Start { config } => {
            format!("model {} · sandbox {}", config.model, config.sandbox_id)
        }
        Record::Forked { parent, sandbox_id } => format!("from {parent} · sandbox {sandbox_id}"),
        Record::Resume { .. } => String::new(),
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
        Record::Finished { ending } => format!("{ending:?}"),
    };
    format!("{:<13} {detail}", rec.kind())
}
