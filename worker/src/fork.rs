//! Live forks: what a child sandbox is given of its parent. The worker
//! makes the children first (from a pool when one matches), freezes the
//! parent (the engine's pause: the cgroup freezer), copies its writable
//! trees into the first child, thaws it, then copies the first child into
//! the others, all at once. Each copy is a process of its own on the host
//! (`corral-init --copy-tree`, see `corral_init::treecopy`) in the memory
//! cgroup of the sandbox it writes to, so the files are charged to that
//! sandbox and not to the worker.
//!
//! It needs what the copy needs: runc's sandboxes (gVisor keeps a
//! sandbox's files in its own memory, where the host cannot read them), a
//! read-only root (the writable trees are then the tmpfs mounts), and a
//! worker that sees the engine's processes and cgroups (the host's PID
//! namespace and `/sys/fs/cgroup`).

use std::path::Path;
use std::time::Duration;

use corral_init::treecopy::Copied;
use corral_proto::SandboxInfo;
use corral_proto::limits::{TMP_DIR, WORKSPACE_DIR};

use crate::docker::ContainerProcess;
use crate::error::{Result, WorkerError};

/// At most this many children in one fork.
pub const MAX_CHILDREN: usize = corral_proto::limits::MAX_FORK_CHILDREN;

/// The trees a child gets: every writable mount of a sandbox whose root is
/// read-only (its users' database is not one: each sandbox has its own).
pub const TREES: [&str; 2] = [WORKSPACE_DIR, TMP_DIR];

/// What a fork made.
#[derive(Debug, Clone)]
pub struct Forked {
    pub children: Vec<SandboxInfo>,
    /// How long the parent was frozen.
    pub frozen: Duration,
    /// The copy each child got.
    pub copied: Copied,
}

/// Why a sandbox cannot be forked, if it cannot.
pub fn unforkable(p: &ContainerProcess) -> Option<String> {
    if p.runtime.contains("runsc") {
        return Some(
            "a gVisor (runsc) sandbox keeps its files in gVisor's own memory, out of the host's reach: it cannot be forked; fork a runc sandbox".into(),
        );
    }
    if p.writable_rootfs {
        return Some(
            "a sandbox with a writable root filesystem cannot be forked (only its tmpfs mounts are copied)".into(),
        );
    }
    if p.paused {
        return Some("the sandbox is paused (another fork is copying it)".into());
    }
    None
}

/// Why this worker cannot reach a sandbox's processes, if it cannot: the
/// engine's pid of the container must be a process here, in that
/// container's cgroup (a worker in a pod of its own, without the host's
/// PID namespace, sees other processes or none under that number).
pub fn out_of_sight(p: &ContainerProcess, container_id: &str) -> Option<String> {
    let pid = p.pid?;
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    if cgroup.contains(container_id) {
        None
    } else {
        Some(format!(
            "this worker does not see the engine's processes (process {pid} here is not the sandbox's): a fork needs the host's PID namespace (hostPID) and its cgroup filesystem"
        ))
    }
}

/// Copies the trees of `from` into `to` with the helper at `helper`.
pub async fn copy(helper: &Path, from: &ContainerProcess, to: &ContainerProcess) -> Result<Copied> {
    let (Some(from_pid), Some(to_pid)) = (from.pid, to.pid) else {
        return Err(WorkerError::Fork(
            "a sandbox of the fork is not running".into(),
        ));
    };
    let mut cmd = tokio::process::Command::new(helper);
    cmd.arg("--copy-tree")
        .arg(from_pid.to_string())
        .arg(to_pid.to_string())
        .arg(format!("{}:{}", from.uid, to.uid))
        .args(TREES)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = cmd
        .output()
        .await
        .map_err(|e| WorkerError::Fork(format!("starting {}: {e}", helper.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut why: String = stderr.trim().chars().take(2000).collect();
        if why.is_empty() {
            why = format!("the copy helper ended with {}", out.status);
        }
        return Err(WorkerError::Fork(why));
    }
    parse_report(&stdout)
        .ok_or_else(|| WorkerError::Fork(format!("the copy helper said {stdout:?}")))
}

/// The helper's report: `copied ENTRIES BYTES LEFT_OUT`, then `note:` lines.
fn parse_report(out: &str) -> Option<Copied> {
    let mut lines = out.lines();
    let mut f = lines.next()?.strip_prefix("copied ")?.split(' ');
    let mut n = || f.next().and_then(|x| x.parse::<u64>().ok());
    let (entries, bytes, left_out) = (n()?, n()?, n()?);
    let notes = lines
        .filter_map(|l| l.strip_prefix("note: "))
        .map(str::to_string)
        .collect();
    Some(Copied {
        entries,
        bytes,
        left_out,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helpers_report_is_read_and_a_garbled_one_is_not() {
        let c = parse_report("copied 3 10 1\nnote: s: a socket, left out\n").unwrap();
        assert_eq!((c.entries, c.bytes, c.left_out), (3, 10, 1));
        assert_eq!(c.notes, vec!["s: a socket, left out".to_string()]);
        assert!(parse_report("copied 3 x 1").is_none());
        assert!(parse_report("").is_none());
    }

    #[test]
    fn runsc_and_writable_roots_are_refused_with_why() {
        let p = ContainerProcess {
            runtime: "runsc".into(),
            ..Default::default()
        };
        assert!(unforkable(&p).unwrap().contains("gVisor"));
        let p = ContainerProcess {
            writable_rootfs: true,
            ..Default::default()
        };
        assert!(unforkable(&p).unwrap().contains("writable root"));
        assert!(unforkable(&ContainerProcess::default()).is_none());
    }

    #[test]
    fn a_pid_that_is_not_the_containers_here_is_out_of_sight() {
        let me = ContainerProcess {
            pid: Some(std::process::id()),
            ..Default::default()
        };
        let why = out_of_sight(&me, "0123456789abcdef").unwrap();
        assert!(why.contains("hostPID"), "{why}");
        // This process's own cgroup path names it.
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let last = own.lines().next().unwrap().rsplit(':').next().unwrap();
        if last.len() > 1 {
            assert!(out_of_sight(&me, last).is_none());
        }
    }
}
