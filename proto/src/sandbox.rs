//! What a worker says about its sandboxes and itself.

use crate::{ProtocolError, SandboxId, SandboxSpec, pb};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxState {
    /// Created; its supervisor has not answered yet.
    Starting,
    Ready,
    /// The container or its supervisor is gone, for the reason given.
    Lost(String),
    /// Its processes and memory are saved (gVisor) and its container is
    /// stopped, until it is restored.
    Checkpointed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxInfo {
    pub id: SandboxId,
    pub spec: SandboxSpec,
    pub state: SandboxState,
    pub container_id: String,
    /// Seq of the sandbox's last event (0: none yet).
    pub last_seq: u64,
    pub running_operations: u32,
    pub created_at_unix_ms: i64,
    /// When a client last used it (0: unknown).
    pub last_used_unix_ms: i64,
    /// The worker that owns it (empty: unknown).
    pub worker_id: String,
    /// The image it runs (empty: unknown).
    pub image: String,
    /// The limits it runs with: the spec's, or the worker's defaults.
    pub limits: Limits,
}

/// A sandbox's limits in force (each 0: not known).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_limit: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub worker_id: String,
    pub version: String,
    pub max_sandboxes: u32,
    pub sandboxes: u32,
    pub running_operations: u32,
    pub docker_version: String,
    pub policy: SandboxPolicy,
    /// Refusing new sandboxes while it serves the ones it has.
    pub draining: bool,
    /// When a drain removes what is left (ms since the epoch; 0: none).
    pub drain_deadline_ms: u64,
    /// The image of a sandbox that names none.
    pub default_image: String,
    /// The OCI runtime of a sandbox that names none (`None`: the engine's).
    pub default_runtime: Option<String>,
    /// Its warm pools.
    pub pools: Vec<PoolInfo>,
    /// The limits of a sandbox whose spec names none (each 0: not known).
    pub default_limits: Limits,
    /// Its port listener's URL (`None`: it has none).
    pub ports_url: Option<String>,
}

/// A warm pool as its worker shows it (see `PoolInfo` in worker.proto).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    pub template: String,
    pub image: String,
    /// Members it keeps now (with a ceiling, as demand asks).
    pub size: u32,
    /// Most it keeps as demand grows (0: its size, always).
    pub max_size: u32,
    pub ready: u32,
    pub claims: u64,
    pub misses: u64,
    pub last_refill_ms: u64,
    /// The template's own limits and runtime (`None`: the worker's default).
    pub memory_bytes: Option<u64>,
    pub cpu_millis: Option<u32>,
    pub pids_limit: Option<u32>,
    pub runtime: Option<String>,
}

impl PoolInfo {
    /// Whether a create of `spec` would take a member of this pool
    /// (`default_image`: the worker's), as far as a client can tell: the
    /// same image, limits and runtime, each given as the template gives
    /// it, and nothing fixed when a container is made. A spec that names a
    /// worker's default the template leaves unset is taken for another.
    pub fn fits(&self, spec: &crate::SandboxSpec, default_image: &str) -> bool {
        spec.network == crate::NetworkMode::None
            && !spec.run_as_root
            && !spec.writable_rootfs
            && spec.add_capabilities.is_empty()
            && !spec.memory_includes_files
            && spec.workspace_bytes.is_none()
            && spec.tmp_bytes.is_none()
            && spec.image.as_deref().unwrap_or(default_image) == self.image
            && spec.memory_bytes == self.memory_bytes
            && spec.cpu_millis == self.cpu_millis
            && spec.pids_limit == self.pids_limit
            && spec.runtime == self.runtime
    }
}

/// The image of a sandbox that names none, for every client: Corral's
/// Debian, with python3, pip, venv, git and a C toolchain
/// (deploy/images/build-debian.sh).
pub const DEFAULT_IMAGE: &str = "corral-debian:latest";

/// The label that names a sandbox's tenant: set by the worker from
/// [`TENANT_HEADER`] when a front door creates it for a tenant (never the
/// client's word), kept by its forks, and matched on every later call.
pub const TENANT_LABEL: &str = "corral.tenant";

