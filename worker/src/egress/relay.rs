//! The bytes of an admitted connection carried both ways, metered and
//! bounded by the sandbox's rate, spliced through a pipe where the kernel
//! allows.

use super::*;

/// Relays an admitted connection both ways until either side is done, it
/// is idle past [`IDLE_TIMEOUT`], or `policy` changes to one that no
/// longer allows it (then it is closed at once, `cut`), copying through
/// this process: what needs its bytes read (a tunnel whose client had not
/// spoken when it was connected, plain HTTP checked a request at a time).
/// Counted and bound by `meters`.
pub async fn relay<S>(
    admitted: Admitted<S>,
    mut policy: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    meters: &Meters,
) -> Outcome
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Admitted {
        client,
        mut upstream,
        outcome: mut out,
        hello_pending,
        http: mut guard,
    } = admitted;
    let (host, port) = (out.host.clone(), out.port);
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = upstream.split();
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    // A tunnel connected before its client spoke: the server's bytes go to
    // the client, the client's are held until they pass the check.
    let mut first = Vec::new();
    // Once a hello has begun, it has the head's time to end.
    let mut hello_by: Option<tokio::time::Instant> = None;
    if hello_pending {
        loop {
            #[derive(PartialEq)]
            enum Step {
                Again,
                Checked,
                End,
            }
            let step = tokio::time::timeout(IDLE_TIMEOUT, async {
                tokio::select! {
                    biased;
                    changed = policy.changed() => {
                        let now = policy.borrow_and_update().clone();
                        if changed.is_err() {
                            return Step::End;
                        }
                        if let Err(reason) = decide(&now, &host, port) {
                            out.blocked = Some(reason);
                            out.cut = true;
                            return Step::End;
                        }
                        Step::Again
                    }
                    n = cr.read(&mut up) => match n {
                        // Done before a word: the server hears of it below.
                        Ok(0) if first.is_empty() => Step::Checked,
                        Ok(n) if n > 0 => {
                            if first.is_empty() {
                                hello_by = Some(tokio::time::Instant::now() + HEAD_TIMEOUT);
                            }
                            first.extend_from_slice(&up[..n]);
                            match hello_verdict(&first, &host) {
                                Verdict::More => Step::Again,
                                Verdict::Go => Step::Checked,
                                Verdict::Http => {
                                    guard = Some(http::Guard::new(http::Mode::Tunnel, &host, port));
                                    Step::Checked
                                }
                                Verdict::Refuse => {
                                    out.blocked = Some(Blocked::SniMismatch);
                                    Step::End
                                }
                            }
                        }
                        Ok(_) => {
                            out.blocked = Some(Blocked::BadRequest);
                            Step::End
                        }
                        Err(_) => Step::End,
                    },
                    () = until(hello_by) => {
                        out.blocked = Some(Blocked::BadRequest);
                        Step::End
                    }
                    n = ur.read(&mut down) => match n {
                        Ok(n) if n > 0 => {
                            meters.inward.charge(n as u64).await;
                            if cw.write_all(&down[..n]).await.is_err() {
                                return Step::End;
                            }
                            out.bytes_in += n as u64;
                            Step::Again
                        }
                        _ => {
                            let _ = cw.shutdown().await;
                            Step::End
                        }
                    },
                }
            })
            .await;
            match step {
                Ok(Step::Again) => {}
                Ok(Step::Checked) => {
                    let passed = match guard.as_mut() {
                        Some(g) => {
                            let mut passed = Vec::new();
                            if let Err(reason) = g.feed(&first, &mut passed) {
                                out.blocked = Some(reason);
                                return out;
                            }
                            passed
                        }
                        None => std::mem::take(&mut first),
                    };
                    meters.out.charge(passed.len() as u64).await;
                    if uw.write_all(&passed).await.is_err() {
                        return out;
                    }
                    out.bytes_out += passed.len() as u64;
                    break;
                }
                Ok(Step::End) | Err(_) => return out,
            }
        }
    }
    // An upgrade's answer, read so far, while it is awaited.
    let mut answer: Option<Vec<u8>> = None;
    let mut refused = false;
    let mut passed = Vec::new();
    loop {
        // While an Upgrade request waits for its answer, nothing more of
        // the client's is read.
        let holding = guard.as_ref().is_some_and(http::Guard::awaiting_upgrade);
        if holding && answer.is_none() && !refused {
            answer = Some(Vec::new());
        }
        let step = tokio::time::timeout(IDLE_TIMEOUT, async {
            tokio::select! {
                changed = policy.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                    let now = policy.borrow_and_update().clone();
                    if let Err(reason) = decide(&now, &host, port) {
                        // No longer allowed: closed at once.
                        out.blocked = Some(reason);
                        out.cut = true;
                        return false;
                    }
                    true
                }
                n = cr.read(&mut up), if !holding => match n {
                    Ok(0) | Err(_) => {
                        let _ = uw.shutdown().await;
                        // The sandbox is done sending: what is left comes
                        // back, unless the policy cuts it.
                        loop {
                            tokio::select! {
                                changed = policy.changed() => {
                                    let now = policy.borrow_and_update().clone();
                                    if changed.is_err() || decide(&now, &host, port).is_err() {
                                        out.blocked = decide(&now, &host, port).err();
                                        out.cut = out.blocked.is_some();
                                        return false;
                                    }
                                }
                                n = ur.read(&mut down) => match n {
                                    Ok(n) if n > 0 => {
                                        meters.inward.charge(n as u64).await;
                                        if cw.write_all(&down[..n]).await.is_err() {
                                            return false;
                                        }
                                        out.bytes_in += n as u64;
                                    }
                                    _ => return false,
                                },
                            }
                        }
                    }
                    Ok(n) => {
                        let bytes = match guard.as_mut() {
                            Some(g) => {
                                passed.clear();
                                if let Err(reason) = g.feed(&up[..n], &mut passed) {
                                    // A request refused: nothing of it goes.
                                    out.blocked = Some(reason);
                                    return false;
                                }
                                &passed[..]
                            }
                            None => &up[..n],
                        };
                        meters.out.charge(bytes.len() as u64).await;
                        if uw.write_all(bytes).await.is_err() {
                            return false;
                        }
                        out.bytes_out += bytes.len() as u64;
                        true
                    }
                },
                n = ur.read(&mut down) => match n {
                    Ok(0) | Err(_) => {
                        let _ = cw.shutdown().await;
                        false
                    }
                    Ok(n) => {
                        if let (Some(g), Some(seen)) = (guard.as_mut(), answer.as_mut()) {
                            seen.extend_from_slice(&down[..n]);
                            match g.answered(seen) {
                                // Upgraded: the rest is the new protocol's.
                                Some(true) => answer = None,
                                // Refused: the client hears the answer and
                                // sends nothing more upstream.
                                Some(false) => {
                                    answer = None;
                                    refused = true;
                                    // The server hears that nothing more
                                    // comes; its answer is passed on, then
                                    // the connection ends.
                                    let _ = uw.shutdown().await;
                                }
                                None => {}
                            }
                        }
                        meters.inward.charge(n as u64).await;
                        if cw.write_all(&down[..n]).await.is_err() {
                            return false;
                        }
                        out.bytes_in += n as u64;
                        true
                    }
                },
            }
        })
        .await;
        if !matches!(step, Ok(true)) {
            return out;
        }
    }
}

