//! The way in: a sandbox's ports reached through URLs the worker serves.
//!
//! A client *exposes* a port of a sandbox (`ExposePort`), with an access:
//! `private` (the worker's token, as for its API), `signed` (a token made
//! for that sandbox, port and expiry, an HMAC under the worker's own key,
//! which a browser presents once in the URL and then as a cookie) or
//! `public` (anyone; only where the operator allows it). The worker's port
//! listener ([`http`]) routes each request by its Host
//! (`{port}-{id}.{domain}`, where wildcard DNS exists) or its path
//! (`/p/{id}/{port}/...`), checks it against the exposure, and carries it
//! to the sandbox through its [`ingress`]: a connection dialled from inside
//! the sandbox by its supervisor's relay, so the way in works whatever the
//! sandbox's runtime (it has no network interface). A revoked or expired
//! exposure is refused at once, and its open connections are cut.

pub mod http;
pub mod ingress;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::event::{PortEvent, PortWhat};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

/// Who may use an exposed port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// The worker's token (as `Authorization: Bearer`).
    Private,
    /// A token made for this exposure (or the worker's token).
    Signed,
    /// Anyone who can reach the port listener.
    Public,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Private => "private",
            Access::Signed => "signed",
            Access::Public => "public",
        }
    }
}

/// The longest a signed exposure lives, and what one lives that names no
/// time to live.
pub const MAX_SIGNED_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
pub const DEFAULT_SIGNED_TTL: Duration = Duration::from_secs(3600);
/// Most ports one sandbox exposes at once.
pub const MAX_EXPOSURES: usize = 32;
/// Most connections open at once to one sandbox's ports (requests' and
/// upgraded ones, and tunnels): as many as its relay carries under gVisor.
pub const MAX_CONNECTIONS: usize = corral_init::ingress::MAX_CONNECTIONS;
/// Of those, most that callers other than the sandbox's owner (signed and
/// public access) hold: the rest stay the owner's, whoever floods a
/// shared URL.
pub const MAX_SHARED_CONNECTIONS: usize = MAX_CONNECTIONS * 3 / 4;

/// One exposed port of a sandbox.
#[derive(Debug, Clone)]
pub struct Exposure {
    pub port: u16,
    pub access: Access,
    /// Ends it (ms since the epoch; `None`: until revoked).
    pub expires_at_ms: Option<i64>,
    pub created_at_ms: i64,
    /// Random per exposure: a token of an earlier exposure of the port
    /// (revoked) names another.
    pub nonce: String,
    /// A request for it while the sandbox is checkpointed restores the
    /// sandbox (its credential checked first).
    pub wake_on_request: bool,
    /// Cut when it is revoked (its open connections end).
    pub revoked: CancellationToken,
}

/// An exposure as its sandbox's file keeps it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Kept {
    port: u16,
    access: Access,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires_at_ms: Option<i64>,
    created_at_ms: i64,
    nonce: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    wake_on_request: bool,
}

impl From<&Exposure> for Kept {
    fn from(e: &Exposure) -> Self {
        Self {
            port: e.port,
            access: e.access,
            expires_at_ms: e.expires_at_ms,
            created_at_ms: e.created_at_ms,
            nonce: e.nonce.clone(),
            wake_on_request: e.wake_on_request,
        }
    }
}

impl From<Kept> for Exposure {
    fn from(k: Kept) -> Self {
        Self {
            port: k.port,
            access: k.access,
            expires_at_ms: k.expires_at_ms,
            created_at_ms: k.created_at_ms,
            nonce: k.nonce,
            wake_on_request: k.wake_on_request,
            revoked: CancellationToken::new(),
        }
    }
}

/// A sandbox's exposed ports and its way in (owned by the sandbox: both
/// go when it does). Its exposures are kept in a file of the worker's
/// state directory, so that they come back with the sandbox after a
/// checkpoint and after a restart of the worker (their tokens hold again:
/// the nonces are kept); the file goes when the sandbox's record does.
#[derive(Default)]
pub struct SandboxPorts {
    exposures: Mutex<BTreeMap<u16, Exposure>>,
    /// Where they are kept (`None`: nowhere, in tests of this module).
    file: Option<std::path::PathBuf>,
    ingress: tokio::sync::OnceCell<Arc<ingress::Ingress>>,
    /// Connections open now (each [`Counted`] holds one).
    open: Arc<AtomicUsize>,
    /// Its bytes' counts and rates, made on its first connection.
    meter: std::sync::OnceLock<Arc<WayMeter>>,
    /// Those of them held by callers other than the owner.
    shared: Arc<AtomicUsize>,
    /// Where what happens to its ports is told, as the sandbox's events
    /// (`None`: nowhere, for a checkpointed sandbox's kept exposures).
    reports: Option<PortReports>,
    /// Refusals told in the current second, and when it began: past
    /// [`REFUSALS_TOLD_PER_SECOND`] they are counted, not told, so that a
    /// flood of requests from anyone who knows the sandbox's id cannot
    /// push its commands' output out of its journal.
    refusals: Mutex<(Option<std::time::Instant>, u32)>,
}

