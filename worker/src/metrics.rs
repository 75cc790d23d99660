//! Prometheus metrics: the worker's families (sandboxes, operations,
//! watchers, bytes streamed, drain), and a small HTTP endpoint that serves
//! any registry's text exposition on a port of its own (the control plane
//! serves its placement metrics with it too), with a readiness check.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label sets: `(name, value)` pairs.
pub type Labels = Vec<(&'static str, String)>;

/// Seconds, from 1 ms to about 9 min.
pub fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// The worker's metrics. Counters and histograms are updated where things
/// happen; gauges of what the worker holds are set when scraped.
pub struct WorkerMetrics {
    registry: Registry,
    pub sandboxes: Family<Labels, Gauge>,
    pub capacity: Gauge,
    pub sandbox_creates: Family<Labels, Counter>,
    pub sandbox_create_seconds: Histogram,
    pub operations: Family<Labels, Counter>,
    pub operation_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    pub running_operations: Gauge,
    pub watchers: Gauge,
    pub stream_bytes: Counter,
    pub journal_bytes: Gauge,
    pub draining: Gauge,
    pub egress_connections: Family<Labels, Counter>,
    pub egress_bytes: Family<Labels, Counter>,
    pub egress_open: Gauge,
    pub ports_requests: Family<Labels, Counter>,
    pub ports_bytes: Family<Labels, Counter>,
    pub ports_open: Gauge,
    pub pool_size: Family<Labels, Gauge>,
    pub pool_ready: Family<Labels, Gauge>,
    pub pool_claims: Family<Labels, Counter>,
    pub pool_refill_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    pub forks: Family<Labels, Counter>,
    pub fork_frozen_seconds: Histogram,
    pub connections_shed: Counter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("corral");
        let m = Self {
            registry: Registry::default(),
            sandboxes: Family::default(),
            capacity: Gauge::default(),
            sandbox_creates: Family::default(),
            sandbox_create_seconds: latency_histogram(),
            operations: Family::default(),
            operation_seconds: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            running_operations: Gauge::default(),
            watchers: Gauge::default(),
            stream_bytes: Counter::default(),
            journal_bytes: Gauge::default(),
            draining: Gauge::default(),
            egress_connections: Family::default(),
            egress_bytes: Family::default(),
            egress_open: Gauge::default(),
            ports_requests: Family::default(),
            ports_bytes: Family::default(),
            ports_open: Gauge::default(),
            pool_size: Family::default(),
            pool_ready: Family::default(),
            pool_claims: Family::default(),
            pool_refill_seconds: Family::new_with_constructor(
                latency_histogram as fn() -> Histogram,
            ),
            forks: Family::default(),
            fork_frozen_seconds: latency_histogram(),
            connections_shed: Counter::default(),
        };
        registry.register("sandboxes", "Sandboxes held, by state", m.sandboxes.clone());
        registry.register(
            "sandbox_capacity",
            "Most sandboxes this worker runs at once",
            m.capacity.clone(),
        );
        registry.register(
            "sandbox_creates",
            "New sandboxes asked for, by outcome (created, at_capacity, draining, refused, failed)",
            m.sandbox_creates.clone(),
        );
        registry.register(
            "sandbox_create_seconds",
            "Time to make a sandbox ready",
            m.sandbox_create_seconds.clone(),
        );
        registry.register(
            "operations",
            "Operations finished, by kind and outcome",
            m.operations.clone(),
        );
        registry.register(
            "operation_seconds",
            "Operation run time, by kind",
            m.operation_seconds.clone(),
        );
        registry.register(
            "running_operations",
            "Operations running now",
            m.running_operations.clone(),
        );
        registry.register("watchers", "Open watch streams", m.watchers.clone());
        registry.register(
            "stream_bytes",
            "Output bytes streamed to watchers",
            m.stream_bytes.clone(),
        );
        registry.register(
            "journal_bytes",
            "Bytes held in the sandboxes' event journals",
            m.journal_bytes.clone(),
        );
        registry.register("draining", "1 while the worker drains", m.draining.clone());
        registry.register(
            "egress_connections",
            "Connections of sandboxes' egress proxies, by decision (allowed, blocked, closed) and reason",
            m.egress_connections.clone(),
        );
        registry.register(
            "egress_bytes",
            "Bytes relayed by sandboxes' egress proxies, by direction (out, in)",
            m.egress_bytes.clone(),
        );
        registry.register(
            "ports_requests",
            "Requests and tunnels to sandboxes' exposed ports, by outcome (carried, or the listener's refusal: unauthenticated, not_exposed, port_not_listening, ...)",
            m.ports_requests.clone(),
        );
        registry.register(
            "ports_bytes",
            "Bytes carried to and from sandboxes' ports (requests, upgrades, tunnels), by direction (in: to the sandbox, out: from it)",
            m.ports_bytes.clone(),
        );
        registry.register(
            "ports_open_connections",
            "Connections to sandboxes' ports open now",
            m.ports_open.clone(),
        );
        registry.register(
            "pool_size",
            "Members each warm pool keeps, by template",
            m.pool_size.clone(),
        );
        registry.register(
            "pool_refill_seconds",
            "Time to make a pool member and have it answer, by template",
            m.pool_refill_seconds.clone(),
        );
        registry.register(
            "pool_ready",
            "Warm pool members ready to be claimed, by template",
            m.pool_ready.clone(),
        );
        registry.register(
            "pool_claims",
            "Creates that matched a pool's template, by template and result (claimed, missed: none was ready)",
            m.pool_claims.clone(),
        );
        registry.register(
            "forks",
            "Sandbox forks, by outcome (forked, refused, failed)",
            m.forks.clone(),
        );
        registry.register(
            "fork_frozen_seconds",
            "How long a fork kept its parent frozen",
            m.fork_frozen_seconds.clone(),
        );
        registry.register(
            "egress_open_connections",
            "Egress connections open now",
            m.egress_open.clone(),
        );
        registry.register(
            "connections_shed",
            "Connections closed before an authenticated call to make room for newer ones",
            m.connections_shed.clone(),
        );
        Self { registry, ..m }
    }
}

