//! Serving the worker: the `corral.v1.Worker` service and server
//! reflection behind bearer-token auth, and standard gRPC health checking
//! (open to anyone).

use std::future::Future;

use corral_proto::limits::{MAX_GRPC_MESSAGE_BYTES, MAX_REQUEST_BYTES};
use corral_proto::pb;
use corral_proto::pb::worker_server::WorkerServer;
use tokio::net::TcpListener;
use tonic::{Request, Status};

pub use crate::admission::Admission;
use std::sync::Arc;

use crate::admission::AdmittedInfo;
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
            mark_authenticated(&req);
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
            mark_authenticated(&req);
            Ok(req)
        } else if given.is_empty() {
            Err(corral_proto::reason::status(
                tonic::Code::Unauthenticated,
                corral_proto::Reason::Unauthenticated,
                None,
                "missing bearer token: present this worker's token (the file its --token-file names, by default `token` in its state directory)",
            ))
        } else {
            Err(corral_proto::reason::status(
                tonic::Code::Unauthenticated,
                corral_proto::Reason::Unauthenticated,
                None,
                "wrong bearer token: present this worker's token (the file its --token-file names, by default `token` in its state directory)",
            ))
        }
    }
}

/// Tells admission that the connection of `req` made an authenticated
/// call (see [`crate::admission`]).
pub fn mark_authenticated(req: &Request<()>) {
    let ext = req.extensions();
    if let Some(info) = ext.get::<AdmittedInfo>() {
        info.authenticated();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("{0}")]
    Gateway(String),
}

/// How the server admits clients.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Bearer token required on every `corral.v1.Worker` call.
    pub token: Option<String>,
    /// TLS (and, with a client CA, mutual TLS).
    pub tls: Option<crate::process::ServerTls>,
    /// Limits on connections and on how long one may stay silent.
    pub admission: Admission,
    /// Bytes of request messages read at once, across all connections
    /// (`None`: [`crate::budget::DEFAULT_BYTES`]).
    pub request_memory: Option<usize>,
}

/// The worker's services behind its request budget.
type Routes = tonic::transport::server::Router<
    tower::layer::util::Stack<crate::budget::BudgetLayer, tower::layer::util::Identity>,
>;

/// Streams one connection may have open at once.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

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
        ServeOptions {
            token,
            ..ServeOptions::default()
        },
        shutdown,
    )
    .await
}

/// Keeps the health service saying what the worker is: SERVING, or
/// NOT_SERVING while it drains (for the whole server, "", which is what a
/// Kubernetes gRPC probe asks about, and for `corral.v1.Worker`). Ends when
/// the worker is gone.
async fn report_health(worker: &Worker, reporter: tonic_health::server::HealthReporter) {
    use tonic_health::ServingStatus;
    let mut drain = worker.drain_state();
    loop {
        let status = if drain.borrow_and_update().is_some() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        };
        reporter.set_service_status("", status).await;
        reporter
            .set_service_status(
                <WorkerServer<WorkerService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
        if drain.changed().await.is_err() {
            return;
        }
    }
}

/// Serves `router` on `incoming` until `shutdown`, with the health service
/// following the worker's drain meanwhile.
async fn run<IO, IE>(
    worker: Worker,
    router: Routes,
    reporter: tonic_health::server::HealthReporter,
    incoming: impl futures_util::Stream<Item = Result<IO, IE>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let served = router.serve_with_incoming_shutdown(incoming, shutdown);
    tokio::pin!(served);
    let health = report_health(&worker, reporter);
    tokio::select! {
        r = &mut served => return Ok(r?),
        () = health => {}
    }
    Ok(served.await?)
}

