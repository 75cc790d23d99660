//! Who gets a connection: the accept loop in front of the gRPC server.
//!
//! A connection goes through two stages before it is anyone's:
//!
//! 1. **Handshake.** It is handed to the server only once its client has
//!    sent the whole HTTP/2 connection preface, the method of an HTTP/1.1
//!    request (the HTTP/JSON gateway's), or with TLS the header of its
//!    first TLS record, within the handshake timeout; anything else is
//!    closed. With TLS, the TLS handshake is done here too (offering `h2`
//!    and `http/1.1`), within the handshake timeout again. A connection that sends one byte and waits costs a file
//!    descriptor for a few seconds, never a server slot.
//! 2. **First authenticated call.** A served connection that has not made
//!    a call the token check let through is *unauthenticated*: at most
//!    half the served slots may be, so the other half is kept for clients
//!    that have the token. It is closed if no authenticated call comes
//!    within [`Admission::first_call_timeout`]. Once one has, it holds its
//!    slot until it closes (HTTP/2 pings find dead peers).
//!
//! Connections not yet authenticated (in either stage) never hold up a new
//! one: when a limit is reached (handshakes in progress, unauthenticated
//! ones served, [`Admission::max_unauthenticated_per_peer`] of one
//! address), the **oldest** of them is shed and the new one takes its
//! place. A flood of idle connections, however it is topped up, thus loses
//! its oldest to every real client, which authenticates on its first call
//! (a few milliseconds) and can no longer be shed. The shed are counted
//! (`corral_connections_shed`).
//!
//! The token check marks the connection through [`AdmittedInfo`], which
//! the server puts in each request's extensions.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
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
    /// included): past it, that address's oldest is shed.
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
    /// The connection's place among the unauthenticated, while it has one.
    place: Mutex<Option<Place>>,
}

