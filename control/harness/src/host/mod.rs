//! The sessions `corral serve` hosts: each one's run (through the
//! harness's [`runner`]), its events written to its [`Journal`], its
//! inputs and stops, and the mark that brings it back after a restart of
//! the service.
//!
//! One [`Host`] owns the table of hosted sessions (a session is in it from
//! the moment its start is accepted until its run has ended and its last
//! event is written); each run is driven by a task of the host's tracker,
//! which owns the run's handle and journal. A stopped service aborts those
//! tasks without ending their runs: their sessions keep their sandboxes,
//! operations and marks, and the next start of the service resumes them
//! from their logs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::agent::events::{Event, to_json_line};
use crate::agent::record::{Endpoint, SessionConfig};
use crate::agent::{Inbox, OnSandboxLost, Settings as AgentSettings, StopMode};
use crate::fleet::Fleet;
use crate::llm::Api;
use crate::runner::{self, Run, RunEnd};
use crate::session::LogError;
use crate::sessions::{
    ReasoningEffort, RunOptions, SessionError, SessionRequest, Sessions, parse_request,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub mod journal;
pub mod status;

use journal::{Journal, Mark};

/// The longest input a client may send a running session.
pub const MAX_INPUT_BYTES: usize = 256 * 1024;

/// What a session's run takes when its start does not say.
#[derive(Clone)]
pub struct Defaults {
    pub model: Option<String>,
    pub base_url: Option<String>,
    pub api: Option<Api>,
    pub api_key: Option<String>,
    pub image: String,
    pub heartbeat: Option<Duration>,
    pub grace: Duration,
    pub worker_lost_after: Duration,
    pub on_sandbox_lost: Option<OnSandboxLost>,
    /// Model endpoints a session may use besides the service's own
    /// (`--allow-base-url`).
    pub allowed_endpoints: Vec<EndpointRule>,
    /// Traces of the hosted runs, when exported.
    pub telemetry: Option<crate::telemetry::Telemetry>,
}

/// A model endpoint clients may name (`--allow-base-url`): `*` (any), or
/// `SCHEME://HOST[:PORT][/PATH]`, matched on the parsed address (a rule
/// without a port allows any port; its path is a prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointRule {
    Any,
    Url {
        scheme: String,
        host: String,
        port: Option<u16>,
        path: String,
    },
}

impl std::str::FromStr for EndpointRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim() == "*" {
            return Ok(Self::Any);
        }
        let url = reqwest::Url::parse(s.trim()).map_err(|e| format!("{s:?}: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!("{s:?}: an http:// or https:// address, or *"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!("{s:?}: no user or password in a rule"));
        }
        Ok(Self::Url {
            scheme: url.scheme().to_string(),
            host: url.host_str().unwrap_or_default().to_ascii_lowercase(),
            port: url.port(),
            path: url.path().trim_end_matches('/').to_string(),
        })
    }
}

impl EndpointRule {
    /// Whether `base_url` is one this rule allows. An address with a user
    /// or password in it is never allowed (`http://allowed@elsewhere/`).
    pub fn allows(&self, base_url: &str) -> bool {
        let Ok(url) = reqwest::Url::parse(base_url) else {
            return false;
        };
        if !url.username().is_empty() || url.password().is_some() {
            return false;
        }
        match self {
            Self::Any => true,
            Self::Url {
                scheme,
                host,
                port,
                path,
            } => {
                let within = |p: &str| {
                    p == path.as_str()
                        || path.is_empty()
                        || p.strip_prefix(path.as_str())
                            .is_some_and(|r| r.starts_with('/'))
                };
                url.scheme() == scheme
                    && url.host_str().map(str::to_ascii_lowercase).as_deref() == Some(host.as_str())
                    && port.is_none_or(|p| url.port_or_known_default() == Some(p))
                    && within(url.path().trim_end_matches('/'))
            }
        }
    }
}

/// How one session is run, as its start asked (kept in its mark, so a
/// restarted service runs it the same way).
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub base_url: Option<String>,
    pub api: Option<Api>,
    /// Kept in the mark (a file only the service's user reads), never
    /// sent back or logged.
    pub api_key: Option<String>,
    pub image: Option<String>,
    /// A template of the workers' for a new session's sandbox (left out
    /// of a mark when none, which an earlier release reads as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    pub reasoning_effort: Option<ReasoningEffort>,
    pub heartbeat_ms: Option<u64>,
    pub grace_ms: Option<u64>,
    #[serde(default)]
    pub keep_sandbox: bool,
    pub on_sandbox_lost: Option<OnSandboxLost>,
}

