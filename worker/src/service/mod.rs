//! The gRPC edge: `corral.v1.Worker` over [`Worker`]. Generated types are
//! converted to validated domain types here, and errors to status codes.

use std::pin::Pin;

use corral_proto::init::OperationRecord;
use corral_proto::limits::LIST_PAGE_BYTES;
use corral_proto::sandbox::{TENANT_HEADER, TENANT_LABEL};
use corral_proto::{OperationId, OperationSpec, Reason, SandboxId, SandboxSpec, pb};
use futures_util::{Stream, StreamExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use crate::worker::Worker;

pub struct WorkerService {
    worker: Worker,
}

impl WorkerService {
    pub fn new(worker: Worker) -> Self {
        Self { worker }
    }
}

/// An error status with its machine-readable reason.
fn status(code: Code, reason: Reason, message: impl Into<String>) -> Status {
    corral_proto::reason::status(code, reason, None, message)
}

/// The tenant a front door makes this call for (see [`TENANT_HEADER`]):
/// the worker then answers for that tenant's sandboxes alone.
fn tenant_header<T>(req: &Request<T>) -> Result<Option<String>, Status> {
    let Some(value) = req.metadata().get(TENANT_HEADER) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(t) if corral_proto::sandbox::is_tenant_name(t) => Ok(Some(t.to_string())),
        _ => Err(invalid(
            TENANT_HEADER,
            "not a tenant's name (1-63 characters of [a-z0-9-])".into(),
        )),
    }
}

impl WorkerService {
    /// For a call made for `tenant`: `id` must be that tenant's; another's
    /// is answered exactly as one that does not exist.
    /// A submit's request (`SubmitOperation`, `RunOperation`), checked:
    /// its sandbox the caller's, its ids and spec well formed.
    fn submission(&self, req: Request<pb::SubmitOperationRequest>) -> Result<Submission, Status> {
        let tenant = tenant_header(&req)?;
        let traceparent = traceparent_of(&req);
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(req.operation_id)?;
        let spec = OperationSpec::try_from(
            req.spec
                .ok_or(corral_proto::ProtocolError::Missing("spec"))?,
        )?;
        Ok(Submission {
            sid,
            oid,
            spec,
            traceparent,
        })
    }

    fn owned(&self, tenant: &Option<String>, id: &SandboxId) -> Result<(), Status> {
        let Some(tenant) = tenant else {
            return Ok(());
        };
        match self.worker.owner(id) {
            Some(Some(owner)) if owner == *tenant => Ok(()),
            _ => Err(crate::error::WorkerError::UnknownSandbox(id.to_string()).into()),
        }
    }
}

fn sandbox_id(s: String) -> Result<SandboxId, Status> {
    Ok(SandboxId::new(s)?)
}

fn invalid(field: &'static str, why: String) -> Status {
    crate::error::WorkerError::Invalid(corral_proto::ProtocolError::invalid(field, why)).into()
}

fn operation_id(s: String) -> Result<OperationId, Status> {
    Ok(OperationId::new(s)?)
}

