//! The front door of the harness: sessions started, resumed, forked,
//! removed and listed, in the spirit of a queue pair. [`Sessions::start`]
//! and [`Sessions::resume`] return a [`SessionHandle`]: an input sender,
//! an event receiver and the task that runs the session, whose error says
//! what failed. Everything a session's lifecycle decides lives here: a new
//! session's settings (flags over the request over defaults), message ids
//! ("the same request again asks nothing twice", "the same prompt
//! resumes"), the sandbox (made before the session is recorded; checked
//! and replaced on resume), skills copied in through the operation
//! manager, and the wiring of manager, model client and coordinator.
//!
//! The caller picks the worker (any [`WorkerApi`]) and shows the events.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, WriteFileSpec};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::agent::core::now_ms;
use crate::agent::events::Event;
use crate::agent::record::{Endpoint, OnSandboxLost, Overrides, SkillDef};
use crate::agent::{
    Coordinator, Core, Inbox, Record, SessionConfig, Settings, State, StopCause, StopMode, Summary,
};
use crate::context::Budget;
use crate::llm::{Api, LlmClient, LlmConfig, Role, ToolChoice};
use crate::ops::{Manager, OpStatus, Operation, OperationManager};
use crate::session::{LogError, Records, Recovery, SessionLog};
use crate::tools::skills::{SANDBOX_SKILLS_DIR, Skill};
use crate::worker_api::{ApiError, WorkerApi};

/// How long a stopped session may take to end its calls before a caller
/// leaves it (a wedged call, an unreachable worker); its log lets a rerun
/// resume.
pub const STOP_PATIENCE: Duration = Duration::from_secs(10);
/// Default model when neither the caller nor the request names one.
pub const DEFAULT_MODEL: &str = "gpt-5-mini";
pub const DEFAULT_MAX_TURNS: u64 = 100;
/// Events waiting for the caller.
const EVENTS_CAPACITY: usize = 1024;
/// Most bytes of skill files copied into a sandbox.
const MAX_SKILL_FILES_BYTES: u64 = 32 << 20;
const MAX_SKILL_FILES: usize = 2_000;
/// The patch of a git workspace against its HEAD, through an index of its
/// own (the repository's stays as it is), with nothing of the repository's
/// configuration run on the way: no fsmonitor, hook, external diff or
/// textconv filter. (What it prints is still the sandbox's: a patch to read
/// before applying.)
const DIFF_COMMAND: &str = r#"cd /workspace || exit 1
if ! command -v git >/dev/null; then
  echo "git is not in this sandbox's image (export it whole, without --diff)" >&2
  exit 3
fi
git() { command git -c core.fsmonitor=false -c core.hooksPath=/dev/null -c diff.external= -c color.ui=never "$@"; }
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "/workspace is not a git repository (export it whole, without --diff)" >&2
  exit 3
fi
GIT_INDEX_FILE=$(mktemp -u) || exit 1
export GIT_INDEX_FILE
trap 'rm -f "$GIT_INDEX_FILE"' EXIT
if git rev-parse --verify -q HEAD >/dev/null; then
  base=HEAD
  git read-tree HEAD || exit 1
else
  base=$(git hash-object -t tree /dev/null)
fi
git add -A . && git diff --cached --binary --no-ext-diff --no-textconv --no-color "$base""#;

/// How long a session's sandbox outlives the last client that used it: a
/// run watches its sandbox all along, and suspends it when it ends; this
/// removes the sandbox of a run that was killed and not resumed.
pub const SANDBOX_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// The sandbox directory a session works in.
const WORKSPACE: &str = corral_proto::limits::WORKSPACE_DIR;
/// How long copying the skills into a new sandbox may take.
const UPLOAD_PATIENCE: Duration = Duration::from_secs(60);

/// What failed in a session's lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Core(#[from] crate::agent::CoreError),
    #[error("session {id} has no turn {turn} (it has {last})")]
    NoSuchTurn { id: String, turn: u64, last: u64 },
    /// What was asked cannot be done as asked (the caller's mistake).
    #[error("{0}")]
    Invalid(String),
    /// The session's sandbox could not be made, found or removed.
    #[error("sandbox {sandbox}: {error}")]
    Sandbox { sandbox: SandboxId, error: String },
    /// The worker takes no new sandbox (at capacity, draining, or not
    /// answering): another worker may.
    #[error("sandbox {sandbox}: {error}")]
    Refused { sandbox: SandboxId, error: String },
    /// The model client could not be set up.
    #[error("model client: {0}")]
    Model(String),
    /// Skills could not be copied into the sandbox.
    #[error("copying {path} into the sandbox: {error}")]
    Upload { path: String, error: String },
    /// The session's task ended without a summary (it panicked or was
    /// aborted).
    #[error("the session task failed: {0}")]
    Task(String),
    /// Which worker: none could be reached, placed on, or found.
    #[error(transparent)]
    Fleet(#[from] crate::fleet::FleetError),
    /// The session's run is over: it takes no more inputs.
    #[error("session {0} is not running")]
    Gone(String),
}

/// A run's request: what `corral run --request` reads as JSON.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
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
    /// fail (the default) | new_sandbox: what a run does when its sandbox
    /// is lost.
    #[serde(default)]
    pub on_sandbox_lost: Option<OnSandboxLost>,
    #[serde(default)]
    pub limits: Limits,
    /// The sandbox's network: `{"egress": ["pypi.org", ...]}`.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
}

/// What a new session's sandbox may reach.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// Egress rules (see `corral sandbox create --egress`), within the
    /// worker's `--allow-egress`.
    #[serde(default)]
    pub egress: Vec<String>,
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

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "low" => Some(Self::Low),
            "medium" => Some(Self::Medium),
            "high" => Some(Self::High),
            _ => None,
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