/// Most refused requests a sandbox's events tell each second (the rest
/// are counted in the next event's `unreported`).
pub const REFUSALS_TOLD_PER_SECOND: u32 = 10;

/// Where a sandbox's port events go.
pub type PortReports = crate::reports::Reports<PortEvent>;

/// One connection to a sandbox's server: the bytes it carried each way,
/// and why it ended, told as a `closed` event when the last holder of it
/// lets it go (its [`Counted`], and whoever carries it).
pub struct Link {
    port: u16,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    why: std::sync::OnceLock<&'static str>,
    reports: Option<PortReports>,
}

impl Link {
    /// A link whose end is told to `reports` (if any).
    pub fn new(port: u16, reports: Option<PortReports>) -> Self {
        Self {
            port,
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            why: std::sync::OnceLock::new(),
            reports,
        }
    }

    /// Bytes it moved, both ways.
    pub fn moved(&self) -> u64 {
        self.bytes_in.load(Ordering::Relaxed) + self.bytes_out.load(Ordering::Relaxed)
    }

    pub fn carried_in(&self, n: u64) {
        self.bytes_in.fetch_add(n, Ordering::Relaxed);
    }

    pub fn carried_out(&self, n: u64) {
        self.bytes_out.fetch_add(n, Ordering::Relaxed);
    }

    /// Says why it ends (the first reason said is kept).
    pub fn end(&self, why: &'static str) {
        let _ = self.why.set(why);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(r) = &self.reports {
            let mut e = PortEvent::new(
                self.port,
                PortWhat::Closed,
                self.why.get().copied().unwrap_or("ended"),
            );
            e.bytes_in = *self.bytes_in.get_mut();
            e.bytes_out = *self.bytes_out.get_mut();
            r.try_send(e);
        }
    }
}

/// A connection to a sandbox's port that counts against its bound while
/// it is open, its bytes counted and held to the sandbox's rate.
pub struct Counted<S> {
    inner: S,
    _place: Place,
    link: Option<Arc<Link>>,
    meter: Option<Arc<WayMeter>>,
    read_wait: Option<Pin<Box<tokio::time::Sleep>>>,
    write_wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// What one sandbox's way in moves, each direction (`in`: to the
/// sandbox), counted (`corral_ports_bytes_total`) and, where the operator
/// set one (`--ports-max-bytes-per-second`), held to a rate shared by all
/// its connections.
pub struct WayMeter {
    pub inward: Option<crate::rate::Rate>,
    pub out: Option<crate::rate::Rate>,
    pub bytes_in: prometheus_client::metrics::counter::Counter,
    pub bytes_out: prometheus_client::metrics::counter::Counter,
}

/// Bytes a rate-held read or write moves at once at most.
const HELD_CHUNK: usize = 16 << 10;

/// How much of `want` may move now under `rate` (none set: all), or
/// `Pending` with a wake set for when some may.
fn allowance(
    rate: Option<&crate::rate::Rate>,
    wait: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    cx: &mut Context<'_>,
    want: usize,
) -> Poll<usize> {
    use std::future::Future;
    let Some(rate) = rate else {
        return Poll::Ready(want);
    };
    if let Some(w) = wait.as_mut() {
        if w.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        *wait = None;
    }
    match rate.try_take(want.min(HELD_CHUNK)) {
        Ok(n) => Poll::Ready(n),
        Err(after) => {
            let mut w = Box::pin(tokio::time::sleep(after));
            // Registered now: woken when it is time.
            let _ = w.as_mut().poll(cx);
            *wait = Some(w);
            Poll::Pending
        }
    }
}

/// The counts one connection is among (each given back when it goes),
/// and the worker's gauge of open ones, once it is made.
#[derive(Default)]
pub struct Place(
    Vec<Arc<AtomicUsize>>,
    Option<prometheus_client::metrics::gauge::Gauge>,
);

impl Drop for Place {
    fn drop(&mut self) {
        for n in &self.0 {
            n.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(g) = &self.1 {
            g.dec();
        }
    }
}

/// One more in `n`, if it is under `bound`.
fn take_one(n: &Arc<AtomicUsize>, bound: usize) -> bool {
    let mut now = n.load(Ordering::Acquire);
    loop {
        if now >= bound {
            return false;
        }
        match n.compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(seen) => now = seen,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let Some(meter) = this.meter.clone() else {
            let before = buf.filled().len();
            let r = Pin::new(&mut this.inner).poll_read(cx, buf);
            this.read((buf.filled().len() - before) as u64);
            return r;
        };
        let Some(rate) = meter.out.as_ref() else {
            let before = buf.filled().len();
            let r = Pin::new(&mut this.inner).poll_read(cx, buf);
            this.read((buf.filled().len() - before) as u64);
            return r;
        };
        let allowed = match allowance(Some(rate), &mut this.read_wait, cx, buf.remaining()) {
            Poll::Ready(n) => n,
            Poll::Pending => return Poll::Pending,
        };
        // Read into a buffer of the allowance, then copied.
        let mut chunk = [0u8; HELD_CHUNK];
        let mut held = ReadBuf::new(&mut chunk[..allowed]);
        let r = Pin::new(&mut this.inner).poll_read(cx, &mut held);
        let n = held.filled().len();
        buf.put_slice(held.filled());
        rate.give_back(allowed - n);
        this.read(n as u64);
        r
    }
}

impl<S> Counted<S> {
    /// `n` bytes came from the sandbox.
    fn read(&self, n: u64) {
        if let Some(m) = &self.meter {
            m.bytes_out.inc_by(n);
        }
        if let Some(l) = &self.link {
            l.carried_out(n);
        }
    }