// Keys are never shown, not even in a debug line.
impl std::fmt::Debug for Defaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Defaults")
            .field("model", &self.model)
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "(hidden)"))
            .field("image", &self.image)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("base_url", &self.base_url)
            .field("api", &self.api)
            .field("api_key", &self.api_key.as_ref().map(|_| "(hidden)"))
            .field("image", &self.image)
            .field("template", &self.template)
            .field("keep_sandbox", &self.keep_sandbox)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The settings a client sent: each choice from its enum, else (a
    /// client of an earlier release) from its older string field.
    pub fn from_pb(s: corral_proto::pb::RunSettings) -> Result<Self, HostError> {
        use corral_proto::pb;
        let bad = |m: String| HostError::Invalid(m);
        let api = match (s.api_kind(), s.api.as_deref()) {
            (pb::ModelApi::Responses, _) | (pb::ModelApi::Unspecified, Some("responses")) => {
                Some(Api::Responses)
            }
            (pb::ModelApi::Chat, _) | (pb::ModelApi::Unspecified, Some("chat")) => Some(Api::Chat),
            (pb::ModelApi::Unspecified, None) => None,
            (pb::ModelApi::Unspecified, Some(other)) => {
                return Err(bad(format!("api {other:?}: responses or chat")));
            }
        };
        let reasoning_effort = match (s.effort(), s.reasoning_effort.as_deref()) {
            (pb::ReasoningEffort::Low, _) | (pb::ReasoningEffort::Unspecified, Some("low")) => {
                Some(ReasoningEffort::Low)
            }
            (pb::ReasoningEffort::Medium, _)
            | (pb::ReasoningEffort::Unspecified, Some("medium")) => Some(ReasoningEffort::Medium),
            (pb::ReasoningEffort::High, _) | (pb::ReasoningEffort::Unspecified, Some("high")) => {
                Some(ReasoningEffort::High)
            }
            (pb::ReasoningEffort::Unspecified, None) => None,
            (pb::ReasoningEffort::Unspecified, Some(other)) => {
                return Err(bad(format!(
                    "reasoning_effort {other:?}: low, medium or high"
                )));
            }
        };
        let on_sandbox_lost = match (s.lost(), s.on_sandbox_lost.as_deref()) {
            (pb::OnSandboxLost::Fail, _) | (pb::OnSandboxLost::Unspecified, Some("fail")) => {
                Some(OnSandboxLost::Fail)
            }
            (pb::OnSandboxLost::NewSandbox, _)
            | (pb::OnSandboxLost::Unspecified, Some("new_sandbox")) => {
                Some(OnSandboxLost::NewSandbox)
            }
            (pb::OnSandboxLost::Unspecified, None) => None,
            (pb::OnSandboxLost::Unspecified, Some(other)) => {
                return Err(bad(format!(
                    "on_sandbox_lost {other:?}: fail or new_sandbox"
                )));
            }
        };
        if let Some(t) = &s.template {
            corral_proto::template::check_name(t).map_err(|e| bad(e.to_string()))?;
        }
        Ok(Self {
            base_url: s.base_url,
            api,
            api_key: s.api_key,
            image: s.image,
            template: s.template,
            reasoning_effort,
            heartbeat_ms: s.heartbeat_ms,
            grace_ms: s.grace_ms,
            keep_sandbox: s.keep_sandbox,
            on_sandbox_lost,
        })
    }

    /// These settings as a client sends them: the enums, and the older
    /// strings beside them for a service of an earlier release.
    pub fn to_pb(&self) -> corral_proto::pb::RunSettings {
        use corral_proto::pb;
        let mut s = pb::RunSettings {
            base_url: self.base_url.clone(),
            api: self.api.map(|a| a.as_str().to_string()),
            api_key: self.api_key.clone(),
            image: self.image.clone(),
            template: self.template.clone(),
            reasoning_effort: self.reasoning_effort.map(|e| e.as_str().to_string()),
            heartbeat_ms: self.heartbeat_ms,
            keep_sandbox: self.keep_sandbox,
            on_sandbox_lost: self.on_sandbox_lost.map(|l| l.as_str().to_string()),
            grace_ms: self.grace_ms,
            ..Default::default()
        };
        if let Some(a) = self.api {
            s.set_api_kind(match a {
                Api::Responses => pb::ModelApi::Responses,
                Api::Chat => pb::ModelApi::Chat,
            });
        }
        if let Some(e) = self.reasoning_effort {
            s.set_effort(match e {
                ReasoningEffort::Low => pb::ReasoningEffort::Low,
                ReasoningEffort::Medium => pb::ReasoningEffort::Medium,
                ReasoningEffort::High => pb::ReasoningEffort::High,
            });
        }
        if let Some(l) = self.on_sandbox_lost {
            s.set_lost(match l {
                OnSandboxLost::Fail => pb::OnSandboxLost::Fail,
                OnSandboxLost::NewSandbox => pb::OnSandboxLost::NewSandbox,
            });
        }
        s
    }

    /// The run's options: these settings over `defaults`, checked.
    /// `recorded`: the config of an existing session, which keeps what it
    /// was started with (model, endpoint, API) unless these settings or
    /// the request name another: the service's defaults are for new
    /// sessions only.
    fn options(
        &self,
        request: SessionRequest,
        defaults: &Defaults,
        recorded: Option<&SessionConfig>,
    ) -> Result<RunOptions, HostError> {
        let existing = recorded.is_some();
        let recorded = recorded.and_then(|c| c.endpoint.as_ref());
        let api = match self.api {
            None if existing => None,
            None => defaults.api,
            some => some,
        };
        let on_sandbox_lost = self.on_sandbox_lost.or(defaults.on_sandbox_lost);
        let mut request = request;
        if request.model.is_none() && !existing {
            request.model = defaults.model.clone();
        }
        let heartbeat = match self.heartbeat_ms {
            Some(0) => None,
            Some(ms) => Some(Duration::from_millis(ms)),
            None => defaults.heartbeat,
        };
        // A new session gets the service's endpoint unless it names one; an
        // existing one keeps its own.
        let base_url = match recorded {
            Some(_) => self.base_url.clone(),
            None => self.base_url.clone().or_else(|| defaults.base_url.clone()),
        };
        // The service's key goes to the service's endpoint only: a client
        // that names another endpoint brings its own key.
        let effective = Endpoint::merge(recorded, base_url.clone(), api);
        let default_endpoint = Endpoint::merge(None, defaults.base_url.clone(), None);
        // A client names only what the operator allows (a resumed session
        // that names none is held to the same: its endpoint came from a
        // client).
        if effective.base_url != default_endpoint.base_url
            && !defaults
                .allowed_endpoints
                .iter()
                .any(|r| r.allows(&effective.base_url))
        {
            return Err(HostError::EndpointDenied(effective.base_url));
        }
        let api_key = match &self.api_key {
            Some(k) => Some(k.clone()),
            None if effective.base_url == default_endpoint.base_url => defaults.api_key.clone(),
            None => None,
        };
        Ok(RunOptions {
            request,
            reasoning_effort: self.reasoning_effort.map(|e| e.as_str().to_string()),
            // A template names its image.
            image: match &self.template {
                Some(_) => self.image.clone(),
                None => Some(self.image.clone().unwrap_or_else(|| defaults.image.clone())),
            },
            template: self.template.clone(),
            base_url,
            api,
            api_key,
            // Paths of the service's machine: not for its clients to name.
            skills: None,
            workspace: None,
            settings: AgentSettings {
                heartbeat,
                grace: self.grace_ms.map_or(defaults.grace, Duration::from_millis),
            },
            until_idle: true,
            worker_lost_after: Some(defaults.worker_lost_after),
            on_sandbox_lost,
            telemetry: defaults.telemetry.clone(),
            trace: None,
            tenant: None,
        })
    }
}