impl WorkerMetrics {
    /// The text exposition.
    pub fn render(&self) -> String {
        render(&self.registry)
    }

    /// An operation ended: counted by kind and outcome, timed by kind.
    pub fn operation_finished(&self, kind: &'static str, outcome: &str, duration: Duration) {
        self.operations
            .get_or_create(&vec![
                ("kind", kind.to_string()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
        self.operation_seconds
            .get_or_create(&vec![("kind", kind.to_string())])
            .observe(duration.as_secs_f64());
    }

    /// An egress connection decided (`reason` empty when allowed).
    pub fn egress_decided(&self, decision: &'static str, reason: &'static str) {
        self.egress_connections
            .get_or_create(&vec![
                ("decision", decision.to_string()),
                ("reason", reason.to_string()),
            ])
            .inc();
    }

    /// Bytes an egress connection relayed.
    pub fn egress_relayed(&self, out: u64, inward: u64) {
        for (dir, n) in [("out", out), ("in", inward)] {
            if n > 0 {
                self.egress_bytes
                    .get_or_create(&vec![("direction", dir.to_string())])
                    .inc_by(n);
            }
        }
    }

    /// A request to an exposed port answered: carried, or refused for
    /// `outcome`.
    pub fn ports_answered(&self, outcome: &'static str) {
        self.ports_requests
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// A create matched pool `template`: it took a member or found none.
    pub fn pool_claimed(&self, template: &str, claimed: bool) {
        let result = if claimed { "claimed" } else { "missed" };
        self.pool_claims
            .get_or_create(&vec![
                ("template", template.to_string()),
                ("result", result.to_string()),
            ])
            .inc();
    }

    /// A member of pool `template` was made and answered in `took`.
    pub fn pool_refilled(&self, template: &str, took: Duration) {
        self.pool_refill_seconds
            .get_or_create(&vec![("template", template.to_string())])
            .observe(took.as_secs_f64());
    }

    /// Pool `template` keeps `size` members, `ready` of them ready now (set
    /// when scraped).
    pub fn pool_state(&self, template: &str, size: u32, ready: usize) {
        let labels = vec![("template", template.to_string())];
        self.pool_size.get_or_create(&labels).set(i64::from(size));
        self.pool_ready.get_or_create(&labels).set(ready as i64);
    }

    /// A fork ended with `outcome`.
    pub fn fork(&self, outcome: &'static str) {
        self.forks
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// A create ended with `outcome`.
    pub fn sandbox_create(&self, outcome: &'static str) {
        self.sandbox_creates
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }
}

/// An outcome as a label: a handful of values, never a message.
pub fn outcome_label(outcome: &corral_proto::Outcome) -> &'static str {
    use corral_proto::Outcome;
    match outcome {
        Outcome::Exited { code: 0 } => "ok",
        Outcome::Exited { .. } => "exited_nonzero",
        Outcome::Signaled { .. } => "signaled",
        Outcome::TimedOut => "timed_out",
        Outcome::OutOfMemory => "out_of_memory",
        Outcome::Canceled => "canceled",
        Outcome::SandboxLost { .. } => "sandbox_lost",
        Outcome::SpawnFailed { .. } => "spawn_failed",
        Outcome::FileError { .. } => "file_error",
    }
}

/// The text exposition of `registry` (OpenMetrics text).
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen for metrics on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics endpoint: {0}")]
    Serve(std::io::Error),
}

/// Binds the metrics endpoint (before anything else starts, so a taken
/// port fails the start).
pub async fn bind(addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener, MetricsError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Listen { addr, source })
}

/// Whether the process takes new work (`GET /readyz`).
pub type Ready = Arc<dyn Fn() -> bool + Send + Sync>;

/// Serves `GET /metrics` (the exposition `render` makes at each scrape)
/// and, with `ready`, `GET /readyz` (200, or 503 while it takes no new
/// work: a plain-HTTP readiness probe beside a TLS gRPC port) on
/// `listener` until `shutdown`; every other path is 404.
pub async fn serve(
    listener: tokio::net::TcpListener,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    ready: Option<Ready>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MetricsError> {
    let mut app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let render = render.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    render(),
                )
            }
        }),
    );
    if let Some(ready) = ready {
        app = app.route(
            "/readyz",
            axum::routing::get(move || {
                let ready = ready.clone();
                async move {
                    if ready() {
                        (axum::http::StatusCode::OK, "ready\n")
                    } else {
                        (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            "draining: no new sandboxes\n",
                        )
                    }
                }
            }),
        );
    }
    axum::serve(Bounded::new(listener), app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(MetricsError::Serve)
}