    /// `n` bytes went to the sandbox.
    fn wrote(&self, n: u64) {
        if let Some(m) = &self.meter {
            m.bytes_in.inc_by(n);
        }
        if let Some(l) = &self.link {
            l.carried_in(n);
        }
    }

    /// The connection's link (its bytes, and why it ends).
    pub fn link(&self) -> Option<Arc<Link>> {
        self.link.clone()
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let Some(meter) = this.meter.clone() else {
            let r = Pin::new(&mut this.inner).poll_write(cx, buf);
            if let Poll::Ready(Ok(n)) = &r {
                this.wrote(*n as u64);
            }
            return r;
        };
        let allowed = match allowance(meter.inward.as_ref(), &mut this.write_wait, cx, buf.len()) {
            Poll::Ready(n) => n,
            Poll::Pending => return Poll::Pending,
        };
        let r = Pin::new(&mut this.inner).poll_write(cx, &buf[..allowed]);
        let n = match &r {
            Poll::Ready(Ok(n)) => *n,
            _ => 0,
        };
        if let Some(rate) = &meter.inward {
            rate.give_back(allowed - n);
        }
        this.wrote(n as u64);
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SandboxPorts {
    /// The exposures kept in `file` (none if it is missing; an unreadable
    /// one is said and set aside: its exposures are lost, never widened).
    pub fn kept_at(file: std::path::PathBuf) -> Self {
        let exposures = match std::fs::read(&file) {
            Ok(b) => match serde_json::from_slice::<Vec<Kept>>(&b) {
                Ok(all) => all.into_iter().map(|k| (k.port, k.into())).collect(),
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "unreadable exposed ports, dropped");
                    let _ = std::fs::remove_file(&file);
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "exposed ports not read");
                BTreeMap::new()
            }
        };
        Self {
            exposures: Mutex::new(exposures),
            file: Some(file),
            ..Self::default()
        }
    }

    /// These ports' events told through `reports` (the sandbox's).
    pub fn telling(mut self, reports: PortReports) -> Self {
        self.reports = Some(reports);
        self
    }

    /// Tells `e`, if the sandbox is told anything (never waiting: an
    /// event that finds the queue full is counted, and the count told).
    fn tell(&self, e: PortEvent) {
        if let Some(r) = &self.reports {
            r.try_send(e);
        }
    }

    /// Tells that a request or tunnel for `port` was refused, and why (at
    /// most [`REFUSALS_TOLD_PER_SECOND`]; the rest are counted).
    pub fn tell_refused(&self, port: u16, reason: &'static str) {
        let Some(r) = &self.reports else { return };
        let now = std::time::Instant::now();
        let told = {
            let mut w = lock(&self.refusals);
            if w.0
                .is_none_or(|since| now.duration_since(since) >= Duration::from_secs(1))
            {
                *w = (Some(now), 0);
            }
            w.1 += 1;
            w.1 <= REFUSALS_TOLD_PER_SECOND
        };
        if told {
            r.try_send(PortEvent::new(port, PortWhat::Refused, reason));
        } else {
            r.untold();
        }
    }

