//! The worker's API as the harness uses it: one trait over the sandbox and
//! operation calls, implemented by the worker library in this process
//! (`corral_worker::Worker`, feature `local`: see `local_api`) and by the
//! gRPC client ([`WorkerClient`], one connection that re-establishes
//! itself). Everything above it — the
//! operation managers, the waiter, the session front door — is written
//! once against the trait.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use corral_proto::init::OperationRecord;
use corral_proto::reason::Reason;
use corral_proto::{Event, OperationId, OperationSpec, SandboxId, SandboxInfo, SandboxSpec};
use futures_util::{Stream, StreamExt};

use crate::client::{ClientError, WorkerClient, source_chain};

/// A sandbox's events, as they come.
pub type Events = Pin<Box<dyn Stream<Item = Result<Event, ApiError>> + Send>>;

/// A worker's machine-readable reason for refusing a call, with the flag
/// of its policy that would allow it (for `policy_denied`): read off the
/// error, never off its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub reason: Reason,
    pub flag: Option<String>,
}

impl Why {
    pub fn new(reason: Reason) -> Self {
        Self { reason, flag: None }
    }
}

/// How a worker call failed, as far as a caller must tell apart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// Worth another try (the worker restarted, the network blinked).
    #[error("{0}")]
    Transient(String),
    /// No such sandbox or operation.
    #[error("{0}")]
    NotFound(String),
    /// Will not succeed however often it is tried; why, when the worker
    /// said.
    #[error("{0}")]
    Rejected(String, Option<Why>),
    /// This worker takes no new sandbox (at capacity, or draining):
    /// another one may.
    #[error("{0}")]
    Refused(String, Why),
}

impl ApiError {
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_))
    }
}