/// Connections the endpoint serves at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may send nothing (a request's headers, the next
/// request) before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may live, however busy.
pub const MAX_LIFETIME: Duration = Duration::from_secs(60);

/// The endpoint's listener: at most [`MAX_CONNECTIONS`] open, each closed
/// when idle or old, so idle or slow clients cannot take the process's
/// descriptors or the scraper's place for long.
struct Bounded {
    listener: tokio::net::TcpListener,
    places: Arc<tokio::sync::Semaphore>,
}

impl Bounded {
    fn new(listener: tokio::net::TcpListener) -> Self {
        Self {
            listener,
            places: Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS)),
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = BoundedIo;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (BoundedIo, std::net::SocketAddr) {
        loop {
            let (stream, addr) = match self.listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(place) = self.places.clone().try_acquire_owned() else {
                tracing::debug!(%addr, "metrics: at the connection limit; closed");
                continue;
            };
            let now = tokio::time::Instant::now();
            return (
                BoundedIo {
                    stream,
                    idle: Box::pin(tokio::time::sleep_until(now + IDLE_TIMEOUT)),
                    end: Box::pin(tokio::time::sleep_until(now + MAX_LIFETIME)),
                    _place: place,
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

/// One connection of the endpoint, closed (reads fail) when idle or old.
struct BoundedIo {
    stream: tokio::net::TcpStream,
    idle: std::pin::Pin<Box<tokio::time::Sleep>>,
    end: std::pin::Pin<Box<tokio::time::Sleep>>,
    _place: tokio::sync::OwnedSemaphorePermit,
}

impl tokio::io::AsyncRead for BoundedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.idle.as_mut().poll(cx).is_ready() || this.end.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "metrics connection idle or too old",
            )));
        }
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.idle
                .as_mut()
                .reset(tokio::time::Instant::now() + IDLE_TIMEOUT);
        }
        read
    }
}

impl tokio::io::AsyncWrite for BoundedIo {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_every_family_with_its_labels() {
        let m = WorkerMetrics::default();
        m.operation_finished("shell", "exited", Duration::from_millis(20));
        m.sandbox_create("created");
        m.sandboxes
            .get_or_create(&vec![("state", "ready".to_string())])
            .set(3);
        let text = m.render();
        for want in [
            "corral_operations_total{kind=\"shell\",outcome=\"exited\"} 1",
            "corral_operation_seconds_count{kind=\"shell\"} 1",
            "corral_sandbox_creates_total{outcome=\"created\"} 1",
            "corral_sandboxes{state=\"ready\"} 3",
            "corral_draining 0",
            "corral_stream_bytes_total 0",
            "# EOF",
        ] {
            assert!(text.contains(want), "{want} missing from:\n{text}");
        }
    }
}