    /// A new connection's link to `port`, for a caller of `access`
    /// (told as `opened`; its end is told as `closed`).
    pub fn link(&self, port: u16, access: Access) -> Arc<Link> {
        self.tell(PortEvent::new(port, PortWhat::Opened, access.as_str()));
        Arc::new(Link::new(port, self.reports.clone()))
    }

    /// Writes `all` to the file (an empty set: no file).
    fn keep(&self, all: &BTreeMap<u16, Exposure>) -> std::io::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        if all.is_empty() {
            return match std::fs::remove_file(file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let kept: Vec<Kept> = all.values().map(Kept::from).collect();
        let json = serde_json::to_vec(&kept).map_err(std::io::Error::other)?;
        crate::state::write_synced(file, &json)
    }

    /// A place for one more connection, if the sandbox is under its bound
    /// (and, for a caller other than its owner, under the share of it
    /// others may hold), kept until the [`Counted`] made with it is
    /// dropped.
    pub fn admit_connection(&self, owner: bool) -> Option<Slot> {
        let mut place = Place::default();
        if !owner {
            if !take_one(&self.shared, MAX_SHARED_CONNECTIONS) {
                return None;
            }
            place.0.push(self.shared.clone());
        }
        if !take_one(&self.open, MAX_CONNECTIONS) {
            return None;
        }
        place.0.push(self.open.clone());
        Some(Slot(place))
    }

    /// The sandbox's meter, made by `make` the first time.
    pub fn meter(&self, make: impl FnOnce() -> WayMeter) -> Arc<WayMeter> {
        self.meter.get_or_init(|| Arc::new(make())).clone()
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Exposes `port` anew (a new nonce: tokens of an earlier exposure of
    /// it no longer hold, and its connections are cut).
    pub fn expose(&self, e: Exposure) -> Result<Exposure, String> {
        let mut all = lock(&self.exposures);
        if !all.contains_key(&e.port) && all.len() >= MAX_EXPOSURES {
            return Err(format!("a sandbox exposes at most {MAX_EXPOSURES} ports"));
        }
        let old = all.insert(e.port, e.clone());
        // Kept first: an exposure the worker would forget on a restart is
        // not made.
        if let Err(err) = self.keep(&all) {
            match old {
                Some(old) => all.insert(e.port, old),
                None => all.remove(&e.port),
            };
            return Err(format!("the exposure could not be kept: {err}"));
        }
        if let Some(old) = old {
            old.revoked.cancel();
        }
        self.tell(PortEvent::new(e.port, PortWhat::Exposed, e.access.as_str()));
        Ok(e)
    }

    /// Revokes `port`'s exposure: whether there was one.
    pub fn revoke(&self, port: u16) -> bool {
        let mut all = lock(&self.exposures);
        let Some(e) = all.remove(&port) else {
            return false;
        };
        e.revoked.cancel();
        self.tell(PortEvent::new(port, PortWhat::Revoked, ""));
        if let Err(err) = self.keep(&all) {
            // A revoked exposure must not come back with a restart: all
            // of the sandbox's go rather than that one.
            tracing::error!(port, error = %err, "a revocation could not be kept: the sandbox's exposures will not outlive a restart");
            if let Some(file) = &self.file {
                let _ = std::fs::remove_file(file);
            }
        }
        true
    }

    /// The exposure of `port` in force at `now_ms` (an expired one is
    /// dropped).
    pub fn get(&self, port: u16, now_ms: i64) -> Option<Exposure> {
        let mut all = lock(&self.exposures);
        let e = all.get(&port)?;
        if e.expires_at_ms.is_some_and(|t| now_ms >= t) {
            if let Some(e) = all.remove(&port) {
                e.revoked.cancel();
                self.tell(PortEvent::new(port, PortWhat::Expired, ""));
            }
            return None;
        }
        Some(e.clone())
    }

    pub fn list(&self, now_ms: i64) -> Vec<Exposure> {
        let mut all = lock(&self.exposures);
        all.retain(|_, e| {
            let live = e.expires_at_ms.is_none_or(|t| now_ms < t);
            if !live {
                e.revoked.cancel();
                if let Some(r) = &self.reports {
                    r.try_send(PortEvent::new(e.port, PortWhat::Expired, ""));
                }
            }
            live
        });
        all.values().cloned().collect()
    }

    /// Cuts every exposure (the sandbox goes).
    pub fn close(&self) {
        for (_, e) in std::mem::take(&mut *lock(&self.exposures)) {
            e.revoked.cancel();
        }
    }

    /// Lets the sandbox's ingress relay go, if it has one (see
    /// [`ingress::Ingress::release`]): whether none is left within
    /// `within`.
    pub async fn release_ingress(&self, within: Duration) -> bool {
        match self.ingress.get() {
            Some(i) => i.release(within).await,
            None => true,
        }
    }

    /// The sandbox's way in, its socket bound in `dir` on first use.
    pub async fn ingress(
        &self,
        dir: &std::path::Path,
        closed: &CancellationToken,
        tracker: &tokio_util::task::TaskTracker,
    ) -> std::io::Result<Arc<ingress::Ingress>> {
        self.ingress
            .get_or_try_init(|| async { ingress::Ingress::bind(dir, closed.clone(), tracker) })
            .await
            .cloned()
    }
}

/// One connection's place under its sandbox's bound, until it is made
/// (then its [`Counted`] keeps it).
pub struct Slot(Place);

impl Slot {
    pub fn hold<S>(self, inner: S) -> Counted<S> {
        Counted {
            inner,
            _place: self.0,
            link: None,
            meter: None,
            read_wait: None,
            write_wait: None,
        }
    }

    /// [`Self::hold`], counted in `open` while it is, its bytes by
    /// `meter` and its `link`.
    pub fn hold_metered<S>(
        mut self,
        inner: S,
        open: &prometheus_client::metrics::gauge::Gauge,
        meter: Arc<WayMeter>,
        link: Arc<Link>,
    ) -> Counted<S> {
        open.inc();
        self.0.1 = Some(open.clone());
        let mut c = self.hold(inner);
        c.meter = Some(meter);
        c.link = Some(link);
        c
    }
}

/// The worker's key for signed URLs: 32 random bytes kept in its state
/// directory (0600), so tokens outlive a restart of the worker.
#[derive(Clone)]
pub struct Key(Arc<ring::hmac::Key>);

impl Key {
    pub fn load_or_make(state_dir: &std::path::Path) -> std::io::Result<Self> {
        use std::io::Write;
        let path = state_dir.join("ports.key");
        let bytes = match std::fs::read(&path) {
            Ok(b) if b.len() == 32 => b,
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not 32 bytes", path.display()),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut b = vec![0u8; 32];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
                    .map_err(|_| std::io::Error::other("no randomness"))?;
                let tmp = state_dir.join("ports.key.tmp");
                let mut f = crate::state::private_file()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&tmp)?;
                f.write_all(&b)?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                b
            }
            Err(e) => return Err(e),
        };
        Ok(Self(Arc::new(ring::hmac::Key::new(
            ring::hmac::HMAC_SHA256,
            &bytes,
        ))))
    }

    fn message(sandbox: &SandboxId, port: u16, expires_at_ms: i64, nonce: &str) -> String {
        format!("corral-port-v1\n{sandbox}\n{port}\n{expires_at_ms}\n{nonce}")
    }

    /// The token of a signed exposure: `{expiry}.{nonce}.{mac}`.
    pub fn sign(&self, sandbox: &SandboxId, e: &Exposure) -> String {
        let expires = e.expires_at_ms.unwrap_or(0);
        let tag = ring::hmac::sign(
            &self.0,
            Self::message(sandbox, e.port, expires, &e.nonce).as_bytes(),
        );
        format!("{expires}.{}.{}", e.nonce, hex(tag.as_ref()))
    }

    /// Checks `token` for `port` of `sandbox` against the exposure in force
    /// (`None`: the port is not exposed, or its exposure ended).
    pub fn verify(
        &self,
        token: &str,
        sandbox: &SandboxId,
        port: u16,
        exposure: Option<&Exposure>,
        now_ms: i64,
    ) -> Result<(), Refusal> {
        let mut parts = token.splitn(3, '.');
        let (Some(expires), Some(nonce), Some(mac)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(Refusal::InvalidToken);
        };
        let Ok(expires) = expires.parse::<i64>() else {
            return Err(Refusal::InvalidToken);
        };
        let Some(mac) = unhex(mac) else {
            return Err(Refusal::InvalidToken);
        };
        // Made by this worker for this sandbox and port (constant time).
        if ring::hmac::verify(
            &self.0,
            Self::message(sandbox, port, expires, nonce).as_bytes(),
            &mac,
        )
        .is_err()
        {
            return Err(Refusal::InvalidToken);
        }
        if now_ms >= expires {
            return Err(Refusal::TokenExpired);
        }
        match exposure {
            Some(e) if e.access == Access::Signed && e.nonce == nonce => Ok(()),
            // Genuine, but its exposure was revoked (or replaced).
            _ => Err(Refusal::Revoked),
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 128 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A random nonce for a new exposure.
pub fn nonce() -> String {
    let mut b = [0u8; 12];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    hex(&b)
}

/// A port as the wire names it: 1 to 65535.
pub fn port_of(port: u32) -> Result<u16, tonic::Status> {
    u16::try_from(port).ok().filter(|p| *p > 0).ok_or_else(|| {
        crate::error::WorkerError::Invalid(corral_proto::ProtocolError::invalid(
            "port",
            format!("{port}: a port is 1 to 65535"),
        ))
        .into()
    })
}

/// An `ExposePort` request's port, access and time to live.
pub fn from_pb(
    r: &corral_proto::pb::ExposePortRequest,
) -> Result<(u16, Access, Option<Duration>), tonic::Status> {
    use corral_proto::pb::PortAccess;
    let access = match r.access() {
        PortAccess::Unspecified | PortAccess::Private => Access::Private,
        PortAccess::Signed => Access::Signed,
        PortAccess::Public => Access::Public,
    };
    let ttl = (r.ttl_ms > 0).then(|| Duration::from_millis(r.ttl_ms));
    Ok((port_of(r.port)?, access, ttl))
}

pub fn to_pb(e: crate::worker::ExposureInfo) -> corral_proto::pb::PortExposure {
    use corral_proto::pb::PortAccess;
    let mut p = corral_proto::pb::PortExposure {
        sandbox_id: e.sandbox.to_string(),
        port: u32::from(e.port),
        url: e.url,
        token: e.token.unwrap_or_default(),
        expires_at_unix_ms: e.expires_at_ms.unwrap_or(0),
        created_at_unix_ms: e.created_at_ms,
        wake_on_request: e.wake_on_request,
        ..Default::default()
    };
    p.set_access(match e.access {
        Access::Private => PortAccess::Private,
        Access::Signed => PortAccess::Signed,
        Access::Public => PortAccess::Public,
    });
    p
}

/// Why the port listener refused a request: each a status and a reason
/// clients decide on (the body is JSON with both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No credential where one is needed.
    Unauthenticated,
    /// A token this worker did not make for this sandbox and port.
    InvalidToken,
    TokenExpired,
    /// A genuine token of an exposure since revoked.
    Revoked,
    /// The port is not exposed (or the sandbox is not this worker's).
    NotExposed,
    /// The sandbox is not running (checkpointed, removed, unknown).
    SandboxNotFound,
    /// Nothing listens on the port in the sandbox.
    PortNotListening,
    /// The sandbox's way in did not answer.
    SandboxUnavailable,
    /// The sandbox is being restored for this request: come again.
    SandboxWaking,
    /// The URL names no sandbox and port.
    BadRoute,
    /// Past the sandbox's bound on connections.
    TooManyConnections,
    /// A request's header fields over the bound.
    HeadTooLarge,
    /// A change (a POST, say) a page of another origin asked for with the
    /// cookie the browser holds for this one.
    CrossOrigin,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::InvalidToken => "invalid_token",
            Refusal::TokenExpired => "token_expired",
            Refusal::Revoked => "revoked",
            Refusal::NotExposed => "not_exposed",
            Refusal::SandboxNotFound => "sandbox_not_found",
            Refusal::PortNotListening => "port_not_listening",
            Refusal::SandboxUnavailable => "sandbox_unavailable",
            Refusal::SandboxWaking => "sandbox_waking",
            Refusal::BadRoute => "bad_route",
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::HeadTooLarge => "head_too_large",
            Refusal::CrossOrigin => "cross_origin",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            Refusal::Unauthenticated
            | Refusal::InvalidToken
            | Refusal::TokenExpired
            | Refusal::Revoked => 401,
            Refusal::NotExposed | Refusal::SandboxNotFound | Refusal::BadRoute => 404,
            Refusal::PortNotListening => 502,
            Refusal::SandboxUnavailable | Refusal::SandboxWaking => 503,
            Refusal::TooManyConnections => 429,
            Refusal::HeadTooLarge => 431,
            Refusal::CrossOrigin => 403,
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => {
                "this port is private: present the worker's token as Authorization: Bearer, or a signed URL's token"
            }
            Refusal::InvalidToken => "the token was not made for this sandbox and port",
            Refusal::TokenExpired => "the token has expired: expose the port again for a new one",
            Refusal::Revoked => "access to this port was revoked",
            Refusal::NotExposed => "this port of the sandbox is not exposed",
            Refusal::SandboxNotFound => "no such running sandbox on this worker",
            Refusal::PortNotListening => {
                "nothing listens on this port in the sandbox (yet): start the server, or wait for it"
            }
            Refusal::SandboxUnavailable => "the sandbox's way in did not answer",
            Refusal::SandboxWaking => {
                "the sandbox is being restored from its checkpoint for this port: try again in a moment"
            }
            Refusal::BadRoute => {
                "the URL names no sandbox and port: /p/{sandbox}/{port}/... or {port}-{sandbox}.{domain}"
            }
            Refusal::TooManyConnections => "too many connections to this sandbox's ports",
            Refusal::HeadTooLarge => "the request's header fields are over 64 KiB",
            Refusal::CrossOrigin => {
                "a page of another origin may not change anything here with this origin's cookie"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposure(port: u16, expires_at_ms: i64) -> Exposure {
        Exposure {
            port,
            access: Access::Signed,
            expires_at_ms: Some(expires_at_ms),
            created_at_ms: 0,
            nonce: nonce(),
            wake_on_request: false,
            revoked: CancellationToken::new(),
        }
    }

    #[test]
    fn a_token_holds_for_its_sandbox_port_and_exposure_only() {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::load_or_make(dir.path()).unwrap();
        let (a, b) = (SandboxId::new("a").unwrap(), SandboxId::new("b").unwrap());
        let e = exposure(80, 10_000);
        let t = key.sign(&a, &e);
        assert_eq!(key.verify(&t, &a, 80, Some(&e), 5_000), Ok(()));
        assert_eq!(
            key.verify(&t, &b, 80, Some(&e), 5_000),
            Err(Refusal::InvalidToken)
        );
        assert_eq!(
            key.verify(&t, &a, 81, Some(&e), 5_000),
            Err(Refusal::InvalidToken)
        );
        assert_eq!(
            key.verify(&t, &a, 80, Some(&e), 10_000),
            Err(Refusal::TokenExpired)
        );
        // Another exposure of the port (a new nonce), or none: revoked.
        let again = exposure(80, 10_000);
        assert_eq!(
            key.verify(&t, &a, 80, Some(&again), 5_000),
            Err(Refusal::Revoked)
        );
        assert_eq!(key.verify(&t, &a, 80, None, 5_000), Err(Refusal::Revoked));
        // A later expiry written into the token breaks its MAC.
        let stretched = t.replacen("10000", "99999", 1);
        assert_eq!(
            key.verify(&stretched, &a, 80, Some(&e), 5_000),
            Err(Refusal::InvalidToken)
        );
        for junk in ["", "x", "1.2", "1.2.zz", "a.b.c", &"f".repeat(500)] {
            assert_eq!(
                key.verify(junk, &a, 80, Some(&e), 0),
                Err(Refusal::InvalidToken),
                "{junk}"
            );
        }
        // The key is kept: a restarted worker's tokens still hold.
        let again = Key::load_or_make(dir.path()).unwrap();
        assert_eq!(again.verify(&t, &a, 80, Some(&e), 5_000), Ok(()));
        let other = Key::load_or_make(tempfile::tempdir().unwrap().path()).unwrap();
        assert_eq!(
            other.verify(&t, &a, 80, Some(&e), 5_000),
            Err(Refusal::InvalidToken)
        );
    }

    #[tokio::test]
    async fn what_happens_to_a_sandboxs_ports_is_told_as_its_events() {
        use corral_proto::event::PortWhat::*;
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let ports = SandboxPorts::default().telling(crate::reports::Reports::new(tx));
        ports.expose(exposure(80, 10_000)).unwrap();
        ports.expose(exposure(81, 10_000)).unwrap();
        let link = ports.link(80, Access::Signed);
        link.carried_in(3);
        ports.tell_refused(80, Refusal::InvalidToken.reason());
        assert!(ports.revoke(80));
        assert!(!ports.revoke(80), "told once");
        link.end("revoked");
        drop(link);
        // 81 is found expired.
        assert!(ports.get(81, 10_000).is_none());
        drop(ports);
        let mut told = Vec::new();
        while let Some(e) = rx.recv().await {
            told.push((e.port, e.what, e.detail, e.bytes_in));
        }
        let d = |s: &str| s.to_string();
        assert_eq!(
            told,
            [
                (80, Exposed, d("signed"), 0),
                (81, Exposed, d("signed"), 0),
                (80, Opened, d("signed"), 0),
                (80, Refused, d("invalid_token"), 0),
                (80, Revoked, d(""), 0),
                (80, Closed, d("revoked"), 3),
                (81, Expired, d(""), 0),
            ]
        );
    }

    #[tokio::test]
    async fn a_flood_of_refusals_is_told_ten_a_second_and_the_rest_counted() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let ports = SandboxPorts::default().telling(crate::reports::Reports::new(tx));
        for _ in 0..25 {
            ports.tell_refused(80, Refusal::Unauthenticated.reason());
        }
        ports.expose(exposure(80, i64::MAX)).unwrap();
        drop(ports);
        let mut told = Vec::new();
        while let Some(e) = rx.recv().await {
            told.push((e.what, e.unreported));
        }
        use corral_proto::event::PortWhat::*;
        let mut want = vec![(Refused, 0); REFUSALS_TOLD_PER_SECOND as usize];
        want.push((Exposed, 25 - REFUSALS_TOLD_PER_SECOND));
        assert_eq!(told, want);
    }

    #[test]
    fn exposures_are_kept_in_their_file_and_revocations_too() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sb.json");
        let ports = SandboxPorts::kept_at(file.clone());
        let mut waking = exposure(80, i64::MAX);
        waking.wake_on_request = true;
        let a = ports.expose(waking).unwrap();
        ports.expose(exposure(81, i64::MAX)).unwrap();
        // What a restarted worker (or a restored sandbox) finds: the same
        // exposures, nonces and all, so their tokens hold.
        let again = SandboxPorts::kept_at(file.clone());
        let got = again.get(80, 0).unwrap();
        assert_eq!(
            (got.nonce.as_str(), got.access, got.wake_on_request),
            (a.nonce.as_str(), Access::Signed, true)
        );
        assert!(!got.revoked.is_cancelled());
        assert!(ports.revoke(81));
        assert!(SandboxPorts::kept_at(file.clone()).get(81, 0).is_none());
        // None left: no file.
        assert!(ports.revoke(80));
        assert!(!file.exists());
        // An unreadable file gives none (never more than was exposed).
        std::fs::write(&file, b"{not json").unwrap();
        assert!(SandboxPorts::kept_at(file).list(0).is_empty());
        // An exposure that cannot be kept is not made.
        let gone = SandboxPorts::kept_at(dir.path().join("missing-dir").join("sb.json"));
        assert!(gone.expose(exposure(82, i64::MAX)).is_err());
        assert!(gone.get(82, 0).is_none());
    }

    #[test]
    fn the_bound_on_connections_is_held_until_each_one_closes() {
        let ports = SandboxPorts::default();
        // Others than the owner fill their share, and no more.
        let mut held: Vec<_> = (0..MAX_SHARED_CONNECTIONS)
            .map(|_| ports.admit_connection(false).unwrap().hold(()))
            .collect();
        assert!(ports.admit_connection(false).is_none());
        // The owner has the rest.
        while held.len() < MAX_CONNECTIONS {
            held.push(ports.admit_connection(true).unwrap().hold(()));
        }
        assert!(ports.admit_connection(true).is_none());
        held.pop();
        // A place taken and given back before it held anything.
        drop(ports.admit_connection(true).unwrap());
        assert_eq!(ports.open_connections(), MAX_CONNECTIONS - 1);
        assert!(ports.admit_connection(true).is_some());
        // A shared one gone frees a place for either.
        drop(held.remove(0));
        assert!(ports.admit_connection(false).is_some());
    }

    #[test]
    fn revoking_or_exposing_again_cuts_the_old_exposure() {
        let ports = SandboxPorts::default();
        let first = ports.expose(exposure(80, i64::MAX)).unwrap();
        let second = ports.expose(exposure(80, i64::MAX)).unwrap();
        assert!(first.revoked.is_cancelled());
        assert!(!second.revoked.is_cancelled());
        assert!(ports.revoke(80));
        assert!(second.revoked.is_cancelled());
        assert!(!ports.revoke(80));
        // Expired: gone at the next look, and cut.
        let short = ports.expose(exposure(81, 100)).unwrap();
        assert!(ports.get(81, 99).is_some());
        assert!(ports.get(81, 100).is_none());
        assert!(short.revoked.is_cancelled());
        for p in 0..MAX_EXPOSURES as u16 {
            ports.expose(exposure(1000 + p, i64::MAX)).unwrap();
        }
        assert!(ports.expose(exposure(2000, i64::MAX)).is_err());
    }
}