/// Parses a request document.
pub fn parse_request(text: &str) -> Result<SessionRequest, String> {
    serde_json::from_str(text).map_err(|e| e.to_string())
}

/// How a session is run, besides its request.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub request: SessionRequest,
    /// `reasoning_effort` as given by the caller (over the request's).
    pub reasoning_effort: Option<String>,
    /// The sandbox image of a new session.
    pub image: Option<String>,
    /// The model endpoint (a new session's, or a resumed one's new one).
    pub base_url: Option<String>,
    pub api: Option<Api>,
    pub api_key: Option<String>,
    /// A directory of skills (`NAME/SKILL.md`) for a new session.
    pub skills: Option<PathBuf>,
    /// A local directory whose contents a new session's /workspace starts
    /// with.
    pub workspace: Option<PathBuf>,
    pub settings: Settings,
    /// End the run once the session is idle (as `corral run` does), rather
    /// than when the input sender is dropped.
    pub until_idle: bool,
    /// How long the worker may stay unreachable before the sandbox is taken
    /// for lost and the run fails (`None`: [`crate::follow::DEFAULT_PATIENCE`]).
    pub worker_lost_after: Option<Duration>,
    /// What a new session's runs do when its sandbox is lost (over the
    /// request's).
    pub on_sandbox_lost: Option<OnSandboxLost>,
}

/// A new session, checked and settled but not made yet (see
/// [`Sessions::prepare`]).
#[derive(Debug, Clone)]
pub struct NewSession {
    id: String,
    config: SessionConfig,
    opts: RunOptions,
    files: Vec<(String, Vec<u8>)>,
}

impl NewSession {
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Records the worker the session is placed on (`None`: the local one).
    pub fn placed_on(mut self, worker: Option<String>) -> Self {
        self.config.worker = worker;
        self
    }
}

/// A running session.
pub struct SessionHandle {
    pub id: String,
    pub resumed: bool,
    pub config: SessionConfig,
    /// Inputs and stops for the session (bounded).
    pub inputs: mpsc::Sender<Inbox>,
    /// What happens, starting with [`Event::SessionStarted`].
    pub events: mpsc::Receiver<Event>,
    /// The session's task: how the run ended. Aborting it leaves the
    /// session as a crash would (its log lets a rerun resume).
    pub task: JoinHandle<Result<Summary, SessionError>>,
}

/// A stored session, opened by this process (its log locked) and read
/// once.
pub struct Stored {
    log: SessionLog<Record>,
    state: State,
    /// None for a log that was made but never started (a crash between
    /// the two): it can only be removed.
    config: Option<SessionConfig>,
    recovery: Recovery,
}

impl Stored {
    pub fn id(&self) -> &str {
        self.log.id()
    }

    /// How the session was started; None when it never was.
    pub fn config(&self) -> Option<&SessionConfig> {
        self.config.as_ref()
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    /// What opening had to repair (a torn last record).
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }
}

/// A session as [`Sessions::list`] finds it.
#[derive(Debug)]
pub struct Listed {
    pub id: String,
    /// Its state, or why its log cannot be read.
    pub state: Result<State, SessionError>,
}

/// Sessions kept in one directory.
#[derive(Debug, Clone)]
pub struct Sessions {
    dir: PathBuf,
}

