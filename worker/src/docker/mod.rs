//! The Docker side of a sandbox, through the Engine API (bollard): the
//! supervisor volume, hardened containers, attach, inspect, removal.

use std::collections::HashMap;
use std::time::Duration;

use bollard::Docker;
use bollard::container::AttachContainerResults;
use bollard::models::{
    ContainerCreateBody, ContainerSummary, HostConfig, HostConfigLogConfig, Mount, MountType,
    VolumeCreateRequest,
};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use corral_proto::limits::{TMP_DIR, WORKSPACE_DIR};
use corral_proto::{NetworkMode, SandboxId, SandboxSpec};
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::error::{Result, WorkerError};
use crate::initbin::InitBinary;
use crate::uids::{LABEL_UID, UidRange};

mod checkpoint;
mod container;
mod init_volume;
pub mod snapshot;
mod usage;

pub use usage::{ContainerProcess, ContainerUsage};

/// Starts from a checkpoint tried again after the engine's spurious
/// "already exists" (see [`DockerRuntime::restore`]).
const RESTORE_TRIES: u32 = 5;

/// The name of a sandbox's checkpoint on the engine (one a container).
pub const CHECKPOINT: &str = "corral";

pub const LABEL_MANAGED: &str = "corral.managed";
pub const LABEL_WORKER: &str = "corral.worker";
pub const LABEL_SANDBOX: &str = "corral.sandbox";
/// The state directory of the worker that made a container: two workers
/// that happen to share an id (and an engine) never take each other's
/// containers for their own.
pub const LABEL_STATE_DIR: &str = "corral.state-dir";
/// Where the supervisor volume is mounted (read-only) in every sandbox.
pub const INIT_DIR: &str = "/.corral";
/// Where the supervisor writes the sandbox user's `passwd` and `group`
/// (a small tmpfs of its own; Corral's images link `/etc/passwd` there).
pub const USERS_DIR: &str = "/run/corral";

/// What of an image's own configuration a sandbox of it keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// Its WORKDIR, when it names one.
    pub workdir: Option<String>,
    /// It sets HOME.
    pub home: bool,
}

/// How old another build's supervisor volume must be before a worker's
/// start removes it.
const OLD_INIT_VOLUME: Duration = Duration::from_secs(7 * 24 * 3600);

/// Hardened defaults; a sandbox spec can change each one, explicitly.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub image: String,
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_limit: u32,
    pub workspace_bytes: u64,
    pub tmp_bytes: u64,
    /// OCI runtime of sandboxes that name none (`None`: the engine's).
    pub runtime: Option<String>,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            image: corral_proto::sandbox::DEFAULT_IMAGE.into(),
            memory_bytes: 1 << 30,
            cpu_millis: 1000,
            pids_limit: 256,
            workspace_bytes: 1 << 30,
            tmp_bytes: 256 << 20,
            runtime: None,
        }
    }
}

pub struct DockerRuntime {
    docker: Docker,
    worker_id: String,
    /// The worker's state directory, as its containers' labels name it.
    state_dir: String,
    init: InitBinary,
    pub defaults: Defaults,
    /// The uids sandboxes' commands run as, one each.
    uids: UidRange,
    init_volume_ready: Mutex<bool>,
}

/// Connects to the engine at `host` (`unix:///path` or `tcp://host:port`),
/// or where `DOCKER_HOST` / the default socket says, and checks it answers.
pub async fn connect(host: Option<&str>) -> Result<Docker> {
    let docker = match host {
        Some(h) if h.starts_with("unix://") || h.starts_with('/') => Docker::connect_with_unix(
            h.trim_start_matches("unix://"),
            120,
            bollard::API_DEFAULT_VERSION,
        )?,
        Some(h) => Docker::connect_with_http(h, 120, bollard::API_DEFAULT_VERSION)?,
        None => Docker::connect_with_defaults()?,
    };
    docker.ping().await?;
    Ok(docker)
}

fn is_not_found(e: &bollard::errors::Error) -> bool {
    matches!(
        e,
        bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// The sandbox id a container is labelled with ("" when it has none).
pub fn sandbox_label(c: &ContainerSummary) -> String {
    c.labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SANDBOX))
        .cloned()
        .unwrap_or_default()
}

pub fn container_name(worker_id: &str, id: &SandboxId) -> String {
    format!("corral-{worker_id}-{id}")
}

/// What the supervisor of a sandbox needs to run its commands as the
/// sandbox user and stop them (to change user, and to signal them), and to
/// do file operations for the sandbox user where a runtime ignores its
/// switch of filesystem user (gVisor): to write past permissions and give
/// what it made to that user. Under runc, that switch drops the file
/// capabilities while an operation runs. A command loses all of them when
/// it starts (it changes user, and with `no-new-privileges` cannot get them
/// back).
pub const SUPERVISOR_CAPABILITIES: &[&str] = &[
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_CHOWN",
];

