//! The worker's end of a sandbox's egress proxy: a Unix socket of the
//! sandbox's own, in a directory mounted (read-only) into that sandbox
//! alone, so a connection on it is the sandbox's whatever it says. The
//! sandbox's relay (`corral_init::relay`) hands each connection of its
//! loopback proxy here (the sandbox's socket itself, passed with
//! `SCM_RIGHTS`, checked to be a connected TCP socket before anything is
//! done with it), or carries its bytes where it cannot; this decides it by
//! the sandbox's policy (see [`crate::egress`]), connects and relays,
//! bounded per sandbox, and reports every decision.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::egress::Rule;
use corral_proto::event::{Egress, EgressDecision};
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use corral_init::relay::{HANDED, RELAYED};

use crate::egress::{
    Blocked, Gate, HEAD_TIMEOUT, Meter, Meters, Spliced, admit, relay_spliced, too_many,
};
use crate::metrics::WorkerMetrics;

/// The socket's name in its directory (as `corral_init::relay` expects).
pub const SOCKET_NAME: &str = "proxy.sock";
/// Where the directory is mounted in the sandbox.
pub const SANDBOX_DIR: &str = "/run/corral-egress";
/// The proxy's address in the sandbox, as its environment names it.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";
/// The environment that names the proxy to a sandbox's commands (loopback
/// itself not through it).
pub fn proxy_env() -> impl Iterator<Item = (&'static str, &'static str)> {
    ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
        .into_iter()
        .map(|k| (k, PROXY_URL))
        .chain(
            ["NO_PROXY", "no_proxy"]
                .into_iter()
                .map(|k| (k, "localhost,127.0.0.1,::1")),
        )
}

/// Connections one sandbox may have open through its proxy by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

/// The worker's egress settings, shared by every sandbox's proxy.
#[derive(Debug, Clone)]
pub struct Settings {
    pub gate: Gate,
    /// Connections one sandbox may have open at once; more are refused
    /// (429, `too_many_connections`) without reading them.
    pub max_connections: usize,
    /// Bytes a second one sandbox's egress may move each way, across its
    /// connections (`--egress-max-bytes-per-second`); `None`: no bound.
    pub max_bytes_per_second: Option<u64>,
}

impl Default for Settings {
    /// This host's addresses refused, ten seconds to connect, the default
    /// bound; no exemption, no own port (the caller adds them).
    fn default() -> Self {
        Self {
            gate: Gate {
                connect_timeout: Duration::from_secs(10),
                own_ips: host_addresses(),
                ..Gate::default()
            },
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_bytes_per_second: None,
        }
    }
}

