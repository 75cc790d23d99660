//! The worker core: the set of sandboxes, their lifecycle, and recovery on
//! start. The gRPC service is a thin layer over this.
//!
//! Each sandbox has one slot in [`table`]: being made, running,
//! checkpointed, being restored, being removed; every change of its life
//! holds it there, so a call never finds a sandbox in transition unknown
//! (it waits for the change, or is told `busy`). The lifecycle is spread
//! along the files: [`create`] (creates, pool claims, the guard that undoes
//! a failed one), [`pools`], [`fork`], [`checkpoint`], [`sweep`] (idle,
//! lifetime, lost and orphans), [`drain`] (with what the worker reports),
//! [`adopt`] (a restart's reconciliation) and [`calls`] (what clients do
//! with a running sandbox).

mod adopt;
mod calls;
mod checkpoint;
mod create;
mod drain;
mod fork;
mod pools;
mod ports;
mod snapshot;
mod sweep;
mod table;
mod templates;
#[cfg(test)]
mod tests;
mod volumes;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corral_proto::{SandboxId, SandboxInfo, SandboxPolicy, SandboxSpec};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::docker::{self, Defaults, DockerRuntime};
use crate::error::{Result, WorkerError};
use crate::initbin::InitBinary;
use crate::runtime::Runtime;
use crate::sandbox::Sandbox;
use crate::state::StateDir;
pub(crate) use ports::PortTarget;
pub use ports::{ExposureInfo, PortsSettings};
use table::{Busy, Change, Lookup, State, Ticket};

/// How long a drain serves sandboxes before it removes what is left.
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(3600);

/// How long a new sandbox's supervisor has to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a call waits for a change of its sandbox (its making, its
/// restore, its removal) to end before it is told `busy`.
const BUSY_WAIT: Duration = Duration::from_secs(120);

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
    /// How the sandboxes' exposed ports are reached.
    pub ports: PortsSettings,
    /// The bounds of volumes.
    pub volumes: crate::volumes::VolumeSettings,
    /// The fleet's registry (`HOST:PORT`), through which templates reach
    /// every worker.
    pub registry: Option<String>,
    /// Most templates one tenant (or the operator) keeps here.
    pub max_templates: usize,
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
            ports: PortsSettings::default(),
            volumes: crate::volumes::VolumeSettings::default(),
            registry: None,
            max_templates: corral_proto::template::MAX_TEMPLATES,
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

/// Wall time as the worker counts it (ms since the epoch): the wall clock
/// at its start plus the monotonic time since. Sandboxes' ages, lifetimes
/// and the drain's deadline are measured on it, so a step of the wall
/// clock moves none of them, and tests drive them on paused time.
#[derive(Debug, Clone, Copy)]
struct Clock {
    wall_ms: i64,
    at: tokio::time::Instant,
}

impl Clock {
    fn start() -> Self {
        Self {
            wall_ms: crate::state::now_unix_ms(),
            at: tokio::time::Instant::now(),
        }
    }

    fn now_ms(&self) -> i64 {
        self.wall_ms
            .saturating_add(i64::try_from(self.at.elapsed().as_millis()).unwrap_or(i64::MAX))
    }
}

/// A cheap handle to the worker.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    runtime: Arc<dyn Runtime>,
    /// Builds images (`--allow-build`).
    builder: Option<Arc<crate::build::Builder>>,
    state: StateDir,
    /// Every sandbox, in the state of its life (see [`table`]).
    table: table::Table<Sandbox>,
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
    tracker: TaskTracker,
    shutdown: CancellationToken,
    egress: Arc<crate::proxy::Settings>,
    /// The sandbox defaults (what a spec that names nothing gets).
    defaults: Defaults,
    /// Warm pools, and the wake of their filler.
    pools: Mutex<Vec<crate::pool::Pool>>,
    pool_wake: tokio::sync::Notify,
    clock: Clock,
    ports_settings: PortsSettings,
    /// Signs exposed ports' tokens.
    ports_key: crate::ports::Key,
    /// Where the port listener is, once it listens.
    ports_url: std::sync::OnceLock<String>,
    /// The token private ports take (set by the server; unset: none).
    ports_token: std::sync::OnceLock<Option<String>>,
    /// Held while a checkpointed sandbox's kept exposures are changed,
    /// and while a restored sandbox takes them: one change at a time, and
    /// none lost to a restore.
    ports_files: tokio::sync::Mutex<()>,
    /// Its templates (built images kept by name).
    templates: crate::templates::Templates,
    /// Most templates one tenant keeps.
    max_templates: usize,
    /// Its volumes, and which sandboxes hold them.
    volumes: crate::volumes::Volumes,
    /// The fleet's registry of templates, if there is one.
    registry: Option<crate::registry::Registry>,
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