/// What a submit asks for.
struct Submission {
    sid: SandboxId,
    oid: OperationId,
    spec: OperationSpec,
    traceparent: Option<String>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SandboxEvent, Status>> + Send>>;
type RunStream = Pin<Box<dyn Stream<Item = Result<pb::RunOperationResponse, Status>> + Send>>;
type DownloadStream = Pin<Box<dyn Stream<Item = Result<pb::DownloadResponse, Status>> + Send>>;
use build::BuildStream;

mod build;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let traceparent = traceparent_of(&req);
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let id = if req.id.is_empty() {
            None
        } else {
            Some(sandbox_id(req.id)?)
        };
        let mut spec = SandboxSpec::try_from(req.spec.unwrap_or_default())?;
        if let Some(tenant) = tenant {
            spec.labels.remove(TENANT_LABEL);
            if spec.labels.len() >= corral_proto::limits::MAX_LABELS {
                return Err(invalid(
                    "labels",
                    format!(
                        "a tenant's sandbox has at most {} labels of its own",
                        corral_proto::limits::MAX_LABELS - 1
                    ),
                ));
            }
            spec.labels.insert(TENANT_LABEL.into(), tenant);
        }
        let info = self
            .worker
            .create_sandbox_traced(id, spec, traceparent)
            .await?;
        Ok(Response::new(info.into()))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let tenant = tenant_header(&req)?;
        let id = sandbox_id(req.into_inner().id)?;
        self.owned(&tenant, &id)?;
        Ok(Response::new(self.worker.get_sandbox(&id).await?.into()))
    }

    async fn set_sandbox_egress(
        &self,
        req: Request<pb::SetSandboxEgressRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let id = sandbox_id(req.id)?;
        self.owned(&tenant, &id)?;
        let rules = corral_proto::egress::parse_rules(&req.rules, false)
            .map_err(crate::error::WorkerError::from)?;
        Ok(Response::new(
            self.worker.set_sandbox_egress(&id, rules).await?.into(),
        ))
    }

    async fn checkpoint_sandbox(
        &self,
        req: Request<pb::CheckpointSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let tenant = tenant_header(&req)?;
        let id = sandbox_id(req.into_inner().id)?;
        self.owned(&tenant, &id)?;
        Ok(Response::new(
            self.worker.checkpoint_sandbox(&id).await?.into(),
        ))
    }

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::PortExposure>, Status> {
        let tenant = tenant_header(&req)?;
        let r = req.into_inner();
        let id = sandbox_id(r.sandbox_id.clone())?;
        self.owned(&tenant, &id)?;
        let (port, access, ttl) = crate::ports::from_pb(&r)?;
        let e = self
            .worker
            .expose_port(&id, port, access, ttl, r.wake_on_request)
            .await?;
        Ok(Response::new(crate::ports::to_pb(e)))
    }

    async fn revoke_access(
        &self,
        req: Request<pb::RevokeAccessRequest>,
    ) -> Result<Response<pb::RevokeAccessResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let r = req.into_inner();
        let id = sandbox_id(r.sandbox_id)?;
        self.owned(&tenant, &id)?;
        let port = crate::ports::port_of(r.port)?;
        let revoked = self.worker.revoke_access(&id, port).await?;
        Ok(Response::new(pb::RevokeAccessResponse { revoked }))
    }

    async fn list_exposures(
        &self,
        req: Request<pb::ListExposuresRequest>,
    ) -> Result<Response<pb::ListExposuresResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let id = sandbox_id(req.into_inner().sandbox_id)?;
        self.owned(&tenant, &id)?;
        let exposures = self.worker.list_exposures(&id).await?;
        Ok(Response::new(pb::ListExposuresResponse {
            exposures: exposures.into_iter().map(crate::ports::to_pb).collect(),
        }))
    }

    async fn restore_sandbox(
        &self,
        req: Request<pb::RestoreSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let tenant = tenant_header(&req)?;
        let id = sandbox_id(req.into_inner().id)?;
        self.owned(&tenant, &id)?;
        Ok(Response::new(
            self.worker.restore_sandbox(&id).await?.into(),
        ))
    }

    async fn fork_sandbox(
        &self,
        req: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<pb::ForkSandboxResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let id = sandbox_id(req.id)?;
        self.owned(&tenant, &id)?;
        let ids = if req.child_ids.is_empty() {
            let n = usize::try_from(req.count).unwrap_or(usize::MAX);
            if n == 0 || n > crate::fork::MAX_CHILDREN {
                return Err(invalid(
                    "count",
                    format!("a fork makes 1 to {} children", crate::fork::MAX_CHILDREN),
                ));
            }
            (0..n).map(|_| SandboxId::random()).collect()
        } else if req.count != 0 && req.count as usize != req.child_ids.len() {
            return Err(invalid(
                "count",
                "differs from the number of child_ids (give one or the other)".into(),
            ));
        } else {
            req.child_ids
                .into_iter()
                .map(sandbox_id)
                .collect::<Result<Vec<_>, _>>()?
        };
        let f = self.worker.fork_sandbox(&id, ids).await?;
        Ok(Response::new(pb::ForkSandboxResponse {
            children: f.children.into_iter().map(Into::into).collect(),
            frozen_us: u64::try_from(f.frozen.as_micros()).unwrap_or(u64::MAX),
            copied_entries: f.copied.entries,
            copied_bytes: f.copied.bytes,
            left_out: f.copied.left_out,
            notes: f.copied.notes,
        }))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let sandboxes = self
            .worker
            .list_sandboxes()
            .into_iter()
            .filter(|s| tenant.is_none() || s.spec.labels.get(TENANT_LABEL) == tenant.as_ref())
            .map(Into::into)
            .collect();
        Ok(Response::new(pb::ListSandboxesResponse { sandboxes }))
    }

    async fn destroy_sandbox(
        &self,
        req: Request<pb::DestroySandboxRequest>,
    ) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let id = sandbox_id(req.into_inner().id)?;
        self.owned(&tenant, &id)?;
        let existed = self.worker.destroy_sandbox(&id).await?;
        Ok(Response::new(pb::DestroySandboxResponse { existed }))
    }

    async fn submit_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let Submission {
            sid,
            oid,
            spec,
            traceparent,
        } = self.submission(req)?;
        let record = self
            .worker
            .submit_traced(&sid, oid, spec, traceparent)
            .await?;
        Ok(Response::new(record.to_pb(&sid)))
    }

    async fn list_templates(
        &self,
        req: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        let tenant = tenant_header(&req)?;
        Ok(Response::new(pb::ListTemplatesResponse {
            templates: self.worker.list_templates(tenant.as_deref()),
        }))
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::Template>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let id = sandbox_id(req.id)?;
        self.owned(&tenant, &id)?;
        let t = self.worker.snapshot_sandbox(&id, req.template).await?;
        Ok(Response::new(t))
    }

    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::Volume>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let v = self
            .worker
            .create_volume(tenant.as_deref(), &req.name, req.size_bytes)
            .await?;
        Ok(Response::new(v))
    }

    async fn list_volumes(
        &self,
        req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let tenant = tenant_header(&req)?;
        Ok(Response::new(pb::ListVolumesResponse {
            volumes: self.worker.list_volumes(tenant.as_deref()),
        }))
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let existed = self
            .worker
            .delete_volume(tenant.as_deref(), &req.into_inner().name)
            .await?;
        Ok(Response::new(pb::DeleteVolumeResponse { existed }))
    }

    async fn delete_template(
        &self,
        req: Request<pb::DeleteTemplateRequest>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let existed = self
            .worker
            .delete_template(tenant.as_deref(), &req.name, req.force)
            .await?;
        Ok(Response::new(pb::DeleteTemplateResponse { existed }))
    }

    type RunOperationStream = RunStream;

    async fn run_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<RunStream>, Status> {
        let Submission {
            sid,
            oid,
            spec,
            traceparent,
        } = self.submission(req)?;
        let (record, watch) = self
            .worker
            .run_watched(&sid, oid, spec, traceparent)
            .await?;
        let submitted = pb::RunOperationResponse {
            kind: Some(pb::run_operation_response::Kind::Submitted(
                record.to_pb(&sid),
            )),
        };
        // Its events to its end, then no more (the end is not waited on:
        // nothing is asked of the watch past its Finished).
        let events = Box::pin(events_of(self.worker.clone(), sid, watch));
        let events = futures_util::stream::unfold(Some(events), |state| async move {
            let mut events = state?;
            let e = events.next().await?;
            let finished = matches!(
                &e,
                Ok(pb::SandboxEvent {
                    kind: Some(pb::sandbox_event::Kind::Finished(_)),
                    ..
                })
            );
            let e = e.map(|e| pb::RunOperationResponse {
                kind: Some(pb::run_operation_response::Kind::Event(e)),
            });
            Some((e, (!finished).then_some(events)))
        });
        let stream = futures_util::stream::once(std::future::ready(Ok(submitted))).chain(events);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_operation(
        &self,
        req: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(req.operation_id)?;
        Ok(Response::new(
            self.worker.operation(&sid, &oid).await?.to_pb(&sid),
        ))
    }

    async fn upload(
        &self,
        req: Request<tonic::Streaming<pb::UploadRequest>>,
    ) -> Result<Response<pb::Operation>, Status> {
        let tenant = tenant_header(&req)?;
        let mut stream = req.into_inner();
        let first = stream.message().await?.ok_or_else(|| {
            status(
                Code::InvalidArgument,
                Reason::InvalidArgument,
                "an upload needs a first message",
            )
        })?;
        let sid = sandbox_id(first.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(first.operation_id)?;
        let spec = OperationSpec::PutArchive(corral_proto::ArchiveSpec::new(first.path));
        spec.validate()?;
        // Watched before it is submitted: its end cannot be missed.
        let after = self.worker.get_sandbox(&sid).await?.last_seq;
        let mut events = self
            .worker
            .watch(&sid, after, Some(oid.clone()))
            .await?
            .events;
        self.worker.submit(&sid, oid.clone(), spec).await?;
        let mut offset = 0u64;
        let (mut data, mut eof) = (first.data, first.eof);
        loop {
            if !data.is_empty() || eof {
                let len = data.len() as u64;
                let written = self
                    .worker
                    .write_input(&sid, oid.clone(), offset, data, eof)
                    .await;
                let reply = match written {
                    Ok(reply) => reply,
                    Err(e) => {
                        // A refused piece (over 1 MiB, say) ends the upload:
                        // nothing is left waiting for the rest.
                        let _ = self.worker.cancel(&sid, &oid).await;
                        return Err(e.into());
                    }
                };
                offset += len;
                // Ended, or the sandbox side stopped (it failed): its end
                // says why.
                if eof || reply.closed {
                    break;
                }
            }
            let gone = match stream.message().await {
                Ok(Some(m)) => {
                    (data, eof) = (m.data, m.eof);
                    continue;
                }
                Ok(None) => status(
                    Code::Cancelled,
                    Reason::Incomplete,
                    "the upload ended without its eof",
                ),
                Err(e) => e,
            };
            // The client is gone: so is what it was sending.
            let _ = self.worker.cancel(&sid, &oid).await;
            return Err(gone);
        }
        while let Some(event) = events.recv().await {
            match event.kind {
                corral_proto::EventKind::Finished(_) => {
                    return Ok(Response::new(
                        self.worker.operation(&sid, &oid).await?.to_pb(&sid),
                    ));
                }
                corral_proto::EventKind::SandboxLost { reason } => {
                    return Err(status(
                        Code::Unavailable,
                        Reason::SandboxLost,
                        format!("the sandbox was lost: {reason}"),
                    ));
                }
                _ => {}
            }
        }
        Err(status(
            Code::Unavailable,
            Reason::Incomplete,
            "the worker stopped watching the upload",
        ))
    }

    type BuildImageStream = BuildStream;

    async fn build_image(
        &self,
        req: Request<tonic::Streaming<pb::BuildImageRequest>>,
    ) -> Result<Response<BuildStream>, Status> {
        self.build(req).await
    }

    async fn download(
        &self,
        req: Request<pb::DownloadRequest>,
    ) -> Result<Response<DownloadStream>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(req.operation_id)?;
        let archive = req
            .archive
            .ok_or(corral_proto::ProtocolError::Missing("archive"))?;
        let spec = OperationSpec::GetArchive(corral_proto::ArchiveSpec {
            path: archive.path,
            contents: archive.contents,
        });
        spec.validate()?;
        let after = self.worker.get_sandbox(&sid).await?.last_seq;
        let mut events = self
            .worker
            .watch(&sid, after, Some(oid.clone()))
            .await?
            .events;
        self.worker.submit(&sid, oid.clone(), spec).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let worker = self.worker.clone();
        // Owned by the response: it ends with the operation, or when the
        // client goes away (and then cancels the operation).
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let msg = match event.kind {
                    corral_proto::EventKind::Output {
                        stream: corral_proto::OutputStream::Stdout,
                        data,
                    } => Ok(pb::DownloadResponse {
                        data,
                        finished: None,
                    }),
                    corral_proto::EventKind::Finished(_) => {
                        let last = worker
                            .operation(&sid, &oid)
                            .await
                            .map(|r| pb::DownloadResponse {
                                data: bytes::Bytes::new(),
                                finished: Some(r.to_pb(&sid)),
                            })
                            .map_err(Status::from);
                        let _ = tx.send(last).await;
                        return;
                    }
                    corral_proto::EventKind::SandboxLost { reason } => {
                        let _ = tx
                            .send(Err(status(
                                Code::Unavailable,
                                Reason::SandboxLost,
                                format!("the sandbox was lost: {reason}"),
                            )))
                            .await;
                        return;
                    }
                    // Part of the archive is gone: never a cut archive
                    // that ends as if whole.
                    corral_proto::EventKind::Gap { from, to } => {
                        let _ = worker.cancel(&sid, &oid).await;
                        let _ = tx
                            .send(Err(status(Code::DataLoss, Reason::Incomplete, format!(
                                "events {from}..={to} of the archive were dropped by the worker's journal: the download is incomplete"
                            ))))
                            .await;
                        return;
                    }
                    _ => continue,
                };
                if tx.send(msg).await.is_err() {
                    let _ = worker.cancel(&sid, &oid).await;
                    return;
                }
            }
            // The watch was dropped (a client that took too long to read,
            // a sandbox removed, a worker stopping): the stream ends with
            // an error, never as if the archive were whole.
            let _ = worker.cancel(&sid, &oid).await;
            let _ = tx
                .send(Err(status(
                    Code::Unavailable,
                    Reason::Incomplete,
                    "the worker stopped following this download before it finished (its watch was dropped): the archive is incomplete",
                )))
                .await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_operations(
        &self,
        req: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let all = self.worker.list_operations(&sid).await?;
        let (operations, next_page_token) = list_page(&sid, &all, &req.page_token)?;
        Ok(Response::new(pb::ListOperationsResponse {
            operations,
            next_page_token,
        }))
    }

    async fn cancel_operation(
        &self,
        req: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::CancelOperationResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(req.operation_id)?;
        let canceling = self.worker.cancel(&sid, &oid).await?;
        Ok(Response::new(pb::CancelOperationResponse { canceling }))
    }

    async fn signal_operation(
        &self,
        req: Request<pb::SignalOperationRequest>,
    ) -> Result<Response<pb::SignalOperationResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let oid = operation_id(req.operation_id)?;
        let delivered = self.worker.signal(&sid, &oid, req.signal).await?;
        Ok(Response::new(pb::SignalOperationResponse { delivered }))
    }

    type WatchSandboxStream = EventStream;
    type DownloadStream = DownloadStream;

    async fn watch_sandbox(
        &self,
        req: Request<pb::WatchSandboxRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
        let only = if req.operation_id.is_empty() {
            None
        } else {
            Some(operation_id(req.operation_id)?)
        };
        let watch = self.worker.watch(&sid, req.after_seq, only).await?;
        let stream = events_of(self.worker.clone(), sid, watch);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write_input(
        &self,
        req: Request<pb::WriteInputRequest>,
    ) -> Result<Response<pb::WriteInputResponse>, Status> {
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
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
        let tenant = tenant_header(&req)?;
        let req = req.into_inner();
        let sid = sandbox_id(req.sandbox_id)?;
        self.owned(&tenant, &sid)?;
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
        let tenant = tenant_header(&req)?;
        let sid = sandbox_id(req.into_inner().id)?;
        self.owned(&tenant, &sid)?;
        let killed = self.worker.reset_sandbox(&sid).await?;
        Ok(Response::new(pb::ResetSandboxResponse { killed }))
    }

    async fn get_sandbox_stats(
        &self,
        req: Request<pb::GetSandboxStatsRequest>,
    ) -> Result<Response<pb::SandboxStats>, Status> {
        let tenant = tenant_header(&req)?;
        let sid = sandbox_id(req.into_inner().sandbox_id)?;
        self.owned(&tenant, &sid)?;
        Ok(Response::new(self.worker.sandbox_stats(&sid).await?.into()))
    }

    async fn get_worker_info(
        &self,
        _req: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(self.worker.info().into()))
    }

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        if tenant_header(&req)?.is_some() {
            return Err(status(
                Code::PermissionDenied,
                Reason::PermissionDenied,
                "a worker is drained by its operator, never for a tenant",
            ));
        }
        let info = self.worker.drain(req.into_inner().drain)?;
        Ok(Response::new(info.into()))
    }
}