/// Why the host refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("{0}")]
    Invalid(String),
    #[error("no session {0}")]
    NotFound(String),
    #[error("session {0} is running on this service")]
    Running(String),
    #[error("session {0} is not running")]
    NotRunning(String),
    #[error("the service hosts {max} sessions already (--max-sessions)")]
    Full { max: usize },
    #[error("the service is shutting down")]
    ShuttingDown,
    #[error("model endpoint {0}: not the service's, nor one it allows (--allow-base-url)")]
    EndpointDenied(String),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl From<LogError> for HostError {
    fn from(e: LogError) -> Self {
        HostError::Session(e.into())
    }
}

/// A hosted session: where its inputs and stops go, how far its journal
/// is written.
#[derive(Clone)]
struct Hosted {
    inputs: mpsc::Sender<Inbox>,
    leave: mpsc::Sender<String>,
    mark: watch::Receiver<Mark>,
    /// The last event before this run.
    events_before: u64,
}

enum Slot {
    /// Accepted, being placed or resumed: watchers wait for its run.
    Starting(watch::Receiver<Mark>),
    Running(Hosted),
}

/// What a start answers.
pub struct Started {
    pub id: String,
    pub resumed: bool,
    pub events_before: u64,
}

/// A session as listed.
pub struct Listed {
    pub id: String,
    pub running: bool,
    pub model: String,
    pub sandbox_id: String,
    pub worker: String,
    pub turns: u64,
    pub events: u64,
    /// Running: the last event before its current run.
    pub run_events_after: u64,
}

/// The sessions the service hosts.
#[derive(Clone)]
pub struct Host {
    inner: Arc<Inner>,
}

struct Inner {
    store: Sessions,
    fleet: Fleet,
    defaults: Defaults,
    max_sessions: usize,
    /// A mark (`ID.json`: the settings) for each session whose run is
    /// not over: resumed when the service starts.
    marks: PathBuf,
    slots: Mutex<HashMap<String, Slot>>,
    tasks: TaskTracker,
    stop: CancellationToken,
}

/// A slot taken for a start, with the session's journal; given back
/// unless the run begins.
struct Reservation {
    host: Host,
    id: String,
    /// The session's journal, for a start.
    journal: Option<Journal>,
    armed: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            self.host.slots().remove(&self.id);
        }
        // Watchers that waited for a run that did not begin read what
        // there is, and end.
        if let Some(journal) = self.journal.take() {
            journal.close();
        }
    }
}

/// Sessions to resume, their slots taken (see [`Host::reserve_marked`]).
pub struct Marked(Vec<(String, Settings, Reservation)>);