/// The metadata a front door sends to a worker with each call it makes for
/// a tenant: the worker then answers for that tenant's sandboxes alone
/// (another's is NOT_FOUND, exactly as one that does not exist). A worker
/// trusts it from whoever holds its credentials, which, where a front door
/// is deployed, only the front door does.
pub const TENANT_HEADER: &str = "x-corral-tenant";

/// Whether `name` is a tenant's name: 1 to 63 characters of `[a-z0-9-]`,
/// starting with a letter or digit.
pub fn is_tenant_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

/// What a worker lets a sandbox be: its operator's choice, never a
/// client's. The default refuses every loosening, and has the default
/// ceilings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxPolicy {
    pub allow_root: bool,
    pub allow_writable_rootfs: bool,
    /// A network other than none.
    pub allow_network: bool,
    /// Capabilities a sandbox may add (`CAP_*`).
    pub allowed_capabilities: Vec<String>,
    /// Images a sandbox may name besides the worker's default: exact
    /// names, or prefixes ending in `*`.
    pub allowed_images: Vec<String>,
    pub allow_any_image: bool,
    /// OCI runtimes a sandbox may name besides the worker's default.
    pub allowed_runtimes: Vec<String>,
    /// The most a sandbox may ask for.
    pub ceilings: Ceilings,
    /// What a sandbox's egress rules must fall within (`--allow-egress`;
    /// `*`: any public destination). Empty: no egress.
    pub allowed_egress: Vec<crate::egress::Rule>,
    /// Images are built on request (`--allow-build`), and sandboxes may
    /// name them.
    pub allow_build: bool,
}

/// The most a sandbox may ask for: the operator's ceilings on its limits.
/// The working memory, the workspace and /tmp are each capped, so their
/// sum (the container's memory limit) is too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceilings {
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids: u32,
    pub workspace_bytes: u64,
    pub tmp_bytes: u64,
}

impl Default for Ceilings {
    /// 16 GiB of memory, 16 CPUs, 4,096 processes (an eighth of Linux's
    /// default `pid_max`), a 16 GiB workspace, 4 GiB of /tmp.
    fn default() -> Self {
        Self {
            memory_bytes: 16 << 30,
            cpu_millis: 16_000,
            pids: 4096,
            workspace_bytes: 16 << 30,
            tmp_bytes: 4 << 30,
        }
    }
}

impl From<SandboxPolicy> for pb::SandboxPolicy {
    fn from(p: SandboxPolicy) -> Self {
        Self {
            allow_root: p.allow_root,
            allow_writable_rootfs: p.allow_writable_rootfs,
            allow_network: p.allow_network,
            allowed_capabilities: p.allowed_capabilities,
            allowed_images: p.allowed_images,
            allow_any_image: p.allow_any_image,
            allowed_runtimes: p.allowed_runtimes,
            max_memory_bytes: p.ceilings.memory_bytes,
            max_cpu_millis: p.ceilings.cpu_millis,
            max_pids: p.ceilings.pids,
            max_workspace_bytes: p.ceilings.workspace_bytes,
            max_tmp_bytes: p.ceilings.tmp_bytes,
            allowed_egress: p.allowed_egress.iter().map(ToString::to_string).collect(),
            allow_build: p.allow_build,
        }
    }
}

impl From<pb::SandboxPolicy> for SandboxPolicy {
    fn from(p: pb::SandboxPolicy) -> Self {
        Self {
            allow_root: p.allow_root,
            allow_writable_rootfs: p.allow_writable_rootfs,
            allow_network: p.allow_network,
            allowed_capabilities: p.allowed_capabilities,
            allowed_images: p.allowed_images,
            allow_any_image: p.allow_any_image,
            allowed_runtimes: p.allowed_runtimes,
            ceilings: Ceilings {
                memory_bytes: p.max_memory_bytes,
                cpu_millis: p.max_cpu_millis,
                pids: p.max_pids,
                workspace_bytes: p.max_workspace_bytes,
                tmp_bytes: p.max_tmp_bytes,
            },
            // A worker's own words: a rule this build cannot read is left
            // out (what it shows is then narrower, never wider).
            allowed_egress: p
                .allowed_egress
                .iter()
                .filter_map(|r| r.parse().ok())
                .collect(),
            allow_build: p.allow_build,
        }
    }
}