/// [`relay`] for a client that is a socket (the sandbox's own, handed
/// over, or the relay's Unix socket): the same promises (cut at once by a
/// policy that no longer allows it, closed when idle, each side's end
/// passed on), with the bytes spliced from socket to socket through a pipe
/// a direction, never copied through the worker.
pub async fn relay_spliced<S>(
    admitted: Admitted<S>,
    mut policy: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    meters: &Meters,
) -> Outcome
where
    S: Spliced + tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use std::os::fd::AsFd as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    // What must be read on its way (a tunnel whose client had not spoken,
    // plain HTTP) is copied.
    if admitted.hello_pending || admitted.http.is_some() {
        return relay(admitted, policy, meters).await;
    }
    let Admitted {
        client,
        upstream,
        outcome: mut out,
        ..
    } = admitted;
    let (host, port) = (out.host.clone(), out.port);
    let (Ok(p_up), Ok(p_down)) = (SplicePipe::new(), SplicePipe::new()) else {
        return out;
    };
    let (sent, got) = (AtomicU64::new(0), AtomicU64::new(0));
    let up = async {
        let r = splice_all(&client, &upstream, &p_up, &sent, &meters.out).await;
        // The sandbox is done sending: the server hears of it.
        let _ = nix::sys::socket::shutdown(
            std::os::fd::AsRawFd::as_raw_fd(&upstream),
            nix::sys::socket::Shutdown::Write,
        );
        r.map_err(|_| None)
    };
    let down = async {
        let r = splice_all(&upstream, &client, &p_down, &got, &meters.inward).await;
        let _ = nix::sys::socket::shutdown(
            std::os::fd::AsRawFd::as_raw_fd(&client.as_fd()),
            nix::sys::socket::Shutdown::Write,
        );
        r
    };
    tokio::pin!(up, down);
    let mut up_done = false;
    let mut seen = 0u64;
    let mut idle = tokio::time::interval(IDLE_TIMEOUT / 4);
    idle.reset();
    let mut quiet_since = tokio::time::Instant::now();
    loop {
        tokio::select! {
            // A replaced policy is seen before more bytes move.
            biased;
            changed = policy.changed() => {
                if changed.is_err() {
                    break;
                }
                let now = policy.borrow_and_update().clone();
                if let Err(reason) = decide(&now, &host, port) {
                    out.blocked = Some(reason);
                    out.cut = true;
                    break;
                }
            }
            r = &mut up, if !up_done => {
                up_done = true;
                if let Err(blocked) = r {
                    // A hello refused late: blocked (not cut by a policy).
                    out.blocked = blocked;
                    break;
                }
            }
            _ = &mut down => break,
            _ = idle.tick() => {
                let moved = sent.load(Ordering::Relaxed) + got.load(Ordering::Relaxed);
                if moved != seen {
                    seen = moved;
                    quiet_since = tokio::time::Instant::now();
                } else if quiet_since.elapsed() >= IDLE_TIMEOUT {
                    break;
                }
            }
        }
    }
    // Both ends closed for both directions, whoever else holds them (a
    // socket handed over from a sandbox may have copies there).
    for fd in [client.as_fd(), upstream.as_fd()] {
        let _ = nix::sys::socket::shutdown(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            nix::sys::socket::Shutdown::Both,
        );
    }
    out.bytes_out += sent.load(Ordering::Relaxed);
    out.bytes_in += got.load(Ordering::Relaxed);
    out
}