fn cap_add(spec: &SandboxSpec) -> Option<Vec<String>> {
    let mut caps = spec.add_capabilities.clone();
    if !spec.run_as_root {
        for c in SUPERVISOR_CAPABILITIES {
            if !caps.iter().any(|x| x == c) {
                caps.push((*c).to_string());
            }
        }
    }
    (!caps.is_empty()).then_some(caps)
}

impl DockerRuntime {
    pub fn new(docker: Docker, worker_id: String, init: InitBinary, defaults: Defaults) -> Self {
        Self {
            docker,
            worker_id,
            state_dir: String::new(),
            init,
            defaults,
            uids: crate::uids::DEFAULT,
            init_volume_ready: Mutex::new(false),
        }
    }

    /// The range sandboxes' uids are taken from.
    pub fn with_uids(mut self, uids: UidRange) -> Self {
        self.uids = uids;
        self
    }

    pub fn uids(&self) -> UidRange {
        self.uids
    }

    /// Does the engine map container uids into a user namespace (rootless
    /// Docker, `userns-remap`)? Then only 0–65535 exist in containers.
    pub async fn remaps_uids(&self) -> bool {
        match self.docker.info().await {
            Ok(info) => info.security_options.unwrap_or_default().iter().any(|o| {
                o.split(',')
                    .any(|kv| kv == "name=rootless" || kv == "name=userns")
            }),
            Err(e) => {
                tracing::warn!(error = %e, "could not ask the engine whether it remaps uids");
                false
            }
        }
    }

    pub fn docker(&self) -> &Docker {
        &self.docker
    }

    /// Names the worker's state directory in the labels of what it makes.
    pub fn with_state_dir(mut self, dir: &std::path::Path) -> Self {
        self.state_dir = std::fs::canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf())
            .display()
            .to_string();
        self
    }

    /// The supervisor binary on this host (also the fork's copy helper).
    pub fn init_path(&self) -> &std::path::Path {
        &self.init.path
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    pub async fn attach(&self, container: &str) -> Result<AttachContainerResults> {
        let opts = AttachContainerOptionsBuilder::default()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .logs(false)
            .build();
        Ok(self.docker.attach_container(container, Some(opts)).await?)
    }

    /// Is the container running? `None` when it does not exist.
    pub async fn running(&self, container: &str) -> Result<Option<bool>> {
        match self.docker.inspect_container(container, None).await {
            Ok(info) => Ok(Some(info.state.and_then(|s| s.running).unwrap_or(false))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Why a container stopped, in words, from its state.
    pub async fn exit_reason(&self, container: &str) -> String {
        match self.docker.inspect_container(container, None).await {
            Ok(info) => {
                let s = info.state.unwrap_or_default();
                if s.oom_killed == Some(true) {
                    "the sandbox's supervisor was killed: out of memory".into()
                } else if let Some(err) = s.error.filter(|e| !e.is_empty()) {
                    format!("container stopped: {err}")
                } else {
                    format!(
                        "container stopped with exit code {}",
                        s.exit_code.unwrap_or(-1)
                    )
                }
            }
            Err(e) if is_not_found(&e) => "container removed".into(),
            Err(e) => format!("container state unknown: {e}"),
        }
    }

    /// Force-removes a container; absent is fine.
    pub async fn remove_container(&self, container: &str) -> Result<()> {
        let opts = RemoveContainerOptionsBuilder::default()
            .force(true)
            .v(true)
            .build();
        match self.docker.remove_container(container, Some(opts)).await {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409, ..
            }) => {
                // Removal already in progress.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Containers labelled as this worker's, running or not.
    pub async fn list_owned(&self) -> Result<Vec<ContainerSummary>> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_WORKER}={}", self.worker_id)],
        )]);
        let opts = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let all = self.docker.list_containers(Some(opts)).await?;
        // Made by a worker of this id with another state directory: not
        // ours to adopt or remove. (No label: made before labels named
        // the state directory, by this worker.)
        Ok(all
            .into_iter()
            .filter(|c| {
                let theirs = c
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(LABEL_STATE_DIR))
                    .is_some_and(|d| *d != self.state_dir);
                if theirs {
                    tracing::debug!(
                        container = c.id.as_deref().unwrap_or(""),
                        "a container of another worker with this worker's id; left alone"
                    );
                }
                !theirs
            })
            .collect())
    }

    pub async fn version(&self) -> String {
        self.docker
            .version()
            .await
            .ok()
            .and_then(|v| v.version)
            .unwrap_or_default()
    }
}
