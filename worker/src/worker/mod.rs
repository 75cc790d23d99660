//! The worker core: the set of sandboxes, their lifecycle, and recovery on
//! start. The gRPC service is a thin layer over this.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corral_proto::init::OperationRecord;
use corral_proto::{
    OperationId, OperationSpec, SandboxId, SandboxInfo, SandboxPolicy, SandboxSpec, SandboxState,
    WorkerInfo,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::docker::{self, Defaults, DockerRuntime};
use crate::error::{Result, WorkerError};
use crate::initbin::InitBinary;
use crate::sandbox::Sandbox;
use crate::state::StateDir;

/// How long a drain serves sandboxes before it removes what is left.
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(3600);

/// How long a new sandbox's supervisor has to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub state_dir: PathBuf,
    pub worker_id: Option<String>,
    pub docker_host: Option<String>,
    pub init_binary: Option<PathBuf>,
    pub max_sandboxes: u32,
    pub defaults: Defaults,
    /// How often to look for containers of this worker that have no record
    /// (and remove them).
    pub sweep_interval: Duration,
    /// What sandboxes may be (the default refuses every loosening).
    pub policy: SandboxPolicy,
    /// Watchers per sandbox, and how long one may hold a sandbox back.
    pub sandbox_limits: crate::sandbox::Limits,
    /// Most watchers of all sandboxes at once.
    pub max_watchers: usize,
    /// The idle timeout of sandboxes that name none (`None`: they have none).
    pub default_idle_timeout: Option<Duration>,
    /// How long any sandbox may live, whatever it does (`None`: forever).
    pub max_lifetime: Option<Duration>,
    /// Start draining (see [`Worker::drain`]).
    pub drain: bool,
    /// How long a drain serves the sandboxes it found before it removes
    /// what is left.
    pub drain_deadline: Duration,
    /// The uids sandboxes' commands run as (`None`: the default for the
    /// engine, see [`crate::uids`]).
    pub sandbox_uids: Option<crate::uids::UidRange>,
    /// How sandboxes' egress proxies connect, and their bounds.
    pub egress: crate::proxy::Settings,
    /// Warm pools (`--pool`).
    pub pools: Vec<crate::pool::Template>,
    /// Export operations' spans to this OTLP/gRPC collector.
    pub otlp_endpoint: Option<String>,
    /// The bounds on builds, when the policy allows them.
    pub build: crate::build::BuildSettings,
}

impl WorkerConfig {
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            worker_id: None,
            docker_host: None,
            init_binary: None,
            max_sandboxes: 64,
            defaults: Defaults::default(),
            sweep_interval: Duration::from_secs(60),
            policy: SandboxPolicy::default(),
            sandbox_limits: crate::sandbox::Limits::default(),
            max_watchers: 4096,
            default_idle_timeout: None,
            max_lifetime: None,
            drain: false,
            drain_deadline: DEFAULT_DRAIN_DEADLINE,
            sandbox_uids: None,
            egress: crate::proxy::Settings::default(),
            pools: Vec::new(),
            otlp_endpoint: None,
            build: crate::build::BuildSettings::default(),
        }
    }
}

/// Returns the heap's free pages to the system. The allocator keeps what
/// a burst of sandboxes and their output freed, in one arena per thread
/// that used it: without this a worker stays at its peak (a gigabyte after
/// a heavy load) long after every sandbox is gone.
#[allow(unsafe_code)]
fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it
    // takes no pointer of ours and is safe to call from any thread.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}

/// The id of a worker that was given none (stored in its state directory
/// on first start, and kept): its host's name qualified by a digest of its
/// state directory's path, so that two workers on one host, say two users'
/// default ones (each its own home), never share an id. Their containers'
/// labels name the state directory besides (see `LABEL_STATE_DIR`).
fn default_worker_id(state_dir: &std::path::Path) -> String {
    let host: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        .take(40)
        .collect();
    let host = if host.is_empty() {
        "worker".to_string()
    } else {
        host
    };
    let canonical =
        |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    // FNV-1a: stable across builds and machines.
    let digest = canonical(state_dir)
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{host}-{:08x}", digest as u32)
}

/// A cheap handle to the worker.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    runtime: Arc<DockerRuntime>,
    /// Builds images (`--allow-build`).
    builder: Option<Arc<crate::build::Builder>>,
    state: StateDir,
    sandboxes: Mutex<HashMap<SandboxId, Sandbox>>,
    /// Serializes create and destroy per sandbox id.
    id_locks: Mutex<HashMap<SandboxId, Arc<tokio::sync::Mutex<()>>>>,
    /// Sandboxes being made: their slots are taken.
    creating: Mutex<usize>,
    max_sandboxes: u32,
    docker_version: String,
    policy: SandboxPolicy,
    default_image: String,
    default_runtime: Option<String>,
    /// The limits of a sandbox whose spec names none.
    default_limits: corral_proto::Limits,
    sandbox_limits: crate::sandbox::Limits,
    max_watchers: usize,
    default_idle_timeout: Option<Duration>,
    max_lifetime: Option<Duration>,
    /// When a drain removes what is left (ms since the epoch), while
    /// draining; watched by the health service.
    drain: tokio::sync::watch::Sender<Option<i64>>,
    drain_deadline: Duration,
    metrics: Arc<crate::metrics::WorkerMetrics>,
    /// Operations' spans, when exported.
    traces: Option<Arc<crate::telemetry::OpTraces>>,
    /// Why sandboxes removed lately were removed, so that their clients
    /// (a watch of one, a call naming one) are told, not only "unknown".
    removed: Mutex<Removed>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    egress: Arc<crate::proxy::Settings>,
    /// The sandbox defaults (what a spec that names nothing gets).
    defaults: Defaults,
    /// Checkpointed sandboxes (see [`Worker::checkpoint_sandbox`]): as
    /// they were when saved, their containers stopped; no slot held.
    checkpointed: Mutex<HashMap<SandboxId, SandboxInfo>>,
    /// Warm pools, and the wake of their filler.
    pools: Mutex<Vec<crate::pool::Pool>>,
    pool_wake: tokio::sync::Notify,
}

/// The reasons of the last [`Removed::KEPT`] removals.
#[derive(Default)]
struct Removed {
    /// Why, and whose it was (its tenant).
    why: HashMap<SandboxId, (&'static str, Option<String>)>,
    order: std::collections::VecDeque<SandboxId>,
}

impl Removed {
    const KEPT: usize = 4096;

    fn note(&mut self, id: SandboxId, why: &'static str, owner: Option<String>) {
        if self.why.insert(id.clone(), (why, owner)).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > Self::KEPT {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }
}

/// The tenant a sandbox was made for (see `TENANT_LABEL`).
fn tenant_of(spec: &SandboxSpec) -> Option<String> {
    spec.labels
        .get(corral_proto::sandbox::TENANT_LABEL)
        .cloned()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A slot taken by a sandbox being made, given back when the create ends
/// (by then a made sandbox is in the set and holds its slot there).
struct Slot<'a>(&'a Mutex<usize>);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut creating = lock(self.0);
        *creating = creating.saturating_sub(1);
    }
}

/// How a create was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// A new sandbox, its container made.
    Created,
    /// A warm pool's member, taken.
    Claimed,
    /// The sandbox was there already (a create is idempotent by id).
    Existing,
}

