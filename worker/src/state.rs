//! The worker's durable state: its id, and one record per sandbox it owns.
//!
//! A record is written (and synced) before its container is created and
//! removed after the container is, so on start the worker knows which of the
//! containers carrying its label it meant to keep: those without a record
//! are leftovers of a create that never finished, and are removed. The
//! directory is locked so two workers never share it.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use corral_proto::{SandboxId, SandboxSpec};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

pub use crate::durable::{private_file, write_synced};
use crate::error::{Result, WorkerError};

pub struct StateDir {
    root: PathBuf,
    _lock: Flock<File>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub version: u32,
    pub id: String,
    pub spec: SandboxSpec,
    pub created_at_unix_ms: i64,
    /// Its container, when that was made under another id (a pool's
    /// member, claimed): the container's label names the member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The sandbox a fork is filling this one from, until the fork is
    /// done: a worker that finds it set after a restart removes the
    /// sandbox (its copy did not finish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forking_from: Option<String>,
    /// Checkpointed: its container is stopped with its processes and
    /// memory saved on the engine, until it is restored (a restarted
    /// worker keeps it so, rather than removing a stopped container).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpointed: bool,
    /// Restored from a checkpoint once: the engine (Docker with runsc)
    /// cannot start its container from a second one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restored: bool,
}

const RECORD_VERSION: u32 = 1;

/// Makes `dir` (and what is missing above it) for Corral's state, readable
/// by its owner only: 0700, the leaf made so even when it existed.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