impl Sessions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh session id.
    pub fn new_id() -> String {
        format!("s-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
    }

    /// Whether session `id` exists (`id` must be valid).
    pub fn exists(&self, id: &str) -> Result<bool, SessionError> {
        crate::session::log::check_id(id)?;
        Ok(crate::session::log::path_of(&self.dir, id).exists())
    }

    /// Opens session `id` for this process: locks its log and reads it
    /// once (a torn last record is cut off; see [`Stored::recovery`]).
    pub fn open(&self, id: &str) -> Result<Stored, SessionError> {
        let mut state = State::new();
        let (log, recovery) =
            SessionLog::<Record>::open_with(&self.dir, id, |_, rec| state.apply(&rec))?;
        let config = state.config.clone();
        Ok(Stored {
            log,
            state,
            config,
            recovery,
        })
    }

    /// Checks and settles a new session `id` (which must not exist):
    /// its settings, its skills, its endpoint's key. Nothing is made yet.
    pub fn prepare(&self, id: &str, opts: RunOptions) -> Result<NewSession, SessionError> {
        crate::session::log::check_id(id)?;
        let req = &opts.request;
        // A run that ends once idle needs something to do; a session fed
        // through its handle starts with nothing.
        if opts.until_idle && req.prompt.is_none() && req.messages.is_empty() {
            return Err(SessionError::Invalid(
                "nothing to do: give a prompt (or --request with a prompt or messages)".into(),
            ));
        }
        let endpoint = Endpoint::merge(None, opts.base_url.clone(), opts.api);
        check_key(&endpoint, &opts.api_key)?;
        let (skills, files) = match &opts.skills {
            Some(dir) => (
                crate::tools::skills::discover(dir).map_err(SessionError::Invalid)?,
                skill_files(dir)?,
            ),
            None => (Vec::new(), Vec::new()),
        };
        if let Some(dir) = &opts.workspace
            && !dir.is_dir()
        {
            return Err(SessionError::Invalid(format!(
                "--workspace {}: not a directory",
                dir.display()
            )));
        }
        let config = new_config(&opts, id, endpoint, &skills);
        check_tool_choice(&config)?;
        corral_proto::egress::parse_rules(&config.egress, false)
            .map_err(|e| SessionError::Invalid(format!("network.egress: {e}")))?;
        if self.exists(id)? {
            return Err(LogError::AlreadyExists(id.into()).into());
        }
        Ok(NewSession {
            id: id.to_string(),
            config,
            opts,
            files,
        })
    }

    /// Starts a prepared session on `worker`: its sandbox first (a session
    /// is not recorded with a sandbox that cannot be made), then its log,
    /// its skills, and its run.
    pub async fn start<W: WorkerApi>(
        &self,
        new: NewSession,
        worker: W,
    ) -> Result<SessionHandle, SessionError> {
        let NewSession {
            id,
            mut config,
            opts,
            files,
        } = new;
        // A local Chat Completions server may say its window (llama.cpp's
        // does); a window given by the caller wins.
        if opts.request.limits.context_window_tokens.is_none()
            && let Some(endpoint) = &config.endpoint
            && endpoint.api == crate::llm::Api::Chat
            && endpoint.base_url != crate::llm::client::DEFAULT_BASE_URL
            && let Some(window) = crate::llm::client::served_context_window(
                &endpoint.base_url,
                opts.api_key.as_deref(),
            )
            .await
        {
            tracing::info!(window, "the model server's context window");
            config.budget.context_window_tokens = window;
        }
        let (sandbox, spec) = (config.sandbox_id.clone(), sandbox_spec(&config));
        let made = create(&worker, &sandbox, &spec).await?;
        // Its address may change (a restarted pod); its id does not.
        config.worker_id = Some(made.worker_id).filter(|w| !w.is_empty());
        // The workspace first: a session is recorded only once its files
        // are in, so a resume never copies them again.
        if let Some(dir) = &opts.workspace {
            let copied =
                crate::transfer::upload_contents(&worker, &sandbox, dir, WORKSPACE, |_| {}).await;
            if let Err(e) = copied {
                let _ = worker.destroy_sandbox(&sandbox).await;
                return Err(SessionError::Upload {
                    path: dir.display().to_string(),
                    error: e.to_string(),
                });
            }
        }
        let made = SessionLog::<Record>::create(&self.dir, &id)
            .map_err(SessionError::from)
            .and_then(|log| {
                Core::create(log, config.clone()).map_err(|e| {
                    // The log was made but not started: it goes too.
                    let _ = std::fs::remove_file(crate::session::log::path_of(&self.dir, &id));
                    e.into()
                })
            });
        let core = match made {
            Ok(core) => core,
            Err(e) => {
                let _ = worker.destroy_sandbox(&sandbox).await;
                return Err(e);
            }
        };
        launch(core, worker, opts, files, false).await
    }

    /// Resumes a stored session on `worker` (the one it was placed on):
    /// its sandbox is checked, and made again when it is gone (operations
    /// that ran in the lost one are answered as lost, never run again).
    pub async fn resume<W: WorkerApi>(
        &self,
        stored: Stored,
        worker: W,
        opts: RunOptions,
    ) -> Result<SessionHandle, SessionError> {
        if opts.skills.is_some() {
            tracing::warn!("skills apply to new sessions; this one keeps its recorded skills");
        }
        let Stored {
            log, state, config, ..
        } = stored;
        let config = config.ok_or_else(|| crate::agent::CoreError::NoStart(log.id().into()))?;
        check_key(
            &Endpoint::merge(config.endpoint.as_ref(), opts.base_url.clone(), opts.api),
            &opts.api_key,
        )?;
        let overrides = overrides_of(&opts);
        // A tool the session does not offer is refused before anything is
        // recorded.
        if let Some(choice) = &overrides.tool_choice {
            let mut with = config.clone();
            with.tool_choice = Some(choice.clone());
            check_tool_choice(&with)?;
        }
        let mut core = Core::resume(log, state, overrides)?;
        let sandbox = config.sandbox_id.clone();
        let existed = match worker.get_sandbox(&sandbox).await {
            Ok(_) => true,
            Err(ApiError::NotFound(_)) => false,
            Err(e) => return Err(sandbox_error(&sandbox, e)),
        };
        if !existed {
            // Made again, with today's spec (a sandbox that exists keeps
            // the one it was made with).
            create(&worker, &sandbox, &sandbox_spec(&config)).await?;
            let saved = self.saved_workspace(core.session_id());
            if saved.exists() {
                // Suspended: its files come back; nothing ran meanwhile.
                restore_saved(&worker, &sandbox, &saved).await?;
                let _ = std::fs::remove_file(&saved);
                tracing::info!(sandbox = %sandbox, "the suspended session's workspace is back");
            } else {
                tracing::warn!(sandbox = %sandbox, "the session's sandbox is gone; a new one replaces it");
            }
            core.sandbox_replaced()?;
        }
        launch(core, worker, opts, Vec::new(), true).await
    }

    /// Resumes a stored session whose sandbox was lost in a fresh sandbox
    /// on `worker` (at `url`; `None`: the local one), of the next
    /// generation: made first (a refusal, at capacity or draining, is
    /// [`SessionError::Refused`], so another worker may be tried), then
    /// recorded; operations that were running are answered as lost, and
    /// the model is told what was lost and why (`reason`).
    pub async fn resume_elsewhere<W: WorkerApi>(
        &self,
        stored: Stored,
        worker: W,
        url: Option<String>,
        reason: &str,
        opts: RunOptions,
    ) -> Result<SessionHandle, SessionError> {
        let Stored {
            log, state, config, ..
        } = stored;
        let config = config.ok_or_else(|| crate::agent::CoreError::NoStart(log.id().into()))?;
        let generation = config.generation + 1;
        let sandbox = next_generation(&config.sandbox_id, generation);
        let made = create(&worker, &sandbox, &sandbox_spec(&config)).await?;
        // A suspended session lost nothing with its worker: its files come
        // along into the new sandbox.
        let saved = self.saved_workspace(log.id());
        let files_kept = saved.exists();
        if files_kept {
            restore_saved(&worker, &sandbox, &saved).await?;
        }
        let overrides = overrides_of(&opts);
        let mut core = match Core::resume(log, state, overrides) {
            Ok(core) => core,
            Err(e) => {
                let _ = worker.destroy_sandbox(&sandbox).await;
                return Err(e.into());
            }
        };
        let worker_id = Some(made.worker_id).filter(|w| !w.is_empty());
        core.placed_again(
            url,
            worker_id,
            sandbox.clone(),
            generation,
            reason,
            files_kept,
        )?;
        if files_kept {
            let _ = std::fs::remove_file(&saved);
        }
        tracing::warn!(sandbox = %sandbox, generation, %reason, "the session goes on in a fresh sandbox");
        launch(core, worker, opts, Vec::new(), true).await
    }

    /// How a stored session was started, read without taking its lock (it
    /// may be running).
    pub fn config_of(&self, id: &str) -> Result<SessionConfig, SessionError> {
        crate::agent::replay(&self.dir, id)?
            .config
            .ok_or_else(|| crate::agent::CoreError::NoStart(id.into()).into())
    }

    /// Where a suspended session's workspace is kept: beside its log.
    pub fn saved_workspace(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.workspace.tar"))
    }

    /// Suspends a stored session that is not running (its log is held):
    /// its /workspace is saved beside its log and its sandbox removed from
    /// `worker`, so it holds no process, memory or disk there; a resume
    /// brings the files back in a new sandbox (processes it had started do
    /// not come back). Returns the bytes saved, or `None` when its sandbox
    /// was gone already.
    pub async fn suspend<W: WorkerApi>(
        &self,
        stored: &Stored,
        worker: W,
    ) -> Result<Option<u64>, SessionError> {
        let Some(config) = stored.config() else {
            return Ok(None);
        };
        let sandbox = &config.sandbox_id;
        match worker.get_sandbox(sandbox).await {
            Ok(_) => {}
            Err(ApiError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(sandbox_error(sandbox, e)),
        }
        let saved = self.saved_workspace(stored.id());
        let moved = crate::transfer::save_contents(&worker, sandbox, WORKSPACE, &saved)
            .await
            .map_err(|e| SessionError::Sandbox {
                sandbox: sandbox.clone(),
                error: format!("saving its workspace: {e}"),
            })?;
        match worker.destroy_sandbox(sandbox).await {
            Ok(_) | Err(ApiError::NotFound(_)) => Ok(Some(moved.bytes)),
            Err(e) => Err(sandbox_error(sandbox, e)),
        }
    }

    /// Forks `parent` into `child` at a turn boundary (see [`fork`]); the
    /// child gets a new sandbox when it first runs, empty.
    pub fn fork(&self, parent: &str, child: &str, turn: Option<u64>) -> Result<(), SessionError> {
        fork(&self.dir, parent, child, turn)
    }

    /// Forks `parent` into `child` (see [`fork`]) and gives the child its
    /// sandbox now, on `worker` (the parent's), with a copy of the parent's
    /// workspace as it is: a live fork of the parent's sandbox (its
    /// /workspace and /tmp at one instant, made on the worker's host) when
    /// the worker can make one, else the workspace copied through this
    /// process, or restored from a suspended parent's saved copy. A parent
    /// whose sandbox is gone leaves the child an empty one (`Ok(false)`).
    /// If the copy fails, the fork is undone.
    pub async fn fork_with_workspace<W: WorkerApi>(
        &self,
        parent: &str,
        child: &str,
        turn: Option<u64>,
        worker: W,
    ) -> Result<bool, SessionError> {
        fork(&self.dir, parent, child, turn)?;
        let undo = |e: SessionError| {
            let _ = std::fs::remove_file(crate::session::log::path_of(&self.dir, child));
            e
        };
        let (from, to) = match (self.config_of(parent), self.config_of(child)) {
            (Ok(p), Ok(c)) => (p, c),
            (Err(e), _) | (_, Err(e)) => return Err(undo(e)),
        };
        let saved = self.saved_workspace(parent);
        let live = match worker.get_sandbox(&from.sandbox_id).await {
            Ok(info) => Some(info),
            Err(ApiError::NotFound(_)) => None,
            // Not knowing is not "gone": no fork with an empty workspace.
            Err(e) => return Err(undo(sandbox_error(&from.sandbox_id, e))),
        };
        // A live parent whose child is to be like it: the worker forks it,
        // its /workspace and /tmp at one instant, on its own host.
        if let Some(info) = &live
            && info.spec == sandbox_spec(&to)
        {
            match worker.fork_sandbox(&from.sandbox_id, &to.sandbox_id).await {
                Ok(Some(frozen)) => {
                    tracing::info!(sandbox = %to.sandbox_id, parent = %from.sandbox_id, frozen_ms = frozen.as_secs_f64() * 1000.0, "the parent's sandbox forked");
                    return Ok(true);
                }
                Ok(None) => {
                    tracing::debug!(sandbox = %from.sandbox_id, "the worker cannot fork this sandbox; copying its workspace")
                }
                Err(e) => return Err(undo(sandbox_error(&to.sandbox_id, e))),
            }
        }
        let live = live.is_some();
        if !live && !saved.exists() {
            tracing::warn!(sandbox = %from.sandbox_id, "the parent's sandbox is gone; the fork starts with an empty workspace");
            return Ok(false);
        }
        let made = create(&worker, &to.sandbox_id, &sandbox_spec(&to)).await;
        if let Err(e) = made {
            return Err(undo(e));
        }
        let copied = if live {
            crate::transfer::copy_contents(
                (&worker, &from.sandbox_id, WORKSPACE),
                (&worker, &to.sandbox_id, WORKSPACE),
            )
            .await
        } else {
            // A suspended parent: its saved workspace.
            crate::transfer::restore_contents(&worker, &to.sandbox_id, &saved, WORKSPACE).await
        };
        if let Err(e) = copied {
            let _ = worker.destroy_sandbox(&to.sandbox_id).await;
            return Err(undo(SessionError::Upload {
                path: format!("{parent}'s workspace"),
                error: e.to_string(),
            }));
        }
        Ok(true)
    }

    /// Writes the changes made to the session's /workspace, a git
    /// repository, as a patch to the local file `dest`: everything against
    /// its HEAD (an empty tree before the first commit), new files
    /// included, binary-safe, so that `git apply` on the original gives
    /// the session's files. The repository's own index is left alone.
    pub async fn export_diff<W: WorkerApi>(
        &self,
        id: &str,
        worker: W,
        dest: &Path,
    ) -> Result<crate::transfer::Moved, SessionError> {
        let config = self.config_of(id)?;
        let saved = self.saved_workspace(id);
        // A suspended session's files are brought up in a sandbox of their
        // own for as long as it takes.
        let temporary = saved.exists().then(|| {
            SandboxId::new(format!("{}-diff", config.sandbox_id))
                .unwrap_or_else(|_| SandboxId::random())
        });
        let sandbox = temporary
            .clone()
            .unwrap_or_else(|| config.sandbox_id.clone());
        if temporary.is_some() {
            create(&worker, &sandbox, &sandbox_spec(&config)).await?;
            if let Err(e) =
                crate::transfer::restore_contents(&worker, &sandbox, &saved, WORKSPACE).await
            {
                let _ = worker.destroy_sandbox(&sandbox).await;
                return Err(SessionError::Upload {
                    path: saved.display().to_string(),
                    error: e.to_string(),
                });
            }
        }
        // `-` is stdout (a patch for a pipe), never a file named `-`.
        let to_stdout = dest.as_os_str() == "-";
        let file: Result<Box<dyn tokio::io::AsyncWrite + Unpin + Send>, _> = if to_stdout {
            Ok(Box::new(tokio::io::stdout()))
        } else {
            tokio::fs::File::create(dest)
                .await
                .map(|f| Box::new(f) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>)
                .map_err(|e| SessionError::Invalid(format!("{}: {e}", dest.display())))
        };
        let written = match file {
            Ok(mut file) => {
                crate::transfer::stream_stdout(&worker, &sandbox, DIFF_COMMAND, &mut file).await
            }
            Err(e) => {
                if temporary.is_some() {
                    let _ = worker.destroy_sandbox(&sandbox).await;
                }
                return Err(e);
            }
        };
        if temporary.is_some() {
            let _ = worker.destroy_sandbox(&sandbox).await;
        }
        written.map_err(|e| {
            if !to_stdout {
                let _ = std::fs::remove_file(dest);
            }
            SessionError::Sandbox {
                sandbox,
                error: e.to_string(),
            }
        })
    }

    /// Copies the session's /workspace into the local directory `dest`
    /// (made if missing), from `worker` (the one it was placed on). A
    /// running session may be exported: what it has written so far comes.
    ///
    /// What comes is the sandbox's, so hostile: `rules` (usually
    /// [`Unpacking::contents_from_sandbox`](crate::transfer::Unpacking::contents_from_sandbox))
    /// bound it, and the notes of the result say what was left out.
    pub async fn export<W: WorkerApi>(
        &self,
        id: &str,
        worker: W,
        dest: &Path,
        rules: crate::transfer::Unpacking,
    ) -> Result<crate::transfer::Moved, SessionError> {
        let config = self.config_of(id)?;
        let saved = self.saved_workspace(id);
        if saved.exists() {
            // Suspended: the files are here already.
            return crate::transfer::unpack_saved(&saved, dest, rules)
                .await
                .map_err(|e| SessionError::Invalid(e.to_string()));
        }
        crate::transfer::download_contents(
            &worker,
            &config.sandbox_id,
            WORKSPACE,
            dest,
            rules,
            |_| {},
        )
        .await
        .map_err(|e| SessionError::Sandbox {
            sandbox: config.sandbox_id.clone(),
            error: e.to_string(),
        })
    }

    /// Removes a stored session: its sandbox from `worker` (the one it was
    /// placed on; `None` keeps the sandbox), then its log.
    pub async fn remove<W: WorkerApi>(
        &self,
        stored: Stored,
        worker: Option<W>,
    ) -> Result<(), SessionError> {
        if let (Some(worker), Some(config)) = (worker, &stored.config) {
            let sandbox = &config.sandbox_id;
            match worker.destroy_sandbox(sandbox).await {
                Ok(_) | Err(ApiError::NotFound(_)) => {}
                Err(e) => return Err(sandbox_error(sandbox, e)),
            }
        }
        let _ = std::fs::remove_file(self.saved_workspace(stored.id()));
        let path = crate::session::log::path_of(&self.dir, stored.id());
        std::fs::remove_file(&path).map_err(|source| LogError::Io {
            path: path.display().to_string(),
            source,
        })?;
        drop(stored);
        Ok(())
    }

    /// Every session, by id, with its state (or why it cannot be read).
    pub fn list(&self) -> Result<Vec<Listed>, SessionError> {
        let mut ids: Vec<String> = match std::fs::read_dir(&self.dir) {
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
            Err(source) => {
                return Err(LogError::Io {
                    path: self.dir.display().to_string(),
                    source,
                }
                .into());
            }
        };
        ids.sort();
        Ok(ids
            .into_iter()
            .map(|id| {
                let state = crate::agent::replay(&self.dir, &id).map_err(SessionError::from);
                Listed { id, state }
            })
            .collect())
    }

    /// A session's records, read as a stream.
    pub fn records(&self, id: &str) -> Result<Records<Record>, SessionError> {
        Ok(SessionLog::records(&self.dir, id)?)
    }
}

/// The id of a replacement sandbox: the first one's, with its generation
/// (`ID-g2`), within the id's length limit.
fn next_generation(current: &SandboxId, generation: u64) -> SandboxId {
    let first = current.as_str();
    let first = match first.rsplit_once("-g") {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => first,
    };
    let suffix = format!("-g{generation}");
    let base: String = first.chars().take(64 - suffix.len()).collect();
    SandboxId::new(format!("{base}{suffix}")).unwrap_or_else(|_| SandboxId::random())
}

/// How long a sandbox's create is tried again after transient failures
/// (a connection that broke, a worker that blinked): creates are
/// idempotent by id. Past it, a caller with other workers places elsewhere.
const CREATE_PATIENCE: Duration = Duration::from_secs(5);

/// Creates `sandbox` on `worker`, tried again as [`CREATE_PATIENCE`] says.
async fn create<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    spec: &SandboxSpec,
) -> Result<corral_proto::SandboxInfo, SessionError> {
    crate::follow::retry(worker, CREATE_PATIENCE, || {
        worker.create_sandbox(sandbox, spec)
    })
    .await
    .map_err(|e| match e {
        crate::follow::FollowError::Refused(e) => sandbox_error(sandbox, e),
        crate::follow::FollowError::GaveUp { last, .. } => {
            sandbox_error(sandbox, ApiError::Transient(last))
        }
    })
}