impl Worker {
    /// Connects to Docker, takes the state directory, finds the supervisor
    /// binary, then reconciles: re-adopts running sandboxes it has records
    /// for and removes containers it owns but has no record of.
    pub async fn start(config: WorkerConfig) -> Result<Self> {
        let state = StateDir::open(&config.state_dir)?;
        let worker_id = state.worker_id(config.worker_id.as_deref(), || {
            default_worker_id(&config.state_dir)
        })?;
        corral_proto::SandboxId::new(worker_id.clone())
            .map_err(|e| WorkerError::Config(format!("worker id {worker_id:?}: {e}")))?;
        crate::policy::check_policy(&config.policy).map_err(WorkerError::Config)?;
        let default_image = config.defaults.image.clone();
        let default_limits = corral_proto::Limits {
            memory_bytes: config.defaults.memory_bytes,
            cpu_millis: config.defaults.cpu_millis,
            pids_limit: config.defaults.pids_limit,
        };
        let default_runtime = config.defaults.runtime.clone();
        let init = InitBinary::locate(config.init_binary.as_deref())?;
        let docker = docker::connect(config.docker_host.as_deref()).await?;
        let defaults = config.defaults.clone();
        for t in &config.pools {
            let spec = t.spec();
            spec.validate()
                .map_err(|e| WorkerError::Config(format!("--pool {t}: {e}")))?;
            crate::policy::check(
                &config.policy,
                &spec,
                &defaults.image,
                defaults.runtime.as_deref(),
            )
            .map_err(|e| WorkerError::Config(format!("--pool {t}: {e}")))?;
        }
        let pool_size: u32 = config.pools.iter().map(|t| t.size).sum();
        if pool_size >= config.max_sandboxes {
            return Err(WorkerError::Config(format!(
                "--pool: {pool_size} members would take every one of --max-sandboxes {} slots",
                config.max_sandboxes
            )));
        }
        let builder = if config.policy.allow_build {
            Some(Arc::new(crate::build::Builder::new(
                docker.clone(),
                &config.state_dir,
                config.build.clone(),
                config.policy.clone(),
                default_image.clone(),
            )?))
        } else {
            None
        };
        let runtime = DockerRuntime::new(docker, worker_id.clone(), init, config.defaults)
            .with_state_dir(&config.state_dir);
        let uids = match config.sandbox_uids {
            Some(u) => u,
            None if runtime.remaps_uids().await => crate::uids::DEFAULT_REMAPPED,
            None => crate::uids::DEFAULT,
        };
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let overlaps = uids.host_overlaps(&read("/etc/passwd"), &read("/etc/subuid"));
        if !overlaps.is_empty() {
            return Err(WorkerError::Config(format!(
                "--sandbox-uids {uids} overlaps {}: give a range no host account holds",
                overlaps.join(", ")
            )));
        }
        let runtime = Arc::new(runtime.with_uids(uids));
        let docker_version = runtime.version().await;
        let state_drain = state.drain_deadline();
        runtime.prune_old_init_volumes().await;
        let traces = match &config.otlp_endpoint {
            Some(e) => Some(Arc::new(
                crate::telemetry::OpTraces::otlp(e, &config.state_dir)
                    .map_err(|e| WorkerError::Config(format!("--otlp-endpoint: {e}")))?,
            )),
            None => None,
        };
        let worker = Self {
            inner: Arc::new(Inner {
                runtime,
                state,
                sandboxes: Mutex::new(HashMap::new()),
                id_locks: Mutex::new(HashMap::new()),
                creating: Mutex::new(0),
                max_sandboxes: config.max_sandboxes,
                docker_version,
                policy: config.policy,
                default_image,
                default_runtime,
                default_limits,
                sandbox_limits: config.sandbox_limits,
                max_watchers: config.max_watchers,
                default_idle_timeout: config.default_idle_timeout,
                max_lifetime: config.max_lifetime,
                drain: tokio::sync::watch::Sender::new(state_drain),
                drain_deadline: config.drain_deadline,
                metrics: Arc::new(crate::metrics::WorkerMetrics::default()),
                traces,
                removed: Mutex::new(Removed::default()),
                tracker: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                egress: Arc::new(config.egress),
                defaults,
                checkpointed: Mutex::new(HashMap::new()),
                pools: Mutex::new(
                    config
                        .pools
                        .into_iter()
                        .map(crate::pool::Pool::new)
                        .collect(),
                ),
                pool_wake: tokio::sync::Notify::new(),
                builder,
            }),
        };
        worker.reconcile().await?;
        if config.drain {
            worker.drain(true)?;
        } else if let Some(deadline) = state_drain {
            info!(
                deadline_ms = deadline,
                "still draining (a drain survives restarts; end it with the Drain call)"
            );
        }
        let sweeper = worker.clone();
        let interval = config.sweep_interval;
        worker
            .inner
            .tracker
            .spawn(async move { sweeper.sweep_forever(interval).await });
        let reaper = worker.clone();
        worker
            .inner
            .tracker
            .spawn(async move { reaper.reap_idle_forever().await });
        if !lock(&worker.inner.pools).is_empty() {
            let filler = worker.clone();
            worker
                .inner
                .tracker
                .spawn(async move { filler.fill_pools_forever().await });
        }
        info!(worker_id, state_dir = %config.state_dir.display(), "worker started");
        Ok(worker)
    }

    pub fn id(&self) -> &str {
        self.inner.runtime.worker_id()
    }

    /// What builds images, when this worker's policy allows builds.
    pub fn builder(&self) -> Option<Arc<crate::build::Builder>> {
        self.inner.builder.clone()
    }

    async fn reconcile(&self) -> Result<()> {
        let inner = &self.inner;
        let records: HashMap<String, crate::state::SandboxRecord> = inner
            .state
            .load_all()?
            .into_iter()
            .map(|r| (r.id.clone(), r))
            .collect();
        let by_container: HashMap<String, String> = records
            .values()
            .filter_map(|r| r.container_id.clone().map(|c| (c, r.id.clone())))
            .collect();
        let mut adopted = std::collections::HashSet::new();
        for c in inner.runtime.list_owned().await? {
            let Some(cid) = c.id.clone() else { continue };
            // A claimed pool member's record names its container; its
            // label, the member it was.
            let sid = by_container
                .get(&cid)
                .cloned()
                .unwrap_or_else(|| docker::sandbox_label(&c));
            use bollard::models::ContainerSummaryStateEnum as State;
            let mut running = c.state == Some(State::RUNNING);
            let record = records.get(&sid);
            // A fork's parent, frozen when the worker went away.
            if c.state == Some(State::PAUSED) && record.is_some_and(|r| r.forking_from.is_none()) {
                match inner.runtime.unpause(&cid).await {
                    Ok(()) => {
                        info!(sandbox = %sid, "thawed a sandbox a fork had frozen");
                        running = true;
                    }
                    Err(e) => warn!(sandbox = %sid, error = %e, "could not thaw a paused sandbox"),
                }
            }
            match (record, SandboxId::new(sid.clone())) {
                (Some(record), Ok(id)) if running && record.forking_from.is_none() => {
                    info!(sandbox = %id, "re-adopting running sandbox");
                    if record.checkpointed {
                        // Restored by a worker that stopped before saying so.
                        let mut r = record.clone();
                        r.checkpointed = false;
                        inner.state.save(&r)?;
                    }
                    self.reattach(&id, record.spec.clone(), cid, record.created_at_unix_ms);
                    adopted.insert(sid);
                }
                (Some(record), Ok(id)) if record.checkpointed && record.forking_from.is_none() => {
                    info!(sandbox = %id, "keeping a checkpointed sandbox");
                    let image = record
                        .spec
                        .image
                        .clone()
                        .unwrap_or_else(|| inner.default_image.clone());
                    let info = SandboxInfo {
                        id: id.clone(),
                        spec: record.spec.clone(),
                        state: SandboxState::Checkpointed,
                        container_id: cid,
                        last_seq: 0,
                        running_operations: 0,
                        created_at_unix_ms: record.created_at_unix_ms,
                        last_used_unix_ms: 0,
                        worker_id: self.id().to_string(),
                        image,
                        limits: limits_of(&record.spec, inner.default_limits),
                    };
                    lock(&inner.checkpointed).insert(id, info);
                    adopted.insert(sid);
                }
                (record, _) => {
                    let why = if record.is_some_and(|r| r.forking_from.is_some()) {
                        "a fork's child whose copy did not finish"
                    } else if record.is_some() {
                        "stopped while the worker was away"
                    } else {
                        "no worker record"
                    };
                    info!(sandbox = %sid, container = %cid, why, "removing container");
                    inner.runtime.remove_container(&cid).await?;
                    if let Ok(id) = SandboxId::new(sid.clone()) {
                        crate::proxy::remove(&self.egress_dir(&id));
                    }
                }
            }
        }
        // Give adopted supervisors a moment to answer, so callers see them ready.
        let sandboxes: Vec<Sandbox> = lock(&inner.sandboxes).values().cloned().collect();
        for sb in sandboxes {
            if let Err(e) = sb.wait_ready(Duration::from_secs(10)).await {
                warn!(sandbox = %sb.id, error = %e, "adopted sandbox is not ready");
            }
        }
        for sid in records.keys().filter(|s| !adopted.contains(*s)) {
            if let Ok(id) = SandboxId::new(sid.clone()) {
                warn!(sandbox = %id, "sandbox record without a running container, dropped");
                inner.state.remove(&id)?;
                crate::proxy::remove(&self.egress_dir(&id));
            }
        }
        Ok(())
    }

