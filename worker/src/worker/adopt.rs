//! A worker's start: the sandboxes of its state directory re-adopted
//! (running ones get a new actor, checkpointed ones are kept), what it
//! has no record of removed.

use std::collections::HashMap;
use std::time::Duration;

use corral_proto::{SandboxId, SandboxInfo, SandboxSpec, SandboxState};
use tracing::{info, warn};

use super::table;
use super::{Worker, limits_of};
use crate::docker;
use crate::error::Result;
use crate::sandbox::Sandbox;

impl Worker {
    pub(super) async fn reconcile(&self) -> Result<()> {
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
                        r.restored = true;
                        inner.state.save(&r)?;
                    }
                    inner.volumes.hold_again(
                        super::tenant_of(&record.spec).as_deref(),
                        &id,
                        &record.spec.volumes,
                    );
                    let sandbox =
                        self.spawn_actor(&id, record.spec.clone(), cid, record.created_at_unix_ms);
                    inner.table.adopt(id, table::State::Running(sandbox));
                    adopted.insert(sid);
                }
                (Some(record), Ok(id)) if record.checkpointed && record.forking_from.is_none() => {
                    info!(sandbox = %id, "keeping a checkpointed sandbox");
                    inner.volumes.hold_again(
                        super::tenant_of(&record.spec).as_deref(),
                        &id,
                        &record.spec.volumes,
                    );
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
                    inner
                        .table
                        .adopt(id, table::State::Checkpointed(Box::new(info)));
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
        let sandboxes: Vec<Sandbox> = inner
            .table
            .lock()
            .running()
            .map(|(_, s)| s.clone())
            .collect();
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

    /// A new actor for sandbox `id` in its running container `container`
    /// (re-adopted, restored, or kept after a checkpoint failed), its
    /// proxy's socket bound again where its mount sees it; it attaches and
    /// replays the supervisor's journal, as after a worker restart. The
    /// caller puts it in the table.
    pub(super) fn spawn_actor(
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
        Sandbox::spawn(
            id.clone(),
            spec,
            container,
            created_at_unix_ms,
            egress,
            &self.env(),
        )
    }
}