/// The calls of a worker the harness makes. Implementations are cheap to
/// clone (a handle), and every call may be retried after a transient
/// failure: creates are idempotent by id, submits run an id at most once.
pub trait WorkerApi: Clone + Send + Sync + 'static {
    /// Where the worker is, for messages (its address, or "this process").
    fn describe(&self) -> String;
    /// The worker in a line of the form `worker W ...`: its address.
    fn name(&self) -> String;
    /// Its address (a URL), or, for a worker in this process, its id.
    fn address(&self) -> String;
    /// Creates the sandbox, or returns it when it exists with this spec.
    fn create_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
    ) -> impl Future<Output = Result<SandboxInfo, ApiError>> + Send;
    /// [`Self::create_sandbox`] under the W3C trace context
    /// `traceparent` (a worker that traces makes its span there).
    fn create_sandbox_traced(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        traceparent: Option<&str>,
    ) -> impl Future<Output = Result<SandboxInfo, ApiError>> + Send {
        let _ = traceparent;
        self.create_sandbox(id, spec)
    }
    fn get_sandbox(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<SandboxInfo, ApiError>> + Send;
    /// Removes the sandbox; false when there was none.
    fn destroy_sandbox(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<bool, ApiError>> + Send;
    fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> impl Future<Output = Result<OperationRecord, ApiError>> + Send;
    /// [`Self::submit`] with the W3C `traceparent` of the span the
    /// operation runs under (a worker that traces makes its span there).
    fn submit_traced(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
        traceparent: Option<&str>,
    ) -> impl Future<Output = Result<OperationRecord, ApiError>> + Send {
        let _ = traceparent;
        self.submit(sandbox, id, spec)
    }
    /// Submits an operation and watches it, in one call where the worker
    /// has one (`RunOperation`): its record, and its events from its
    /// first to its end (a stream that ends before is followed again from
    /// the last seq received). By default, a watch from the sandbox's last
    /// event, then the submit.
    fn run(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> impl Future<Output = Result<(OperationRecord, Events), ApiError>> + Send {
        async move {
            let before = self.get_sandbox(sandbox).await?.last_seq;
            let events = self.watch(sandbox, before, Some(id)).await?;
            let record = self.submit(sandbox, id, spec).await?;
            Ok((record, events))
        }
    }
    /// Asks a running operation to stop; false when it was not running.
    fn cancel(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> impl Future<Output = Result<bool, ApiError>> + Send;
    fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> impl Future<Output = Result<OperationRecord, ApiError>> + Send;
    /// The sandbox's events after `after_seq` (of one operation, with
    /// `only`). The watcher is registered when this returns, so a stream
    /// opened before a submit holds the sandbox's output for its reader.
    fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<&OperationId>,
    ) -> impl Future<Output = Result<Events, ApiError>> + Send;
    /// Feeds `data` at `offset` of an operation's input; returns the
    /// input's end and whether it is closed (takes no more).
    fn write_input(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        offset: u64,
        data: Bytes,
        eof: bool,
    ) -> impl Future<Output = Result<(u64, bool), ApiError>> + Send;
    fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        size: corral_proto::TerminalSize,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Forks sandbox `parent` into a new sandbox `child` with its spec and
    /// a copy of its writable trees at one instant; how long the parent
    /// was frozen. `None`: this worker cannot fork that sandbox (gVisor, a
    /// writable root, a worker without the host's view or too old to
    /// know the call), so the caller copies another way.
    fn fork_sandbox(
        &self,
        parent: &SandboxId,
        child: &SandboxId,
    ) -> impl Future<Output = Result<Option<std::time::Duration>, ApiError>> + Send;
}

fn remote(e: ClientError) -> ApiError {
    let text = source_chain(&e);
    let why = e.reason().map(|reason| Why {
        reason,
        flag: e.flag(),
    });
    if e.is_refusal() {
        ApiError::Refused(text, why.unwrap_or(Why::new(Reason::AtCapacity)))
    } else if e.is_transient() {
        ApiError::Transient(text)
    } else if matches!(&e, ClientError::Status(s) if s.code() == tonic::Code::NotFound) {
        ApiError::NotFound(text)
    } else {
        ApiError::Rejected(text, why)
    }
}

impl WorkerApi for WorkerClient {
    fn describe(&self) -> String {
        format!("the worker at {}", self.url())
    }

    fn name(&self) -> String {
        format!("worker {}", self.url())
    }

    fn address(&self) -> String {
        self.url().to_string()
    }

    async fn create_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<SandboxInfo, ApiError> {
        WorkerClient::create_sandbox(self, Some(id), spec.clone())
            .await
            .map_err(remote)
    }

    async fn create_sandbox_traced(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        traceparent: Option<&str>,
    ) -> Result<SandboxInfo, ApiError> {
        WorkerClient::create_sandbox_traced(self, Some(id), spec.clone(), traceparent)
            .await
            .map_err(remote)
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        WorkerClient::get_sandbox(self, id).await.map_err(remote)
    }

    async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool, ApiError> {
        WorkerClient::destroy_sandbox(self, id)
            .await
            .map_err(remote)
    }

    async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<OperationRecord, ApiError> {
        WorkerClient::submit(self, sandbox, id, spec.clone())
            .await
            .map_err(remote)
    }

    async fn submit_traced(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
        traceparent: Option<&str>,
    ) -> Result<OperationRecord, ApiError> {
        WorkerClient::submit_traced(self, sandbox, id, spec.clone(), traceparent)
            .await
            .map_err(remote)
    }

    async fn run(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<(OperationRecord, Events), ApiError> {
        let (record, events) = WorkerClient::run(self, sandbox, id, spec.clone(), None)
            .await
            .map_err(remote)?;
        Ok((record, Box::pin(events.map(|e| e.map_err(remote)))))
    }

    async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, ApiError> {
        WorkerClient::cancel(self, sandbox, id)
            .await
            .map_err(remote)
    }

    async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, ApiError> {
        WorkerClient::operation(self, sandbox, id)
            .await
            .map_err(remote)
    }

    async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<&OperationId>,
    ) -> Result<Events, ApiError> {
        let stream = WorkerClient::watch(self, sandbox, after_seq, only)
            .await
            .map_err(remote)?;
        Ok(Box::pin(stream.map(|r| r.map_err(remote))))
    }

    async fn write_input(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        offset: u64,
        data: Bytes,
        eof: bool,
    ) -> Result<(u64, bool), ApiError> {
        WorkerClient::write_input(self, sandbox, id, offset, data, eof)
            .await
            .map_err(remote)
    }

    async fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        size: corral_proto::TerminalSize,
    ) -> Result<(), ApiError> {
        WorkerClient::resize_terminal(self, sandbox, id, size)
            .await
            .map_err(remote)
    }

    async fn fork_sandbox(
        &self,
        parent: &SandboxId,
        child: &SandboxId,
    ) -> Result<Option<std::time::Duration>, ApiError> {
        match WorkerClient::fork_sandbox(self, parent, std::slice::from_ref(child), 0).await {
            Ok(f) => Ok(Some(f.frozen)),
            Err(e) if e.reason() == Some(corral_proto::reason::Reason::NotApplicable) => Ok(None),
            Err(ClientError::Status(s)) if s.code() == tonic::Code::Unimplemented => Ok(None),
            Err(e) => Err(remote(e)),
        }
    }
}
