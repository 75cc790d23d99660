//! A fake worker for placement benchmarks: a real tonic server that
//! answers `GetWorkerInfo` with a fixed fullness (after a delay, if set)
//! and, when asked to, `RunOperation` with each run's end at once and the
//! stream's own end later; it refuses everything else. A black-holed
//! worker is a listener that never accepts: connections hang until the
//! caller's timeout.

use std::pin::Pin;
use std::time::Duration;

use corral_proto::pb;
use futures_util::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// How a fake worker answers.
#[derive(Debug, Clone, Copy, Default)]
pub struct FakeWorker {
    pub max_sandboxes: u32,
    pub sandboxes: u32,
    pub draining: bool,
    /// Each answer waits this long.
    pub delay: Duration,
    /// `RunOperation`, when set: every run is answered with its
    /// submission and its end (exit 0) at once, and the stream itself
    /// ends this long after; `cut` counts the streams that a client
    /// reset before their end.
    pub runs: Option<(Duration, &'static std::sync::atomic::AtomicU64)>,
}

/// A response stream that counts, when it is dropped before its end, one
/// stream cut short.
struct Counted<S> {
    inner: S,
    ended: bool,
    cut: &'static std::sync::atomic::AtomicU64,
}

impl<S: Stream + Unpin> Stream for Counted<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let next = Pin::new(&mut self.inner).poll_next(cx);
        if let std::task::Poll::Ready(None) = next {
            self.ended = true;
        }
        next
    }
}

