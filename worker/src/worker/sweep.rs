//! What the worker removes on its own: sandboxes idle past their timeout
//! or past their lifetime (every second), everything at a drain's
//! deadline, lost sandboxes, and containers it has no record of.

use std::time::Duration;

use corral_proto::{SandboxId, SandboxSpec};
use tracing::{info, warn};

use super::table::Lookup;
use super::{Worker, give_back_memory, lock};
use crate::docker;
use crate::error::Result;
use crate::sandbox::Sandbox;

impl Worker {
    /// Removes, every `interval`, containers labelled as this worker's that
    /// have no record: leftovers of anything that went wrong, or containers
    /// made behind the worker's back. A sandbox being created has its record
    /// already, so it is never taken for an orphan.
    pub(super) async fn sweep_forever(&self, interval: Duration) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(e) = self.sweep().await {
                warn!(error = %e, "orphan sweep failed");
            }
            give_back_memory();
        }
    }

    /// Removes, every second, the sandboxes that asked for an idle timeout
    /// and have had no client for that long.
    /// Why `s` is to be removed now, if it is: no client used it within
    /// its idle timeout (its own, else the worker's default), or it lived
    /// past its lifetime (its own, else the worker's; the shorter wins).
    pub(super) fn expired(&self, s: &Sandbox, now_ms: i64) -> Option<&'static str> {
        let idle_limit = s
            .spec
            .idle_timeout_ms
            .map(Duration::from_millis)
            .or(self.inner.default_idle_timeout);
        if idle_limit.is_some_and(|limit| s.idle_for() >= limit) {
            return Some("no client used it within its idle timeout");
        }
        self.past_lifetime(&s.spec, s.created_at_unix_ms(), now_ms)
    }

    /// Why a sandbox of `spec` made at `created_ms` is to be removed now
    /// for its age, if it is: it lived past its lifetime (its own, else the
    /// worker's; the shorter wins). Checkpointed sandboxes too.
    pub(super) fn past_lifetime(
        &self,
        spec: &SandboxSpec,
        created_ms: i64,
        now_ms: i64,
    ) -> Option<&'static str> {
        let lifetime = match (
            spec.ttl_ms.map(Duration::from_millis),
            self.inner.max_lifetime,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let age = Duration::from_millis(u64::try_from(now_ms - created_ms).unwrap_or(0));
        lifetime
            .is_some_and(|l| age >= l)
            .then_some("it lived past its lifetime")
    }

    /// Why sandbox `id` is to be removed now, if it is: for a running one
    /// see [`Self::expired`]; a checkpointed one goes at its lifetime's end
    /// alone (no client can use it).
    pub(super) fn due(&self, id: &SandboxId, now_ms: i64, drained: bool) -> Option<&'static str> {
        let why = match self.inner.table.lookup(id) {
            Lookup::Running(s) => self.expired(&s, now_ms),
            Lookup::Checkpointed(info) => {
                self.past_lifetime(&info.spec, info.created_at_unix_ms, now_ms)
            }
            _ => None,
        };
        if drained {
            return Some("the drain deadline passed");
        }
        why
    }

    pub(super) async fn reap_idle_forever(&self) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = shutdown.cancelled() => return,
            }
            let now = self.inner.clock.now_ms();
            let drained = self
                .inner
                .drain
                .borrow()
                .is_some_and(|deadline| now >= deadline);
            let expired: Vec<(SandboxId, &'static str)> = {
                let table = self.inner.table.lock();
                let running = table
                    .running()
                    .filter_map(|(id, s)| Some((id.clone(), self.expired(s, now)?)));
                let checkpointed = table.checkpointed().filter_map(|(id, info)| {
                    let why = self.past_lifetime(&info.spec, info.created_at_unix_ms, now)?;
                    Some((id.clone(), why))
                });
                if drained {
                    table
                        .ids()
                        .into_iter()
                        .map(|id| (id, "the drain deadline passed"))
                        .collect()
                } else {
                    running.chain(checkpointed).collect()
                }
            };
            for (id, why) in expired {
                // Looked at again: a client may have come since.
                if self.due(&id, now, drained).is_none() {
                    continue;
                }
                info!(sandbox = %id, why, "removing a sandbox");
                if let Err(e) = self.remove_sandbox(&id, why).await {
                    warn!(sandbox = %id, error = %e, "could not remove an idle sandbox");
                }
            }
        }
    }

    /// Sandboxes that will be removed when idle (the local worker stays
    /// while there are any).
    pub fn sandboxes_with_idle_timeout(&self) -> usize {
        self.inner
            .table
            .lock()
            .running()
            .filter(|(_, s)| {
                s.spec.idle_timeout_ms.is_some()
                    || s.spec.ttl_ms.is_some()
                    || self.inner.default_idle_timeout.is_some()
                    || self.inner.max_lifetime.is_some()
            })
            .count()
    }

    pub(super) async fn sweep(&self) -> Result<()> {
        // Lost sandboxes stay one interval, so clients can learn why; then
        // their container (if any is left) and record go.
        let lost: Vec<SandboxId> = self
            .inner
            .table
            .lock()
            .running()
            .filter(|(_, s)| s.is_lost())
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            info!(sandbox = %id, "removing a lost sandbox");
            self.remove_sandbox(&id, "it was lost").await?;
        }
        // Containers first, records second: a container seen here had its
        // record written before it was created, so a create racing with the
        // sweep is never mistaken for an orphan.
        let containers = self.inner.runtime.list_owned().await?;
        let all = self.inner.state.load_all()?;
        let claimed: std::collections::HashSet<String> =
            all.iter().filter_map(|r| r.container_id.clone()).collect();
        let records: std::collections::HashSet<String> = all.into_iter().map(|r| r.id).collect();
        for c in containers {
            let sid = docker::sandbox_label(&c);
            if records.contains(&sid)
                || c.id.as_ref().is_some_and(|cid| claimed.contains(cid))
                || lock(&self.inner.pools).iter().any(|p| p.holds(&sid))
            {
                continue;
            }
            if let Some(cid) = c.id {
                warn!(sandbox = %sid, container = %cid, "removing a container with no worker record");
                self.inner.runtime.remove_container(&cid).await?;
                // A removed sandbox whose container outlived its removal:
                // its volumes are free now (unless its id is in use again).
                if let Ok(id) = SandboxId::new(sid.clone())
                    && matches!(
                        self.inner.table.lookup(&id),
                        super::table::Lookup::Unknown | super::table::Lookup::Removed { .. }
                    )
                {
                    self.inner.volumes.release(&id);
                }
            }
        }
        Ok(())
    }
}