fn sandbox_error(sandbox: &SandboxId, e: ApiError) -> SessionError {
    match e {
        // Full, draining, or not answering: another worker may do.
        ApiError::Refused(error) | ApiError::Transient(error) => SessionError::Refused {
            sandbox: sandbox.clone(),
            error,
        },
        e => SessionError::Sandbox {
            sandbox: sandbox.clone(),
            error: e.to_string(),
        },
    }
}

fn check_key(endpoint: &Endpoint, key: &Option<String>) -> Result<(), SessionError> {
    if key.is_none() && endpoint.base_url.contains("api.openai.com") {
        return Err(SessionError::Invalid(
            "no API key: set OPENAI_API_KEY or pass --api-key-file (endpoints that need no key: --base-url)".into(),
        ));
    }
    Ok(())
}

/// A tool choice that names a tool must name one the session offers.
fn check_tool_choice(config: &SessionConfig) -> Result<(), SessionError> {
    let Some(ToolChoice::Tool(name)) = &config.tool_choice else {
        return Ok(());
    };
    let offered: Vec<String> = config
        .registry()
        .tools()
        .into_iter()
        .map(|t| t.name)
        .collect();
    if offered.contains(name) {
        return Ok(());
    }
    Err(SessionError::Invalid(format!(
        "--tool-choice {name}: the session offers no such tool (auto, required, none, or one of: {})",
        offered.join(", ")
    )))
}