impl From<SandboxInfo> for pb::Sandbox {
    fn from(s: SandboxInfo) -> Self {
        let (state, lost_reason) = match s.state {
            SandboxState::Starting => (pb::SandboxState::Starting, String::new()),
            SandboxState::Ready => (pb::SandboxState::Ready, String::new()),
            SandboxState::Lost(r) => (pb::SandboxState::Lost, r),
            SandboxState::Checkpointed => (pb::SandboxState::Checkpointed, String::new()),
        };
        Self {
            id: s.id.into(),
            spec: Some(s.spec.into()),
            state: state as i32,
            container_id: s.container_id,
            last_seq: s.last_seq,
            running_operations: s.running_operations,
            lost_reason,
            created_at_unix_ms: s.created_at_unix_ms,
            last_used_unix_ms: s.last_used_unix_ms,
            worker_id: s.worker_id,
            image: s.image,
            memory_bytes: s.limits.memory_bytes,
            cpu_millis: s.limits.cpu_millis,
            pids_limit: s.limits.pids_limit,
        }
    }
}

impl TryFrom<pb::Sandbox> for SandboxInfo {
    type Error = ProtocolError;
    fn try_from(s: pb::Sandbox) -> Result<Self, ProtocolError> {
        let state = match pb::SandboxState::try_from(s.state) {
            Ok(pb::SandboxState::Starting) => SandboxState::Starting,
            Ok(pb::SandboxState::Ready) => SandboxState::Ready,
            Ok(pb::SandboxState::Lost) => SandboxState::Lost(s.lost_reason),
            Ok(pb::SandboxState::Checkpointed) => SandboxState::Checkpointed,
            _ => {
                return Err(ProtocolError::invalid(
                    "state",
                    format!("unknown state {}", s.state),
                ));
            }
        };
        Ok(Self {
            id: SandboxId::new(s.id)?,
            spec: s.spec.unwrap_or_default().try_into()?,
            state,
            container_id: s.container_id,
            last_seq: s.last_seq,
            running_operations: s.running_operations,
            created_at_unix_ms: s.created_at_unix_ms,
            last_used_unix_ms: s.last_used_unix_ms,
            worker_id: s.worker_id,
            image: s.image,
            limits: Limits {
                memory_bytes: s.memory_bytes,
                cpu_millis: s.cpu_millis,
                pids_limit: s.pids_limit,
            },
        })
    }
}

impl From<WorkerInfo> for pb::WorkerInfo {
    fn from(i: WorkerInfo) -> Self {
        Self {
            worker_id: i.worker_id,
            version: i.version,
            max_sandboxes: i.max_sandboxes,
            sandboxes: i.sandboxes,
            running_operations: i.running_operations,
            docker_version: i.docker_version,
            policy: Some(i.policy.into()),
            draining: i.draining,
            drain_deadline_ms: i.drain_deadline_ms,
            default_image: i.default_image,
            default_runtime: i.default_runtime.unwrap_or_default(),
            default_memory_bytes: i.default_limits.memory_bytes,
            default_cpu_millis: i.default_limits.cpu_millis,
            default_pids_limit: i.default_limits.pids_limit,
            ports_url: i.ports_url.unwrap_or_default(),
            pools: i
                .pools
                .into_iter()
                .map(|p| pb::PoolInfo {
                    template: p.template,
                    image: p.image,
                    size: p.size,
                    max_size: p.max_size,
                    ready: p.ready,
                    claims: p.claims,
                    misses: p.misses,
                    last_refill_ms: p.last_refill_ms,
                    memory_bytes: p.memory_bytes,
                    cpu_millis: p.cpu_millis,
                    pids_limit: p.pids_limit,
                    runtime: p.runtime,
                })
                .collect(),
        }
    }
}

