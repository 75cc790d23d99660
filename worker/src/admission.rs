//! Who gets a connection: the accept loop in front of the gRPC server.
//!
//! A connection goes through two stages before it is anyone's:
//!
//! 1. **Handshake.** It is handed to the server only once its client has
//!    sent the whole HTTP/2 connection preface (or, with TLS, the header
//!    of its first TLS record) within the handshake timeout; anything else
//!    is closed. Beyond the limit of pending handshakes new ones are closed
//!    at once. A connection that sends one byte and waits costs a file
//!    descriptor for a few seconds, never a server slot.
//! 2. **First authenticated call.** A served connection that has not made
//!    a call the token check let through is *unauthenticated*: at most
//!    half the served slots and [`Admission::max_unauthenticated_per_peer`]
//!    per client address (handshakes included) may be, so the other half
//!    is kept for clients that have the token, and one address cannot take
//!    every place. It is closed if no authenticated call comes within
//!    [`Admission::first_call_timeout`]. Once one has, it holds its slot
//!    until it closes (HTTP/2 pings find dead peers).
//!
//! The token check marks the connection through [`AdmittedInfo`], which
//! the server puts in each request's extensions.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// The HTTP/2 connection preface every client sends first (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;
/// A TLS record header: type, version, length.
const TLS_RECORD_HEADER: usize = 5;

/// Limits on connections.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections waiting for their client's preface.
    pub max_pending: usize,
    /// How long a new connection may take to send its preface.
    pub handshake_timeout: Duration,
    /// How long a served connection may go without an authenticated call.
    pub first_call_timeout: Duration,
    /// Connections from one address not yet authenticated (handshakes
    /// included).
    pub max_unauthenticated_per_peer: usize,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_pending: 4096,
            handshake_timeout: Duration::from_secs(5),
            first_call_timeout: Duration::from_secs(10),
            max_unauthenticated_per_peer: 256,
        }
    }
}

impl Admission {
    /// Descriptors these limits may hold at once (served and pending).
    pub fn descriptors(&self) -> usize {
        self.max_connections + self.max_pending
    }

    /// These limits brought under `available` descriptors: pending
    /// handshakes first, then served connections, never below 16 each.
    /// Returns whether anything changed.
    pub fn fit(&mut self, available: usize) -> bool {
        let before = (self.max_connections, self.max_pending);
        if self.descriptors() > available {
            self.max_pending = self.max_pending.min((available / 4).max(16));
            self.max_connections = self
                .max_connections
                .min(available.saturating_sub(self.max_pending).max(16));
        }
        before != (self.max_connections, self.max_pending)
    }
}

/// Who a connection is, as the server's requests see it: its address, and
/// whether the token check has let one of its calls through.
#[derive(Clone)]
pub struct AdmittedInfo {
    pub tcp: TcpConnectInfo,
    state: Arc<ConnState>,
}

impl AdmittedInfo {
    /// Marks the connection as its token's: its unauthenticated place is
    /// given back and its first-call deadline no longer applies.
    pub fn authenticated(&self) {
        self.state.authenticate();
    }
}

struct ConnState {
    authenticated: std::sync::atomic::AtomicBool,
    /// The connection's unauthenticated place, while it has one.
    ticket: Mutex<Option<Ticket>>,
}

impl ConnState {
    fn authenticate(&self) {
        use std::sync::atomic::Ordering;
        if !self.authenticated.swap(true, Ordering::AcqRel) {
            // Poisoned only if a holder panicked; the place goes either way.
            let taken = match self.ticket.lock() {
                Ok(mut t) => t.take(),
                Err(p) => p.into_inner().take(),
            };
            drop(taken);
        }
    }