impl Host {
    pub fn new(
        store: Sessions,
        fleet: Fleet,
        defaults: Defaults,
        max_sessions: usize,
        state_dir: &Path,
    ) -> Result<Self, HostError> {
        let marks = state_dir.join("running");
        for dir in [store.dir(), marks.as_path()] {
            private_dir(dir).map_err(|source| HostError::Io {
                what: dir.display().to_string(),
                source,
            })?;
        }
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                fleet,
                defaults,
                max_sessions,
                marks,
                slots: Mutex::new(HashMap::new()),
                tasks: TaskTracker::new(),
                stop: CancellationToken::new(),
            }),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        // A panic elsewhere with the lock held leaves the table as it was:
        // every change to it is one insert or remove.
        self.inner
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn mark_path(&self, id: &str) -> PathBuf {
        self.inner.marks.join(format!("{id}.json"))
    }

    /// Takes the slots of every session whose run was not over when the
    /// service stopped (its mark is still there), before anyone may ask
    /// about them: a watcher that comes first waits for the resumed run.
    pub fn reserve_marked(&self) -> Marked {
        let Ok(rd) = std::fs::read_dir(&self.inner.marks) else {
            return Marked(Vec::new());
        };
        let mut ids: Vec<String> = rd
            .filter_map(Result::ok)
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .map(str::to_string)
            })
            .collect();
        ids.sort();
        let mut marked = Vec::new();
        for id in ids {
            let settings = match std::fs::read(self.mark_path(&id))
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Settings>(&b).map_err(|e| e.to_string()))
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "the mark of a hosted session cannot be read; it is not resumed");
                    continue;
                }
            };
            if !matches!(self.inner.store.exists(&id), Ok(true)) {
                // Its start never recorded it: nothing to resume.
                let _ = std::fs::remove_file(self.mark_path(&id));
                continue;
            }
            if journal::ends_a_run(&self.inner.store.events_path(&id)) {
                // Its run ended (its last event written) just before the
                // service stopped: nothing to resume.
                let _ = std::fs::remove_file(self.mark_path(&id));
                continue;
            }
            match self.reserve(&id, true) {
                Ok(r) => marked.push((id, settings, r)),
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "a session hosted before the restart is not resumed now; the next start tries again");
                }
            }
        }
        Marked(marked)
    }

    /// Resumes the sessions of [`Self::reserve_marked`], each as its start
    /// asked. One that cannot be resumed is said and its mark left for the
    /// next start.
    pub async fn resume_marked(&self, marked: Marked) {
        let mut resuming = tokio::task::JoinSet::new();
        for (id, settings, reservation) in marked.0 {
            let host = self.clone();
            resuming.spawn(async move {
                let recorded = host.recorded(&id);
                let r = match recorded.and_then(|c| {
                    settings.options(SessionRequest::default(), &host.inner.defaults, c.as_ref())
                }) {
                    Ok(opts) => {
                        host.begin(id.clone(), opts, settings, reservation, true)
                            .await
                    }
                    Err(e) => Err(e),
                };
                (id, r)
            });
        }
        while let Some(done) = resuming.join_next().await {
            match done {
                Ok((id, Ok(_))) => {
                    tracing::info!(session = %id, "a session hosted before the restart is resumed")
                }
                Ok((id, Err(e))) => {
                    tracing::warn!(session = %id, error = %crate::client::source_chain(&e), "a session hosted before the restart could not be resumed; the next start tries again")
                }
                Err(e) => tracing::warn!(error = %e, "resuming a session panicked"),
            }
        }
    }

    /// Starts session `id` (a new one: `request` must give it something
    /// to do) or resumes it (`request` may bring a new input).
    pub async fn start(
        &self,
        id: Option<String>,
        request: Option<SessionRequest>,
        settings: Settings,
        tenant: Option<&str>,
    ) -> Result<Started, HostError> {
        if self.inner.stop.is_cancelled() {
            return Err(HostError::ShuttingDown);
        }
        let id = id.unwrap_or_else(Sessions::new_id);
        crate::session::log::check_id(&id)?;
        let recorded = self.recorded(&id)?;
        if let (Some(tenant), Some(config)) = (tenant, &recorded)
            && config.tenant.as_deref() != Some(tenant)
        {
            return Err(HostError::NotFound(id));
        }
        let mut opts = settings.options(
            request.unwrap_or_default(),
            &self.inner.defaults,
            recorded.as_ref(),
        )?;
        opts.tenant = tenant.map(str::to_string);
        let new = recorded.is_none();
        let reservation = self.reserve(&id, true)?;
        let events = self.inner.store.events_path(&id);
        let started = self
            .begin(id.clone(), opts, settings, reservation, false)
            .await;
        // A new session that never began leaves nothing behind (its journal
        // was opened for watchers of its start).
        if started.is_err() && new && !self.inner.store.exists(&id).unwrap_or(true) {
            let _ = std::fs::remove_file(&events);
        }
        started
    }

    /// For a call made for `tenant` (None: every tenant's), session `id`
    /// must be that tenant's: another's is answered as one that does not
    /// exist.
    pub fn owned(&self, id: &str, tenant: Option<&str>) -> Result<(), HostError> {
        let Some(tenant) = tenant else {
            return Ok(());
        };
        crate::session::log::check_id(id)?;
        let theirs = match self.recorded(id) {
            Ok(Some(config)) => config.tenant.as_deref() == Some(tenant),
            _ => false,
        };
        if theirs {
            Ok(())
        } else {
            Err(HostError::NotFound(id.to_string()))
        }
    }

    /// Whether session `id` is not one this service has (a start makes it).
    pub fn is_new(&self, id: &str) -> Result<bool, HostError> {
        Ok(!self.inner.store.exists(id)?)
    }

    /// The config session `id` has now, if it exists.
    fn recorded(&self, id: &str) -> Result<Option<SessionConfig>, HostError> {
        if !self.inner.store.exists(id)? {
            return Ok(None);
        }
        Ok(Some(self.inner.store.config_of(id)?))
    }

    /// Launches a reserved start in a task of its own (a caller that goes
    /// away mid-start does not cut a placement or a resume in half), and
    /// waits for it.
    async fn begin(
        &self,
        id: String,
        opts: RunOptions,
        settings: Settings,
        reservation: Reservation,
        keep_mark_on_failure: bool,
    ) -> Result<Started, HostError> {
        let host = self.clone();
        let launched = self.inner.tasks.spawn(async move {
            host.launch(id, opts, settings, reservation, keep_mark_on_failure)
                .await
        });
        launched.await.map_err(|e| HostError::Io {
            what: "starting the session".into(),
            source: std::io::Error::other(e.to_string()),
        })?
    }

    /// Takes session `id`'s slot (within --max-sessions), with its journal
    /// opened for a start (`journal`), so watchers may wait for its run.
    fn reserve(&self, id: &str, journal: bool) -> Result<Reservation, HostError> {
        let check = |slots: &HashMap<String, Slot>| {
            if slots.contains_key(id) {
                return Err(HostError::Running(id.to_string()));
            }
            if slots.len() >= self.inner.max_sessions {
                return Err(HostError::Full {
                    max: self.inner.max_sessions,
                });
            }
            Ok(())
        };
        check(&self.slots())?;
        // Read outside the table's lock (a long journal takes a while).
        let journal = match journal {
            true => {
                let path = self.inner.store.events_path(id);
                Some(Journal::open(&path).map_err(|source| HostError::Io {
                    what: path.display().to_string(),
                    source,
                })?)
            }
            false => None,
        };
        let mark = match &journal {
            Some(j) => j.watch(),
            // Nothing to watch: a fork's child or a removal.
            None => {
                watch::channel(Mark {
                    count: 0,
                    open: false,
                })
                .1
            }
        };
        let mut slots = self.slots();
        check(&slots)?;
        slots.insert(id.to_string(), Slot::Starting(mark));
        Ok(Reservation {
            host: self.clone(),
            id: id.to_string(),
            journal,
            armed: true,
        })
    }

    async fn launch(
        self,
        id: String,
        opts: RunOptions,
        settings: Settings,
        mut reservation: Reservation,
        keep_mark_on_failure: bool,
    ) -> Result<Started, HostError> {
        let store = &self.inner.store;
        let resumed = store.exists(&id)?;
        // Marked first: a service killed from here on resumes the run.
        let mark = self.mark_path(&id);
        let keep_mark_on_failure = keep_mark_on_failure || mark.exists();
        write_private(&mark, &serde_json::to_vec(&settings).unwrap_or_default()).map_err(
            |source| HostError::Io {
                what: mark.display().to_string(),
                source,
            },
        )?;
        let end = RunEnd {
            export: None,
            keep_sandbox: settings.keep_sandbox,
        };
        let run = match runner::run(store, &self.inner.fleet, &id, opts, end).await {
            Ok(run) => run,
            Err(e) => {
                // A run that never began leaves nothing to resume (a new
                // session left nothing behind; an old one stays as it was),
                // unless it is one the service hosted before it stopped:
                // the next start tries it again.
                if !keep_mark_on_failure {
                    let _ = std::fs::remove_file(&mark);
                }
                return Err(e.into());
            }
        };
        let Some(journal) = reservation.journal.take() else {
            return Err(HostError::Invalid("a start without its journal".into()));
        };
        let events_before = journal.count();
        let (leave, left) = mpsc::channel(1);
        self.slots().insert(
            id.clone(),
            Slot::Running(Hosted {
                inputs: run.inputs.clone(),
                leave,
                mark: journal.watch(),
                events_before,
            }),
        );
        reservation.armed = false;
        let host = self.clone();
        self.inner
            .tasks
            .spawn(async move { host.drive(run, journal, left).await });
        Ok(Started {
            id,
            resumed,
            events_before,
        })
    }

    /// Carries one run's events to its journal until it ends, and ends it:
    /// its result written, its mark and slot taken away.
    async fn drive(self, mut run: Run, mut journal: Journal, mut left: mpsc::Receiver<String>) {
        let started = Instant::now();
        let id = run.id.clone();
        let ended = loop {
            tokio::select! {
                biased;
                Some(e) = run.events.recv() => write(&mut journal, &e),
                res = &mut run.task => {
                    while let Ok(e) = run.events.try_recv() {
                        write(&mut journal, &e);
                    }
                    break res;
                }
                Some(why) = left.recv() => run.leave(why),
                () = self.inner.stop.cancelled() => {
                    // As if killed: the run's operations go on on their
                    // worker, its log and mark stay, and the next start
                    // of the service resumes it.
                    run.task.abort();
                    self.slots().remove(&id);
                    return;
                }
            }
        };
        let last = match ended {
            Ok(Ok(outcome)) => outcome.result_event(&id, started.elapsed()),
            Ok(Err(e)) => Event::Error {
                message: crate::client::source_chain(&e),
            },
            Err(e) => Event::Error {
                message: format!("the session's run failed: {e}"),
            },
        };
        write(&mut journal, &last);
        let _ = std::fs::remove_file(self.mark_path(&id));
        // Out of the table before watchers are told: a start right after
        // the last event finds the session free.
        self.slots().remove(&id);
        journal.close();
    }

    fn running(&self, id: &str) -> Result<Hosted, HostError> {
        match self.slots().get(id) {
            Some(Slot::Running(h)) => Ok(h.clone()),
            Some(Slot::Starting(_)) => Err(HostError::NotRunning(id.to_string())),
            None => {
                if self.inner.store.exists(id)? {
                    Err(HostError::NotRunning(id.to_string()))
                } else {
                    Err(HostError::NotFound(id.to_string()))
                }
            }
        }
    }

    /// A new input for a running session.
    pub async fn send(&self, id: &str, input_id: String, text: String) -> Result<(), HostError> {
        crate::session::log::check_id(id)?;
        if text.trim().is_empty() {
            return Err(HostError::Invalid("the input is empty".into()));
        }
        if text.len() > MAX_INPUT_BYTES {
            return Err(HostError::Invalid(format!(
                "the input is {} bytes; at most {MAX_INPUT_BYTES}",
                text.len()
            )));
        }
        let hosted = self.running(id)?;
        hosted
            .inputs
            .send(Inbox::Input { input_id, text })
            .await
            .map_err(|_| HostError::NotRunning(id.to_string()))
    }

    /// Stops a running session (or, `leave`, gives up on its calls).
    pub async fn stop(&self, id: &str, leave: bool) -> Result<(), HostError> {
        crate::session::log::check_id(id)?;
        let hosted = self.running(id)?;
        if leave {
            let _ = hosted
                .leave
                .try_send("left by a client without waiting for its calls".into());
            return Ok(());
        }
        hosted
            .inputs
            .send(Inbox::Stop(StopMode::Hard))
            .await
            .map_err(|_| HostError::NotRunning(id.to_string()))
    }

    /// Where a watcher of session `id` reads: its journal, and how far it
    /// is written when its run is hosted.
    pub fn watch(&self, id: &str) -> Result<(PathBuf, Option<watch::Receiver<Mark>>), HostError> {
        crate::session::log::check_id(id)?;
        let path = self.inner.store.events_path(id);
        let mark = match self.slots().get(id) {
            Some(Slot::Running(h)) => Some(h.mark.clone()),
            Some(Slot::Starting(mark)) => Some(mark.clone()),
            None => None,
        };
        if mark.is_none() && !path.exists() && !self.inner.store.exists(id)? {
            return Err(HostError::NotFound(id.to_string()));
        }
        Ok((path, mark))
    }

    /// The sessions (of `tenant` alone, when one is given).
    pub fn list(&self, tenant: Option<&str>) -> Result<Vec<Listed>, HostError> {
        let mut out = Vec::new();
        for listed in self.inner.store.list()? {
            if let Some(tenant) = tenant {
                let theirs = listed
                    .brief
                    .as_ref()
                    .ok()
                    .and_then(|b| b.config.as_ref())
                    .is_some_and(|c| c.tenant.as_deref() == Some(tenant));
                if !theirs {
                    continue;
                }
            }
            let run = match self.slots().get(&listed.id) {
                Some(Slot::Running(h)) => Some(h.events_before),
                // Its run has not written yet.
                Some(Slot::Starting(mark)) => Some(mark.borrow().count),
                None => None,
            };
            let events = journal::count_lines(&self.inner.store.events_path(&listed.id));
            let (model, sandbox_id, worker, turns) = match &listed.brief {
                Ok(s) => match &s.config {
                    Some(c) => (
                        c.model.clone(),
                        c.sandbox_id.to_string(),
                        c.worker.clone().unwrap_or_default(),
                        s.turns,
                    ),
                    None => Default::default(),
                },
                Err(_) => Default::default(),
            };
            out.push(Listed {
                id: listed.id,
                running: run.is_some(),
                run_events_after: run.unwrap_or(0),
                model,
                sandbox_id,
                worker,
                turns,
                events,
            });
        }
        Ok(out)
    }

    /// The worker a stored session was placed on.
    async fn worker_of(&self, id: &str) -> Result<crate::client::WorkerClient, HostError> {
        let config = self.inner.store.config_of(id)?;
        let fleet = &self.inner.fleet;
        let urls = fleet.urls().await.map_err(SessionError::from)?;
        Ok(fleet
            .connect_recorded(&urls, config.worker.as_deref(), config.worker_id.as_deref())
            .await
            .map_err(SessionError::from)?)
    }

    /// Copies session `id` up to `turn` into `new_id`, its files too.
    pub async fn fork(&self, id: &str, new_id: &str, turn: Option<u64>) -> Result<(), HostError> {
        crate::session::log::check_id(id)?;
        crate::session::log::check_id(new_id)?;
        if !self.inner.store.exists(id)? {
            return Err(HostError::NotFound(id.to_string()));
        }
        // The child's name is taken while it is made.
        let reservation = self.reserve(new_id, false)?;
        let worker = self.worker_of(id).await?;
        let forked = self
            .inner
            .store
            .fork_with_workspace(
                id,
                new_id,
                turn,
                worker,
                self.inner.defaults.telemetry.as_ref(),
            )
            .await;
        drop(reservation);
        forked?;
        Ok(())
    }

    /// Removes a session that is not running, and its sandbox (unless
    /// `keep_sandbox`).
    pub async fn remove(&self, id: &str, keep_sandbox: bool) -> Result<(), HostError> {
        crate::session::log::check_id(id)?;
        if !self.inner.store.exists(id)? {
            return Err(HostError::NotFound(id.to_string()));
        }
        let reservation = self.reserve(id, false)?;
        let stored = self.inner.store.open(id)?;
        let worker = match (keep_sandbox, stored.config().is_some()) {
            (false, true) => Some(self.worker_of(id).await?),
            _ => None,
        };
        self.inner.store.remove(stored, worker).await?;
        let _ = std::fs::remove_file(self.mark_path(id));
        drop(reservation);
        Ok(())
    }

    /// Sends `out` the session's /workspace as a tar stream of its
    /// contents: from its sandbox, or from where it was saved when the
    /// session is suspended.
    pub async fn export(&self, id: &str, out: mpsc::Sender<bytes::Bytes>) -> Result<(), HostError> {
        crate::session::log::check_id(id)?;
        if !self.inner.store.exists(id)? {
            return Err(HostError::NotFound(id.to_string()));
        }
        let saved = self.inner.store.saved_workspace(id);
        if saved.exists() {
            return send_file(&saved, out).await;
        }
        let config = self.inner.store.config_of(id)?;
        let worker = self.worker_of(id).await?;
        crate::transfer::get(
            &worker,
            &config.sandbox_id,
            corral_proto::ArchiveSpec::contents_of(corral_proto::limits::WORKSPACE_DIR),
            out,
            |_| {},
        )
        .await
        .map_err(|e| {
            HostError::Session(SessionError::Sandbox {
                sandbox: config.sandbox_id.clone(),
                error: e.to_string(),
                why: None,
            })
        })?;
        Ok(())
    }

    /// Stops hosting: every run's task is aborted (its session resumes at
    /// the next start), and new starts are refused. Returns once they are
    /// all gone.
    pub async fn shut_down(&self) {
        self.inner.stop.cancel();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// Resolves once the service is stopping.
    pub fn stopping(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.inner.stop.cancelled()
    }
}

