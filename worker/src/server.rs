//! Serving the worker: the `corral.v1.Worker` service and server
//! reflection behind bearer-token auth, and standard gRPC health checking
//! (open to anyone).

use std::future::Future;

use corral_proto::limits::MAX_GRPC_MESSAGE_BYTES;
use corral_proto::pb;
use corral_proto::pb::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tonic::{Request, Status};

use crate::service::WorkerService;
use crate::worker::Worker;

/// Checks `authorization: Bearer <token>` in constant time.
#[derive(Clone)]
pub struct TokenAuth {
    expected: Option<String>,
}

impl TokenAuth {
    pub fn new(token: Option<String>) -> Self {
        Self { expected: token }
    }

    #[allow(clippy::result_large_err)]
    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let same = given.len() == expected.len()
            && given
                .bytes()
                .zip(expected.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if same {
            Ok(req)
        } else if given.is_empty() {
            Err(Status::unauthenticated("missing bearer token"))
        } else {
            Err(Status::unauthenticated("wrong bearer token"))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// How the server admits clients.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Bearer token required on every `corral.v1.Worker` call.
    pub token: Option<String>,
    /// TLS (and, with a client CA, mutual TLS).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// Serves until `shutdown` resolves. The listener is bound by the caller
/// (tests bind `127.0.0.1:0`).
pub async fn serve(
    worker: Worker,
    listener: TcpListener,
    token: Option<String>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    serve_with(
        worker,
        listener,
        ServeOptions { token, tls: None },
        shutdown,
    )
    .await
}

/// [`serve`] with TLS options.
pub async fn serve_with(
    worker: Worker,
    listener: TcpListener,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let token = options.token;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<WorkerServer<WorkerService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let auth = TokenAuth::new(token);
    // Reflection describes the API: only to those who may call it.
    let reflection_auth = auth.clone();
    let reflection = tonic::service::interceptor::InterceptedService::new(reflection, move |req| {
        reflection_auth.check(req)
    });
    let service = WorkerServer::new(WorkerService::new(worker))
        .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
    let service =
        tonic::service::interceptor::InterceptedService::new(service, move |req| auth.check(req));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = options.tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .add_service(health)
        .add_service(reflection)
        .add_service(service)
        // Accepted sockets are configured by the incoming stream, not by the
        // builder: without TCP_NODELAY here every reply waits on Nagle.
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await?;
    Ok(())
}