    fn is_authenticated(&self) -> bool {
        self.authenticated
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A place among the unauthenticated: one of the global ones, and one of
/// its address's.
struct Ticket {
    _global: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

/// One of an address's places; given back on drop.
struct PeerSlot {
    ip: IpAddr,
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PeerSlot {
    fn take(peers: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr, max: usize) -> Option<Self> {
        let mut map = peers.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self {
            ip,
            peers: peers.clone(),
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut map = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// A served connection; its place is given back when it closes. Until
/// its first authenticated call it is closed at its deadline.
pub struct Admitted {
    stream: TcpStream,
    /// What the handshake stage read, given to the server first.
    prefix: Vec<u8>,
    at: usize,
    state: Arc<ConnState>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    _permit: OwnedSemaphorePermit,
}

impl Connected for Admitted {
    type ConnectInfo = AdmittedInfo;

    fn connect_info(&self) -> AdmittedInfo {
        AdmittedInfo {
            tcp: self.stream.connect_info(),
            state: self.state.clone(),
        }
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(deadline) = this.deadline.as_mut() {
            if this.state.is_authenticated() {
                this.deadline = None;
            } else if deadline.as_mut().poll(cx).is_ready() {
                debug!("no authenticated call in time; closed");
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no authenticated call in time",
                )));
            }
        }
        if this.at < this.prefix.len() {
            let n = buf.remaining().min(this.prefix.len() - this.at);
            buf.put_slice(&this.prefix[this.at..this.at + n]);
            this.at += n;
            if this.at == this.prefix.len() {
                this.prefix = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
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

/// Reads the client's first bytes: the whole HTTP/2 preface, or a TLS
/// record header. `None` for anything else.
async fn preface(stream: &mut TcpStream) -> io::Result<Option<Vec<u8>>> {
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    let need = if first[0] == TLS_HANDSHAKE {
        TLS_RECORD_HEADER
    } else if first[0] == PREFACE[0] {
        PREFACE.len()
    } else {
        return Ok(None);
    };
    let mut got = vec![0u8; need];
    got[0] = first[0];
    stream.read_exact(&mut got[1..]).await?;
    Ok((got[0] == TLS_HANDSHAKE || got == PREFACE).then_some(got))
}

async fn accept_loop(
    listener: TcpListener,
    limits: Admission,
    tx: mpsc::Sender<io::Result<Admitted>>,
) {
    let served = Arc::new(Semaphore::new(limits.max_connections));
    let unauthenticated = Arc::new(Semaphore::new((limits.max_connections / 2).max(1)));
    let peers: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    let pending = Arc::new(Semaphore::new(limits.max_pending));
    let mut handshakes = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            () = tx.closed() => return,
        };
        let (mut stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, say: wait a moment instead of spinning.
                debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = PeerSlot::take(&peers, peer.ip(), limits.max_unauthenticated_per_peer)
        else {
            debug!(%peer, "too many unauthenticated connections from this address; closed");
            continue;
        };
        let Ok(waiting) = pending.clone().try_acquire_owned() else {
            debug!(%peer, "too many connections waiting for a handshake; closed");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (served, unauthenticated, tx) = (served.clone(), unauthenticated.clone(), tx.clone());
        handshakes.spawn(async move {
            let spoke = tokio::time::timeout(limits.handshake_timeout, preface(&mut stream)).await;
            drop(waiting);
            let prefix = match spoke {
                Ok(Ok(Some(p))) => p,
                Ok(Ok(None)) => {
                    debug!(%peer, "not an HTTP/2 or TLS client; closed");
                    return;
                }
                _ => {
                    debug!(%peer, "no handshake in time; closed");
                    return;
                }
            };
            let Ok(global) = unauthenticated.try_acquire_owned() else {
                debug!(%peer, "at the limit of unauthenticated connections; closed");
                return;
            };
            let Ok(permit) = served.try_acquire_owned() else {
                debug!(%peer, "at the connection limit; closed");
                return;
            };
            let state = Arc::new(ConnState {
                authenticated: false.into(),
                ticket: Mutex::new(Some(Ticket {
                    _global: global,
                    _peer: slot,
                })),
            });
            let _ = tx
                .send(Ok(Admitted {
                    stream,
                    prefix,
                    at: 0,
                    state,
                    deadline: Some(Box::pin(tokio::time::sleep(limits.first_call_timeout))),
                    _permit: permit,
                }))
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_fit_the_descriptors_there_are() {
        let mut a = Admission::default();
        assert!(!a.fit(1 << 20));
        assert_eq!((a.max_connections, a.max_pending), (1024, 4096));
        assert!(a.fit(1000));
        assert!(a.descriptors() <= 1000, "{a:?}");
        assert_eq!(a.max_pending, 250);
        assert_eq!(a.max_connections, 750);
        let mut tiny = Admission::default();
        tiny.fit(10);
        assert_eq!((tiny.max_connections, tiny.max_pending), (16, 16));
    }

    #[test]
    fn a_peer_has_its_places_and_gives_them_back() {
        let peers: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
        let ip: IpAddr = "127.0.0.2".parse().unwrap();
        let other: IpAddr = "127.0.0.3".parse().unwrap();
        let a = PeerSlot::take(&peers, ip, 2).unwrap();
        let _b = PeerSlot::take(&peers, ip, 2).unwrap();
        assert!(PeerSlot::take(&peers, ip, 2).is_none());
        assert!(PeerSlot::take(&peers, other, 2).is_some());
        drop(a);
        assert!(PeerSlot::take(&peers, ip, 2).is_some());
    }
}