impl<S> Drop for Counted<S> {
    fn drop(&mut self) {
        if !self.ended {
            self.cut.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn no<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented(
        "a fake worker answers GetWorkerInfo only",
    ))
}

#[tonic::async_trait]
impl pb::worker_server::Worker for FakeWorker {
    async fn create_sandbox(
        &self,
        _: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn get_sandbox(
        &self,
        _: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn list_sandboxes(
        &self,
        _: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        no()
    }
    async fn destroy_sandbox(
        &self,
        _: Request<pb::DestroySandboxRequest>,
    ) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        no()
    }
    async fn submit_operation(
        &self,
        _: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        no()
    }
    async fn list_templates(
        &self,
        _: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        no()
    }
    async fn delete_template(
        &self,
        _: Request<pb::DeleteTemplateRequest>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        no()
    }
    async fn snapshot_sandbox(
        &self,
        _: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::Template>, Status> {
        no()
    }
    async fn create_volume(
        &self,
        _: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::Volume>, Status> {
        no()
    }
    async fn list_volumes(
        &self,
        _: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        no()
    }
    async fn delete_volume(
        &self,
        _: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        no()
    }
    type RunOperationStream = Stream_<pb::RunOperationResponse>;
    async fn run_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<Self::RunOperationStream>, Status> {
        use corral_proto::{Event, EventKind, OperationId, OperationResult, Outcome};
        use pb::run_operation_response::Kind;
        let Some((end_after, cut)) = self.runs else {
            return no();
        };
        let req = req.into_inner();
        let sandbox = corral_proto::SandboxId::new(req.sandbox_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let id = OperationId::new(req.operation_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let spec = req
            .spec
            .ok_or_else(|| Status::invalid_argument("no spec"))?
            .try_into()
            .map_err(|e: corral_proto::ProtocolError| Status::invalid_argument(e.to_string()))?;
        let record = corral_proto::init::OperationRecord {
            id: id.clone(),
            spec,
            result: None,
            first_seq: 1,
            input_bytes: 0,
        };
        let end = Event {
            seq: 1,
            operation_id: Some(id),
            kind: EventKind::Finished(Box::new(OperationResult::with_outcome(Outcome::Exited {
                code: 0,
            }))),
        };
        let answers = [
            Kind::Submitted(record.to_pb(&sandbox)),
            Kind::Event(end.into()),
        ]
        .map(|kind| Ok(pb::RunOperationResponse { kind: Some(kind) }));
        let later = futures_util::stream::once(tokio::time::sleep(end_after))
            .filter_map(|()| std::future::ready(None));
        Ok(Response::new(Box::pin(Counted {
            inner: Box::pin(futures_util::stream::iter(answers).chain(later)),
            ended: false,
            cut,
        })))
    }
    async fn get_operation(
        &self,
        _: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        no()
    }
    async fn upload(
        &self,
        _: Request<Streaming<pb::UploadRequest>>,
    ) -> Result<Response<pb::Operation>, Status> {
        no()
    }
    type BuildImageStream = Stream_<pb::BuildImageEvent>;
    async fn build_image(
        &self,
        _: Request<Streaming<pb::BuildImageRequest>>,
    ) -> Result<Response<Self::BuildImageStream>, Status> {
        no()
    }
    type DownloadStream = Stream_<pb::DownloadResponse>;
    async fn download(
        &self,
        _: Request<pb::DownloadRequest>,
    ) -> Result<Response<Self::DownloadStream>, Status> {
        no()
    }
    async fn list_operations(
        &self,
        _: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        no()
    }
    async fn cancel_operation(
        &self,
        _: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::CancelOperationResponse>, Status> {
        no()
    }
    async fn signal_operation(
        &self,
        _: Request<pb::SignalOperationRequest>,
    ) -> Result<Response<pb::SignalOperationResponse>, Status> {
        no()
    }
    type WatchSandboxStream = Stream_<pb::SandboxEvent>;
    async fn watch_sandbox(
        &self,
        _: Request<pb::WatchSandboxRequest>,
    ) -> Result<Response<Self::WatchSandboxStream>, Status> {
        no()
    }
    async fn write_input(
        &self,
        _: Request<pb::WriteInputRequest>,
    ) -> Result<Response<pb::WriteInputResponse>, Status> {
        no()
    }
    async fn resize_terminal(
        &self,
        _: Request<pb::ResizeTerminalRequest>,
    ) -> Result<Response<pb::ResizeTerminalResponse>, Status> {
        no()
    }
    async fn reset_sandbox(
        &self,
        _: Request<pb::ResetSandboxRequest>,
    ) -> Result<Response<pb::ResetSandboxResponse>, Status> {
        no()
    }
    async fn set_sandbox_egress(
        &self,
        _: Request<pb::SetSandboxEgressRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn fork_sandbox(
        &self,
        _: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<pb::ForkSandboxResponse>, Status> {
        no()
    }
    async fn checkpoint_sandbox(
        &self,
        _: Request<pb::CheckpointSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn restore_sandbox(
        &self,
        _: Request<pb::RestoreSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn expose_port(
        &self,
        _: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::PortExposure>, Status> {
        no()
    }
    async fn revoke_access(
        &self,
        _: Request<pb::RevokeAccessRequest>,
    ) -> Result<Response<pb::RevokeAccessResponse>, Status> {
        no()
    }
    async fn list_exposures(
        &self,
        _: Request<pb::ListExposuresRequest>,
    ) -> Result<Response<pb::ListExposuresResponse>, Status> {
        no()
    }
    async fn get_sandbox_stats(
        &self,
        _: Request<pb::GetSandboxStatsRequest>,
    ) -> Result<Response<pb::SandboxStats>, Status> {
        no()
    }
    async fn drain(
        &self,
        _: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        no()
    }
    async fn get_worker_info(
        &self,
        _: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        tokio::time::sleep(self.delay).await;
        Ok(Response::new(pb::WorkerInfo {
            worker_id: "fake".into(),
            version: "0".into(),
            max_sandboxes: self.max_sandboxes,
            sandboxes: self.sandboxes,
            draining: self.draining,
            ..Default::default()
        }))
    }
}

/// Serves `worker` on a new loopback port until `stop`; its URL.
pub async fn serve(
    worker: FakeWorker,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    // TCP_NODELAY, as the real worker sets it: without it every answer
    // waits on Nagle and delayed ACKs.
    let incoming = futures_util::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |conn| {
            conn.inspect(|s| {
                let _ = s.set_nodelay(true);
            })
        },
    );
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(pb::worker_server::WorkerServer::new(worker))
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
            .await;
    });
    Ok((url, task))
}

/// A listener that never accepts (held until dropped): a worker whose
/// host is gone without a word.
pub fn black_hole() -> std::io::Result<(String, std::net::TcpListener)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((format!("http://{}", listener.local_addr()?), listener))
}