impl ConnState {
    fn authenticate(&self) {
        use std::sync::atomic::Ordering;
        if !self.authenticated.swap(true, Ordering::AcqRel) {
            // Poisoned only if a holder panicked; the place goes either way.
            let taken = match self.place.lock() {
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

/// Where an unauthenticated connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Handshake,
    Served,
}

struct Waiter {
    ip: IpAddr,
    stage: Stage,
    shed: CancellationToken,
}

/// The connections not yet authenticated, in the order they came, with
/// their counts by address and by stage.
#[derive(Default)]
struct Unauthenticated {
    next: u64,
    waiting: BTreeMap<u64, Waiter>,
    by_peer: HashMap<IpAddr, usize>,
    handshakes: usize,
    served: usize,
}

impl Unauthenticated {
    fn count(&mut self, w: &Waiter, up: bool) {
        let peer = self.by_peer.entry(w.ip).or_insert(0);
        let stage = match w.stage {
            Stage::Handshake => &mut self.handshakes,
            Stage::Served => &mut self.served,
        };
        if up {
            *peer += 1;
            *stage += 1;
        } else {
            *peer = peer.saturating_sub(1);
            *stage = stage.saturating_sub(1);
            if *peer == 0 {
                self.by_peer.remove(&w.ip);
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Waiter> {
        let w = self.waiting.remove(&id)?;
        self.count(&w, false);
        Some(w)
    }

    /// Sheds the oldest connection that `which` picks: it is closed, and
    /// its place is free at once.
    fn shed_oldest(&mut self, which: impl Fn(&Waiter) -> bool, shed: &Counter) -> bool {
        let Some(id) = self
            .waiting
            .iter()
            .find_map(|(id, w)| which(w).then_some(*id))
        else {
            return false;
        };
        if let Some(w) = self.remove(id) {
            w.shed.cancel();
            shed.inc();
        }
        true
    }
}

/// The limits on the unauthenticated and what is shed to keep them.
#[derive(Clone)]
struct Places {
    all: Arc<Mutex<Unauthenticated>>,
    per_peer: usize,
    handshakes: usize,
    served: usize,
    shed: Counter,
}

impl Places {
    fn lock(&self) -> std::sync::MutexGuard<'_, Unauthenticated> {
        self.all.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection from `ip`, in its handshake: the
    /// oldest of its address's, or of all handshakes, is shed to make one.
    fn arrive(&self, ip: IpAddr) -> Place {
        let mut all = self.lock();
        if all.by_peer.get(&ip).copied().unwrap_or(0) >= self.per_peer {
            debug!(%ip, "at this address's limit of unauthenticated connections: its oldest shed");
            all.shed_oldest(|w| w.ip == ip, &self.shed);
        }
        if all.handshakes >= self.handshakes {
            debug!(%ip, "at the limit of handshakes: the oldest shed");
            all.shed_oldest(|w| w.stage == Stage::Handshake, &self.shed);
        }
        let id = all.next;
        all.next += 1;
        let w = Waiter {
            ip,
            stage: Stage::Handshake,
            shed: CancellationToken::new(),
        };
        all.count(&w, true);
        let shed = w.shed.clone();
        all.waiting.insert(id, w);
        Place {
            id,
            places: self.clone(),
            shed,
        }
    }
}

/// A connection's place among the unauthenticated; given back on drop.
struct Place {
    id: u64,
    places: Places,
    shed: CancellationToken,
}

impl Place {
    /// Handshake done: served, unauthenticated. The oldest served one is
    /// shed if they are at their limit. `false`: this one was shed
    /// meanwhile.
    fn serve(&self) -> bool {
        let mut all = self.places.lock();
        let Some(mut w) = all.remove(self.id) else {
            return false;
        };
        if all.served >= self.places.served {
            debug!("at the limit of unauthenticated connections served: the oldest shed");
            all.shed_oldest(|w| w.stage == Stage::Served, &self.places.shed);
        }
        w.stage = Stage::Served;
        all.count(&w, true);
        all.waiting.insert(self.id, w);
        true
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.lock().remove(self.id);
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
    /// Fires if it is shed before its first authenticated call.
    shed: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
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
        if this.state.is_authenticated() {
            this.deadline = None;
            this.shed = None;
        }
        if let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            debug!("no authenticated call in time; closed");
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no authenticated call in time",
            )));
        }
        if let Some(shed) = this.shed.as_mut()
            && shed.as_mut().poll(cx).is_ready()
        {
            debug!("shed for a newer connection before an authenticated call; closed");
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "shed for a newer connection",
            )));
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

/// A connection the server gets: admitted, and with TLS its handshake
/// done (here rather than by the server, so that ALPN may offer HTTP/1.1
/// beside HTTP/2, and within the handshake timeout).
pub enum Conn {
    Plain(Admitted),
    Tls(Box<tokio_rustls::server::TlsStream<Admitted>>),
}

impl Connected for Conn {
    type ConnectInfo = AdmittedInfo;

    fn connect_info(&self) -> AdmittedInfo {
        match self {
            Self::Plain(a) => a.connect_info(),
            Self::Tls(t) => t.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(a) => Pin::new(a).poll_read(cx, buf),
            Self::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(a) => Pin::new(a).poll_write(cx, buf),
            Self::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(a) => Pin::new(a).poll_flush(cx),
            Self::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(a) => Pin::new(a).poll_shutdown(cx),
            Self::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(a) => Pin::new(a).poll_write_vectored(cx, bufs),
            Self::Tls(t) => Pin::new(t.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(a) => a.is_write_vectored(),
            Self::Tls(t) => t.is_write_vectored(),
        }
    }
}

/// The admitted connections of `listener` (with `tls`, each after its TLS
/// handshake), and the accept loop that feeds them (the caller owns it:
/// abort it when serving ends; it owns the handshakes in progress).
/// `shed` counts the connections shed.
pub fn admit(
    listener: TcpListener,
    limits: Admission,
    shed: Counter,
    tls: Option<crate::process::ServerTls>,
) -> (
    ReceiverStream<io::Result<Conn>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(accept_loop(listener, limits, shed, tls, tx));
    (ReceiverStream::new(rx), task)
}

/// The methods an HTTP/1.1 request (the HTTP/JSON gateway's) may begin
/// with.
const HTTP1_METHODS: [&[u8]; 6] = [b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS"];

/// Reads the client's first bytes: the whole HTTP/2 preface, the method
/// of an HTTP/1.1 request line and its space, or a TLS record header.
/// `None` for anything else.
async fn preface(stream: &mut TcpStream) -> io::Result<Option<Vec<u8>>> {
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    if first[0] == TLS_HANDSHAKE {
        let mut got = vec![0u8; TLS_RECORD_HEADER];
        got[0] = first[0];
        stream.read_exact(&mut got[1..]).await?;
        return Ok(Some(got));
    }
    // A method and its space ("PRI " begins the HTTP/2 preface), read a
    // byte at a time: nothing past it is taken from the stream here.
    let mut got = vec![first[0]];
    while got.len() <= 8 && got.last() != Some(&b' ') {
        let mut b = [0u8; 1];
        stream.read_exact(&mut b).await?;
        got.push(b[0]);
    }
    let Some(method) = got.strip_suffix(b" ") else {
        return Ok(None);
    };
    if method == b"PRI" {
        let have = got.len();
        got.resize(PREFACE.len(), 0);
        stream.read_exact(&mut got[have..]).await?;
        return Ok((got == PREFACE).then_some(got));
    }
    Ok(HTTP1_METHODS.contains(&method).then_some(got))
}

async fn accept_loop(
    listener: TcpListener,
    limits: Admission,
    shed: Counter,
    tls: Option<crate::process::ServerTls>,
    tx: mpsc::Sender<io::Result<Conn>>,
) {
    let served = Arc::new(Semaphore::new(limits.max_connections));
    let places = Places {
        all: Arc::default(),
        per_peer: limits.max_unauthenticated_per_peer.max(1),
        handshakes: limits.max_pending.max(1),
        served: (limits.max_connections / 2).max(1),
        shed,
    };
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
        let place = places.arrive(peer.ip());
        let _ = stream.set_nodelay(true);
        let (served, tx, tls) = (served.clone(), tx.clone(), tls.clone());
        handshakes.spawn(async move {
            let spoke = tokio::select! {
                spoke = tokio::time::timeout(limits.handshake_timeout, preface(&mut stream)) => spoke,
                () = place.shed.cancelled() => {
                    debug!(%peer, "shed in its handshake for a newer connection; closed");
                    return;
                }
            };
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
            if !place.serve() {
                debug!(%peer, "shed for a newer connection; closed");
                return;
            }
            // A slot given back by a connection just shed comes in a
            // moment; a server full of authenticated connections is full.
            let permit = tokio::select! {
                p = tokio::time::timeout(Duration::from_secs(1), served.acquire_owned()) => p,
                () = place.shed.cancelled() => return,
            };
            let Ok(Ok(permit)) = permit else {
                debug!(%peer, "at the connection limit; closed");
                return;
            };
            let shed = Box::pin(place.shed.clone().cancelled_owned());
            let state = Arc::new(ConnState {
                authenticated: false.into(),
                place: Mutex::new(Some(place)),
            });
            let admitted = Admitted {
                stream,
                prefix,
                at: 0,
                state,
                deadline: Some(Box::pin(tokio::time::sleep(limits.first_call_timeout))),
                shed: Some(shed),
                _permit: permit,
            };
            let conn = match tls {
                None => Conn::Plain(admitted),
                // Its deadline and shedding hold during the handshake too.
                Some(tls) => {
                    match tokio::time::timeout(limits.handshake_timeout, tls.0.accept(admitted))
                        .await
                    {
                        Ok(Ok(s)) => Conn::Tls(Box::new(s)),
                        Ok(Err(e)) => {
                            debug!(%peer, error = %e, "TLS handshake failed; closed");
                            return;
                        }
                        Err(_) => {
                            debug!(%peer, "no TLS handshake in time; closed");
                            return;
                        }
                    }
                }
            };
            let _ = tx.send(Ok(conn)).await;
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

    fn places(per_peer: usize, handshakes: usize, served: usize) -> Places {
        Places {
            all: Arc::default(),
            per_peer,
            handshakes,
            served,
            shed: Counter::default(),
        }
    }

    #[test]
    fn a_new_connection_sheds_the_oldest_of_its_address_and_places_come_back() {
        let p = places(2, 100, 100);
        let ip: IpAddr = "127.0.0.2".parse().unwrap();
        let other: IpAddr = "127.0.0.3".parse().unwrap();
        let a = p.arrive(ip);
        let b = p.arrive(ip);
        let o = p.arrive(other);
        // A third from the same address: the oldest of that address goes.
        let c = p.arrive(ip);
        assert!(a.shed.is_cancelled());
        assert!(!b.shed.is_cancelled() && !c.shed.is_cancelled() && !o.shed.is_cancelled());
        assert_eq!(p.shed.get(), 1);
        assert_eq!(p.lock().by_peer[&ip], 2);
        // The shed one's drop gives back nothing twice.
        drop(a);
        assert_eq!(p.lock().by_peer[&ip], 2);
        drop(b);
        drop(c);
        drop(o);
        let all = p.lock();
        assert!(all.by_peer.is_empty() && all.waiting.is_empty());
        assert_eq!((all.handshakes, all.served), (0, 0));
    }

    #[test]
    fn handshakes_and_served_ones_shed_their_own_oldest() {
        let p = places(100, 2, 1);
        let ip = |n: u8| IpAddr::from([127, 0, 0, n]);
        let a = p.arrive(ip(1));
        let b = p.arrive(ip(2));
        assert!(a.serve());
        // At the limit of served unauthenticated: the next one served sheds
        // the oldest served (not a handshake).
        let c = p.arrive(ip(3));
        assert!(b.serve());
        assert!(a.shed.is_cancelled());
        assert!(!b.shed.is_cancelled() && !c.shed.is_cancelled());
        // Handshakes at their limit: the oldest handshake goes.
        let d = p.arrive(ip(4));
        let e = p.arrive(ip(5));
        assert!(c.shed.is_cancelled());
        assert!(!d.shed.is_cancelled() && !e.shed.is_cancelled() && !b.shed.is_cancelled());
        // Shed in its handshake: it is not served.
        assert!(!c.serve());
        assert_eq!(p.shed.get(), 2);
        // Authenticated (its place dropped): never shed after.
        let state = ConnState {
            authenticated: false.into(),
            place: Mutex::new(Some(b)),
        };
        state.authenticate();
        assert!(d.serve());
        assert!(e.serve());
        assert_eq!(p.shed.get(), 3);
        assert!(d.shed.is_cancelled());
    }
}
