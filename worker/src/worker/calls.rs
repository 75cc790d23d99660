//! What clients do with a running sandbox: commands and their input,
//! output and signals, watches, stats, resets, and its egress policy.

use corral_proto::init::OperationRecord;
use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxInfo};
use tracing::info;

use super::Worker;
use super::table::{Change, Lookup};
use crate::error::{Result, WorkerError};
use crate::state::StateDir;

impl Worker {
    /// Replaces a sandbox's egress policy (bounded as at create): new
    /// connections follow it at once, open ones it no longer allows are
    /// closed. The record keeps it, so a restart does too.
    pub async fn set_sandbox_egress(
        &self,
        id: &SandboxId,
        rules: Vec<corral_proto::egress::Rule>,
    ) -> Result<SandboxInfo> {
        let mut asked = self.sandbox(id).await?.spec.clone();
        asked.egress.clone_from(&rules);
        asked.validate()?;
        crate::policy::check_egress(&self.inner.policy, &rules)?;
        let ticket = self.hold(id, Change::Egress).await?;
        let mut sandbox = match self.inner.table.lookup(id) {
            Lookup::Running(s) => s,
            other => return Err(super::not_running(id, other)),
        };
        if !sandbox.set_egress(rules) {
            return Err(WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                "egress",
                "this sandbox was made without egress, so it has no proxy: make it with egress rules (an empty list later blocks everything)",
            )));
        }
        let mut record = self
            .inner
            .state
            .load(id)
            .unwrap_or_else(|| StateDir::new_record(id, &sandbox.spec));
        record.spec = sandbox.spec.clone();
        record.created_at_unix_ms = sandbox.created_at_unix_ms;
        self.inner.state.save(&record)?;
        self.inner.table.commit_running(ticket, sandbox.clone());
        info!(sandbox = %id, rules = sandbox.spec.egress.len(), "egress policy replaced");
        Ok(self.info_of(&sandbox))
    }

    pub async fn submit(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        spec: OperationSpec,
    ) -> Result<OperationRecord> {
        self.submit_traced(sandbox, id, spec, None).await
    }

    /// [`Self::submit`], under the W3C trace context `traceparent`: with
    /// `--otlp-endpoint`, the operation's span is made there.
    pub async fn submit_traced(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<OperationRecord> {
        spec.validate()?;
        let sb = self.sandbox(sandbox).await?;
        self.submit_to(&sb, id, spec, traceparent).await
    }

    /// [`Self::submit_traced`] on a sandbox in hand (one being made, not
    /// yet in the table, too).
    pub(super) async fn submit_to(
        &self,
        sb: &crate::sandbox::Sandbox,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<OperationRecord> {
        // The sandbox's environment, under the command's own, and its
        // proxy's under that: the container has them already, unless the
        // sandbox was a pool's member, made before anyone asked for it.
        let spec = match spec {
            OperationSpec::Shell(mut s) => {
                for (k, v) in &sb.spec.env {
                    s.env.entry(k.clone()).or_insert_with(|| v.clone());
                }
                if sb.has_egress() {
                    for (k, v) in crate::proxy::proxy_env() {
                        s.env.entry(k.to_string()).or_insert_with(|| v.to_string());
                    }
                }
                OperationSpec::Shell(s)
            }
            other => other,
        };
        sb.submit(id, spec, traceparent).await
    }

    /// Submits an operation and watches its events from its first, in one
    /// call (`RunOperation`): the watch is made first, from the sandbox's
    /// last event, so nothing of the operation comes before it. An id
    /// submitted before is watched from its own first event.
    pub async fn run_watched(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<(OperationRecord, crate::sandbox::Watch)> {
        let before = self.sandbox(sandbox).await?.last_seq();
        let watch = self.watch(sandbox, before, Some(id.clone())).await?;
        let record = self
            .submit_traced(sandbox, id.clone(), spec, traceparent)
            .await?;
        if record.first_seq > 0 && record.first_seq <= before {
            drop(watch);
            let watch = self.watch(sandbox, record.first_seq - 1, Some(id)).await?;
            return Ok((record, watch));
        }
        Ok((record, watch))
    }

    /// What the sandbox uses now (about a second: see `GetSandboxStats`).
    pub async fn sandbox_stats(&self, id: &SandboxId) -> Result<corral_proto::SandboxStats> {
        let container = self.sandbox(id).await?.info().container_id;
        let u = self.inner.runtime.stats(&container).await?;
        Ok(corral_proto::SandboxStats {
            sandbox_id: id.clone(),
            memory_bytes: u.memory_bytes,
            memory_limit_bytes: u.memory_limit_bytes,
            files_bytes: u.files_bytes.min(u.memory_bytes),
            cpu_percent: u.cpu_percent,
            cpu_total_ns: u.cpu_total_ns,
            pids: u32::try_from(u.pids).unwrap_or(u32::MAX),
            pids_limit: u32::try_from(u.pids_limit).unwrap_or(u32::MAX),
        })
    }

    pub async fn list_operations(&self, sandbox: &SandboxId) -> Result<Vec<OperationRecord>> {
        Ok(self.sandbox(sandbox).await?.operations())
    }

    pub async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord> {
        self.sandbox(sandbox)
            .await?
            .operation(id)
            .ok_or_else(|| WorkerError::UnknownOperation(id.to_string()))
    }

    /// Feeds input to an operation (see `WriteInput` in worker.proto).
    pub async fn write_input(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        offset: u64,
        data: bytes::Bytes,
        eof: bool,
    ) -> Result<crate::sandbox::InputReply> {
        if data.len() > corral_proto::limits::MAX_INPUT_CHUNK_BYTES {
            return Err(corral_proto::ProtocolError::invalid(
                "data",
                format!(
                    "{} bytes; at most {} in one call",
                    data.len(),
                    corral_proto::limits::MAX_INPUT_CHUNK_BYTES
                ),
            )
            .into());
        }
        let sb = self.sandbox(sandbox).await?;
        let reply = sb.write_input(id, offset, data, eof).await;
        sb.touch();
        reply
    }

    pub async fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: OperationId,
        size: corral_proto::TerminalSize,
    ) -> Result<()> {
        self.sandbox(sandbox).await?.resize(id, size).await
    }

    /// Kills every process of a sandbox but its supervisor.
    pub async fn reset_sandbox(&self, sandbox: &SandboxId) -> Result<u32> {
        let killed = self.sandbox(sandbox).await?.reset().await?;
        info!(sandbox = %sandbox, killed, "sandbox reset");
        Ok(killed)
    }

    /// Cancels an operation; true when it was running. Unknown or finished
    /// operations are left alone.
    pub async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool> {
        self.sandbox(sandbox).await?.cancel(id.clone()).await
    }

    /// Sends `signal` (checked: 1-31) to a running command of `sandbox`.
    pub async fn signal(&self, sandbox: &SandboxId, id: &OperationId, signal: i32) -> Result<bool> {
        let signal = corral_proto::init::valid_signal(signal)?;
        self.sandbox(sandbox)
            .await?
            .signal(id.clone(), signal)
            .await
    }

    pub async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<OperationId>,
    ) -> Result<crate::sandbox::Watch> {
        let sandbox = self.sandbox(sandbox).await?;
        let total: usize = self
            .inner
            .table
            .lock()
            .running()
            .map(|(_, s)| s.watchers())
            .sum();
        if total >= self.inner.max_watchers {
            return Err(WorkerError::TooManyWatchers(format!(
                "this worker serves {total} watchers, its limit"
            )));
        }
        sandbox.watch(after_seq, only, &self.inner.tracker)
    }
}