/// Where an operation sorts in a listing (the order of
/// [`crate::sandbox::Sandbox::operations`]), as a page token.
fn list_key(o: &OperationRecord) -> String {
    if o.first_seq == 0 {
        format!("u:{}", o.id)
    } else {
        format!("s{:020}:{}", o.first_seq, o.id)
    }
}

/// One page of a listing, oldest first, from after `token`: about
/// [`LIST_PAGE_BYTES`] of operations (at least one), and the token of the
/// next page when more follow.
fn list_page(
    sid: &SandboxId,
    all: &[OperationRecord],
    token: &str,
) -> Result<(Vec<pb::Operation>, String), Status> {
    use prost::Message;
    let ours = token.is_empty() || token.starts_with("u:") || token.starts_with('s');
    if !ours || token.len() > 256 {
        return Err(status(
            Code::InvalidArgument,
            Reason::InvalidArgument,
            "page_token: not one this worker gave",
        ));
    }
    let mut page = Vec::new();
    let mut bytes = 0;
    let mut rest = all
        .iter()
        .filter(|o| token.is_empty() || list_key(o).as_str() > token)
        .peekable();
    while let Some(o) = rest.next() {
        let op = o.to_pb(sid);
        bytes += op.encoded_len();
        page.push(op);
        if bytes >= LIST_PAGE_BYTES && rest.peek().is_some() {
            return Ok((page, list_key(o)));
        }
    }
    Ok((page, String::new()))
}

