//! What a container is and uses: its first process as the host sees it,
//! and its memory, CPU and process counts.

use super::*;

impl DockerRuntime {
    /// The container's first process as the host sees it, and what a fork
    /// needs to know of it.
    pub async fn process(&self, container: &str) -> Result<ContainerProcess> {
        let info = self.docker.inspect_container(container, None).await?;
        let state = info.state.unwrap_or_default();
        let pid = state
            .pid
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0);
        let uid = info
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(LABEL_UID))
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        let host = info.host_config.unwrap_or_default();
        Ok(ContainerProcess {
            pid: pid.filter(|_| state.running.unwrap_or(false)),
            paused: state.paused.unwrap_or(false),
            uid,
            runtime: host.runtime.unwrap_or_default(),
            writable_rootfs: !host.readonly_rootfs.unwrap_or(false),
        })
    }

    /// What the container uses now: memory (less the page cache that can
    /// be dropped, as `docker stats` counts it), CPU over one sampling
    /// interval of the engine, processes.
    pub async fn stats(&self, container: &str) -> Result<ContainerUsage> {
        let options = bollard::query_parameters::StatsOptions {
            stream: false,
            one_shot: false,
        };
        let mut stream = self.docker.stats(container, Some(options));
        let s = match stream.next().await {
            Some(r) => r?,
            None => return Ok(ContainerUsage::default()),
        };
        let mem = s.memory_stats.unwrap_or_default();
        let inactive = mem
            .stats
            .as_ref()
            .and_then(|m| {
                m.get("inactive_file")
                    .or_else(|| m.get("total_inactive_file"))
            })
            .copied()
            .unwrap_or(0);
        // Tmpfs pages: cgroup v2 counts them as `shmem`; v1 has them in
        // `cache` but on no file list (they are swap-backed).
        let stat = |k: &str| mem.stats.as_ref().and_then(|m| m.get(k)).copied();
        let shmem = stat("shmem").unwrap_or_else(|| {
            stat("cache").unwrap_or(0).saturating_sub(
                stat("active_file").unwrap_or(0) + stat("inactive_file").unwrap_or(0),
            )
        });
        let cpu = s.cpu_stats.unwrap_or_default();
        let pre = s.precpu_stats.unwrap_or_default();
        let total = |c: &bollard::models::ContainerCpuStats| {
            c.cpu_usage
                .as_ref()
                .and_then(|u| u.total_usage)
                .unwrap_or(0)
        };
        let cpu_delta = total(&cpu).saturating_sub(total(&pre)) as f64;
        let system_delta = cpu
            .system_cpu_usage
            .unwrap_or(0)
            .saturating_sub(pre.system_cpu_usage.unwrap_or(0)) as f64;
        let cpus = f64::from(cpu.online_cpus.unwrap_or(1).max(1));
        let pids = s.pids_stats.unwrap_or_default();
        Ok(ContainerUsage {
            memory_bytes: mem.usage.unwrap_or(0).saturating_sub(inactive),
            memory_limit_bytes: mem.limit.unwrap_or(0),
            files_bytes: shmem,
            cpu_percent: if system_delta > 0.0 {
                cpu_delta / system_delta * cpus * 100.0
            } else {
                0.0
            },
            cpu_total_ns: total(&cpu),
            pids: pids.current.unwrap_or(0),
            pids_limit: pids.limit.unwrap_or(0),
        })
    }
}

/// A container's first process and how it runs (see
/// [`DockerRuntime::process`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerProcess {
    /// Its pid in the host's (the engine's) PID namespace; `None` when it
    /// does not run.
    pub pid: Option<u32>,
    pub paused: bool,
    /// The sandbox user's uid (0 for a sandbox whose commands run as root).
    pub uid: u32,
    /// The OCI runtime ("" for the engine's default).
    pub runtime: String,
    pub writable_rootfs: bool,
}

/// What a container uses (see [`DockerRuntime::stats`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContainerUsage {
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// Tmpfs pages (the cgroup's `shmem`): the sandbox's files.
    pub files_bytes: u64,
    pub cpu_percent: f64,
    pub cpu_total_ns: u64,
    pub pids: u64,
    pub pids_limit: u64,
}