/// The addresses of this host's interfaces (none if they cannot be read).
pub fn host_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<std::net::IpAddr> = addrs
        .filter_map(|a| a.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| std::net::IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A sandbox's socket directory under the worker's state directory.
pub fn socket_dir(state_root: &Path, id: &SandboxId) -> PathBuf {
    state_root.join("egress").join(id.as_str())
}

/// Makes a sandbox's socket directory, 0755: what reaches it is the mount
/// in one sandbox; on the host it sits in the private state directory.
pub fn make_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

/// Makes `dir` and binds its socket anew (a stale one from an earlier run
/// is replaced), 0666 (see [`make_dir`]).
pub fn bind(dir: &Path) -> std::io::Result<UnixListener> {
    bind_named(dir, SOCKET_NAME)
}

/// [`bind`] for the socket `name` of the directory (the way in's too).
pub fn bind_named(dir: &Path, name: &str) -> std::io::Result<UnixListener> {
    make_dir(dir)?;
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    // A Unix socket's path has at most 107 bytes; a state directory may be
    // deeper. Bound through the directory's descriptor, the path is short.
    let listener = if path.as_os_str().len() < 100 {
        UnixListener::bind(&path)?
    } else {
        let d = std::fs::File::open(dir)?;
        let short = format!(
            "/proc/self/fd/{}/{name}",
            std::os::fd::AsRawFd::as_raw_fd(&d)
        );
        UnixListener::bind(short)?
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Makes `dir` (a sandbox's socket directory) name the directory of the
/// pool member it was claimed from, beside it (see [`socket_dir`]).
pub fn link_dir(dir: &Path, member: &SandboxId) -> std::io::Result<()> {
    std::os::unix::fs::symlink(member.as_str(), dir)
}

/// Removes a sandbox's socket directory (nothing if it has none), and the
/// member's directory it names if it is a link made by [`link_dir`].
pub fn remove(dir: &Path) {
    let removed = match std::fs::read_link(dir) {
        Ok(target) => {
            // Only a sibling's name, as link_dir makes it.
            let sibling = target
                .file_name()
                .filter(|n| target.as_os_str() == *n)
                .and_then(|n| dir.parent().map(|p| p.join(n)));
            if let Some(real) = sibling {
                remove(&real);
            }
            std::fs::remove_file(dir)
        }
        Err(_) => std::fs::remove_dir_all(dir),
    };
    match removed {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            warn!(dir = %dir.display(), error = %e, "removing an egress socket directory");
        }
        _ => {}
    }
}

/// What the proxy tells its sandbox: each decision, as an event.
pub type Reports = crate::reports::Reports<Egress>;

/// Serves a sandbox's socket until `closed`: each connection is admitted
/// or refused, relayed, and reported (to `reports`, and the metrics). At
/// most `settings.max_connections` at once; a task per connection, owned
/// by `tracker`, ended by `closed` too.
pub async fn serve(
    listener: UnixListener,
    policy: watch::Receiver<Arc<Vec<Rule>>>,
    settings: Arc<Settings>,
    reports: Reports,
    metrics: Arc<WorkerMetrics>,
    tracker: TaskTracker,
    closed: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    // One rate a direction for all of this sandbox's connections.
    let meter = |direction: &str| Meter {
        bytes: metrics
            .egress_bytes
            .get_or_create(&vec![("direction", direction.to_string())])
            .clone(),
        rate: settings
            .max_bytes_per_second
            .map(|n| Arc::new(crate::rate::Rate::new(n))),
    };
    let meters = Arc::new(Meters {
        out: meter("out"),
        inward: meter("in"),
    });
    loop {
        let accepted = tokio::select! {
            () = closed.cancelled() => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, say: the next try may do.
                warn!(error = %e, "egress accept failed");
                tokio::select! {
                    () = closed.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            let reason = Blocked::TooManyConnections.as_str();
            metrics.egress_decided(EgressDecision::Blocked.as_str(), reason);
            // Said without waiting on the sandbox: it may not be reading.
            // Its head is not read, so the event names no host; a flood
            // that fills the event queue is not waited for either. A
            // connection handed over (if it is here yet) hears it itself.
            match receive_handed(&stream) {
                Ok(Some(tcp)) => {
                    let _ = tcp.try_write(too_many());
                }
                _ => {
                    let _ = stream.try_write(too_many());
                }
            }
            reports.try_send(Egress {
                host: String::new(),
                port: 0,
                decision: EgressDecision::Blocked,
                reason: reason.to_string(),
                unreported: 0,
            });
            continue;
        };
        let (policy, settings, reports, metrics, meters, closed) = (
            policy.clone(),
            Arc::clone(&settings),
            reports.clone(),
            Arc::clone(&metrics),
            Arc::clone(&meters),
            closed.clone(),
        );
        tracker.spawn(async move {
            let _slot = slot;
            tokio::select! {
                () = closed.cancelled() => {}
                () = async {
                    match take(stream).await {
                        Some(Brought::Handed(tcp)) => one(tcp, policy, &settings, &reports, &metrics, &meters).await,
                        Some(Brought::Carried(unix)) => one(unix, policy, &settings, &reports, &metrics, &meters).await,
                        None => {}
                    }
                } => {}
            }
        });
    }
}

/// What a connection on a sandbox's socket brings.
enum Brought {
    /// The sandbox's own connection, handed over by its relay.
    Handed(tokio::net::TcpStream),
    /// The relay's socket, the connection's bytes on it.
    Carried(tokio::net::UnixStream),
}

/// Reads what `stream` brings: a connection handed over ([`HANDED`] and a
/// descriptor), or carried ([`RELAYED`], or the request itself from a
/// relay of an older build). `None`: nothing usable came within
/// [`HEAD_TIMEOUT`] (the socket closed, a descriptor that is not a
/// connected TCP socket, more than one), and nothing is answered.
async fn take(stream: tokio::net::UnixStream) -> Option<Brought> {
    let first = tokio::time::timeout(HEAD_TIMEOUT, async {
        loop {
            stream.readable().await.ok()?;
            let mut b = [0u8; 1];
            match stream.try_io(tokio::io::Interest::READABLE, || {
                nix::sys::socket::recv(
                    std::os::fd::AsRawFd::as_raw_fd(&stream),
                    &mut b,
                    nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
                )
                .map_err(std::io::Error::from)
            }) {
                Ok(0) => return None,
                Ok(_) => return Some(b[0]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return None,
            }
        }
    })
    .await
    .ok()??;
    match first {
        HANDED => match receive_handed(&stream) {
            Ok(Some(tcp)) => Some(Brought::Handed(tcp)),
            Ok(None) => None,
            Err(e) => {
                warn!(error = %e, "a sandbox handed its egress proxy something other than a connection");
                None
            }
        },
        RELAYED => {
            let mut b = [0u8; 1];
            stream.try_read(&mut b).ok()?;
            Some(Brought::Carried(stream))
        }
        _ => Some(Brought::Carried(stream)),
    }
}

/// The connection handed over on `stream`, if its message is there: one
/// byte and exactly one descriptor, a connected TCP socket (not listening),
/// made non-blocking. `Ok(None)`: nothing there yet, or not a handing.
#[allow(unsafe_code)]
fn receive_handed(
    stream: &tokio::net::UnixStream,
) -> std::io::Result<Option<tokio::net::TcpStream>> {
    use nix::sys::socket::MsgFlags;
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    let peeked = nix::sys::socket::recv(
        stream.as_raw_fd(),
        &mut b,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    );
    if !matches!(peeked, Ok(1)) || b[0] != HANDED {
        return Ok(None);
    }
    receive_socket(stream, &mut b).map(Some)
}

/// Receives `head` (its whole length, in one message) with the connected
/// TCP socket a relay attached to it: exactly one descriptor, a connected
/// TCP socket (not listening), made non-blocking.
#[allow(unsafe_code)]
pub(crate) fn receive_socket(
    stream: &tokio::net::UnixStream,
    head: &mut [u8],
) -> std::io::Result<tokio::net::TcpStream> {
    use nix::sys::socket::{
        AddressFamily, ControlMessageOwned, MsgFlags, SockType, SockaddrLike, SockaddrStorage,
        getpeername, getsockname, getsockopt, recvmsg, sockopt,
    };
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    let want = head.len();
    let mut iov = [std::io::IoSliceMut::new(head)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )?;
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC) || msg.bytes != want;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: the kernel just installed these descriptors in this
            // process for this message; nothing else owns them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let bad = |what: &str| {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            what.to_string(),
        ))
    };
    if truncated || fds.len() != 1 {
        return bad("not exactly one descriptor");
    }
    let Some(fd) = fds.pop() else {
        return bad("no descriptor");
    };
    let st = nix::sys::stat::fstat(&fd)?;
    if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFSOCK
        || getsockopt(&fd, sockopt::SockType)? != SockType::Stream
        || getsockopt(&fd, sockopt::AcceptConn)?
    {
        return bad("not a stream socket");
    }
    let inet =
        |a: SockaddrStorage| matches!(a.family(), Some(AddressFamily::Inet | AddressFamily::Inet6));
    if !inet(getsockname::<SockaddrStorage>(fd.as_raw_fd())?)
        || !inet(getpeername::<SockaddrStorage>(fd.as_raw_fd())?)
    {
        return bad("not a connected TCP socket");
    }
    // Whatever the sandbox set on it: the worker sends on it unpaced.
    corral_init::relay::loopback_congestion(&fd);
    let tcp = std::net::TcpStream::from(fd);
    tcp.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(tcp)
}

async fn one<S>(
    stream: S,
    mut policy: watch::Receiver<Arc<Vec<Rule>>>,
    settings: &Settings,
    reports: &Reports,
    metrics: &WorkerMetrics,
    meters: &Meters,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Spliced,
{
    let report = |host: &str, port: u16, decision: EgressDecision, reason: Option<Blocked>| {
        let reason = reason.map_or("", Blocked::as_str);
        metrics.egress_decided(decision.as_str(), reason);
        debug!(host, port, decision = decision.as_str(), reason, "egress");
        Egress {
            host: host.to_string(),
            port,
            decision,
            reason: reason.to_string(),
            unreported: 0,
        }
    };
    match admit(stream, &mut policy, &settings.gate).await {
        Err(refused) => {
            // Reported before the client hears of it: the sandbox's event
            // comes before whatever its command does next.
            let out = &refused.outcome;
            let e = report(&out.host, out.port, EgressDecision::Blocked, out.blocked);
            reports.send(e).await;
            refused.answer().await;
        }
        Ok(admitted) => {
            let (host, port) = (admitted.outcome().host.clone(), admitted.outcome().port);
            let e = report(&host, port, EgressDecision::Allowed, None);
            reports.send(e).await;
            // The request's head, sent upstream as it was admitted.
            meters.out.charge(admitted.outcome().bytes_out).await;
            let out = {
                let _open = Open::new(&metrics.egress_open);
                relay_spliced(admitted, policy, meters).await
            };
            if out.cut {
                let e = report(&host, port, EgressDecision::Closed, out.blocked);
                reports.send(e).await;
            } else if out.blocked.is_some() {
                // A tunnel connected before its client spoke, whose first
                // bytes were then refused: blocked, as in time.
                let e = report(&host, port, EgressDecision::Blocked, out.blocked);
                reports.send(e).await;
            }
        }
    }
}

/// One open connection on the gauge, for as long as it lives (a cancelled
/// relay counts down too).
struct Open<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> Open<'a> {
    fn new(g: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::fd::{AsRawFd, RawFd};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A sandbox's side sends `first` with `fds`; what the worker's side
    /// takes of it.
    async fn brought(first: &[u8], fds: &[RawFd]) -> Option<Brought> {
        use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
        let (sandbox, worker) = tokio::net::UnixStream::pair().unwrap();
        let cmsgs: Vec<ControlMessage> = if fds.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(fds)]
        };
        if !first.is_empty() {
            sendmsg::<()>(
                sandbox.as_raw_fd(),
                &[std::io::IoSlice::new(first)],
                &cmsgs,
                MsgFlags::empty(),
                None,
            )
            .unwrap();
        }
        drop(sandbox);
        take(worker).await
    }

    #[tokio::test]
    async fn a_handed_connection_is_taken_and_anything_else_handed_is_refused() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        // The sandbox's socket: taken, and what its client sent is on it.
        std::io::Write::write_all(&mut client, b"GET / HTTP/1.1").unwrap();
        let Some(Brought::Handed(mut tcp)) = brought(&[HANDED], &[server.as_raw_fd()]).await else {
            panic!("a connected TCP socket was not taken");
        };
        let mut got = [0u8; 14];
        tcp.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"GET / HTTP/1.1");
        tcp.write_all(b"ok").await.unwrap();
        let mut back = [0u8; 2];
        std::io::Read::read_exact(&mut client, &mut back).unwrap();
        assert_eq!(&back, b"ok");
        // Not a connection: a pipe, a listening socket, a Unix socket, two
        // sockets at once, the byte without a descriptor.
        let (pr, _pw) = nix::unistd::pipe().unwrap();
        let (u1, _u2) = std::os::unix::net::UnixStream::pair().unwrap();
        for (what, fds) in [
            ("a pipe", vec![pr.as_raw_fd()]),
            ("a listening socket", vec![listener.as_raw_fd()]),
            ("a Unix socket", vec![u1.as_raw_fd()]),
            ("two sockets", vec![server.as_raw_fd(), server.as_raw_fd()]),
            ("nothing", vec![]),
        ] {
            assert!(brought(&[HANDED], &fds).await.is_none(), "{what} was taken");
        }
        // A socket from the sandbox, unconnected.
        let lone = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::empty(),
            None,
        )
        .unwrap();
        assert!(brought(&[HANDED], &[lone.as_raw_fd()]).await.is_none());
    }

    /// A socket's congestion control, by name.
    fn congestion(fd: &impl std::os::fd::AsFd) -> String {
        let name =
            nix::sys::socket::getsockopt(fd, nix::sys::socket::sockopt::TcpCongestion).unwrap();
        name.to_string_lossy().trim_end_matches('\0').to_string()
    }

    #[tokio::test]
    async fn a_handed_connection_is_sent_on_unpaced_whatever_the_sandbox_chose() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        // The sandbox picks a pacing one where it can (BBR), else another.
        for other in ["bbr", "cubic"] {
            let name = std::ffi::OsString::from(other);
            let set = nix::sys::socket::sockopt::TcpCongestion;
            if nix::sys::socket::setsockopt(&server, set, &name).is_ok() {
                break;
            }
        }
        let Some(Brought::Handed(tcp)) = brought(&[HANDED], &[server.as_raw_fd()]).await else {
            panic!("a connected TCP socket was not taken");
        };
        assert_eq!(congestion(&tcp), corral_init::relay::LOOPBACK_CONGESTION);
    }

    #[tokio::test]
    async fn a_carried_connection_starts_after_its_mark_or_at_once_from_an_older_relay() {
        let Some(Brought::Carried(mut s)) = brought(&[RELAYED, b'G', b'E', b'T'], &[]).await else {
            panic!("not carried");
        };
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"GET");
        // An older relay: the request's first byte is the first byte.
        let Some(Brought::Carried(mut s)) = brought(b"CONNECT", &[]).await else {
            panic!("not carried");
        };
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"CONNECT");
        // Closed before a byte: nothing.
        assert!(brought(b"", &[]).await.is_none());
    }

    #[tokio::test]
    async fn a_claimed_members_directory_is_the_sandboxs_and_goes_with_it() {
        let root = tempfile::tempdir().unwrap();
        let member = SandboxId::new("m-pool-1").unwrap();
        let sandbox = SandboxId::new("s1").unwrap();
        let (m, s) = (
            socket_dir(root.path(), &member),
            socket_dir(root.path(), &sandbox),
        );
        make_dir(&m).unwrap();
        link_dir(&s, &member).unwrap();
        // Bound under the sandbox's name, the socket is in the member's
        // directory (the one a container mounted).
        let _listener = bind(&s).unwrap();
        assert!(m.join(SOCKET_NAME).exists());
        remove(&s);
        assert!(!s.exists() && !m.exists());
        // A plain directory goes as before; nothing there is nothing done.
        make_dir(&s).unwrap();
        remove(&s);
        assert!(!s.exists());
        remove(&s);
    }
}