impl From<pb::WorkerInfo> for WorkerInfo {
    fn from(i: pb::WorkerInfo) -> Self {
        Self {
            worker_id: i.worker_id,
            version: i.version,
            max_sandboxes: i.max_sandboxes,
            sandboxes: i.sandboxes,
            running_operations: i.running_operations,
            docker_version: i.docker_version,
            policy: i.policy.map(Into::into).unwrap_or_default(),
            draining: i.draining,
            drain_deadline_ms: i.drain_deadline_ms,
            default_image: i.default_image,
            default_runtime: Some(i.default_runtime).filter(|r| !r.is_empty()),
            default_limits: Limits {
                memory_bytes: i.default_memory_bytes,
                cpu_millis: i.default_cpu_millis,
                pids_limit: i.default_pids_limit,
            },
            ports_url: Some(i.ports_url).filter(|u| !u.is_empty()),
            pools: i
                .pools
                .into_iter()
                .map(|p| PoolInfo {
                    template: p.template,
                    image: p.image,
                    size: p.size,
                    max_size: p.max_size,
                    ready: p.ready,
                    claims: p.claims,
                    misses: p.misses,
                    last_refill_ms: p.last_refill_ms,
                    memory_bytes: p.memory_bytes,
                    cpu_millis: p.cpu_millis,
                    pids_limit: p.pids_limit,
                    runtime: p.runtime.filter(|r| !r.is_empty()),
                })
                .collect(),
        }
    }
}

/// What a sandbox uses now (see `SandboxStats` in worker.proto).
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxStats {
    pub sandbox_id: SandboxId,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// Of `memory_bytes`, the tmpfs files'.
    pub files_bytes: u64,
    pub cpu_percent: f64,
    pub cpu_total_ns: u64,
    pub pids: u32,
    pub pids_limit: u32,
}

impl From<SandboxStats> for pb::SandboxStats {
    fn from(s: SandboxStats) -> Self {
        Self {
            sandbox_id: s.sandbox_id.into(),
            memory_bytes: s.memory_bytes,
            memory_limit_bytes: s.memory_limit_bytes,
            files_bytes: s.files_bytes,
            cpu_percent: s.cpu_percent,
            cpu_total_ns: s.cpu_total_ns,
            pids: s.pids,
            pids_limit: s.pids_limit,
        }
    }
}

impl TryFrom<pb::SandboxStats> for SandboxStats {
    type Error = ProtocolError;
    fn try_from(s: pb::SandboxStats) -> Result<Self, ProtocolError> {
        Ok(Self {
            sandbox_id: SandboxId::new(s.sandbox_id)?,
            memory_bytes: s.memory_bytes,
            memory_limit_bytes: s.memory_limit_bytes,
            files_bytes: s.files_bytes,
            cpu_percent: s.cpu_percent,
            cpu_total_ns: s.cpu_total_ns,
            pids: s.pids,
            pids_limit: s.pids_limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_fits_a_create_of_its_image_limits_and_runtime_only() {
        let pool = PoolInfo {
            template: "corral-debian:latest=4,memory=1g".into(),
            image: "corral-debian:latest".into(),
            size: 4,
            max_size: 0,
            ready: 4,
            claims: 0,
            misses: 0,
            last_refill_ms: 0,
            memory_bytes: Some(1 << 30),
            cpu_millis: None,
            pids_limit: None,
            runtime: None,
        };
        let spec = crate::SandboxSpec {
            image: Some("corral-debian:latest".into()),
            memory_bytes: Some(1 << 30),
            egress: crate::egress::parse_rules(&["pypi.org"], false).unwrap(),
            ..crate::SandboxSpec::default()
        };
        assert!(pool.fits(&spec, "corral-sandbox:latest"));
        // The image as the worker's default.
        let default = crate::SandboxSpec {
            image: None,
            ..spec.clone()
        };
        assert!(pool.fits(&default, "corral-debian:latest"));
        assert!(!pool.fits(&default, "corral-sandbox:latest"));
        for other in [
            crate::SandboxSpec {
                memory_bytes: None,
                ..spec.clone()
            },
            crate::SandboxSpec {
                pids_limit: Some(64),
                ..spec.clone()
            },
            crate::SandboxSpec {
                runtime: Some("runsc".into()),
                ..spec.clone()
            },
            crate::SandboxSpec {
                run_as_root: true,
                ..spec.clone()
            },
            crate::SandboxSpec {
                tmp_bytes: Some(1 << 20),
                ..spec
            },
        ] {
            assert!(!pool.fits(&other, "corral-sandbox:latest"), "{other:?}");
        }
    }
}
