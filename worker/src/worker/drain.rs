//! Draining (no new sandboxes; the ones here served until they end or
//! the deadline passes), and what the worker reports of itself: its info
//! and its metrics.

use corral_proto::{SandboxState, WorkerInfo};
use tracing::info;

use super::{Worker, lock};
use crate::error::Result;
use crate::sandbox::Sandbox;

impl Worker {
    pub fn info(&self) -> WorkerInfo {
        let drain = *self.inner.drain.borrow();
        let (held, running_operations) = {
            let table = self.inner.table.lock();
            let ops = table
                .running()
                .map(|(_, s)| s.running_operations() as u32)
                .sum();
            (table.held(), ops)
        };
        WorkerInfo {
            worker_id: self.id().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            max_sandboxes: self.inner.max_sandboxes,
            // As the capacity check counts: lost ones hold no slot, ones
            // being made or restored do.
            sandboxes: held as u32,
            running_operations,
            docker_version: self.inner.docker_version.clone(),
            policy: self.inner.policy.clone(),
            draining: drain.is_some(),
            drain_deadline_ms: drain.map_or(0, |ms| u64::try_from(ms).unwrap_or(0)),
            default_image: self.inner.default_image.clone(),
            default_runtime: self.inner.default_runtime.clone(),
            pools: lock(&self.inner.pools).iter_mut().map(Into::into).collect(),
            default_limits: self.inner.default_limits,
            ports_url: self.ports_base().map(str::to_string),
        }
    }

    /// Starts draining (`true`; again: the deadline stays) or ends it:
    /// see `Drain` in worker.proto. Recorded in the state directory, so a
    /// restarted worker goes on draining.
    pub fn drain(&self, on: bool) -> Result<WorkerInfo> {
        let now = self.inner.clock.now_ms();
        let current = *self.inner.drain.borrow();
        let next = match (on, current) {
            (true, Some(deadline)) => Some(deadline),
            (true, None) => Some(
                now + i64::try_from(self.inner.drain_deadline.as_millis()).unwrap_or(i64::MAX / 2),
            ),
            (false, _) => None,
        };
        if next != current {
            self.inner.state.set_drain_deadline(next)?;
            self.inner.drain.send_replace(next);
            match next {
                Some(deadline) => {
                    info!(
                        sandboxes = self.inner.table.lock().ids().len(),
                        deadline_ms = deadline,
                        "draining: no new sandboxes; the ones here are served until they end or the deadline passes"
                    );
                    // Nobody will claim the pools' members now.
                    let w = self.clone();
                    self.inner
                        .tracker
                        .spawn(async move { w.empty_pools().await });
                }
                None => {
                    info!("drain ended: taking new sandboxes again");
                    self.inner.pool_wake.notify_one();
                }
            }
        }
        Ok(self.info())
    }

    /// The worker's metrics, for those who count on its behalf (the
    /// server's admission of connections).
    pub fn metrics(&self) -> &crate::metrics::WorkerMetrics {
        &self.inner.metrics
    }

    /// The metrics' text exposition, with what the worker holds now.
    pub fn metrics_text(&self) -> String {
        let m = &self.inner.metrics;
        let (sandboxes, checkpointed): (Vec<Sandbox>, usize) = {
            let table = self.inner.table.lock();
            (
                table.running().map(|(_, s)| s.clone()).collect(),
                table.checkpointed().count(),
            )
        };
        let mut by_state: std::collections::BTreeMap<&'static str, i64> =
            ["starting", "ready", "lost", "checkpointed"]
                .into_iter()
                .map(|s| (s, 0))
                .collect();
        let (mut running, mut watchers, mut journal) = (0i64, 0i64, 0i64);
        for s in &sandboxes {
            let info = s.info();
            let state = match info.state {
                SandboxState::Starting => "starting",
                SandboxState::Ready => "ready",
                SandboxState::Lost(_) => "lost",
                SandboxState::Checkpointed => "checkpointed",
            };
            *by_state.entry(state).or_default() += 1;
            running += i64::from(info.running_operations);
            watchers += s.watchers() as i64;
            journal += s.journal_bytes() as i64;
        }
        *by_state.entry("checkpointed").or_default() = checkpointed as i64;
        for (state, n) in by_state {
            m.sandboxes
                .get_or_create(&vec![("state", state.to_string())])
                .set(n);
        }
        m.capacity.set(i64::from(self.inner.max_sandboxes));
        for p in lock(&self.inner.pools).iter_mut() {
            let target = p.target(tokio::time::Instant::now()) as u32;
            m.pool_state(&p.template.to_string(), target, p.ready.len());
        }
        m.running_operations.set(running);
        m.watchers.set(watchers);
        m.journal_bytes.set(journal);
        m.draining
            .set(i64::from(self.inner.drain.borrow().is_some()));
        m.render()
    }

    /// Counts output bytes streamed to a watcher.
    pub fn streamed(&self, bytes: usize) {
        self.inner.metrics.stream_bytes.inc_by(bytes as u64);
    }

    /// Whether the worker is shutting down (its sandboxes stay).
    pub fn shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Whether the worker drains now.
    pub fn draining(&self) -> bool {
        self.inner.drain.borrow().is_some()
    }

    /// Whether the worker drains (`Some(deadline ms)`), as it changes.
    pub fn drain_state(&self) -> tokio::sync::watch::Receiver<Option<i64>> {
        self.inner.drain.subscribe()
    }
}
