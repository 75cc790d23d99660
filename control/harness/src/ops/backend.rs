//! What a manager needs from a worker, in-process or over gRPC.

use std::future::Future;
use std::pin::Pin;

use corral_proto::init::OperationRecord;
use corral_proto::{Event, OperationId, OperationSpec, SandboxId};
use corral_worker::{Worker, WorkerError};
use futures_util::{Stream, StreamExt};
use tokio::sync::Mutex;
use tokio_stream::wrappers::ReceiverStream;

use crate::client::{ClientError, Credentials, WorkerClient};

pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, BackendError>> + Send>>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Worth another try (the worker restarted, the network blinked).
    #[error("{0}")]
    Transient(String),
    /// Will not succeed however often it is tried.
    #[error("{0}")]
    Rejected(String),
}

pub trait Backend: Send + Sync + 'static {
    fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> impl Future<Output = Result<OperationRecord, BackendError>> + Send;
    fn cancel(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send;
    fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> impl Future<Output = Result<OperationRecord, BackendError>> + Send;
    fn last_seq(
        &self,
        sandbox: &SandboxId,
    ) -> impl Future<Output = Result<u64, BackendError>> + Send;
    fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
    ) -> impl Future<Output = Result<EventStream, BackendError>> + Send;
}

/// The worker library in this process: no network hop.
#[derive(Clone)]
pub struct LocalBackend {
    worker: Worker,
}

impl LocalBackend {
    pub fn new(worker: Worker) -> Self {
        Self { worker }
    }
}

fn local(e: WorkerError) -> BackendError {
    match e {
        WorkerError::Docker(_)
        | WorkerError::InitUnresponsive { .. }
        | WorkerError::ShuttingDown => BackendError::Transient(e.to_string()),
        _ => BackendError::Rejected(e.to_string()),
    }
}

impl Backend for LocalBackend {
    async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<OperationRecord, BackendError> {
        self.worker
            .submit(sandbox, id.clone(), spec.clone())
            .await
            .map_err(local)
    }

    async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, BackendError> {
        self.worker.cancel(sandbox, id).await.map_err(local)
    }

    async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, BackendError> {
        self.worker.operation(sandbox, id).map_err(local)
    }

    async fn last_seq(&self, sandbox: &SandboxId) -> Result<u64, BackendError> {
        Ok(self.worker.get_sandbox(sandbox).map_err(local)?.last_seq)
    }

    async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
    ) -> Result<EventStream, BackendError> {
        let rx = self.worker.watch(sandbox, after_seq, None).map_err(local)?;
        Ok(Box::pin(ReceiverStream::new(rx).map(Ok)))
    }
}

/// A worker over gRPC. A call that fails for a transient reason drops the
/// connection, and the next call makes a new one.
pub struct RemoteBackend {
    url: String,
    creds: Credentials,
    client: Mutex<Option<WorkerClient>>,
}

fn remote(e: ClientError) -> BackendError {
    if e.is_transient() {
        BackendError::Transient(e.to_string())
    } else {
        BackendError::Rejected(e.to_string())
    }
}

impl RemoteBackend {
    pub fn new(url: impl Into<String>, token: Option<String>) -> Self {
        Self::with_credentials(url, Credentials { token, tls: None })
    }

    pub fn with_credentials(url: impl Into<String>, creds: Credentials) -> Self {
        Self {
            url: url.into(),
            creds,
            client: Mutex::new(None),
        }
    }

    async fn client(&self) -> Result<WorkerClient, BackendError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = WorkerClient::connect_with(&self.url, &self.creds)
            .await
            .map_err(remote)?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn call<T, F, Fut>(&self, f: F) -> Result<T, BackendError>
    where
        F: FnOnce(WorkerClient) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let c = self.client().await?;
        match f(c).await {
            Ok(v) => Ok(v),
            Err(e) => {
                let e = remote(e);
                if matches!(e, BackendError::Transient(_)) {
                    *self.client.lock().await = None;
                }
                Err(e)
            }
        }
    }
}

impl Backend for RemoteBackend {
    async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<OperationRecord, BackendError> {
        self.call(|c| async move { c.submit(sandbox, id, spec.clone()).await })
            .await
    }

    async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, BackendError> {
        self.call(|c| async move { c.cancel(sandbox, id).await })
            .await
    }

    async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, BackendError> {
        self.call(|c| async move { c.operation(sandbox, id).await })
            .await
    }

    async fn last_seq(&self, sandbox: &SandboxId) -> Result<u64, BackendError> {
        self.call(|c| async move { c.get_sandbox(sandbox).await.map(|s| s.last_seq) })
            .await
    }

    async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
    ) -> Result<EventStream, BackendError> {
        let stream = self
            .call(|c| async move { c.watch(sandbox, after_seq, None).await })
            .await?;
        Ok(Box::pin(stream.map(|r| r.map_err(remote))))
    }
}
