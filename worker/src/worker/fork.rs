//! Live forks: a running sandbox frozen for an instant while its
//! writable trees are copied into new sandboxes made beside it.

use std::time::Duration;

use corral_proto::{SandboxId, SandboxInfo};
use tracing::{info, warn};

use super::table::{Change, Lookup};
use super::{Made, Worker};
use crate::error::{Result, WorkerError};
use crate::sandbox::Sandbox;

impl Worker {
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

    pub(super) async fn fork_inner(
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
        let parent = self.sandbox(parent_id).await?;
        if parent.is_lost() {
            return Err(WorkerError::SandboxLost {
                id: parent_id.to_string(),
                reason: "it cannot be forked".into(),
            });
        }
        let runtime = &self.inner.runtime;
        let of_parent = runtime.process(&parent.container_id).await?;
        if let Some(why) = fork::unforkable(&of_parent)
            .or_else(|| runtime.out_of_sight(&of_parent, &parent.container_id))
        {
            return Err(WorkerError::NotApplicable(why));
        }
        for id in &ids {
            if !matches!(
                self.inner.table.lookup(id),
                Lookup::Unknown | Lookup::Removed { .. }
            ) {
                return Err(WorkerError::Conflict {
                    what: "sandbox",
                    id: id.to_string(),
                });
            }
        }
        // The children, before the parent is frozen: made (or claimed from
        // a pool) at once. They read the parent's volumes (one writer at a
        // time: the parent stays it).
        let mut spec = parent.spec.clone();
        for v in &mut spec.volumes {
            v.read_only = true;
        }
        let made = futures_util::future::join_all(ids.iter().map(|id| {
            self.create_sandbox_inner(Some(id.clone()), spec.clone(), Some(parent_id), None)
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
    pub(super) async fn fork_copy(
        &self,
        parent: &Sandbox,
        children: &[SandboxInfo],
    ) -> Result<(Duration, corral_init::treecopy::Copied)> {
        let runtime = &self.inner.runtime;
        let mut procs = Vec::new();
        for c in children {
            procs.push(runtime.process(&c.container_id).await?);
        }
        // Not removed, checkpointed nor forked again while it is frozen.
        let _held = self.hold(&parent.id, Change::Forking).await?;
        let of_parent = runtime.process(&parent.container_id).await?;
        if let Some(why) = crate::fork::unforkable(&of_parent) {
            return Err(WorkerError::NotApplicable(why));
        }
        let started = std::time::Instant::now();
        runtime.pause(&parent.container_id).await?;
        let first = runtime.copy_trees(&of_parent, &procs[0]).await;
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
            procs[1..].iter().map(|p| runtime.copy_trees(&procs[0], p)),
        )
        .await;
        for r in rest {
            r?;
        }
        Ok((frozen, copied))
    }
}
