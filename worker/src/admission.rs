//! Who gets a connection: the accept loop in front of the gRPC server.
//!
//! A connection is handed to the server only once its client has said
//! something (the HTTP/2 or TLS preface) within the handshake timeout, and
//! only while fewer than the limit of connections are open; a connection
//! that says nothing in time is closed. Half-open connections therefore
//! cost a file descriptor for a few seconds, never a server slot, and
//! beyond the limit of pending handshakes new ones are closed at once.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// Limits on connections.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections waiting for their client's first bytes.
    pub max_pending: usize,
    /// How long a new connection may stay silent.
    pub handshake_timeout: Duration,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_pending: 4096,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// A served connection; its place is given back when it closes.
pub struct Admitted {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Connected for Admitted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The admitted connections of `listener`, and the accept loop that feeds
/// them (the caller owns it: abort it when serving ends; it owns the
/// handshakes in progress).
pub fn admit(
    listener: TcpListener,
    limits: Admission,
) -> (
    ReceiverStream<io::Result<Admitted>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(accept_loop(listener, limits, tx));
    (ReceiverStream::new(rx), task)
}

async fn accept_loop(
    listener: TcpListener,
    limits: Admission,
    tx: mpsc::Sender<io::Result<Admitted>>,
) {
    let served = Arc::new(Semaphore::new(limits.max_connections));
    let pending = Arc::new(Semaphore::new(limits.max_pending));
    let mut handshakes = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            () = tx.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, say: wait a moment instead of spinning.
                debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(waiting) = pending.clone().try_acquire_owned() else {
            debug!(%peer, "too many connections waiting for a handshake; closed");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (served, tx) = (served.clone(), tx.clone());
        handshakes.spawn(async move {
            let mut first = [0u8; 1];
            let spoke =
                tokio::time::timeout(limits.handshake_timeout, stream.peek(&mut first)).await;
            drop(waiting);
            if !matches!(spoke, Ok(Ok(n)) if n > 0) {
                debug!(%peer, "silent connection closed");
                return;
            }
            let Ok(permit) = served.try_acquire_owned() else {
                debug!(%peer, "at the connection limit; closed");
                return;
            };
            let _ = tx
                .send(Ok(Admitted {
                    stream,
                    _permit: permit,
                }))
                .await;
        });
    }
}
