//! Checkpoint and restore (gVisor): a sandbox set apart, its container
//! stopped with its memory saved, and started again where it stood. Both
//! hold the sandbox's slot in the table while they run, so that calls
//! meanwhile find it checkpointed or wait for its restore, never unknown.

use corral_proto::{SandboxId, SandboxInfo, SandboxState};
use tracing::{info, warn};

use super::table::{Change, Lookup, Refused, State};
use super::{READY_TIMEOUT, Worker};
use crate::error::{Result, WorkerError};
use crate::state::StateDir;

/// How long a checkpoint waits for the sandbox's ingress relay to end.
const RELEASE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

impl Worker {
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
        let ticket = self.hold(id, Change::Checkpointing).await?;
        let sandbox = match self.inner.table.lookup(id) {
            Lookup::Running(s) => s,
            Lookup::Checkpointed(info) => return Ok(*info),
            other => return Err(super::not_running(id, other)),
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
        let mut record = self
            .inner
            .state
            .load(id)
            .unwrap_or_else(|| StateDir::new_record(id, &sandbox.spec));
        // The engine leaves the first restore's task in its containerd,
        // and refuses to start the container from another checkpoint ("id
        // already in use"): a second checkpoint would never come back.
        if record.restored {
            return Err(WorkerError::NotApplicable(format!(
                "sandbox {id} was restored from a checkpoint already, and this engine (Docker with runsc) cannot start a container from a second one: it would stay checkpointed for good; a new sandbox can be checkpointed"
            )));
        }
        // Recorded first: a worker that dies mid-checkpoint keeps what the
        // engine saved (one that finds it running clears the mark).
        record.spec = sandbox.spec.clone();
        record.checkpointed = true;
        self.inner.state.save(&record)?;
        // Set apart before its actor lets go (so the container's stop is
        // no loss): calls meanwhile are told it is checkpointed.
        info.state = SandboxState::Checkpointed;
        self.inner
            .table
            .set_state(&ticket, State::Checkpointed(Box::new(info.clone())));
        // Its ingress relay holds a connection to the worker's socket,
        // which gVisor cannot save: let go first (it is started again
        // when a request needs it).
        if !sandbox.ports().release_ingress(RELEASE_WITHIN).await {
            warn!(sandbox = %id, "its ingress relay did not end in time; the checkpoint may fail");
        }
        sandbox.close();
        if let Err(e) = self.inner.runtime.checkpoint(&sandbox.container_id).await {
            warn!(sandbox = %id, error = %e, "checkpoint failed; the sandbox goes on");
            record.checkpointed = false;
            if let Err(e) = self.inner.state.save(&record) {
                warn!(sandbox = %id, error = %e, "could not clear a checkpoint's mark");
            }
            let again = self.spawn_actor(
                id,
                sandbox.spec.clone(),
                sandbox.container_id.clone(),
                sandbox.created_at_unix_ms,
            );
            self.inner.table.commit_running(ticket, again.clone());
            let _ = again.wait_ready(READY_TIMEOUT).await;
            return Err(e);
        }
        self.inner
            .table
            .commit_checkpointed(ticket, Box::new(info.clone()));
        info!(sandbox = %id, "sandbox checkpointed");
        Ok(info)
    }

    /// Starts a checkpointed sandbox from its checkpoint: its processes go
    /// on where they stood, its memory as it was; its operations' events
    /// are replayed from its supervisor's journal. It takes a slot again
    /// (refused at capacity or while draining, and then stays
    /// checkpointed). Restoring one that runs is answered as it is.
    pub async fn restore_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo> {
        let ticket = self.hold(id, Change::Restoring).await?;
        if self.inner.drain.borrow().is_some()
            && let Lookup::Checkpointed(_) = self.inner.table.lookup(id)
        {
            return Err(WorkerError::Draining);
        }
        let mut placed = super::create::Placed::default();
        let info = match self
            .inner
            .table
            .begin_restoring(&ticket, |held| self.place(held, None, None, &mut placed))
        {
            Ok(info) => info,
            // It runs: answered as it is.
            Err(Refused::Found(_)) => {
                drop(ticket);
                return self.get_sandbox(id).await;
            }
            Err(Refused::Full(e)) => return Err(e),
        };
        self.let_go(placed).await;
        // A failure leaves it checkpointed (the ticket dropped).
        // Its volumes on the host again (after a restart of the host).
        let volumes = self
            .inner
            .volumes
            .resolve(super::tenant_of(&info.spec).as_deref(), &info.spec.volumes)?;
        self.inner.volumes.mount(&volumes).await?;
        self.inner.runtime.restore(&info.container_id).await?;
        if let Some(mut record) = self.inner.state.load(id) {
            record.checkpointed = false;
            record.restored = true;
            if let Err(e) = self.inner.state.save(&record) {
                warn!(sandbox = %id, error = %e, "could not clear a restored sandbox's checkpoint mark");
            }
        }
        // It takes its kept exposures as it starts: not while one is
        // being revoked.
        let kept = self.inner.ports_files.lock().await;
        let sandbox = self.spawn_actor(
            id,
            info.spec.clone(),
            info.container_id.clone(),
            info.created_at_unix_ms,
        );
        drop(kept);
        // Running again: whatever else fails, it is among the sandboxes.
        self.inner.table.commit_running(ticket, sandbox.clone());
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            // Removed as it came back (its lifetime ended meanwhile, say):
            // said as what it is.
            return Err(match self.inner.table.lookup(id) {
                Lookup::Removed { why, .. } => WorkerError::Removed {
                    id: id.to_string(),
                    reason: why,
                },
                _ => e,
            });
        }
        info!(sandbox = %id, "sandbox restored");
        Ok(self.info_of(&sandbox))
    }
}
