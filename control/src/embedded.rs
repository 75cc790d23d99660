//! The embedded worker: a worker in this process, served on a loopback port,
//! so `corral` needs nothing but a local Docker engine.

use corral_worker::cli::default_state_dir;
use corral_worker::{Worker, WorkerConfig, WorkerError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct Embedded {
    pub url: String,
    /// Made for this process: other local users cannot call the server.
    token: String,
    worker: Worker,
    stop: CancellationToken,
    server: JoinHandle<()>,
}

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("embedded worker: {0}")]
    Worker(#[from] WorkerError),
    #[error("embedded worker: cannot listen on loopback: {0}")]
    Listen(std::io::Error),
}

impl Embedded {
    pub async fn start(mut config: WorkerConfig) -> Result<Self, EmbeddedError> {
        if config.state_dir.as_os_str().is_empty() {
            config.state_dir = default_state_dir("embedded");
        }
        let worker = Worker::start(config).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(EmbeddedError::Listen)?;
        let addr = listener.local_addr().map_err(EmbeddedError::Listen)?;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let w = worker.clone();
        let token = corral_worker::cli::new_token();
        let required = Some(token.clone());
        let server = tokio::spawn(async move {
            let shutdown = async move { stopped.cancelled().await };
            if let Err(e) = corral_worker::server::serve(w, listener, required, shutdown).await {
                tracing::error!(error = %e, "embedded worker server failed");
            }
        });
        Ok(Self {
            url: format!("http://{addr}"),
            token,
            worker,
            stop,
            server,
        })
    }

    /// The token the server requires.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The worker itself, for in-process use (no network hop).
    pub fn worker(&self) -> Worker {
        self.worker.clone()
    }

    /// Stops serving; sandboxes keep running for the next `corral` to adopt.
    pub async fn stop(self) {
        self.worker.shutdown().await;
        self.stop.cancel();
        let _ = self.server.await;
    }
}
