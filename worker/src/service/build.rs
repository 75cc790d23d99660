//! `BuildImage`: a client's context streamed to the worker's builder, the
//! build's output and result streamed back.

use std::pin::Pin;

use corral_proto::{Reason, pb};
use futures_util::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use super::{WorkerService, status};

/// The most of a context read (and dropped) from a client before it is
/// told this worker builds nothing.
const NO_BUILD_DRAIN: usize = 64 << 20;

/// The longest a build's context may go without a piece.
const CONTEXT_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) type BuildStream =
    Pin<Box<dyn Stream<Item = Result<pb::BuildImageEvent, Status>> + Send>>;

fn build_result(outcome: crate::build::Outcome, duration_ms: u64) -> pb::BuildImageResult {
    use crate::build::{FailureKind, Outcome};
    use pb::build_failure::Kind;
    match outcome {
        Outcome::Built { image, cached } => pb::BuildImageResult {
            image,
            cached,
            duration_ms,
            failure: None,
            template: None,
        },
        Outcome::Failed(f) => pb::BuildImageResult {
            image: String::new(),
            cached: false,
            duration_ms,
            template: None,
            failure: Some(pb::BuildFailure {
                kind: match f.kind {
                    FailureKind::StepFailed => Kind::StepFailed,
                    FailureKind::TimedOut => Kind::TimedOut,
                    FailureKind::Invalid => Kind::Invalid,
                } as i32,
                step: f.step,
                steps: f.steps,
                instruction: f.instruction,
                message: f.message,
            }),
        },
    }
}

impl WorkerService {
    pub(super) async fn build(
        &self,
        req: Request<tonic::Streaming<pb::BuildImageRequest>>,
    ) -> Result<Response<BuildStream>, Status> {
        let tenant = super::tenant_header(&req)?;
        let mut stream = req.into_inner();
        let Some(builder) = self.worker.builder() else {
            // What the client sends first is read (up to a bound): a call
            // ended while its client still writes may reach it as an
            // internal error instead of this refusal.
            let mut drained = 0usize;
            while drained < NO_BUILD_DRAIN {
                match tokio::time::timeout(CONTEXT_IDLE, stream.message()).await {
                    Ok(Ok(Some(m))) if !m.eof => drained += m.data.len().max(1),
                    _ => break,
                }
            }
            return Err(crate::error::WorkerError::Denied {
                flag: Some("--allow-build"),
                what: "this worker builds no images (its operator allows it with corral-worker --allow-build)".into(),
            }
            .into());
        };
        let started = std::time::Instant::now();
        let first = stream.message().await?.ok_or_else(|| {
            status(
                Code::InvalidArgument,
                Reason::InvalidArgument,
                "a build needs a first message",
            )
        })?;
        // Kept as a template once built, when it names one.
        let template = if first.template.is_empty() {
            None
        } else {
            corral_proto::template::check_name(&first.template)?;
            let start =
                corral_proto::template::TemplateStart::try_from(first.start.unwrap_or_default())?;
            Some((first.template, start))
        };
        let request = crate::build::Request {
            dockerfile: first.dockerfile,
            timeout: (first.timeout_ms > 0)
                .then(|| std::time::Duration::from_millis(first.timeout_ms)),
        };
        // The whole context first: nothing is built from part of one.
        let mut spooled = builder.spool().await?;
        let (mut data, mut eof) = (first.data, first.eof);
        loop {
            spooled.write(&data).await?;
            if eof {
                break;
            }
            // A client that sends nothing for a while holds no disk.
            let next = tokio::time::timeout(CONTEXT_IDLE, stream.message())
                .await
                .map_err(|_| {
                    status(
                        Code::DeadlineExceeded,
                        Reason::Incomplete,
                        format!(
                            "no piece of the build's context for {} s: the build was dropped",
                            CONTEXT_IDLE.as_secs()
                        ),
                    )
                })??;
            match next {
                Some(m) => (data, eof) = (m.data, m.eof),
                None => {
                    return Err(status(
                        Code::Cancelled,
                        Reason::Incomplete,
                        "the build's context ended without its eof",
                    ));
                }
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::BuildImageEvent, Status>>(16);
        let (out_tx, mut out_rx) = tokio::sync::mpsc::channel::<String>(16);
        // Owned by the response: it ends with the build, or stops the build
        // when the client goes away.
        let worker = self.worker.clone();
        tokio::spawn(async move {
            // Owns the output's receiver: when the client is gone the relay
            // ends and drops it, and the build, its sender, stops at once.
            let relay_tx = tx.clone();
            let relay = async move {
                let tx = relay_tx;
                loop {
                    let text = tokio::select! {
                        text = out_rx.recv() => text,
                        // The client is gone: so is the build's audience,
                        // which stops it.
                        () = tx.closed() => return,
                    };
                    let Some(text) = text else { return };
                    let event = pb::BuildImageEvent {
                        kind: Some(pb::build_image_event::Kind::Output(text)),
                    };
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
            };
            let (outcome, ()) = tokio::join!(builder.build(request, spooled, out_tx), relay);
            let duration_ms = started.elapsed().as_millis() as u64;
            let last = match outcome.map_err(Status::from) {
                Ok(o) => {
                    let built = match &o {
                        crate::build::Outcome::Built { image, .. } => Some(image.clone()),
                        crate::build::Outcome::Failed(_) => None,
                    };
                    let mut result = build_result(o, duration_ms);
                    match (built, template) {
                        (Some(image), Some((name, start))) => {
                            match worker
                                .keep_template(tenant, name, image, start, false)
                                .await
                            {
                                Ok(t) => {
                                    result.template = Some(t);
                                    Ok(result)
                                }
                                Err(e) => Err(Status::from(e)),
                            }
                        }
                        _ => Ok(result),
                    }
                }
                Err(e) => Err(e),
            }
            .map(|r| pb::BuildImageEvent {
                kind: Some(pb::build_image_event::Kind::Done(r)),
            });
            let _ = tx.send(last).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