/// The caller's W3C trace context, when it traces: bounded here, and
/// checked before anything is kept of it (see [`crate::telemetry`]).
fn traceparent_of<T>(req: &Request<T>) -> Option<String> {
    req.metadata()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= 64)
        .map(str::to_string)
}

/// A watch's events as a stream of the API's. A watch the worker drops
/// ends with ABORTED, never as if the sandbox had nothing more to say: its
/// client resumes from the seq of the last event it got.
fn events_of(
    worker: Worker,
    sid: SandboxId,
    watch: crate::sandbox::Watch,
) -> impl Stream<Item = Result<pb::SandboxEvent, Status>> + Send {
    futures_util::stream::unfold(Some(watch), move |state| {
        let worker = worker.clone();
        let sid = sid.clone();
        async move {
            let mut watch = state?;
            match watch.events.recv().await {
                Some(e) => {
                    worker.streamed(e.output_len());
                    Some((Ok(pb::SandboxEvent::from(e)), Some(watch)))
                }
                None if watch.was_dropped() => Some((
                    Err(status(
                        Code::Aborted,
                        Reason::Incomplete,
                        "the worker dropped this watch: it took nothing while holding the \
                         sandbox's output back; watch again after the last seq received",
                    )),
                    None,
                )),
                // The sandbox went (removed, its worker stopping):
                // said, never an end as if it had nothing more to say.
                None => match worker.get_sandbox(&sid).await {
                    Err(e) => Some((Err(Status::from(e)), None)),
                    Ok(_) if worker.shutting_down() => Some((
                        Err(status(
                            Code::Unavailable,
                            Reason::ShuttingDown,
                            "the worker is shutting down; its sandboxes go on: watch again",
                        )),
                        None,
                    )),
                    Ok(_) => None,
                },
            }
        }
    })
}
