//! A running sandbox saved as a template (`SnapshotSandbox`): its image
//! and its workspace as they are, not its processes (nor what it changed
//! of a writable root). A sandbox of such a template starts with the workspace
//! it was saved with, written by its own supervisor as an upload would be
//! (its user owns it).

use corral_proto::limits::{MAX_INPUT_CHUNK_BYTES, WORKSPACE_DIR};
use corral_proto::{
    ArchiveSpec, EventKind, OperationId, OperationSpec, OutputStream, SandboxId, pb,
};
use futures_util::StreamExt;

use super::Worker;
use crate::error::{Result, WorkerError};
use crate::sandbox::Sandbox;

/// A file removed when dropped.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How an operation of the worker's own in `sandbox` ended, if `kind`
/// ends it (`failed`: what a failure is said as).
fn ended(sandbox: &Sandbox, kind: EventKind, failed: &str) -> Option<Result<()>> {
    match kind {
        EventKind::Finished(r) if r.outcome.is_success() => Some(Ok(())),
        EventKind::Finished(r) => {
            let said = String::from_utf8_lossy(&r.stderr.head);
            Some(Err(WorkerError::NotApplicable(format!(
                "{failed}: {} {}",
                r.outcome,
                said.trim()
            ))))
        }
        EventKind::SandboxLost { reason } => Some(Err(WorkerError::SandboxLost {
            id: sandbox.id.to_string(),
            reason,
        })),
        _ => None,
    }
}

impl Worker {
    /// Saves running sandbox `id` as its tenant's template `name` (what
    /// its own template started with, if it was made from one).
    pub async fn snapshot_sandbox(&self, id: &SandboxId, name: String) -> Result<pb::Template> {
        corral_proto::template::check_name(&name)?;
        let sandbox = self.sandbox(id).await?;
        if sandbox.is_lost() {
            return Err(WorkerError::SandboxLost {
                id: id.to_string(),
                reason: "it cannot be saved".into(),
            });
        }
        let tenant = super::tenant_of(&sandbox.spec);
        let dir = self.inner.state.root().join("snapshots");
        std::fs::create_dir_all(&dir).map_err(|e| WorkerError::state(&dir, e))?;
        let scratch = Scratch(dir.join(format!("{}.tar", uuid::Uuid::new_v4().simple())));
        self.workspace_to(&sandbox, &scratch.0).await?;
        let image = self.info_of(&sandbox).image;
        let saved = self.inner.runtime.snapshot(&image, &scratch.0).await?;
        let start = sandbox
            .spec
            .template
            .as_deref()
            .and_then(|t| self.inner.templates.get(tenant.as_deref(), t))
            .map(|t| t.start)
            .unwrap_or_default();
        tracing::info!(sandbox = %id, template = %name, image = %saved, "sandbox saved as a template");
        self.keep_template(tenant, name, saved, start, true).await
    }

    /// The contents of `sandbox`'s workspace, as its supervisor reads them,
    /// into the tar file `to`.
    async fn workspace_to(&self, sandbox: &Sandbox, to: &std::path::Path) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let oid = OperationId::random();
        let after = self.info_of(sandbox).last_seq;
        let mut events = sandbox
            .watch(after, Some(oid.clone()), &self.inner.tracker)?
            .events;
        self.submit_to(
            sandbox,
            oid,
            OperationSpec::GetArchive(ArchiveSpec::contents_of(WORKSPACE_DIR)),
            None,
        )
        .await?;
        let mut file = tokio::fs::File::create(to)
            .await
            .map_err(|e| WorkerError::state(to, e))?;
        while let Some(event) = events.recv().await {
            match event.kind {
                // The archive is its stdout; its stderr says what was left
                // out (a FIFO, a socket), never part of the archive.
                EventKind::Output {
                    stream: OutputStream::Stdout,
                    data,
                } => file
                    .write_all(&data)
                    .await
                    .map_err(|e| WorkerError::state(to, e))?,
                EventKind::Output { .. } => {}
                kind => {
                    if let Some(end) = ended(sandbox, kind, "its workspace could not be read") {
                        file.flush().await.map_err(|e| WorkerError::state(to, e))?;
                        return end;
                    }
                }
            }
        }
        Err(WorkerError::Detached(sandbox.id.to_string()))
    }

    /// Writes the workspace a snapshot's image carries into `sandbox`'s,
    /// through its supervisor (as an upload, owned by its user).
    pub(super) async fn seed_workspace(&self, sandbox: &Sandbox) -> Result<()> {
        let oid = OperationId::random();
        let after = self.info_of(sandbox).last_seq;
        let mut events = sandbox
            .watch(after, Some(oid.clone()), &self.inner.tracker)?
            .events;
        self.submit_to(
            sandbox,
            oid.clone(),
            OperationSpec::PutArchive(ArchiveSpec::new(WORKSPACE_DIR)),
            None,
        )
        .await?;
        let mut seed = self.inner.runtime.seed(&sandbox.container_id);
        let mut offset = 0u64;
        'sent: while let Some(chunk) = seed.next().await {
            let chunk = chunk?;
            for piece in chunk.chunks(MAX_INPUT_CHUNK_BYTES) {
                let reply = sandbox
                    .write_input(
                        oid.clone(),
                        offset,
                        bytes::Bytes::copy_from_slice(piece),
                        false,
                    )
                    .await?;
                offset += piece.len() as u64;
                if reply.closed {
                    break 'sent;
                }
            }
        }
        let _ = sandbox
            .write_input(oid.clone(), offset, bytes::Bytes::new(), true)
            .await;
        while let Some(event) = events.recv().await {
            if let Some(end) = ended(sandbox, event.kind, "its saved workspace was not written") {
                return end;
            }
        }
        Err(WorkerError::Detached(sandbox.id.to_string()))
    }
}