impl StateDir {
    /// Opens (creating) and locks the directory.
    pub fn open(root: &Path) -> Result<Self> {
        let err = |e| WorkerError::state(root, e);
        private_dir(root).map_err(err)?;
        private_dir(&root.join("sandboxes")).map_err(err)?;
        private_dir(&root.join(PORTS_DIR)).map_err(err)?;
        let lock_file = private_file()
            .write(true)
            .create(true)
            .truncate(true)
            .open(root.join("lock"))
            .map_err(err)?;
        let lock = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock).map_err(|_| {
            WorkerError::StateLocked(format!(
                "state directory {} is in use by another worker process",
                root.display()
            ))
        })?;
        Ok(Self {
            root: root.to_path_buf(),
            _lock: lock,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// This worker's id: `preferred` if given, else the stored one, else
    /// `default` (stored, so that a renamed host keeps owning its
    /// sandboxes).
    pub fn worker_id(
        &self,
        preferred: Option<&str>,
        default: impl FnOnce() -> String,
    ) -> Result<String> {
        let path = self.root.join("worker-id");
        if let Some(id) = preferred {
            return Ok(id.to_string());
        }
        match fs::read_to_string(&path) {
            Ok(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
            _ => {
                let id = default();
                write_synced(&path, id.as_bytes()).map_err(|e| WorkerError::state(&path, e))?;
                Ok(id)
            }
        }
    }

    /// When a drain removes what is left (ms since the epoch), if this
    /// worker is draining: kept here so a restart goes on draining.
    pub fn drain_deadline(&self) -> Option<i64> {
        fs::read_to_string(self.root.join("draining"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// Records the drain (`None`: ended).
    pub fn set_drain_deadline(&self, deadline: Option<i64>) -> Result<()> {
        let path = self.root.join("draining");
        match deadline {
            Some(ms) => write_synced(&path, ms.to_string().as_bytes()),
            None => match fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
        .map_err(|e| WorkerError::state(&path, e))
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.root.join("sandboxes").join(format!("{id}.json"))
    }

    pub fn save(&self, record: &SandboxRecord) -> Result<()> {
        let path = self.record_path(&record.id);
        let json = serde_json::to_vec_pretty(record)
            .map_err(|e| WorkerError::state(&path, std::io::Error::other(e)))?;
        write_synced(&path, &json).map_err(|e| WorkerError::state(&path, e))
    }

    /// Removes the sandbox's record, and its exposed ports' (which would
    /// otherwise come back with a later sandbox of the same id).
    pub fn remove(&self, id: &SandboxId) -> Result<()> {
        let gone = |path: PathBuf| match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(WorkerError::state(&path, e)),
        };
        gone(self.ports_path(id))?;
        gone(self.record_path(id.as_str()))
    }

    /// Where sandbox `id`'s exposed ports are kept (see
    /// [`crate::ports::SandboxPorts`]), so that they outlive a checkpoint
    /// and a restart of the worker.
    pub fn ports_path(&self, id: &SandboxId) -> PathBuf {
        ports_path(&self.root, id)
    }

    /// The record of sandbox `id`, if it has a readable one.
    pub fn load(&self, id: &SandboxId) -> Option<SandboxRecord> {
        let b = fs::read(self.record_path(id.as_str())).ok()?;
        serde_json::from_slice::<SandboxRecord>(&b)
            .ok()
            .filter(|r| r.version == RECORD_VERSION)
    }

    /// Every readable record; unreadable ones are reported and skipped.
    pub fn load_all(&self) -> Result<Vec<SandboxRecord>> {
        let dir = self.root.join("sandboxes");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(|e| WorkerError::state(&dir, e))? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match fs::read(&path).map_err(|e| e.to_string()).and_then(|b| {
                serde_json::from_slice::<SandboxRecord>(&b).map_err(|e| e.to_string())
            }) {
                Ok(r) if r.version == RECORD_VERSION => out.push(r),
                Ok(r) => {
                    tracing::warn!(path = %path.display(), version = r.version, "sandbox record of an unknown version, ignored")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable sandbox record, ignored")
                }
            }
        }
        Ok(out)
    }

    pub fn new_record(id: &SandboxId, spec: &SandboxSpec) -> SandboxRecord {
        SandboxRecord {
            version: RECORD_VERSION,
            id: id.to_string(),
            spec: spec.clone(),
            created_at_unix_ms: now_unix_ms(),
            container_id: None,
            forking_from: None,
            checkpointed: false,
            restored: false,
        }
    }
}

pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Writes a file atomically: a synced temporary file renamed into place.
const PORTS_DIR: &str = "ports";

/// [`StateDir::ports_path`] under `root`.
pub fn ports_path(root: &Path, id: &SandboxId) -> PathBuf {
    root.join(PORTS_DIR).join(format!("{id}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_the_directory_is_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert!(matches!(
            StateDir::open(dir.path()),
            Err(WorkerError::StateLocked(_))
        ));
        let id = SandboxId::new("sb1").unwrap();
        let spec = SandboxSpec {
            pids_limit: Some(64),
            ..Default::default()
        };
        state.save(&StateDir::new_record(&id, &spec)).unwrap();
        // Its owner's only: the directory, the records, the id.
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(dir.path()), 0o700);
        assert_eq!(mode(&dir.path().join("sandboxes")), 0o700);
        for entry in fs::read_dir(dir.path().join("sandboxes")).unwrap() {
            assert_eq!(mode(&entry.unwrap().path()), 0o600);
        }
        let all = state.load_all().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].spec, spec);
        state.remove(&id).unwrap();
        state.remove(&id).unwrap();
        assert!(state.load_all().unwrap().is_empty());
        let wid = state.worker_id(None, || "node-1".into()).unwrap();
        assert_eq!(wid, "node-1");
        assert_eq!(state.worker_id(None, || "other".into()).unwrap(), wid);
        assert_eq!(
            state.worker_id(Some("given"), || "other".into()).unwrap(),
            "given"
        );
        assert_eq!(state.drain_deadline(), None);
        state.set_drain_deadline(Some(42)).unwrap();
        assert_eq!(state.drain_deadline(), Some(42));
        state.set_drain_deadline(None).unwrap();
        state.set_drain_deadline(None).unwrap();
        assert_eq!(state.drain_deadline(), None);
    }
}