    /// Removes, every `interval`, containers labelled as this worker's that
    /// have no record: leftovers of anything that went wrong, or containers
    /// made behind the worker's back. A sandbox being created has its record
    /// already, so it is never taken for an orphan.
    async fn sweep_forever(&self, interval: Duration) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(e) = self.sweep().await {
                warn!(error = %e, "orphan sweep failed");
            }
            give_back_memory();
        }
    }

    /// Removes, every second, the sandboxes that asked for an idle timeout
    /// and have had no client for that long.
    /// Why `s` is to be removed now, if it is: no client used it within
    /// its idle timeout (its own, else the worker's default), or it lived
    /// past its lifetime (its own, else the worker's; the shorter wins).
    fn expired(&self, s: &Sandbox, now_ms: i64) -> Option<&'static str> {
        let idle_limit = s
            .spec
            .idle_timeout_ms
            .map(Duration::from_millis)
            .or(self.inner.default_idle_timeout);
        if idle_limit.is_some_and(|limit| s.idle_for() >= limit) {
            return Some("no client used it within its idle timeout");
        }
        self.past_lifetime(&s.spec, s.created_at_unix_ms(), now_ms)
    }

    /// Why a sandbox of `spec` made at `created_ms` is to be removed now
    /// for its age, if it is: it lived past its lifetime (its own, else the
    /// worker's; the shorter wins). Checkpointed sandboxes too.
    fn past_lifetime(
        &self,
        spec: &SandboxSpec,
        created_ms: i64,
        now_ms: i64,
    ) -> Option<&'static str> {
        let lifetime = match (
            spec.ttl_ms.map(Duration::from_millis),
            self.inner.max_lifetime,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let age = Duration::from_millis(u64::try_from(now_ms - created_ms).unwrap_or(0));
        lifetime
            .is_some_and(|l| age >= l)
            .then_some("it lived past its lifetime")
    }

    /// Why checkpointed sandbox `id` is to be removed now, if it is.
    fn checkpoint_expired(
        &self,
        id: &SandboxId,
        now_ms: i64,
        drained: bool,
    ) -> Option<&'static str> {
        let checkpointed = lock(&self.inner.checkpointed);
        let info = checkpointed.get(id)?;
        if drained {
            return Some("the drain deadline passed");
        }
        self.past_lifetime(&info.spec, info.created_at_unix_ms, now_ms)
    }

    async fn reap_idle_forever(&self) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = shutdown.cancelled() => return,
            }
            let now = crate::state::now_unix_ms();
            let drained = self
                .inner
                .drain
                .borrow()
                .is_some_and(|deadline| now >= deadline);
            let mut expired: Vec<(SandboxId, &'static str)> = lock(&self.inner.sandboxes)
                .iter()
                .filter_map(|(id, s)| {
                    let why = if drained {
                        Some("the drain deadline passed")
                    } else {
                        self.expired(s, now)
                    };
                    why.map(|why| (id.clone(), why))
                })
                .collect();
            let checkpointed: Vec<SandboxId> =
                lock(&self.inner.checkpointed).keys().cloned().collect();
            expired.extend(checkpointed.into_iter().filter_map(|id| {
                let why = self.checkpoint_expired(&id, now, drained)?;
                Some((id, why))
            }));
            for (id, why) in expired {
                // Looked at again: a client may have come since.
                let still = drained
                    || lock(&self.inner.sandboxes)
                        .get(&id)
                        .is_some_and(|s| self.expired(s, now).is_some())
                    || self.checkpoint_expired(&id, now, false).is_some();
                if !still {
                    continue;
                }
                info!(sandbox = %id, why, "removing a sandbox");
                if let Err(e) = self.remove_sandbox(&id, why).await {
                    warn!(sandbox = %id, error = %e, "could not remove an idle sandbox");
                }
            }
        }
    }

    /// Sandboxes that will be removed when idle (the local worker stays
    /// while there are any).
    pub fn sandboxes_with_idle_timeout(&self) -> usize {
        lock(&self.inner.sandboxes)
            .values()
            .filter(|s| {
                s.spec.idle_timeout_ms.is_some()
                    || s.spec.ttl_ms.is_some()
                    || self.inner.default_idle_timeout.is_some()
                    || self.inner.max_lifetime.is_some()
            })
            .count()
    }

    async fn sweep(&self) -> Result<()> {
        // Lost sandboxes stay one interval, so clients can learn why; then
        // their container (if any is left) and record go.
        let lost: Vec<SandboxId> = lock(&self.inner.sandboxes)
            .iter()
            .filter(|(_, s)| s.is_lost())
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            info!(sandbox = %id, "removing a lost sandbox");
            self.remove_sandbox(&id, "it was lost").await?;
        }
        // Containers first, records second: a container seen here had its
        // record written before it was created, so a create racing with the
        // sweep is never mistaken for an orphan.
        let containers = self.inner.runtime.list_owned().await?;
        let all = self.inner.state.load_all()?;
        let claimed: std::collections::HashSet<String> =
            all.iter().filter_map(|r| r.container_id.clone()).collect();
        let records: std::collections::HashSet<String> = all.into_iter().map(|r| r.id).collect();
        for c in containers {
            let sid = docker::sandbox_label(&c);
            if records.contains(&sid)
                || c.id.as_ref().is_some_and(|cid| claimed.contains(cid))
                || lock(&self.inner.pools).iter().any(|p| p.holds(&sid))
            {
                continue;
            }
            if let Some(cid) = c.id {
                warn!(sandbox = %sid, container = %cid, "removing a container with no worker record");
                self.inner.runtime.remove_container(&cid).await?;
            }
        }
        Ok(())
    }

    fn env(&self) -> crate::sandbox::Env<'_> {
        crate::sandbox::Env {
            runtime: &self.inner.runtime,
            tracker: &self.inner.tracker,
            shutdown: &self.inner.shutdown,
            limits: self.inner.sandbox_limits,
            metrics: &self.inner.metrics,
            egress: &self.inner.egress,
            traces: self.inner.traces.as_ref(),
        }
    }

    fn egress_dir(&self, id: &SandboxId) -> std::path::PathBuf {
        crate::proxy::socket_dir(self.inner.state.root(), id)
    }

    /// The bound socket of a sandbox's egress proxy, if its spec has egress.
    fn egress_socket(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<Option<tokio::net::UnixListener>> {
        if !spec.has_egress_proxy() {
            return Ok(None);
        }
        let dir = self.egress_dir(id);
        crate::proxy::bind(&dir)
            .map(Some)
            .map_err(|e| WorkerError::state(&dir, e))
    }

    /// Replaces a sandbox's egress policy (bounded as at create): new
    /// connections follow it at once, open ones it no longer allows are
    /// closed. The record keeps it, so a restart does too.
    pub async fn set_sandbox_egress(
        &self,
        id: &SandboxId,
        rules: Vec<corral_proto::egress::Rule>,
    ) -> Result<SandboxInfo> {
        let mut asked = self.sandbox(id)?.spec.clone();
        asked.egress.clone_from(&rules);
        asked.validate()?;
        crate::policy::check_egress(&self.inner.policy, &rules)?;
        let id_lock = self.id_lock(id);
        let _guard = id_lock.lock().await;
        let mut sandbox = self.sandbox(id)?;
        if !sandbox.set_egress(rules) {
            return Err(WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                "egress",
                "this sandbox was made without egress, so it has no proxy: make it with egress rules (an empty list later blocks everything)",
            )));
        }
        let mut record = self
            .inner
            .state
            .load(id)
            .unwrap_or_else(|| StateDir::new_record(id, &sandbox.spec));
        record.spec = sandbox.spec.clone();
        record.created_at_unix_ms = sandbox.created_at_unix_ms;
        self.inner.state.save(&record)?;
        lock(&self.inner.sandboxes).insert(id.clone(), sandbox.clone());
        info!(sandbox = %id, rules = sandbox.spec.egress.len(), "egress policy replaced");
        Ok(self.info_of(&sandbox))
    }

    /// Forks sandbox `parent` into new sandboxes `ids` (see [`crate::fork`]):
    /// each has the parent's spec and a copy of its writable trees as they
    /// were at one instant; the parent's operations go on, the children
    /// start with none. Nothing is left of a fork that fails.
    pub async fn fork_sandbox(
        &self,
        parent: &SandboxId,
        ids: Vec<SandboxId>,
    ) -> Result<crate::fork::Forked> {
        // The worker's own task: a client that goes away mid-fork must not
        // leave the parent frozen or the children half-made.
        let this = self.clone();
        let parent_id = parent.clone();
        let forked = self
            .inner
            .tracker
            .spawn(async move { this.fork_inner(&parent_id, ids).await })
            .await
            .unwrap_or_else(|e| Err(WorkerError::Fork(format!("the fork's task failed: {e}"))));
        let m = &self.inner.metrics;
        match &forked {
            Ok(f) => {
                m.fork("forked");
                m.fork_frozen_seconds.observe(f.frozen.as_secs_f64());
            }
            Err(WorkerError::Fork(_)) => m.fork("failed"),
            Err(_) => m.fork("refused"),
        }
        forked
    }

    async fn fork_inner(
        &self,
        parent_id: &SandboxId,
        ids: Vec<SandboxId>,
    ) -> Result<crate::fork::Forked> {
        use crate::fork;
        let invalid = |why: &str| {
            WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                "fork",
                why.to_string(),
            ))
        };
        if ids.is_empty() || ids.len() > fork::MAX_CHILDREN {
            return Err(invalid(&format!(
                "a fork makes 1 to {} children",
                fork::MAX_CHILDREN
            )));
        }
        let unique: std::collections::HashSet<&SandboxId> = ids.iter().collect();
        if unique.len() != ids.len() || unique.contains(parent_id) {
            return Err(invalid(
                "the children's ids must differ from each other and from the parent's",
            ));
        }
        let parent = self.sandbox(parent_id)?;
        if parent.is_lost() {
            return Err(WorkerError::SandboxLost {
                id: parent_id.to_string(),
                reason: "it cannot be forked".into(),
            });
        }
        let runtime = &self.inner.runtime;
        let of_parent = runtime.process(&parent.container_id).await?;
        if let Some(why) = fork::unforkable(&of_parent)
            .or_else(|| fork::out_of_sight(&of_parent, &parent.container_id))
        {
            return Err(WorkerError::NotApplicable(why));
        }
        for id in &ids {
            if !matches!(
                self.sandbox(id),
                Err(WorkerError::UnknownSandbox(_) | WorkerError::Removed { .. })
            ) {
                return Err(WorkerError::Conflict {
                    what: "sandbox",
                    id: id.to_string(),
                });
            }
        }
        // The children, before the parent is frozen: made (or claimed from
        // a pool) at once.
        let made = futures_util::future::join_all(ids.iter().map(|id| {
            self.create_sandbox_inner(Some(id.clone()), parent.spec.clone(), Some(parent_id))
        }))
        .await;
        let mut children = Vec::new();
        let mut failed = None;
        for (id, m) in ids.iter().zip(made) {
            match m {
                Ok((info, Made::Created | Made::Claimed)) => children.push(info),
                Ok((_, Made::Existing)) => {
                    failed.get_or_insert(WorkerError::Conflict {
                        what: "sandbox",
                        id: id.to_string(),
                    });
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let undo = |children: Vec<SandboxInfo>| async move {
            for c in children {
                if let Err(e) = self.remove_sandbox(&c.id, "its fork failed").await {
                    warn!(sandbox = %c.id, error = %e, "could not remove a failed fork's child");
                }
            }
        };
        if let Some(e) = failed {
            undo(children).await;
            return Err(e);
        }
        // Their records name the parent until the copy is done: a worker
        // that restarts before then removes them.
        let done = || -> Result<()> {
            for c in &children {
                let Ok(id) = SandboxId::new(c.id.clone()) else {
                    continue;
                };
                if let Some(mut r) = self.inner.state.load(&id) {
                    r.forking_from = None;
                    self.inner.state.save(&r)?;
                }
            }
            Ok(())
        };
        let copied = self
            .fork_copy(&parent, &children)
            .await
            .and_then(|c| done().map(|()| c));
        match copied {
            Ok((frozen, copied)) => {
                info!(
                    sandbox = %parent_id,
                    children = children.len(),
                    frozen_ms = frozen.as_secs_f64() * 1000.0,
                    entries = copied.entries,
                    bytes = copied.bytes,
                    "sandbox forked"
                );
                Ok(fork::Forked {
                    children,
                    frozen,
                    copied,
                })
            }
            Err(e) => {
                undo(children).await;
                Err(e)
            }
        }
    }

    /// A fork's copies: the parent frozen into the first child, then the
    /// first child into the others. How long the parent was frozen.
    async fn fork_copy(
        &self,
        parent: &Sandbox,
        children: &[SandboxInfo],
    ) -> Result<(Duration, corral_init::treecopy::Copied)> {
        let runtime = &self.inner.runtime;
        let helper = runtime.init_path().to_path_buf();
        let mut procs = Vec::new();
        for c in children {
            procs.push(runtime.process(&c.container_id).await?);
        }
        // Not removed (nor forked again) while it is frozen.
        let id_lock = self.id_lock(&parent.id);
        let _guard = id_lock.lock().await;
        let of_parent = runtime.process(&parent.container_id).await?;
        if let Some(why) = crate::fork::unforkable(&of_parent) {
            return Err(WorkerError::NotApplicable(why));
        }
        let started = std::time::Instant::now();
        runtime.pause(&parent.container_id).await?;
        let first = crate::fork::copy(&helper, &of_parent, &procs[0]).await;
        let mut thawed = runtime.unpause(&parent.container_id).await;
        let frozen = started.elapsed();
        for _ in 0..10 {
            let Err(e) = &thawed else { break };
            warn!(sandbox = %parent.id, error = %e, "could not thaw a forked sandbox; trying again");
            tokio::time::sleep(Duration::from_millis(100)).await;
            thawed = runtime.unpause(&parent.container_id).await;
        }
        thawed?;
        let copied = first?;
        let rest = futures_util::future::join_all(
            procs[1..]
                .iter()
                .map(|p| crate::fork::copy(&helper, &procs[0], p)),
        )
        .await;
        for r in rest {
            r?;
        }
        Ok((frozen, copied))
    }

    fn id_lock(&self, id: &SandboxId) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.inner.id_locks)
            .entry(id.clone())
            .or_default()
            .clone()
    }

    /// The sandbox a client names (which keeps it from being idle).
    fn sandbox(&self, id: &SandboxId) -> Result<Sandbox> {
        let found = lock(&self.inner.sandboxes).get(id).cloned();
        let Some(sandbox) = found else {
            if lock(&self.inner.checkpointed).contains_key(id) {
                return Err(WorkerError::Checkpointed(id.to_string()));
            }
            return Err(match lock(&self.inner.removed).why.get(id) {
                Some((why, _)) => WorkerError::Removed {
                    id: id.to_string(),
                    reason: why,
                },
                None => WorkerError::UnknownSandbox(id.to_string()),
            });
        };
        sandbox.touch();
        Ok(sandbox)
    }

    /// Creates a sandbox, or returns the existing one with this id and spec.
    pub async fn create_sandbox(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
    ) -> Result<SandboxInfo> {
        self.create_sandbox_traced(id, spec, None).await
    }

    /// [`Self::create_sandbox`] under the W3C trace context
    /// `traceparent`: with `--otlp-endpoint`, a span of the create (made,
    /// claimed from a pool, or there already) is made there.
    pub async fn create_sandbox_traced(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
        traceparent: Option<String>,
    ) -> Result<SandboxInfo> {
        let started = std::time::Instant::now();
        let began = std::time::SystemTime::now();
        let made = self.create_sandbox_inner(id, spec, None).await;
        if let (Some(t), Some(parent)) = (&self.inner.traces, &traceparent) {
            let how = match &made {
                Ok((_, Made::Created)) => "created",
                Ok((_, Made::Claimed)) => "claimed",
                Ok((_, Made::Existing)) => "existing",
                Err(_) => "failed",
            };
            let sandbox = made.as_ref().ok().map(|(info, _)| info.id.to_string());
            t.sandbox_span(parent, "create", began, how, sandbox.as_deref());
        }
        let m = &self.inner.metrics;
        match &made {
            Ok((_, Made::Created | Made::Claimed)) => {
                m.sandbox_create("created");
                m.sandbox_create_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
            Ok((_, Made::Existing)) => {}
            Err(WorkerError::AtCapacity(_)) => m.sandbox_create("at_capacity"),
            Err(WorkerError::Draining) => m.sandbox_create("draining"),
            Err(
                WorkerError::Invalid(_) | WorkerError::Denied { .. } | WorkerError::Conflict { .. },
            ) => m.sandbox_create("refused"),
            Err(_) => m.sandbox_create("failed"),
        }
        made.map(|(info, _)| info)
    }

    /// [`Self::create_sandbox`], and whether a new one was made;
    /// `forking_from` is the parent of a fork's child (kept in its record
    /// until the fork is done).
    async fn create_sandbox_inner(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
        forking_from: Option<&SandboxId>,
    ) -> Result<(SandboxInfo, Made)> {
        spec.validate()?;
        crate::policy::check(
            &self.inner.policy,
            &spec,
            &self.inner.default_image,
            self.inner.default_runtime.as_deref(),
        )?;
        if self.inner.shutdown.is_cancelled() {
            return Err(WorkerError::ShuttingDown);
        }
        let id = id.unwrap_or_else(SandboxId::random);
        let id_lock = self.id_lock(&id);
        let _guard = id_lock.lock().await;
        // A checkpointed sandbox holds its id as a running one does.
        let existing = match self.sandbox(&id) {
            Ok(sb) => Some((sb.spec.clone(), sb.info())),
            Err(WorkerError::Checkpointed(_)) => self
                .get_sandbox(&id)
                .ok()
                .map(|info| (info.spec.clone(), info)),
            Err(_) => None,
        };
        if let Some((existing, info)) = existing {
            return if existing == spec {
                Ok((info, Made::Existing))
            } else {
                Err(WorkerError::Conflict {
                    what: "sandbox",
                    id: id.to_string(),
                })
            };
        }
        // The same create again is answered above; a new one is not.
        if self.inner.drain.borrow().is_some() {
            return Err(WorkerError::Draining);
        }
        // A warm member of a pool whose template this matches, if one is
        // ready.
        if let Some(made) = self.claim(&id, &spec, forking_from).await? {
            return Ok((made, Made::Claimed));
        }
        let _slot = self.take_slot().await?;
        let mut record = StateDir::new_record(&id, &spec);
        record.forking_from = forking_from.map(ToString::to_string);
        self.inner.state.save(&record)?;
        let forget = |this: &Self| {
            let _ = this.inner.state.remove(&id);
            crate::proxy::remove(&this.egress_dir(&id));
        };
        // The proxy's socket is there before the container mounts its
        // directory.
        let egress = match self.egress_socket(&id, &spec) {
            Ok(e) => e,
            Err(e) => {
                forget(self);
                return Err(e);
            }
        };
        let egress_dir = egress.as_ref().map(|_| self.egress_dir(&id));
        let container = match self
            .inner
            .runtime
            .create(&id, &spec, egress_dir.as_deref())
            .await
        {
            Ok(c) => c,
            Err(e) => {
                forget(self);
                return Err(e);
            }
        };
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec,
            container.clone(),
            record.created_at_unix_ms,
            egress,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            sandbox.close();
            let _ = self.inner.runtime.remove_container(&container).await;
            forget(self);
            return Err(e);
        }
        info!(sandbox = %id, container = %container, "sandbox ready");
        lock(&self.inner.sandboxes).insert(id, sandbox.clone());
        Ok((self.info_of(&sandbox), Made::Created))
    }

    /// A slot for a sandbox about to run (a create, a restore), taken
    /// before its container is made or started: creates run concurrently,
    /// and each takes seconds. A lost sandbox (its container killed or
    /// removed behind the worker's back) holds none; the next sweep removes
    /// it. Pool members hold one each, and give it up to a sandbox that
    /// finds the worker full. Held until the sandbox is among the
    /// sandboxes (it holds its slot there).
    async fn take_slot(&self) -> Result<Slot<'_>> {
        let (slot, evicted) = {
            let sandboxes = lock(&self.inner.sandboxes);
            let mut creating = lock(&self.inner.creating);
            let mut pools = lock(&self.inner.pools);
            // Members still being made do not count here: one that is
            // done when the worker has no room for it is removed.
            let held: usize = pools.iter().map(|p| p.ready.len()).sum();
            let count = sandboxes.values().filter(|s| !s.is_lost()).count() + *creating + held;
            let mut evicted = None;
            if count >= self.inner.max_sandboxes as usize {
                evicted = pools.iter_mut().find_map(|p| p.ready.pop_front());
                if evicted.is_none() {
                    return Err(WorkerError::AtCapacity(self.inner.max_sandboxes));
                }
            }
            *creating += 1;
            (Slot(&self.inner.creating), evicted)
        };
        if let Some(m) = evicted {
            info!(member = %m.id, "a pool member gives its slot");
            self.discard_member(m).await;
        }
        Ok(slot)
    }

    /// A pool's ready member made into sandbox `id` with `spec`, if a pool
    /// matches and has one (`None`: made cold). The member's container,
    /// started and answering, gets the sandbox's record and a new actor;
    /// its commands get the spec's environment from the worker.
    async fn claim(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        forking_from: Option<&SandboxId>,
    ) -> Result<Option<SandboxInfo>> {
        let (member, dead) = {
            let mut pools = lock(&self.inner.pools);
            let Some(pool) = pools
                .iter_mut()
                .find(|p| p.template.matches(spec, &self.inner.defaults))
            else {
                return Ok(None);
            };
            let mut dead = Vec::new();
            let mut found = None;
            while let Some(m) = pool.ready.pop_front() {
                if m.sandbox.is_lost() {
                    dead.push(m);
                } else {
                    found = Some(m);
                    break;
                }
            }
            match &found {
                Some(_) => pool.claims += 1,
                None => pool.misses += 1,
            }
            let label = pool.template.to_string();
            self.inner.metrics.pool_claimed(&label, found.is_some());
            (found, dead)
        };
        // Its slot, from the pool's to this sandbox's, held until it is
        // among the sandboxes.
        let slot = member.as_ref().map(|_| {
            *lock(&self.inner.creating) += 1;
            Slot(&self.inner.creating)
        });
        for m in dead {
            self.discard_member(m).await;
        }
        self.inner.pool_wake.notify_one();
        let Some(member) = member else {
            return Ok(None);
        };
        let container = member.sandbox.container_id.clone();
        member.sandbox.close();
        let mut record = StateDir::new_record(id, spec);
        record.container_id = Some(container.clone());
        record.forking_from = forking_from.map(ToString::to_string);
        let forget = |this: &Self| {
            let _ = this.inner.state.remove(id);
            crate::proxy::remove(&this.egress_dir(id));
        };
        // The member's socket directory, mounted when it was made, is the
        // sandbox's under its id too (a link: the container's mount names
        // the member's, which must stay for the engine to start it again
        // from a checkpoint), and its proxy's socket is bound there if the
        // spec has egress; the sandbox's actor then has the supervisor
        // serve it.
        let egress = self.inner.state.save(&record).and_then(|()| {
            let dir = self.egress_dir(id);
            crate::proxy::remove(&dir);
            crate::proxy::link_dir(&dir, &member.id).map_err(|e| WorkerError::state(&dir, e))?;
            self.egress_socket(id, spec)
        });
        let egress = match egress {
            Ok(e) => e,
            Err(e) => {
                let _ = self.inner.runtime.remove_container(&container).await;
                crate::proxy::remove(&self.egress_dir(&member.id));
                forget(self);
                return Err(e);
            }
        };
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec.clone(),
            container.clone(),
            record.created_at_unix_ms,
            egress,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            warn!(sandbox = %id, member = %member.id, error = %e, "a claimed member did not answer; made cold instead");
            sandbox.close();
            let _ = self.inner.runtime.remove_container(&container).await;
            forget(self);
            return Ok(None);
        }
        info!(sandbox = %id, member = %member.id, container = %container, "sandbox ready, from a pool");
        lock(&self.inner.sandboxes).insert(id.clone(), sandbox.clone());
        drop(slot);
        Ok(Some(self.info_of(&sandbox)))
    }

    /// Removes a pool member (dead, evicted, or the pools emptied).
    async fn discard_member(&self, m: crate::pool::Member) {
        m.sandbox.close();
        if let Err(e) = self
            .inner
            .runtime
            .remove_container(&m.sandbox.container_id)
            .await
        {
            warn!(member = %m.id, error = %e, "could not remove a pool member");
        }
        crate::proxy::remove(&self.egress_dir(&m.id));
    }

    /// Keeps every pool at its size, as capacity allows: members that died
    /// are removed, new ones made one at a time (woken by claims, else
    /// every two seconds), never while draining or stopping.
    async fn fill_pools_forever(&self) {
        loop {
            self.fill_pools().await;
            tokio::select! {
                () = self.inner.shutdown.cancelled() => return,
                () = self.inner.pool_wake.notified() => {}
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    async fn fill_pools(&self) {
        let dead: Vec<crate::pool::Member> = {
            let mut pools = lock(&self.inner.pools);
            let mut dead = Vec::new();
            for p in pools.iter_mut() {
                let (gone, alive): (Vec<_>, Vec<_>) =
                    p.ready.drain(..).partition(|m| m.sandbox.is_lost());
                p.ready = alive.into();
                dead.extend(gone);
            }
            dead
        };
        for m in dead {
            warn!(member = %m.id, "a pool member died; it is replaced");
            self.discard_member(m).await;
        }
        loop {
            if self.inner.shutdown.is_cancelled() || self.inner.drain.borrow().is_some() {
                return;
            }
            // The next member: of the pool that lacks the most, if the
            // worker has a slot for it.
            let next = {
                let sandboxes = lock(&self.inner.sandboxes);
                let creating = lock(&self.inner.creating);
                let mut pools = lock(&self.inner.pools);
                let held: usize = pools.iter().map(crate::pool::Pool::held).sum();
                let count = sandboxes.values().filter(|s| !s.is_lost()).count() + *creating + held;
                if count >= self.inner.max_sandboxes as usize {
                    None
                } else {
                    pools
                        .iter_mut()
                        .enumerate()
                        .filter(|(_, p)| p.held() < p.template.size as usize)
                        .max_by_key(|(_, p)| p.template.size as usize - p.held())
                        .map(|(i, p)| {
                            let id = crate::pool::member_id();
                            p.filling.push(id.clone());
                            (i, id, p.template.spec())
                        })
                }
            };
            let Some((i, id, spec)) = next else { return };
            let started = std::time::Instant::now();
            let made = self.make_member(&id, spec).await;
            let unwanted = {
                let sandboxes = lock(&self.inner.sandboxes);
                let creating = lock(&self.inner.creating);
                let mut pools = lock(&self.inner.pools);
                pools[i].filling.retain(|f| f != &id);
                let held: usize = pools.iter().map(crate::pool::Pool::held).sum();
                let count = sandboxes.values().filter(|s| !s.is_lost()).count() + *creating + held;
                let pool = &mut pools[i];
                match made {
                    // Made while creates filled the worker: no room.
                    Ok(sandbox) if count >= self.inner.max_sandboxes as usize => {
                        Some(crate::pool::Member { id, sandbox })
                    }
                    Ok(sandbox) => {
                        pool.last_refill = Some(started.elapsed());
                        pool.ready.push_back(crate::pool::Member { id, sandbox });
                        self.inner
                            .metrics
                            .pool_refilled(&pool.template.to_string(), started.elapsed());
                        None
                    }
                    Err(e) => {
                        warn!(member = %id, error = %e, "could not make a pool member; trying again later");
                        return;
                    }
                }
            };
            if let Some(m) = unwanted {
                self.discard_member(m).await;
                return;
            }
        }
    }

    async fn make_member(&self, id: &SandboxId, spec: SandboxSpec) -> Result<Sandbox> {
        // A socket directory mounted from the start, empty: a claim that
        // asks for egress binds its proxy's socket there.
        let dir = self.egress_dir(id);
        let made = match crate::proxy::make_dir(&dir) {
            Ok(()) => self.inner.runtime.create(id, &spec, Some(&dir)).await,
            Err(e) => Err(WorkerError::state(&dir, e)),
        };
        let container = match made {
            Ok(c) => c,
            Err(e) => {
                crate::proxy::remove(&dir);
                return Err(e);
            }
        };
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec,
            container.clone(),
            crate::state::now_unix_ms(),
            None,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            sandbox.close();
            let _ = self.inner.runtime.remove_container(&container).await;
            crate::proxy::remove(&dir);
            return Err(e);
        }
        Ok(sandbox)
    }

    /// Removes every pool member (a drain, a shutdown that removes all).
    async fn empty_pools(&self) {
        let members: Vec<crate::pool::Member> = lock(&self.inner.pools)
            .iter_mut()
            .flat_map(|p| p.ready.drain(..).collect::<Vec<_>>())
            .collect();
        for m in members {
            self.discard_member(m).await;
        }
    }

    /// A new actor for sandbox `id` in its running container `container`
    /// (re-adopted, restored, or kept after a checkpoint failed), its
    /// proxy's socket bound again where its mount sees it; it attaches and
    /// replays the supervisor's journal, as after a worker restart.
    fn reattach(
        &self,
        id: &SandboxId,
        spec: SandboxSpec,
        container: String,
        created_at_unix_ms: i64,
    ) -> Sandbox {
        let egress = match self.egress_socket(id, &spec) {
            Ok(e) => e,
            Err(e) => {
                warn!(sandbox = %id, error = %e, "no egress socket for an adopted sandbox");
                None
            }
        };
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec,
            container,
            created_at_unix_ms,
            egress,
            &self.env(),
        );
        lock(&self.inner.sandboxes).insert(id.clone(), sandbox.clone());
        sandbox
    }

    /// Checkpoints a gVisor sandbox: its processes and memory (its files in
    /// gVisor's memory among them) are saved on the engine and its
    /// container stops. Until [`Self::restore_sandbox`] it runs nothing and
    /// holds no slot and no idle timeout removes it (its lifetime, counted
    /// from its creation, and a drain's deadline do), clients see it
    /// `checkpointed`, and calls that need it running are refused so.
    /// Only runsc sandboxes (runc would need CRIU), on an engine with its
    /// experimental features on. Checkpointing one that is already is
    /// answered as it is.
    pub async fn checkpoint_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo> {
        // Known first: no lock is kept for an id nobody has.
        let known = self.get_sandbox(id)?;
        if known.state == SandboxState::Checkpointed {
            return Ok(known);
        }
        let id_lock = self.id_lock(id);
        let _guard = id_lock.lock().await;
        let sandbox = match self.sandbox(id) {
            Err(WorkerError::Checkpointed(_)) => return self.get_sandbox(id),
            found => found?,
        };
        let mut info = self.info_of(&sandbox);
        if let SandboxState::Lost(reason) = info.state {
            return Err(WorkerError::SandboxLost {
                id: id.to_string(),
                reason,
            });
        }
        let runtime = sandbox
            .spec
            .runtime
            .clone()
            .or_else(|| self.inner.defaults.runtime.clone());
        if runtime.as_deref() != Some("runsc") {
            return Err(WorkerError::NotApplicable(format!(
                "sandbox {id} runs under {}: only gVisor sandboxes (runtime runsc) are checkpointed with their memory (runc would need CRIU)",
                runtime.as_deref().unwrap_or("the engine's default runtime")
            )));
        }
        // Nothing changes for a refusal.
        self.inner.runtime.checkpoints_supported().await?;
        // Recorded first: a worker that dies mid-checkpoint keeps what the
        // engine saved (one that finds it running clears the mark).
        let mut record = self
            .inner
            .state
            .load(id)
            .unwrap_or_else(|| StateDir::new_record(id, &sandbox.spec));
        record.spec = sandbox.spec.clone();
        record.checkpointed = true;
        self.inner.state.save(&record)?;
        // Set apart before its actor lets go (so the container's stop is
        // no loss): calls meanwhile are told it is checkpointed.
        info.state = SandboxState::Checkpointed;
        lock(&self.inner.sandboxes).remove(id);
        lock(&self.inner.checkpointed).insert(id.clone(), info.clone());
        sandbox.close();
        if let Err(e) = self.inner.runtime.checkpoint(&sandbox.container_id).await {
            warn!(sandbox = %id, error = %e, "checkpoint failed; the sandbox goes on");
            lock(&self.inner.checkpointed).remove(id);
            record.checkpointed = false;
            if let Err(e) = self.inner.state.save(&record) {
                warn!(sandbox = %id, error = %e, "could not clear a checkpoint's mark");
            }
            let again = self.reattach(
                id,
                sandbox.spec.clone(),
                sandbox.container_id.clone(),
                sandbox.created_at_unix_ms,
            );
            let _ = again.wait_ready(READY_TIMEOUT).await;
            return Err(e);
        }
        info!(sandbox = %id, "sandbox checkpointed");
        Ok(info)
    }

    /// Starts a checkpointed sandbox from its checkpoint: its processes go
    /// on where they stood, its memory as it was; its operations' events
    /// are replayed from its supervisor's journal. It takes a slot again
    /// (refused at capacity or while draining, and then stays
    /// checkpointed). Restoring one that runs is answered as it is.
    pub async fn restore_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo> {
        let known = self.get_sandbox(id)?;
        if known.state != SandboxState::Checkpointed {
            return Ok(known);
        }
        let id_lock = self.id_lock(id);
        let _guard = id_lock.lock().await;
        let Some(info) = lock(&self.inner.checkpointed).get(id).cloned() else {
            return self.get_sandbox(id);
        };
        if self.inner.drain.borrow().is_some() {
            return Err(WorkerError::Draining);
        }
        let slot = self.take_slot().await?;
        self.inner.runtime.restore(&info.container_id).await?;
        // Running again: whatever else fails, it is among the sandboxes.
        lock(&self.inner.checkpointed).remove(id);
        if let Some(mut record) = self.inner.state.load(id) {
            record.checkpointed = false;
            if let Err(e) = self.inner.state.save(&record) {
                warn!(sandbox = %id, error = %e, "could not clear a restored sandbox's checkpoint mark");
            }
        }
        let sandbox = self.reattach(
            id,
            info.spec.clone(),
            info.container_id.clone(),
            info.created_at_unix_ms,
        );
        drop(slot);
        sandbox.wait_ready(READY_TIMEOUT).await?;
        info!(sandbox = %id, "sandbox restored");
        Ok(self.info_of(&sandbox))
    }

    /// A sandbox as clients see it: with its worker and its image.
    fn info_of(&self, sandbox: &Sandbox) -> SandboxInfo {
        let mut info = sandbox.info();
        info.worker_id = self.id().to_string();
        info.image = info
            .spec
            .image
            .clone()
            .unwrap_or_else(|| self.inner.default_image.clone());
        info.limits = limits_of(&info.spec, self.inner.default_limits);
        info
    }

    pub fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo> {
        match self.sandbox(id) {
            Err(WorkerError::Checkpointed(_)) => lock(&self.inner.checkpointed)
                .get(id)
                .cloned()
                .ok_or_else(|| WorkerError::UnknownSandbox(id.to_string())),
            found => Ok(self.info_of(&found?)),
        }
    }

    /// Whose sandbox `id` is, if this worker has it or removed it lately:
    /// `Some(tenant)`, the tenant `None` for one made for no tenant.
    pub fn owner(&self, id: &SandboxId) -> Option<Option<String>> {
        if let Some(sandbox) = lock(&self.inner.sandboxes).get(id) {
            return Some(tenant_of(&sandbox.spec));
        }
        if let Some(info) = lock(&self.inner.checkpointed).get(id) {
            return Some(tenant_of(&info.spec));
        }
        lock(&self.inner.removed)
            .why
            .get(id)
            .map(|(_, owner)| owner.clone())
    }

    pub fn list_sandboxes(&self) -> Vec<SandboxInfo> {
        let sandboxes: Vec<Sandbox> = lock(&self.inner.sandboxes).values().cloned().collect();
        let mut all: Vec<SandboxInfo> = sandboxes.iter().map(|s| self.info_of(s)).collect();
        all.extend(lock(&self.inner.checkpointed).values().cloned());
        all.sort_by(|a, b| (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id)));
        all
    }

    /// Removes a sandbox and its container. Returns whether it existed.
    /// Removes a sandbox at a client's word.
    pub async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool> {
        self.remove_sandbox(id, "a client removed it").await
    }

    /// Removes a sandbox; its watchers and later calls naming it are told
    /// `why`.
    async fn remove_sandbox(&self, id: &SandboxId, why: &'static str) -> Result<bool> {
        let id_lock = self.id_lock(id);
        let _guard = id_lock.lock().await;
        let removed = lock(&self.inner.sandboxes).remove(id);
        let (container, owner) = match removed {
            Some(sandbox) => {
                sandbox.close();
                (sandbox.container_id.clone(), tenant_of(&sandbox.spec))
            }
            // Its checkpoint goes with its container.
            None => match lock(&self.inner.checkpointed).remove(id) {
                Some(info) => (info.container_id.clone(), tenant_of(&info.spec)),
                None => return Ok(false),
            },
        };
        lock(&self.inner.removed).note(id.clone(), why, owner);
        self.inner.runtime.remove_container(&container).await?;
        self.inner.state.remove(id)?;
        crate::proxy::remove(&self.egress_dir(id));
        if let Some(t) = &self.inner.traces {
            t.forget_sandbox(id);
        }
        lock(&self.inner.id_locks).remove(id);
        info!(sandbox = %id, "sandbox destroyed");
        Ok(true)
    }

    pub async fn submit(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        spec: OperationSpec,
    ) -> Result<OperationRecord> {
        self.submit_traced(sandbox, id, spec, None).await
    }

    /// [`Self::submit`], under the W3C trace context `traceparent`: with
    /// `--otlp-endpoint`, the operation's span is made there.
    pub async fn submit_traced(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<OperationRecord> {
        spec.validate()?;
        let sb = self.sandbox(sandbox)?;
        // The sandbox's environment, under the command's own, and its
        // proxy's under that: the container has them already, unless the
        // sandbox was a pool's member, made before anyone asked for it.
        let spec = match spec {
            OperationSpec::Shell(mut s) => {
                for (k, v) in &sb.spec.env {
                    s.env.entry(k.clone()).or_insert_with(|| v.clone());
                }
                if sb.has_egress() {
                    for (k, v) in crate::proxy::proxy_env() {
                        s.env.entry(k.to_string()).or_insert_with(|| v.to_string());
                    }
                }
                OperationSpec::Shell(s)
            }
            other => other,
        };
        sb.submit(id, spec, traceparent).await
    }

    /// What the sandbox uses now (about a second: see `GetSandboxStats`).
    pub async fn sandbox_stats(&self, id: &SandboxId) -> Result<corral_proto::SandboxStats> {
        let container = self.sandbox(id)?.info().container_id;
        let u = self.inner.runtime.stats(&container).await?;
        Ok(corral_proto::SandboxStats {
            sandbox_id: id.clone(),
            memory_bytes: u.memory_bytes,
            memory_limit_bytes: u.memory_limit_bytes,
            files_bytes: u.files_bytes.min(u.memory_bytes),
            cpu_percent: u.cpu_percent,
            cpu_total_ns: u.cpu_total_ns,
            pids: u32::try_from(u.pids).unwrap_or(u32::MAX),
            pids_limit: u32::try_from(u.pids_limit).unwrap_or(u32::MAX),
        })
    }

    pub fn list_operations(&self, sandbox: &SandboxId) -> Result<Vec<OperationRecord>> {
        Ok(self.sandbox(sandbox)?.operations())
    }

    pub fn operation(&self, sandbox: &SandboxId, id: &OperationId) -> Result<OperationRecord> {
        self.sandbox(sandbox)?
            .operation(id)
            .ok_or_else(|| WorkerError::UnknownOperation(id.to_string()))
    }

    /// Feeds input to an operation (see `WriteInput` in worker.proto).
    pub async fn write_input(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        offset: u64,
        data: bytes::Bytes,
        eof: bool,
    ) -> Result<crate::sandbox::InputReply> {
        if data.len() > corral_proto::limits::MAX_INPUT_CHUNK_BYTES {
            return Err(corral_proto::ProtocolError::invalid(
                "data",
                format!(
                    "{} bytes; at most {} in one call",
                    data.len(),
                    corral_proto::limits::MAX_INPUT_CHUNK_BYTES
                ),
            )
            .into());
        }
        let sb = self.sandbox(sandbox)?;
        let reply = sb.write_input(id, offset, data, eof).await;
        sb.touch();
        reply
    }

    pub async fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        size: corral_proto::TerminalSize,
    ) -> Result<()> {
        self.sandbox(sandbox)?.resize(id, size).await
    }

    /// Kills every process of a sandbox but its supervisor.
    pub async fn reset_sandbox(&self, sandbox: &SandboxId) -> Result<u32> {
        let killed = self.sandbox(sandbox)?.reset().await?;
        info!(sandbox = %sandbox, killed, "sandbox reset");
        Ok(killed)
    }

    /// Cancels an operation; true when it was running. Unknown or finished
    /// operations are left alone.
    pub async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool> {
        self.sandbox(sandbox)?.cancel(id.clone()).await
    }

    /// Sends `signal` (checked: 1-31) to a running command of `sandbox`.
    pub async fn signal(&self, sandbox: &SandboxId, id: &OperationId, signal: i32) -> Result<bool> {
        let signal = corral_proto::init::valid_signal(signal)?;
        self.sandbox(sandbox)?.signal(id.clone(), signal).await
    }

    pub fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<OperationId>,
    ) -> Result<crate::sandbox::Watch> {
        let sandbox = self.sandbox(sandbox)?;
        let total: usize = lock(&self.inner.sandboxes)
            .values()
            .map(Sandbox::watchers)
            .sum();
        if total >= self.inner.max_watchers {
            return Err(WorkerError::TooManyWatchers(format!(
                "this worker serves {total} watchers, its limit"
            )));
        }
        sandbox.watch(after_seq, only, &self.inner.tracker)
    }

    pub fn info(&self) -> WorkerInfo {
        let drain = *self.inner.drain.borrow();
        let sandboxes = lock(&self.inner.sandboxes);
        WorkerInfo {
            worker_id: self.id().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            max_sandboxes: self.inner.max_sandboxes,
            // As the capacity check counts: lost ones hold no slot, ones
            // being made do.
            sandboxes: (sandboxes.values().filter(|s| !s.is_lost()).count()
                + *lock(&self.inner.creating)) as u32,
            running_operations: sandboxes
                .values()
                .map(|s| s.running_operations() as u32)
                .sum(),
            docker_version: self.inner.docker_version.clone(),
            policy: self.inner.policy.clone(),
            draining: drain.is_some(),
            drain_deadline_ms: drain.map_or(0, |ms| u64::try_from(ms).unwrap_or(0)),
            default_image: self.inner.default_image.clone(),
            default_runtime: self.inner.default_runtime.clone(),
            pools: lock(&self.inner.pools).iter().map(Into::into).collect(),
            default_limits: self.inner.default_limits,
        }
    }

    /// Starts draining (`true`; again: the deadline stays) or ends it:
    /// see `Drain` in worker.proto. Recorded in the state directory, so a
    /// restarted worker goes on draining.
    pub fn drain(&self, on: bool) -> Result<WorkerInfo> {
        let now = crate::state::now_unix_ms();
        let current = *self.inner.drain.borrow();
        let next = match (on, current) {
            (true, Some(deadline)) => Some(deadline),
            (true, None) => Some(
                now + i64::try_from(self.inner.drain_deadline.as_millis()).unwrap_or(i64::MAX / 2),
            ),
            (false, _) => None,
        };
        if next != current {
            self.inner.state.set_drain_deadline(next)?;
            self.inner.drain.send_replace(next);
            match next {
                Some(deadline) => {
                    info!(
                        sandboxes = lock(&self.inner.sandboxes).len(),
                        deadline_ms = deadline,
                        "draining: no new sandboxes; the ones here are served until they end or the deadline passes"
                    );
                    // Nobody will claim the pools' members now.
                    let w = self.clone();
                    self.inner
                        .tracker
                        .spawn(async move { w.empty_pools().await });
                }
                None => {
                    info!("drain ended: taking new sandboxes again");
                    self.inner.pool_wake.notify_one();
                }
            }
        }
        Ok(self.info())
    }

    /// The worker's metrics, for those who count on its behalf (the
    /// server's admission of connections).
    pub fn metrics(&self) -> &crate::metrics::WorkerMetrics {
        &self.inner.metrics
    }

    /// The metrics' text exposition, with what the worker holds now.
    pub fn metrics_text(&self) -> String {
        let m = &self.inner.metrics;
        let sandboxes: Vec<Sandbox> = lock(&self.inner.sandboxes).values().cloned().collect();
        let mut by_state: std::collections::BTreeMap<&'static str, i64> =
            ["starting", "ready", "lost", "checkpointed"]
                .into_iter()
                .map(|s| (s, 0))
                .collect();
        let (mut running, mut watchers, mut journal) = (0i64, 0i64, 0i64);
        for s in &sandboxes {
            let info = s.info();
            let state = match info.state {
                SandboxState::Starting => "starting",
                SandboxState::Ready => "ready",
                SandboxState::Lost(_) => "lost",
                SandboxState::Checkpointed => "checkpointed",
            };
            *by_state.entry(state).or_default() += 1;
            running += i64::from(info.running_operations);
            watchers += s.watchers() as i64;
            journal += s.journal_bytes() as i64;
        }
        *by_state.entry("checkpointed").or_default() = lock(&self.inner.checkpointed).len() as i64;
        for (state, n) in by_state {
            m.sandboxes
                .get_or_create(&vec![("state", state.to_string())])
                .set(n);
        }
        m.capacity.set(i64::from(self.inner.max_sandboxes));
        for p in lock(&self.inner.pools).iter() {
            m.pool_state(&p.template.to_string(), p.template.size, p.ready.len());
        }
        m.running_operations.set(running);
        m.watchers.set(watchers);
        m.journal_bytes.set(journal);
        m.draining
            .set(i64::from(self.inner.drain.borrow().is_some()));
        m.render()
    }

    /// Counts output bytes streamed to a watcher.
    pub fn streamed(&self, bytes: usize) {
        self.inner.metrics.stream_bytes.inc_by(bytes as u64);
    }

    /// Whether the worker is shutting down (its sandboxes stay).
    pub fn shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Whether the worker drains now.
    pub fn draining(&self) -> bool {
        self.inner.drain.borrow().is_some()
    }

    /// Whether the worker drains (`Some(deadline ms)`), as it changes.
    pub fn drain_state(&self) -> tokio::sync::watch::Receiver<Option<i64>> {
        self.inner.drain.subscribe()
    }

    /// Stops every actor and watcher (so open watch streams end and a
    /// gRPC server can drain). Sandboxes keep running: the next start of a
    /// worker on this state directory re-adopts them.
    pub async fn shutdown(&self) {
        // Pool members stay, as sandboxes do: having no record, they are
        // removed (and made anew) by the next start.
        self.inner.shutdown.cancel();
        self.inner.tracker.close();
        if tokio::time::timeout(Duration::from_secs(5), self.inner.tracker.wait())
            .await
            .is_err()
        {
            warn!("some sandbox tasks did not stop within 5 s");
        }
        // The operations' spans made so far go out (the exporter's
        // connection is driven by the runtime meanwhile).
        if let Some(t) = self.inner.traces.clone() {
            let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
        }
    }

    /// Destroys every sandbox, then shuts down (the embedded worker's exit).
    pub async fn destroy_all_and_shutdown(&self) {
        self.empty_pools().await;
        let mut ids: Vec<SandboxId> = lock(&self.inner.sandboxes).keys().cloned().collect();
        ids.extend(lock(&self.inner.checkpointed).keys().cloned());
        for id in ids {
            if let Err(e) = self.remove_sandbox(&id, "its worker shut down").await {
                warn!(sandbox = %id, error = %e, "could not destroy sandbox");
            }
        }
        self.shutdown().await;
    }
}

/// The limits a sandbox of `spec` runs with: the spec's, else `defaults`.
fn limits_of(spec: &SandboxSpec, defaults: corral_proto::Limits) -> corral_proto::Limits {
    corral_proto::Limits {
        memory_bytes: spec.memory_bytes.unwrap_or(defaults.memory_bytes),
        cpu_millis: spec.cpu_millis.unwrap_or(defaults.cpu_millis),
        pids_limit: spec.pids_limit.unwrap_or(defaults.pids_limit),
    }
}