/// Waits until `at`, or forever when there is none.
pub(crate) async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The size asked of a splicing pipe.
pub(crate) const PIPE_BYTES: i32 = 1 << 20;

/// A pipe for splicing, both ends non-blocking.
pub(crate) struct SplicePipe {
    r: std::os::fd::OwnedFd,
    w: std::os::fd::OwnedFd,
}

impl SplicePipe {
    fn new() -> std::io::Result<Self> {
        let (r, w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)?;
        // Larger than the default 64 KiB: fewer, bigger moves (a pipe that
        // cannot grow works as it is).
        let _ = nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_BYTES));
        Ok(Self { r, w })
    }
}

/// A socket tokio watches, spliced from or to.
pub trait Spliced: std::os::fd::AsFd {
    fn ready(
        &self,
        interest: tokio::io::Interest,
    ) -> impl std::future::Future<Output = std::io::Result<tokio::io::Ready>>;
    fn attempt<R>(
        &self,
        interest: tokio::io::Interest,
        f: impl FnOnce() -> std::io::Result<R>,
    ) -> std::io::Result<R>;
}

macro_rules! spliced {
    ($($t:ty),*) => {$(
        impl Spliced for $t {
            fn ready(
                &self,
                interest: tokio::io::Interest,
            ) -> impl std::future::Future<Output = std::io::Result<tokio::io::Ready>> {
                <$t>::ready(self, interest)
            }
            fn attempt<R>(
                &self,
                interest: tokio::io::Interest,
                f: impl FnOnce() -> std::io::Result<R>,
            ) -> std::io::Result<R> {
                self.try_io(interest, f)
            }
        }
    )*};
}