/// The worker's services (health open to anyone; the worker service and
/// reflection behind the token), ready to serve on any transport.
async fn router(
    worker: Worker,
    token: Option<String>,
    budget: crate::budget::Budget,
) -> Result<(Routes, tonic_health::server::HealthReporter), ServeError> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let auth = TokenAuth::new(token);
    let http_auth = Arc::new(auth.clone());
    // Reflection describes the API: only to those who may call it.
    let reflection_auth = auth.clone();
    let reflection = tonic::service::interceptor::InterceptedService::new(reflection, move |req| {
        reflection_auth.check(req)
    });
    let service = WorkerServer::new(WorkerService::new(worker))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
    let service =
        tonic::service::interceptor::InterceptedService::new(service, move |req| auth.check(req));
    // Dead peers are found by HTTP/2 pings and closed.
    // HTTP/1.1 too, for the HTTP/JSON gateway on the same address.
    // TLS, when there is one, is done by admission.
    let mut builder = tonic::transport::Server::builder()
        .accept_http1(true)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .layer(crate::budget::BudgetLayer(budget));
    let grpc = tonic::service::Routes::new(health)
        .add_service(reflection)
        .add_service(service)
        .into_axum_router();
    let check = http_auth;
    let auth: corral_proto::gateway::AuthCheck = Arc::new(move |headers, extensions| {
        check.check(request_of(headers, extensions)).map(|_| ())
    });
    let http = with_http_gateway(grpc, &["corral.v1.Worker"], auth)?;
    Ok((builder.add_routes(http.into()), health_reporter))
}

/// A call's credentials as a gRPC check reads them: an HTTP request's
/// headers and what the server knows of its connection.
pub fn request_of(headers: &http::HeaderMap, extensions: &http::Extensions) -> Request<()> {
    Request::from_parts(
        tonic::metadata::MetadataMap::from_headers(headers.clone()),
        extensions.clone(),
        (),
    )
}

/// `grpc` (a server's gRPC routes) with the HTTP/JSON gateway of
/// `services` in front of them ([`corral_proto::gateway`]): one listener,
/// `auth` the server's own check of its callers.
pub fn with_http_gateway(
    grpc: axum::Router,
    services: &[&str],
    auth: corral_proto::gateway::AuthCheck,
) -> Result<axum::Router, ServeError> {
    let pool = prost_reflect_pool()?;
    corral_proto::gateway::router(
        pool,
        services,
        corral_proto::gateway::routes_of(services),
        grpc,
        auth,
    )
    .map_err(|e| ServeError::Gateway(e.to_string()))
}

/// The descriptors of Corral's services, as the gateway reads them.
fn prost_reflect_pool() -> Result<corral_proto::gateway::DescriptorPool, ServeError> {
    corral_proto::gateway::DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET)
        .map_err(|e| ServeError::Gateway(format!("the descriptors: {e}")))
}

/// Connections the kernel queues for a listener before it accepts them
/// (capped by the host's `net.core.somaxconn`): enough that a flood of
/// connections from elsewhere is shed by the admission (oldest idle one
/// first), not by the kernel dropping a real client's handshake.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener on `addr` with [`LISTEN_BACKLOG`].
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// [`serve`] with TLS options.
pub async fn serve_with(
    worker: Worker,
    listener: TcpListener,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let budget = crate::budget::Budget::new(
        options
            .request_memory
            .unwrap_or(crate::budget::DEFAULT_BYTES),
    );
    let (router, reporter) = router(worker.clone(), options.token, budget).await?;
    // Accepted sockets (with TCP_NODELAY: without it every reply waits on
    // Nagle) reach the server only once their client has spoken.
    let shed = worker.metrics().connections_shed.clone();
    let (incoming, accept) =
        crate::admission::admit(listener, options.admission, shed, options.tls);
    let served = run(worker, router, reporter, incoming, shutdown).await;
    accept.abort();
    served
}

/// Serves on a Unix socket (the local worker that `corral` commands on one
/// machine share). `connections` counts the open ones, so the owner can
/// tell when nobody is using the worker.
pub async fn serve_unix(
    worker: Worker,
    listener: tokio::net::UnixListener,
    token: Option<String>,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let budget = crate::budget::Budget::new(crate::budget::DEFAULT_BYTES);
    let (router, reporter) = router(worker.clone(), token, budget).await?;
    let incoming = futures_util::stream::unfold(listener, move |listener| {
        let connections = connections.clone();
        async move {
            let accepted = listener
                .accept()
                .await
                .map(|(stream, _)| Counted::new(stream, connections));
            Some((accepted, listener))
        }
    });
    run(worker, router, reporter, incoming, shutdown).await
}

/// A connection that counts itself while it is open.
struct Counted {
    stream: tokio::net::UnixStream,
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Counted {
    fn new(
        stream: tokio::net::UnixStream,
        count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self { stream, count }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl tonic::transport::server::Connected for Counted {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