/// Brings a suspended session's saved workspace into `sandbox`; a sandbox
/// left half restored is removed (the next try starts over).
async fn restore_saved<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    saved: &std::path::Path,
) -> Result<(), SessionError> {
    let restored = crate::transfer::restore_contents(worker, sandbox, saved, WORKSPACE).await;
    if let Err(e) = restored {
        let _ = worker.destroy_sandbox(sandbox).await;
        return Err(SessionError::Upload {
            path: saved.display().to_string(),
            error: e.to_string(),
        });
    }
    Ok(())
}

/// What a resumed run changes of its session, from the request: what is
/// given replaces the session's from here on (recorded with the resume).
fn overrides_of(opts: &RunOptions) -> Overrides {
    let req = &opts.request;
    Overrides {
        max_turns: req.limits.max_turns,
        model: req.model.clone(),
        base_url: opts.base_url.clone(),
        api: opts.api,
        tool_choice: req.tool_choice.as_deref().map(ToolChoice::parse),
        context_window_tokens: req.limits.context_window_tokens,
        max_output_tokens: req.limits.max_output_tokens,
        reasoning_effort: opts
            .reasoning_effort
            .clone()
            .or_else(|| req.reasoning_effort.map(|e| e.as_str().to_string())),
    }
}

/// The sandbox a session's config asks for (each generation's).
pub fn sandbox_spec(config: &SessionConfig) -> SandboxSpec {
    SandboxSpec {
        image: config.image.clone(),
        idle_timeout_ms: Some(SANDBOX_IDLE_TIMEOUT.as_millis() as u64),
        // Checked when the session was made; a rule this build cannot read
        // (a log from elsewhere) is left out: narrower, never wider.
        egress: config
            .egress
            .iter()
            .filter_map(|r| r.parse().ok())
            .collect(),
        ..SandboxSpec::default()
    }
}