impl table::Occupant for Sandbox {
    fn holds_slot(&self) -> bool {
        !self.is_lost()
    }

    fn owner(&self) -> Option<String> {
        tenant_of(&self.spec)
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
        let init = InitBinary::locate(config.init_binary.as_deref())?;
        let docker = docker::connect(config.docker_host.as_deref()).await?;
        let builder = if config.policy.allow_build {
            Some(Arc::new(crate::build::Builder::new(
                docker.clone(),
                &config.state_dir,
                config.build.clone(),
                config.policy.clone(),
                config.defaults.image.clone(),
            )?))
        } else {
            None
        };
        let registry = config
            .registry
            .clone()
            .map(|a| crate::registry::Registry::new(docker.clone(), a));
        let runtime = DockerRuntime::new(docker, worker_id, init, config.defaults.clone())
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
        let runtime = runtime.with_uids(uids);
        runtime.prune_old_init_volumes().await;
        Self::start_on(config, state, Arc::new(runtime), builder, registry).await
    }

    /// Starts on `runtime`, with the state directory `state` taken (its
    /// worker id the runtime's): checks the configuration, reconciles, and
    /// starts the sweeps and the pools' filler.
    async fn start_on(
        config: WorkerConfig,
        state: StateDir,
        runtime: Arc<dyn Runtime>,
        builder: Option<Arc<crate::build::Builder>>,
        registry: Option<crate::registry::Registry>,
    ) -> Result<Self> {
        crate::policy::check_policy(&config.policy).map_err(WorkerError::Config)?;
        let default_image = config.defaults.image.clone();
        let default_limits = corral_proto::Limits {
            memory_bytes: config.defaults.memory_bytes,
            cpu_millis: config.defaults.cpu_millis,
            pids_limit: config.defaults.pids_limit,
        };
        let default_runtime = config.defaults.runtime.clone();
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
        let worker_id = runtime.worker_id().to_string();
        let docker_version = runtime.version().await;
        let state_drain = state.drain_deadline();
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
                table: table::Table::default(),
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
                tracker: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                egress: Arc::new(config.egress),
                defaults,
                pools: Mutex::new(
                    config
                        .pools
                        .into_iter()
                        .map(crate::pool::Pool::new)
                        .collect(),
                ),
                pool_wake: tokio::sync::Notify::new(),
                clock: Clock::start(),
                ports_key: crate::ports::Key::load_or_make(&config.state_dir)
                    .map_err(|e| WorkerError::state(&config.state_dir.join("ports.key"), e))?,
                ports_settings: config.ports,
                ports_url: std::sync::OnceLock::new(),
                ports_token: std::sync::OnceLock::new(),
                ports_files: tokio::sync::Mutex::new(()),
                templates: crate::templates::Templates::load(
                    config.state_dir.join("templates.json"),
                ),
                max_templates: config.max_templates.max(1),
                volumes: crate::volumes::Volumes::load(&config.state_dir, config.volumes),
                registry,
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
    /// Its templates.
    pub fn templates(&self) -> &crate::templates::Templates {
        &self.inner.templates
    }

    pub fn builder(&self) -> Option<Arc<crate::build::Builder>> {
        self.inner.builder.clone()
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
            state_root: self.inner.state.root(),
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

    /// What sandbox `id` is once no make or restore of it is under way
    /// (waited for up to [`BUSY_WAIT`], then `busy`).
    async fn settled(&self, id: &SandboxId) -> Result<Lookup<Sandbox>> {
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        loop {
            match self.inner.table.lookup(id) {
                Lookup::Busy(b) => wait(id, b, deadline).await?,
                found => return Ok(found),
            }
        }
    }

    /// Holds sandbox `id` (running or checkpointed) for `change` once no
    /// other change of it is under way.
    async fn hold(&self, id: &SandboxId, change: Change) -> Result<Ticket> {
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        loop {
            match self.inner.table.hold(id, change) {
                Ok(ticket) => return Ok(ticket),
                Err(Lookup::Busy(b)) => wait(id, b, deadline).await?,
                Err(other) => return Err(not_running(id, other)),
            }
        }
    }

    /// The running sandbox a client names (which keeps it from being idle).
    async fn sandbox(&self, id: &SandboxId) -> Result<Sandbox> {
        match self.settled(id).await? {
            Lookup::Running(sandbox) => {
                sandbox.touch();
                Ok(sandbox)
            }
            other => Err(not_running(id, other)),
        }
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

    /// Sandbox `id` as clients see it. One being restored is as it was
    /// saved until it runs; one being made is waited for.
    pub async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo> {
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        loop {
            if let Some(info) = self.inner.table.restoring(id) {
                return Ok(info);
            }
            return match self.inner.table.lookup(id) {
                Lookup::Running(sandbox) => {
                    sandbox.touch();
                    Ok(self.info_of(&sandbox))
                }
                Lookup::Checkpointed(info) => Ok(*info),
                Lookup::Busy(b) => {
                    wait(id, b, deadline).await?;
                    continue;
                }
                other => Err(not_running(id, other)),
            };
        }
    }

    /// Whose sandbox `id` is, if this worker has it or removed it lately:
    /// `Some(tenant)`, the tenant `None` for one made for no tenant.
    pub fn owner(&self, id: &SandboxId) -> Option<Option<String>> {
        self.inner.table.owner(id)
    }

    pub fn list_sandboxes(&self) -> Vec<SandboxInfo> {
        let (running, mut all): (Vec<Sandbox>, Vec<SandboxInfo>) = {
            let map = self.inner.table.lock();
            (
                map.running().map(|(_, s)| s.clone()).collect(),
                map.checkpointed().map(|(_, i)| i.clone()).collect(),
            )
        };
        all.extend(running.iter().map(|s| self.info_of(s)));
        all.sort_by(|a, b| (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id)));
        all
    }

    /// Removes a sandbox at a client's word. Returns whether it existed.
    pub async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool> {
        self.remove_sandbox(id, "a client removed it").await
    }

    /// Removes a sandbox (running or checkpointed; one being made or
    /// restored once that ends) and its container; its watchers and later
    /// calls naming it are told `why` at once. Returns whether it existed.
    async fn remove_sandbox(&self, id: &SandboxId, why: &'static str) -> Result<bool> {
        let ticket = match self.hold(id, Change::Removing).await {
            Ok(t) => t,
            Err(WorkerError::UnknownSandbox(_) | WorkerError::Removed { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        let container = match self.inner.table.remove(&ticket, why) {
            Some(State::Running(sandbox)) => {
                sandbox.close();
                sandbox.container_id.clone()
            }
            // Its checkpoint goes with its container.
            Some(State::Checkpointed(info) | State::Restoring(info)) => info.container_id.clone(),
            Some(State::Making | State::Removing) | None => {
                self.inner.table.release(ticket);
                return Ok(false);
            }
        };
        // The id stays held (a new sandbox of it waits) until its container
        // is gone; if removing it fails, the sweep takes the container.
        let removed = self.inner.runtime.remove_container(&container).await;
        // Its volumes are free once its container is gone (not before: it
        // could still write).
        if removed.is_ok() {
            self.inner.volumes.release(id);
        }
        let forgot = self.inner.state.remove(id);
        crate::proxy::remove(&self.egress_dir(id));
        if let Some(t) = &self.inner.traces {
            t.forget_sandbox(id);
        }
        self.inner.table.release(ticket);
        removed?;
        forgot?;
        info!(sandbox = %id, "sandbox destroyed");
        Ok(true)
    }

    /// Stops every actor and watcher (so open watch streams end and a
    /// gRPC server can drain). Sandboxes keep running: the next start of a
    /// worker on this state directory re-adopts them.
    pub async fn shutdown(&self) {
        // Pool members stay, as sandboxes do: having no record, they are
        // removed (and made anew) by the next start.
        self.inner.shutdown.cancel();
        self.inner.tracker.close();
        self.inner.volumes.unmount_idle().await;
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
        let ids = self.inner.table.lock().ids();
        for id in ids {
            if let Err(e) = self.remove_sandbox(&id, "its worker shut down").await {
                warn!(sandbox = %id, error = %e, "could not destroy sandbox");
            }
        }
        self.shutdown().await;
    }
}

/// Waits for change `b` of sandbox `id` to end, until `deadline`.
async fn wait(id: &SandboxId, b: Busy, deadline: tokio::time::Instant) -> Result<()> {
    let change = b.change;
    tokio::time::timeout_at(deadline, b.ended_now())
        .await
        .map_err(|_| WorkerError::Busy {
            id: id.to_string(),
            change: change.as_str(),
        })
}

/// The error for a call that needs sandbox `id` running and found it as
/// `found`.
fn not_running(id: &SandboxId, found: Lookup<Sandbox>) -> WorkerError {
    match found {
        Lookup::Checkpointed(_) => WorkerError::Checkpointed(id.to_string()),
        Lookup::Removed { why, .. } => WorkerError::Removed {
            id: id.to_string(),
            reason: why,
        },
        Lookup::Busy(b) => WorkerError::Busy {
            id: id.to_string(),
            change: b.change.as_str(),
        },
        Lookup::Running(_) | Lookup::Unknown => WorkerError::UnknownSandbox(id.to_string()),
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
