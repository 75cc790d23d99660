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
//! The caller picks the worker (any [`WorkerApi`]) and shows the events
//! (or lets [`crate::runner`] pick it on a fleet). Its rooms: `request`
//! (what a caller asks), `launch` (how a session is made and set going),
//! `workspace` (its files: suspend, export, diff, a fork's copy) and
//! `fork` (a log forked at a turn boundary).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, WriteFileSpec};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::agent::events::Event;
use crate::agent::record::{Endpoint, OnSandboxLost, Overrides, SkillDef};
use crate::agent::{
    Coordinator, Core, Inbox, Record, SessionConfig, Settings, State, StopCause, StopMode, Summary,
};
use crate::context::Budget;
use crate::llm::{Api, LlmConfig, Role, ToolChoice};
use crate::ops::{Manager, OpStatus, Operation, OperationManager};
use crate::session::{LogError, Records, Recovery, SessionLog};
use crate::tools::skills::{SANDBOX_SKILLS_DIR, Skill};
use crate::worker_api::{ApiError, Why, WorkerApi};
use corral_proto::reason::Reason;

mod fork;
mod launch;
mod request;
mod workspace;

pub use fork::INTERRUPTED_BY_FORK;
use fork::fork;
pub use launch::sandbox_spec;
use launch::*;
pub use request::*;

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
/// The exit of [`DIFF_COMMAND`] when the workspace cannot give a patch
/// (no git, or not a repository): the caller's to change, not a failure.
pub(crate) const NO_DIFF: i32 = 3;
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
    /// The model's endpoint needs an API key and none was given (to this
    /// process: a service's clients send none, its operator gives it).
    #[error(
        "no API key for {base_url}: set OPENAI_API_KEY or pass --api-key-file (endpoints that need no key: --base-url)"
    )]
    NoApiKey { base_url: String },
    /// The session's sandbox could not be made, found or removed (`why`:
    /// the worker's reason, when it gave one).
    #[error("sandbox {sandbox}: {error}")]
    Sandbox {
        sandbox: SandboxId,
        error: String,
        why: Option<Why>,
    },
    /// The worker takes no new sandbox (`why`: at capacity or draining, as
    /// it said; `no_worker`: it did not answer in time): another worker
    /// may.
    #[error("sandbox {sandbox}: {error}")]
    Refused {
        sandbox: SandboxId,
        error: String,
        why: Why,
    },
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
    /// Its log (locked, for appending) and its state as the log left it:
    /// what [`crate::agent::Core::resume`] takes.
    pub fn into_parts(self) -> (SessionLog<Record>, State) {
        (self.log, self.state)
    }

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
    /// What a listing shows of it, or why its log cannot be read.
    pub brief: Result<crate::agent::Brief, SessionError>,
}

/// Each session's brief as far as its log was read (see
/// [`Sessions::brief_of`]).
type Briefs = std::collections::HashMap<String, (crate::session::log::Mark, crate::agent::Brief)>;

/// Sessions kept in one directory.
#[derive(Clone)]
pub struct Sessions {
    dir: PathBuf,
    clock: crate::session::Clock,
    models: Arc<crate::llm::MakeModel>,
    briefs: Arc<std::sync::Mutex<Briefs>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("dir", &self.dir)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            clock: crate::session::Clock::system(),
            models: Arc::new(crate::llm::http_model),
            briefs: Arc::default(),
        }
    }

    /// The same sessions, their records timed by `clock` (a test's fixed
    /// clock; the system's by default).
    pub fn with_clock(mut self, clock: crate::session::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The same sessions, their requests answered by what `models` makes
    /// of each session's endpoint (a test's scripted model; by default the
    /// endpoint's server, over HTTP).
    pub fn with_models(mut self, models: Arc<crate::llm::MakeModel>) -> Self {
        self.models = models;
        self
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
        let (mut log, recovery) =
            SessionLog::<Record>::open_with(&self.dir, id, |_, rec| state.apply(&rec))?;
        log.set_clock(self.clock.clone());
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
        let made = create(&worker, &sandbox, &spec, opts.trace.as_ref()).await?;
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
        let made = SessionLog::<Record>::create_clocked(&self.dir, &id, self.clock.clone())
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
        launch(core, worker, opts, files, false, &*self.models).await
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
            create(
                &worker,
                &sandbox,
                &sandbox_spec(&config),
                opts.trace.as_ref(),
            )
            .await?;
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
        launch(core, worker, opts, Vec::new(), true, &*self.models).await
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
        let made = create(
            &worker,
            &sandbox,
            &sandbox_spec(&config),
            opts.trace.as_ref(),
        )
        .await?;
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
        launch(core, worker, opts, Vec::new(), true, &*self.models).await
    }

    /// A stored session's settings as they are now (its start, and what
    /// its resumes, moves and shrinks changed), read without taking its lock
    /// (it may be running): its records are read, but nothing is replayed
    /// but their settings.
    pub fn config_of(&self, id: &str) -> Result<SessionConfig, SessionError> {
        self.brief_of(id)?
            .config
            .ok_or_else(|| crate::agent::CoreError::NoStart(id.into()).into())
    }

    /// What a listing shows of session `id` (see [`crate::agent::Brief`]),
    /// read from where the last question about it stopped: a session's
    /// log is read once by this store, however often it is asked.
    pub fn brief_of(&self, id: &str) -> Result<crate::agent::Brief, SessionError> {
        let briefs = || {
            self.briefs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let cached = briefs().get(id).cloned();
        let (mark, brief) = SessionLog::<Record>::fold_on(
            &self.dir,
            id,
            cached,
            crate::agent::Brief::default,
            |brief, _, rec| brief.apply(&rec),
        )?;
        briefs().insert(id.to_string(), (mark, brief.clone()));
        Ok(brief)
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
        self.briefs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(stored.id());
        let _ = std::fs::remove_file(self.saved_workspace(stored.id()));
        let _ = std::fs::remove_file(self.events_path(stored.id()));
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
                let brief = self.brief_of(&id);
                Listed { id, brief }
            })
            .collect())
    }

    /// A session's records, read as a stream.
    pub fn records(&self, id: &str) -> Result<Records<Record>, SessionError> {
        Ok(SessionLog::records(&self.dir, id)?)
    }
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