/// The settings of a new session: the request (with what the caller put
/// over it), then defaults.
fn new_config(opts: &RunOptions, id: &str, endpoint: Endpoint, skills: &[Skill]) -> SessionConfig {
    let req = &opts.request;
    let budget = Budget {
        context_window_tokens: req
            .limits
            .context_window_tokens
            .unwrap_or(Budget::default().context_window_tokens),
        max_tool_result_chars: req
            .limits
            .max_tool_result_chars
            .unwrap_or(Budget::default().max_tool_result_chars),
        // What the answer may take, when the request bounds it.
        reserve_output_tokens: req
            .limits
            .max_output_tokens
            .map_or(Budget::default().reserve_output_tokens, u64::from),
    };
    SessionConfig {
        model: req
            .model
            .clone()
            .unwrap_or_else(|| DEFAULT_MODEL.to_string()),
        system_prompt: req
            .system_prompt
            .clone()
            .unwrap_or_else(|| crate::context::DEFAULT_SYSTEM_PROMPT.trim_end().to_string()),
        tools: req.tools.clone(),
        sandbox_id: SandboxId::new(format!(
            "{}-{}",
            id.chars().take(40).collect::<String>(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .unwrap_or_else(|_| SandboxId::random()),
        image: opts.image.clone(),
        budget,
        max_output_tokens: req.limits.max_output_tokens,
        reasoning_effort: opts
            .reasoning_effort
            .clone()
            .or_else(|| req.reasoning_effort.map(|e| e.as_str().to_string())),
        max_turns: req.limits.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        skills: skills.iter().map(SkillDef::from_skill).collect(),
        worker: None,
        endpoint: Some(endpoint),
        tool_choice: req.tool_choice.as_deref().map(ToolChoice::parse),
        workspace: opts.workspace.as_ref().map(|d| d.display().to_string()),
        worker_id: None,
        on_sandbox_lost: opts
            .on_sandbox_lost
            .or(req.on_sandbox_lost)
            .unwrap_or_default(),
        generation: 0,
        egress: req
            .network
            .as_ref()
            .map(|n| n.egress.clone())
            .unwrap_or_default(),
    }
}

/// Every regular file under `dir`, as (path in the sandbox, contents).
fn skill_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, SessionError> {
    let invalid =
        |p: &Path, e: std::io::Error| SessionError::Invalid(format!("{}: {e}", p.display()));
    let mut out = Vec::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| invalid(&d, e))? {
            let e = e.map_err(|e| invalid(&d, e))?;
            let path = e.path();
            let kind = e.file_type().map_err(|e| invalid(&path, e))?;
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let data = std::fs::read(&path).map_err(|e| invalid(&path, e))?;
                total += data.len() as u64;
                if total > MAX_SKILL_FILES_BYTES || out.len() >= MAX_SKILL_FILES {
                    return Err(SessionError::Invalid(format!(
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
                out.push((format!("{SANDBOX_SKILLS_DIR}/{rel}"), data));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Copies files into the sandbox through the operation manager, and
/// waits for every one of them.
async fn upload<M: OperationManager>(
    manager: &M,
    updates: &mut mpsc::Receiver<Operation>,
    files: Vec<(String, Vec<u8>)>,
) -> Result<(), SessionError> {
    let ops: Vec<(OperationId, String, Vec<u8>)> = files
        .into_iter()
        .map(|(path, data)| (OperationId::random(), path, data))
        .collect();
    let mut waiting: std::collections::HashMap<OperationId, String> = ops
        .iter()
        .map(|(id, path, _)| (id.clone(), path.clone()))
        .collect();
    // Operations are added while their updates are read: the manager's
    // update channel is bounded, and it must never wait on this caller.
    let adds = async {
        for (id, path, data) in ops {
            let spec = OperationSpec::WriteFile(WriteFileSpec::new(path.clone(), data));
            manager
                .add(Operation::new(id, spec))
                .await
                .map_err(|e| SessionError::Upload {
                    path,
                    error: e.to_string(),
                })?;
        }
        Ok::<_, SessionError>(())
    };
    let wait = async {
        while !waiting.is_empty() {
            let Some(op) = updates.recv().await else {
                return Err(SessionError::Upload {
                    path: waiting.values().next().cloned().unwrap_or_default(),
                    error: "the operation manager stopped".into(),
                });
            };
            if !op.status.is_terminal() {
                continue;
            }
            let Some(path) = waiting.remove(&op.id) else {
                continue;
            };
            let ok = op.status == OpStatus::Completed
                && op.result.as_ref().is_some_and(|r| r.outcome.is_success());
            if !ok {
                let error = match (&op.failure, &op.result) {
                    (Some(f), _) => f.clone(),
                    (None, Some(r)) => r.outcome.to_string(),
                    (None, None) => format!("{:?}", op.status),
                };
                return Err(SessionError::Upload { path, error });
            }
        }
        Ok(())
    };
    let both = async { tokio::try_join!(adds, wait).map(|_| ()) };
    match tokio::time::timeout(UPLOAD_PATIENCE, both).await {
        Ok(r) => r,
        Err(_) => Err(SessionError::Upload {
            path: waiting.values().next().cloned().unwrap_or_default(),
            error: format!("not done within {} s", UPLOAD_PATIENCE.as_secs()),
        }),
    }
}

/// Gives the core its inputs, wires the manager, model client and
/// coordinator, and starts the run.
async fn launch<W: WorkerApi>(
    mut core: Core,
    worker: W,
    opts: RunOptions,
    files: Vec<(String, Vec<u8>)>,
    resumed: bool,
) -> Result<SessionHandle, SessionError> {
    let config = core.config().clone();
    let endpoint = Endpoint::merge(config.endpoint.as_ref(), None, None);
    let mut llm_config = LlmConfig::new(endpoint.base_url, endpoint.api);
    llm_config.api_key = opts.api_key.clone();
    let llm = Arc::new(LlmClient::new(llm_config).map_err(|e| SessionError::Model(e.to_string()))?);
    let patience = opts
        .worker_lost_after
        .unwrap_or(crate::follow::DEFAULT_PATIENCE);
    let (manager, mut updates) = Manager::start_with(worker, config.sandbox_id.clone(), patience);
    let mut lost = manager.lost();
    let mut egress = manager.egress();
    if let Err(e) = upload(&manager, &mut updates, files).await {
        manager.shutdown().await;
        return Err(e);
    }
    if let Err(e) = give_inputs(&mut core, &opts) {
        manager.shutdown().await;
        return Err(e);
    }
    let (events_tx, events) = mpsc::channel(EVENTS_CAPACITY);
    let id = core.session_id().to_string();
    let _ = events_tx.try_send(Event::SessionStarted {
        session_id: id.clone(),
        resumed,
        sandbox_id: config.sandbox_id.to_string(),
        model: config.model.clone(),
        worker: config.worker.clone(),
    });
    let manager = Arc::new(manager);
    let (coordinator, inputs) = Coordinator::new(
        core,
        manager.clone(),
        updates,
        llm,
        events_tx,
        opts.settings,
    );
    // Not a sender: a caller that drops its inputs still ends the run.
    let inbox = inputs.downgrade();
    let task = tokio::spawn(async move {
        let run = coordinator.run();
        tokio::pin!(run);
        // A lost sandbox fails the run (the coordinator records why).
        let summary = loop {
            tokio::select! {
                summary = &mut run => break summary,
                changed = lost.changed() => {
                    let reason = lost.borrow_and_update().clone();
                    match (changed, reason, inbox.upgrade()) {
                        (Ok(()), Some(reason), Some(tx)) => {
                            tracing::warn!(%reason, "the session's sandbox is lost");
                            // The run goes on meanwhile (its inbox may be full).
                            tokio::select! {
                                summary = &mut run => break summary,
                                _ = tx.send(crate::agent::Inbox::SandboxLost(reason)) => {}
                            }
                        }
                        (Ok(()), _, _) => {}
                        _ => break run.await,
                    }
                }
                e = egress.recv() => match (e, inbox.upgrade()) {
                    (Ok(e), Some(tx)) => {
                        tokio::select! {
                            summary = &mut run => break summary,
                            _ = tx.send(crate::agent::Inbox::Egress(e)) => {}
                        }
                    }
                    (Err(tokio::sync::broadcast::error::RecvError::Lagged(n)), _) => {
                        tracing::warn!(missed = n, "egress decisions were not recorded (too many at once)");
                    }
                    // The manager is gone, or the run's inbox: the run
                    // ends on its own.
                    _ => break run.await,
                },
            }
        };
        // The coordinator is gone: its manager stops (operations keep
        // running on the worker).
        if let Ok(m) = Arc::try_unwrap(manager) {
            m.shutdown().await;
        }
        Ok(summary?)
    });
    Ok(SessionHandle {
        id,
        resumed,
        config,
        inputs,
        events,
        task,
    })
}

/// The run's inputs: the request's messages (the same request again asks
/// nothing twice), then its prompt (rerunning a run that did not finish,
/// with the same prompt, resumes it rather than asking again).
fn give_inputs(core: &mut Core, opts: &RunOptions) -> Result<(), SessionError> {
    if opts.until_idle {
        core.stop(StopMode::WhenIdle, StopCause::Requested)?;
    }
    let resumed = core.state().turns() > 0 || core.state().last_input.is_some();
    for (i, m) in opts.request.messages.iter().enumerate() {
        match m.role {
            MessageRole::User => {
                let id = m.message_id.clone().unwrap_or_else(|| {
                    format!(
                        "message-{i}-{:016x}",
                        crate::llm::conform::fnv1a(m.content.as_bytes())
                    )
                });
                core.add_input(&id, &m.content)?;
            }
            MessageRole::Assistant if resumed => {
                tracing::warn!(
                    "assistant messages of a request apply to new sessions only; skipped"
                );
            }
            MessageRole::Assistant => core.history(Role::Assistant, &m.content)?,
        }
    }
    if let Some(prompt) = &opts.request.prompt {
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
    Ok(())
}

/// The text an inherited call without a result gets in a fork.
pub const INTERRUPTED_BY_FORK: &str = "Error: interrupted by fork: this call had not finished when the session was forked, and its result is not part of this session.";

/// Forks `parent` into `child` at a turn boundary: everything before turn
/// `turn + 1` starts (all of it when `turn` is `None`). Calls without a
/// final result get an explicit "interrupted by fork" result, and the child
/// runs in a new sandbox.
fn fork(dir: &Path, parent: &str, child: &str, turn: Option<u64>) -> Result<(), SessionError> {
    let mut upto = 0;
    let mut state = crate::agent::State::new();
    for rec in SessionLog::<Record>::records(dir, parent)? {
        let (seq, rec) = rec?;
        if let (Some(n), Record::Turn { turn: t }) = (turn, &rec)
            && *t > n
        {
            break;
        }
        state.apply(&rec);
        upto = seq;
    }
    if let Some(n) = turn
        && state.last_turn < n
    {
        return Err(SessionError::NoSuchTurn {
            id: parent.to_string(),
            turn: n,
            last: state.last_turn,
        });
    }
    let mut then = vec![Record::Forked {
        parent: parent.to_string(),
        sandbox_id: SandboxId::random(),
    }];
    let mut open: Vec<(&String, &crate::agent::state::CallState)> =
        state.unanswered_calls().collect();
    open.sort_by_key(|(id, _)| (*id).clone());
    for (call_id, call) in open {
        for op in &call.ops {
            if state.ops.get(op).is_some_and(|o| o.end.is_none()) {
                then.push(Record::Operation {
                    snapshot: crate::agent::record::OpSnapshot {
                        id: op.clone(),
                        status: crate::ops::OpStatus::Canceled,
                        result: None,
                        failure: Some("interrupted by fork".into()),
                        lost: false,
                    },
                });
            }
        }
        then.push(Record::Result {
            call_id: call_id.clone(),
            output: crate::tools::text(INTERRUPTED_BY_FORK),
            running: false,
        });
    }
    // A request in flight at the fork point is sent again when the child
    // resumes (its Resume record says so).
    then.push(Record::Resume {
        at_unix_ms: now_ms(),
        max_turns: None,
        model: None,
        endpoint: None,
        tool_choice: None,
        context_window_tokens: None,
        max_output_tokens: None,
        reasoning_effort: None,
    });
    SessionLog::<Record>::fork(dir, parent, child, upto, &then)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_sandbox_is_named_after_the_first_with_its_generation() {
        let first = SandboxId::new("s1-0123abcd").unwrap();
        let second = next_generation(&first, 1);
        assert_eq!(second.as_str(), "s1-0123abcd-g1");
        assert_eq!(next_generation(&second, 2).as_str(), "s1-0123abcd-g2");
        let long = SandboxId::new("x".repeat(64)).unwrap();
        let next = next_generation(&long, 12);
        assert_eq!(next.as_str().len(), 64);
        assert!(next.as_str().ends_with("-g12"));
    }
}
