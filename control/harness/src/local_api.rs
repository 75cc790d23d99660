//! The worker library in this process behind [`WorkerApi`] (feature
//! `local`): the same calls as over gRPC, without the network hop.

use bytes::Bytes;
use corral_proto::init::OperationRecord;
use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxInfo, SandboxSpec};
use corral_worker::{Worker, WorkerError};
use futures_util::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::worker_api::{ApiError, Events, Why, WorkerApi};

fn local(e: WorkerError) -> ApiError {
    let text = e.to_string();
    let why = Why {
        reason: e.code_and_reason().1,
        flag: match &e {
            WorkerError::Denied { flag, .. } => flag.map(String::from),
            _ => None,
        },
    };
    match e {
        WorkerError::UnknownSandbox(_)
        | WorkerError::Removed { .. }
        | WorkerError::UnknownOperation(_) => ApiError::NotFound(text),
        WorkerError::AtCapacity(_) | WorkerError::Draining => ApiError::Refused(text, why),
        WorkerError::Docker(_)
        | WorkerError::InitUnresponsive { .. }
        | WorkerError::Detached(_)
        | WorkerError::Busy { .. }
        | WorkerError::ShuttingDown => ApiError::Transient(text),
        _ => ApiError::Rejected(text, Some(why)),
    }
}

impl WorkerApi for Worker {
    fn describe(&self) -> String {
        "the worker in this process".into()
    }

    fn name(&self) -> String {
        format!("worker {} (in this process)", self.id())
    }

    fn address(&self) -> String {
        self.id().to_string()
    }

    async fn create_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<SandboxInfo, ApiError> {
        Worker::create_sandbox(self, Some(id.clone()), spec.clone())
            .await
            .map_err(local)
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        Worker::get_sandbox(self, id).await.map_err(local)
    }

    async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool, ApiError> {
        Worker::destroy_sandbox(self, id).await.map_err(local)
    }

    async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<OperationRecord, ApiError> {
        Worker::submit(self, sandbox, id.clone(), spec.clone())
            .await
            .map_err(local)
    }

    async fn run(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<(OperationRecord, Events), ApiError> {
        let (record, watch) = Worker::run_watched(self, sandbox, id.clone(), spec.clone(), None)
            .await
            .map_err(local)?;
        Ok((record, Box::pin(ReceiverStream::new(watch.events).map(Ok))))
    }

    async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, ApiError> {
        Worker::cancel(self, sandbox, id).await.map_err(local)
    }

    async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, ApiError> {
        Worker::operation(self, sandbox, id).await.map_err(local)
    }

    async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<&OperationId>,
    ) -> Result<Events, ApiError> {
        let rx = Worker::watch(self, sandbox, after_seq, only.cloned())
            .await
            .map_err(local)?
            .events;
        Ok(Box::pin(ReceiverStream::new(rx).map(Ok)))
    }

    async fn write_input(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        offset: u64,
        data: Bytes,
        eof: bool,
    ) -> Result<(u64, bool), ApiError> {
        let r = Worker::write_input(self, sandbox, id.clone(), offset, data, eof)
            .await
            .map_err(local)?;
        Ok((r.input_bytes, r.closed))
    }

    async fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        size: corral_proto::TerminalSize,
    ) -> Result<(), ApiError> {
        Worker::resize_terminal(self, sandbox, id.clone(), size)
            .await
            .map_err(local)
    }

    async fn fork_sandbox(
        &self,
        parent: &SandboxId,
        child: &SandboxId,
    ) -> Result<Option<std::time::Duration>, ApiError> {
        match Worker::fork_sandbox(self, parent, vec![child.clone()]).await {
            Ok(f) => Ok(Some(f.frozen)),
            Err(WorkerError::NotApplicable(_)) => Ok(None),
            Err(e) => Err(local(e)),
        }
    }
}