spliced!(tokio::net::TcpStream, tokio::net::UnixStream);

/// What one direction of a sandbox's egress is counted in, and bound by.
#[derive(Debug, Clone, Default)]
pub struct Meter {
    /// Bytes moved, as they move (`corral_egress_bytes_total`).
    pub bytes: prometheus_client::metrics::counter::Counter,
    /// The sandbox's rate in this direction, shared by its connections.
    pub rate: Option<std::sync::Arc<crate::rate::Rate>>,
}

impl Meter {
    /// Up to `want` bytes may move now (waits for the rate).
    async fn allow(&self, want: usize) -> usize {
        match &self.rate {
            Some(rate) => rate.take(want).await,
            None => want,
        }
    }

    /// Counts `n` bytes that moved already (a request's head, sent when
    /// it was admitted), and waits until the rate has them.
    pub async fn charge(&self, n: u64) {
        if let Some(rate) = &self.rate {
            let mut left = usize::try_from(n).unwrap_or(usize::MAX);
            while left > 0 {
                left -= rate.take(left).await;
            }
        }
        self.bytes.inc_by(n);
    }

    fn moved(&self, allowed: usize, moved: usize) {
        if let Some(rate) = &self.rate {
            rate.give_back(allowed.saturating_sub(moved));
        }
        self.bytes.inc_by(moved as u64);
    }
}

/// Both directions of a sandbox's egress: out (to servers), in.
#[derive(Debug, Clone, Default)]
pub struct Meters {
    pub out: Meter,
    pub inward: Meter,
}

/// Moves everything `from` sends to `to` through `pipe`, counting it in
/// `moved` and `meter` and at most at `meter`'s rate, until `from` ends
/// (`Ok`) or either side fails.
pub(crate) async fn splice_all(
    from: &impl Spliced,
    to: &impl Spliced,
    pipe: &SplicePipe,
    moved: &std::sync::atomic::AtomicU64,
    meter: &Meter,
) -> std::io::Result<()> {
    use nix::fcntl::{SpliceFFlags, splice};
    use tokio::io::Interest;
    let flags = SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE;
    const CHUNK: usize = 1 << 20;
    loop {
        from.ready(Interest::READABLE).await?;
        let allowed = meter.allow(CHUNK).await;
        let n = match from.attempt(Interest::READABLE, || {
            splice(from.as_fd(), None, &pipe.w, None, allowed, flags).map_err(std::io::Error::from)
        }) {
            Ok(0) => {
                meter.moved(allowed, 0);
                return Ok(());
            }
            Ok(n) => n,
            Err(e) => {
                meter.moved(allowed, 0);
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    continue;
                }
                return Err(e);
            }
        };
        meter.moved(allowed, n);
        let mut left = n;
        while left > 0 {
            to.ready(Interest::WRITABLE).await?;
            match to.attempt(Interest::WRITABLE, || {
                splice(&pipe.r, None, to.as_fd(), None, left, flags).map_err(std::io::Error::from)
            }) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(m) => left -= m,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        moved.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Serves one connection of a sandbox's proxy: [`admit`], then [`relay`].
pub async fn serve_connection<S>(
    client: S,
    mut policy: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    gate: &Gate,
) -> Outcome
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    match admit(client, &mut policy, gate).await {
        Ok(a) => relay(a, policy, &Meters::default()).await,
        Err(refused) => refused.answer().await,
    }
}