/// Writes one event to the journal; a journal that cannot be written is
/// said (the run goes on: its log holds what happened).
fn write(journal: &mut Journal, e: &Event) {
    if let Err(err) = journal.append(&to_json_line(e)) {
        tracing::error!(path = %journal.path().display(), error = %err, "a session event could not be written");
    }
}

async fn send_file(path: &Path, out: mpsc::Sender<bytes::Bytes>) -> Result<(), HostError> {
    use tokio::io::AsyncReadExt;
    let io = |source| HostError::Io {
        what: path.display().to_string(),
        source,
    };
    let mut file = tokio::fs::File::open(path).await.map_err(io)?;
    loop {
        let mut buf = bytes::BytesMut::with_capacity(256 * 1024);
        let n = file.read_buf(&mut buf).await.map_err(io)?;
        if n == 0 {
            return Ok(());
        }
        if out.send(buf.freeze()).await.is_err() {
            return Ok(());
        }
    }
}

/// A directory only its owner reads, made if missing.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `bytes` to `path` (mode 0600), whole or not at all.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("json.partial");
    crate::session::log::durably(|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })
}

/// The request of a start: empty for a resume, else the `--request` JSON.
pub fn request_of(json: &str) -> Result<Option<SessionRequest>, HostError> {
    if json.trim().is_empty() {
        return Ok(None);
    }
    parse_request(json)
        .map(Some)
        .map_err(|e| HostError::Invalid(format!("request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::{EndpointRule, HostError, Settings};
    use crate::agent::OnSandboxLost;
    use crate::llm::Api;
    use crate::sessions::ReasoningEffort;
    use corral_proto::pb;

    #[test]
    fn settings_are_read_from_enums_and_from_an_earlier_clients_strings() {
        let typed = Settings {
            api: Some(Api::Chat),
            reasoning_effort: Some(ReasoningEffort::High),
            on_sandbox_lost: Some(OnSandboxLost::NewSandbox),
            ..Settings::default()
        };
        let wire = typed.to_pb();
        // Both the enums and, for a service of an earlier release, the strings.
        assert_eq!(wire.api_kind(), pb::ModelApi::Chat);
        assert_eq!(wire.api.as_deref(), Some("chat"));
        assert_eq!(wire.effort(), pb::ReasoningEffort::High);
        assert_eq!(wire.reasoning_effort.as_deref(), Some("high"));
        assert_eq!(wire.lost(), pb::OnSandboxLost::NewSandbox);
        assert_eq!(wire.on_sandbox_lost.as_deref(), Some("new_sandbox"));
        let read = Settings::from_pb(wire).unwrap();
        assert_eq!(read.api, Some(Api::Chat));
        assert_eq!(read.reasoning_effort, Some(ReasoningEffort::High));
        assert_eq!(read.on_sandbox_lost, Some(OnSandboxLost::NewSandbox));
        // An earlier client: strings only.
        let old = pb::RunSettings {
            api: Some("responses".into()),
            reasoning_effort: Some("low".into()),
            on_sandbox_lost: Some("fail".into()),
            ..Default::default()
        };
        let read = Settings::from_pb(old).unwrap();
        assert_eq!(read.api, Some(Api::Responses));
        assert_eq!(read.reasoning_effort, Some(ReasoningEffort::Low));
        assert_eq!(read.on_sandbox_lost, Some(OnSandboxLost::Fail));
        // The enum wins over a string that disagrees; nothing set is unset.
        let mut both = pb::RunSettings {
            api: Some("chat".into()),
            ..Default::default()
        };
        both.set_api_kind(pb::ModelApi::Responses);
        assert_eq!(Settings::from_pb(both).unwrap().api, Some(Api::Responses));
        let none = Settings::from_pb(pb::RunSettings::default()).unwrap();
        assert_eq!(
            (none.api, none.reasoning_effort, none.on_sandbox_lost),
            (None, None, None)
        );
        for bad in [
            pb::RunSettings {
                api: Some("grpc".into()),
                ..Default::default()
            },
            pb::RunSettings {
                reasoning_effort: Some("extreme".into()),
                ..Default::default()
            },
            pb::RunSettings {
                on_sandbox_lost: Some("retry".into()),
                ..Default::default()
            },
        ] {
            assert!(matches!(Settings::from_pb(bad), Err(HostError::Invalid(_))));
        }
    }

    #[test]
    fn settings_kept_in_a_mark_read_as_before() {
        // The mark of a run started by an earlier release.
        let old = r#"{"base_url":null,"api":"chat","api_key":null,"image":null,"reasoning_effort":"medium","heartbeat_ms":null,"grace_ms":null,"keep_sandbox":false,"on_sandbox_lost":"new_sandbox"}"#;
        let s: Settings = serde_json::from_str(old).unwrap();
        assert_eq!(s.api, Some(Api::Chat));
        assert_eq!(s.reasoning_effort, Some(ReasoningEffort::Medium));
        assert_eq!(s.on_sandbox_lost, Some(OnSandboxLost::NewSandbox));
        let again: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(
            again,
            serde_json::from_str::<serde_json::Value>(old).unwrap()
        );
    }

    #[test]
    fn endpoint_rules_match_the_parsed_address_not_its_text() {
        let loopback: EndpointRule = "http://127.0.0.1".parse().unwrap();
        assert!(loopback.allows("http://127.0.0.1:8080/v1"));
        assert!(!loopback.allows("http://127.0.0.1:8080@10.0.0.1/v1"));
        assert!(!loopback.allows("http://127.0.0.10:8080/v1"));
        assert!(!loopback.allows("https://127.0.0.1:8080/v1"));
        let one: EndpointRule = "https://api.example.com:8443/v1".parse().unwrap();
        assert!(one.allows("https://API.example.com:8443/v1"));
        assert!(one.allows("https://api.example.com:8443/v1/"));
        assert!(!one.allows("https://api.example.com:443/v1"));
        assert!(!one.allows("https://api.example.com:8443/v10"));
        assert!(!one.allows("https://api.example.com.evil.net:8443/v1"));
        assert!(
            "*".parse::<EndpointRule>()
                .unwrap()
                .allows("http://10.0.0.1/v1")
        );
        assert!("ftp://x".parse::<EndpointRule>().is_err());
        assert!("http://u:p@x".parse::<EndpointRule>().is_err());
    }
}
