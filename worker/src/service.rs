//! The gRPC edge: `corral.v1.Worker` over [`Worker`]. Generated types are
//! converted to validated domain types here, and errors to status codes.

use std::pin::Pin;

use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, pb};
use futures_util::{Stream, StreamExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::worker::Worker;

pub struct WorkerService {
    worker: Worker,
}

impl WorkerService {
    pub fn new(worker: Worker) -> Self {
        Self { worker }
    }
}

fn sandbox_id(s: String) -> Result<SandboxId, Status> {
    Ok(SandboxId::new(s)?)
}

fn operation_id(s: String) -> Result<OperationId, Status> {
    Ok(OperationId::new(s)?)
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SandboxEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let req = req.into_inner();
        let id = if req.id.is_empty() {
            None
        } else {
            Some(sandbox_id(req.id)?)
        };
        let spec = SandboxSpec::try_from(req.spec.unwrap_or_default())?;
        let info = self.worker.create_sandbox(id, spec).await?;
        Ok(Response::new(info.into()))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let id = sandbox_id(req.into_inner().id)?;
        Ok(Response::new(self.worker.get_sandbox(&id)?.into()))
    }

    async fn list_sandboxes(
        &self,
        _req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let sandboxes = self
            .worker
            .list_sandboxes()
            .into_iter()
            .map(Into::into)
            .collect();
        Ok(Response::new(pb::ListSandboxesResponse { sandboxes }))
    }

    async fn destroy_sandbox(
        &self,
        req: Request<pb::DestroySandboxRequest>,
    ) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        let id = sandbox_id(req.into_inner().id)?;
        let existed = self.worker.destroy_sandbox(&id).await?;
        Ok(Response::new(pb::DestroySandboxResponse { existed }))
    }

    async fn submit_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let oid = operation_id(req.operation_id)?;
        let spec = OperationSpec::try_from(
            req.spec
                .ok_or(corral_proto::ProtocolError::Missing("spec"))?,
        )?;
        let record = self.worker.submit(&sid, oid, spec).await?;
        Ok(Response::new(record.to_pb(&sid)))
    }

    async fn get_operation(
        &self,
        req: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let oid = operation_id(req.operation_id)?;
        Ok(Response::new(
            self.worker.operation(&sid, &oid)?.to_pb(&sid),
        ))
    }

    async fn list_operations(
        &self,
        req: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let sid = sandbox_id(req.into_inner().sandbox_id)?;
        let operations = self
            .worker
            .list_operations(&sid)?
            .iter()
            .map(|o| o.to_pb(&sid))
            .collect();
        Ok(Response::new(pb::ListOperationsResponse { operations }))
    }

    async fn cancel_operation(
        &self,
        req: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::CancelOperationResponse>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let oid = operation_id(req.operation_id)?;
        let canceling = self.worker.cancel(&sid, &oid).await?;
        Ok(Response::new(pb::CancelOperationResponse { canceling }))
    }

    type WatchSandboxStream = EventStream;

    async fn watch_sandbox(
        &self,
        req: Request<pb::WatchSandboxRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let only = if req.operation_id.is_empty() {
            None
        } else {
            Some(operation_id(req.operation_id)?)
        };
        let rx = self.worker.watch(&sid, req.after_seq, only)?;
        let stream = ReceiverStream::new(rx).map(|e| Ok(pb::SandboxEvent::from(e)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write_input(
        &self,
        req: Request<pb::WriteInputRequest>,
    ) -> Result<Response<pb::WriteInputResponse>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let oid = operation_id(req.operation_id)?;
        let reply = self
            .worker
            .write_input(&sid, oid, req.offset, req.data, req.eof)
            .await?;
        Ok(Response::new(pb::WriteInputResponse {
            input_bytes: reply.input_bytes,
            closed: reply.closed,
        }))
    }

    async fn resize_terminal(
        &self,
        req: Request<pb::ResizeTerminalRequest>,
    ) -> Result<Response<pb::ResizeTerminalResponse>, Status> {
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        let oid = operation_id(req.operation_id)?;
        let size = corral_proto::TerminalSize::try_from(
            req.size
                .ok_or(corral_proto::ProtocolError::Missing("size"))?,
        )?;
        self.worker.resize_terminal(&sid, oid, size).await?;
        Ok(Response::new(pb::ResizeTerminalResponse {}))
    }

    async fn reset_sandbox(
        &self,
        req: Request<pb::ResetSandboxRequest>,
    ) -> Result<Response<pb::ResetSandboxResponse>, Status> {
        let sid = sandbox_id(req.into_inner().id)?;
        let killed = self.worker.reset_sandbox(&sid).await?;
        Ok(Response::new(pb::ResetSandboxResponse { killed }))
    }

    async fn get_sandbox_stats(
        &self,
        req: Request<pb::GetSandboxStatsRequest>,
    ) -> Result<Response<pb::SandboxStats>, Status> {
        let sid = sandbox_id(req.into_inner().sandbox_id)?;
        Ok(Response::new(self.worker.sandbox_stats(&sid).await?.into()))
    }

    async fn get_worker_info(
        &self,
        _req: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(self.worker.info().into()))
    }
}
