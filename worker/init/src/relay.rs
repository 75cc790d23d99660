//! The sandbox's egress relay: an HTTP proxy address on the sandbox's
//! loopback (`127.0.0.1:3128`, named in `HTTP_PROXY` and `HTTPS_PROXY`)
//! whose every connection goes to the worker over the Unix socket the
//! worker mounted for this sandbox alone. The relay reads nothing of what
//! a connection carries: the worker parses the request, decides by the
//! sandbox's policy and connects. A sandbox has no other interface than
//! loopback, so this is its only way out, and the worker knows the sandbox
//! by the socket, not by anything the sandbox says.
//!
//! Each accepted connection is *handed* to the worker: one byte,
//! [`HANDED`], with the connection's descriptor attached (`SCM_RIGHTS`),
//! and the relay keeps nothing, so the bytes go between the sandbox's
//! socket and the upstream one in the worker alone (one proxy hop, not
//! two). Where descriptors cannot cross (gVisor's own network stack has no
//! host descriptor to give), the relay says [`RELAYED`] and carries the
//! connection byte for byte itself. Only the sandbox's socket crosses,
//! never the other way: a host socket in a sandbox could be disconnected
//! and connected anywhere.
//!
//! It runs as a process of its own (`corral-init --egress-relay`), started
//! by the supervisor with the listening socket already bound (so no command
//! can take the port first) and started again if it dies. One thread, one
//! poll loop, bounded: at most [`MAX_CONNECTIONS`] relayed connections,
//! each with two buffers of [`CARRY_BYTES`].

use std::io::{self, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// Where the proxy listens in the sandbox.
pub const PROXY_ADDR: &str = "127.0.0.1:3128";
/// The directory the worker mounts (read-only) into a sandbox with egress.
pub const SOCKET_DIR: &str = "/run/corral-egress";
/// The worker's socket in [`SOCKET_DIR`].
pub const SOCKET_NAME: &str = "proxy.sock";
/// The first byte on the worker's socket when the connection's descriptor
/// comes with it.
pub const HANDED: u8 = 0;
/// The first byte on the worker's socket when the relay carries the
/// connection's bytes after it. (A relay of an older build sends neither:
/// its first byte is the request's, never a control character.)
pub const RELAYED: u8 = 1;
/// Most connections relayed at once; more are answered at once with a
/// refusal (never left to hang in the listen queue).
pub const MAX_CONNECTIONS: usize = 256;
/// Each direction's buffer of a carried connection.
pub const CARRY_BYTES: usize = 256 * 1024;
/// The size of a pipe on most hosts (what the tests carry several of).
pub const BUF_BYTES: usize = 64 * 1024;

/// The congestion control of the sandbox's side of a connection, which is
/// its loopback. Hosts often default to BBR, which paces what it sends to
/// the bandwidth it has measured: right across a network, a brake on
/// loopback, where a relay sending to the client in paced bursts left the
/// cores idle between them (a 200 MB download through the worker went
/// from 0.47-0.50x to 0.73-0.83x of the direct one when its sandbox side
/// stopped pacing). Reno paces nothing and any process may choose it.
pub const LOOPBACK_CONGESTION: &str = "reno";

/// Sets [`LOOPBACK_CONGESTION`] on a socket of the sandbox's loopback (a
/// listener passes it to the connections it accepts). Best effort: a stack
/// that refuses it (gVisor's may) keeps its own.
pub fn loopback_congestion(socket: &impl AsFd) {
    let _ = nix::sys::socket::setsockopt(
        socket,
        nix::sys::socket::sockopt::TcpCongestion,
        &std::ffi::OsString::from(LOOPBACK_CONGESTION),
    );
}

/// The answer when the worker's socket takes no connection (the worker is
/// restarting, say): a proxy's own refusal, which clients report.
const UNAVAILABLE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nX-Corral-Egress: blocked; reason=unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
/// The answer past [`MAX_CONNECTIONS`].
const TOO_MANY: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\nX-Corral-Egress: blocked; reason=too_many_connections\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// Bytes read from one side, not yet written to the other, in a buffer
/// of this process's. Only connections that cannot be handed over are
/// carried, which is under gVisor, whose `splice` between a socket and a
/// pipe was seen to reorder bytes past the pipe's first 64 KiB: plain
/// reads and writes are what is carried there.
pub(crate) struct Half {
    buf: Vec<u8>,
    /// What is held: `buf[start..end]`.
    start: usize,
    end: usize,
    /// The reading side said EOF (or failed).
    eof: bool,
    /// The EOF was passed on (the other side shut for writing).
    closed: bool,
}

impl Half {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            buf: vec![0u8; CARRY_BYTES],
            start: 0,
            end: 0,
            eof: false,
            closed: false,
        })
    }
    fn pending(&self) -> bool {
        self.end > self.start
    }
    fn wants_read(&self) -> bool {
        !self.eof && self.end < self.buf.len()
    }
    /// Reads what `from` has into the buffer.
    fn fill(&mut self, from: BorrowedFd<'_>) {
        while self.wants_read() {
            match nix::unistd::read(from, &mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end += n,
                Err(Errno::EAGAIN) => return,
                Err(Errno::EINTR) => {}
                Err(_) => self.eof = true,
            }
        }
    }
    /// Writes what the buffer holds to `to`; false when `to` failed.
    fn drain(&mut self, to: BorrowedFd<'_>) -> bool {
        while self.pending() {
            match nix::unistd::write(to, &self.buf[self.start..self.end]) {
                Ok(0) => return false,
                Ok(n) => self.start += n,
                Err(Errno::EAGAIN) => return true,
                Err(Errno::EINTR) => {}
                Err(_) => return false,
            }
        }
        // Empty: the whole buffer is free again.
        self.start = 0;
        self.end = 0;
        true
    }
    /// Drops what the buffer holds; how many bytes that was.
    fn discard(&mut self) -> usize {
        let dropped = self.end - self.start;
        self.start = 0;
        self.end = 0;
        dropped
    }
}

/// Most bytes a client may go on sending after the worker stopped
/// reading (an answer to a refused request is on its way back), read and
/// dropped so that its socket is not reset before the answer is read.
const MAX_DISCARD: usize = 4 << 20;

pub(crate) struct Conn {
    pub(crate) tcp: TcpStream,
    pub(crate) unix: UnixStream,
    /// Sandbox to worker.
    up: Half,
    /// Worker to sandbox.
    down: Half,
    /// The worker stopped reading: what the sandbox sends is dropped.
    up_dead: bool,
    discarded: usize,
}

impl Conn {
    pub(crate) fn new(tcp: TcpStream, unix: UnixStream, up: Half, down: Half) -> Self {
        Self {
            tcp,
            unix,
            up,
            down,
            up_dead: false,
            discarded: 0,
        }
    }

    /// What to wait for on its TCP side and on its Unix side.
    pub(crate) fn interest(&self) -> (PollFlags, PollFlags) {
        let mut tcp = PollFlags::empty();
        let mut unix = PollFlags::empty();
        if self.up.wants_read() {
            tcp |= PollFlags::POLLIN;
        }
        if self.down.pending() {
            tcp |= PollFlags::POLLOUT;
        }
        if self.down.wants_read() {
            unix |= PollFlags::POLLIN;
        }
        if self.up.pending() {
            unix |= PollFlags::POLLOUT;
        }
        (tcp, unix)
    }

    /// Moves what can move; false when the connection is over.
    pub(crate) fn step(&mut self) -> bool {
        self.up.fill(self.tcp.as_fd());
        self.down.fill(self.unix.as_fd());
        if self.up_dead || !self.up.drain(self.unix.as_fd()) {
            self.up_dead = true;
            self.discarded += self.up.discard();
        }
        if !self.down.drain(self.tcp.as_fd()) {
            return false;
        }
        if self.up.eof && !self.up.pending() && !self.up.closed && !self.up_dead {
            self.up.closed = true;
            let _ = self.unix.shutdown(Shutdown::Write);
        }
        if self.down.eof && !self.down.pending() && !self.down.closed {
            self.down.closed = true;
            let _ = self.tcp.shutdown(Shutdown::Write);
        }
        if self.up_dead {
            // Over once the answer is out and the sandbox stopped sending
            // (or sent more than it may).
            return !(self.down.closed && (self.up.eof || self.discarded > MAX_DISCARD));
        }
        !(self.up.closed && self.down.closed)
    }
}

/// A connection to the worker's socket, without waiting: a full queue is
/// a refusal, never a stall of every other connection.
pub(crate) fn connect_worker(path: &Path) -> io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr)?;
    Ok(UnixStream::from(fd))
}

/// Hands `tcp` to the worker over `unix`: [`HANDED`] with the descriptor.
fn hand_over(unix: &UnixStream, tcp: &TcpStream) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let fds = [std::os::fd::AsRawFd::as_raw_fd(tcp)];
    let iov = [io::IoSlice::new(&[HANDED])];
    let sent = sendmsg::<()>(
        std::os::fd::AsRawFd::as_raw_fd(unix),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent == 1 {
        Ok(())
    } else {
        Err(io::ErrorKind::WriteZero.into())
    }
}

/// Serves `listener` until it fails (it never returns otherwise).
pub fn serve(listener: TcpListener, socket: &Path) -> io::Error {
    serve_with(listener, socket, true)
}

/// [`serve`], handing connections over while `hand` holds (and while the
/// kernel takes them: the first refusal makes this relay carry every
/// connection after it).
fn serve_with(listener: TcpListener, socket: &Path, mut hand: bool) -> io::Error {
    if let Err(e) = listener.set_nonblocking(true) {
        return e;
    }
    let mut conns: Vec<Conn> = Vec::new();
    loop {
        let mut fds = Vec::with_capacity(1 + 2 * conns.len());
        fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
        for c in &conns {
            let (tcp, unix) = c.interest();
            fds.push(PollFd::new(c.tcp.as_fd(), tcp));
            fds.push(PollFd::new(c.unix.as_fd(), unix));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return e.into(),
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let mut ready = ready.into_iter();
        if ready.next() == Some(true) {
            loop {
                let tcp = match listener.accept() {
                    Ok((tcp, _)) => tcp,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    // A connection that went away before it was taken, or
                    // out of descriptors: a moment's rest (the listener
                    // stays readable), then the next wake tries again.
                    Err(_) => {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        break;
                    }
                };
                let mut tcp = tcp;
                if hand {
                    let Ok(unix) = connect_worker(socket) else {
                        let _ = tcp.set_nonblocking(true);
                        let _ = tcp.write(UNAVAILABLE);
                        continue;
                    };
                    match hand_over(&unix, &tcp) {
                        // The worker has it; this process keeps nothing.
                        Ok(()) => continue,
                        // Out of memory for a moment: this one is carried.
                        Err(e)
                            if matches!(
                                e.raw_os_error(),
                                Some(libc::ENOBUFS | libc::ENOMEM | libc::EAGAIN | libc::EINTR)
                            ) => {}
                        Err(e) => {
                            eprintln!(
                                "corral-init: the egress relay cannot hand connections to the worker ({e}); it carries them itself"
                            );
                            hand = false;
                        }
                    }
                }
                if conns.len() >= MAX_CONNECTIONS {
                    // Said without waiting: the socket's buffer takes it.
                    let _ = tcp.set_nonblocking(true);
                    let _ = tcp.write(TOO_MANY);
                    continue;
                }
                // Pipes first: out of descriptors, the client is told so.
                let halves = Half::new().and_then(|up| Ok((up, Half::new()?)));
                let unix = connect_worker(socket).and_then(|mut u| {
                    // A fresh socket's buffer takes one byte.
                    u.write_all(&[RELAYED])?;
                    Ok(u)
                });
                match (halves, unix) {
                    (Ok((up, down)), Ok(unix)) if tcp.set_nonblocking(true).is_ok() => {
                        conns.push(Conn::new(tcp, unix, up, down));
                    }
                    _ => {
                        let _ = tcp.write(UNAVAILABLE);
                    }
                }
            }
        }
        // Each connection readied (or not) moves what it can.
        let mut i = 0;
        let woke: Vec<bool> = (0..conns.len())
            .map(|_| {
                let a = ready.next().unwrap_or(false);
                let b = ready.next().unwrap_or(false);
                a || b
            })
            .collect();
        conns.retain_mut(|c| {
            let keep = if woke.get(i).copied().unwrap_or(true) {
                c.step()
            } else {
                true
            };
            i += 1;
            keep
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixListener;

    /// A relay on a loopback port, serving the worker's socket of a
    /// temporary directory, handing connections over or carrying them:
    /// the directory, the worker's listener, the relay's address.
    fn relaying(hand: bool) -> (tempfile::TempDir, UnixListener, std::net::SocketAddr) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("proxy.sock");
        let worker = UnixListener::bind(&sock).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve_with(listener, &sock, hand));
        (dir, worker, addr)
    }

    /// The worker's side of a carried connection: its first byte says so.
    fn carried(worker: &UnixListener) -> UnixStream {
        let (mut s, _) = worker.accept().unwrap();
        let mut first = [0u8; 1];
        s.read_exact(&mut first).unwrap();
        assert_eq!(first[0], RELAYED);
        s
    }

    /// The worker's side of a handed connection: one byte, one descriptor.
    #[allow(unsafe_code)]
    fn handed(worker: &UnixListener) -> TcpStream {
        use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
        use std::os::fd::{AsRawFd, FromRawFd, RawFd};
        let (s, _) = worker.accept().unwrap();
        let mut b = [9u8; 1];
        let mut iov = [io::IoSliceMut::new(&mut b)];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let msg =
            recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()).unwrap();
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .unwrap()
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(fds) => fds,
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(fds.len(), 1);
        assert_eq!(b[0], HANDED);
        // SAFETY: installed in this process by the recvmsg above.
        let tcp = unsafe { TcpStream::from_raw_fd(fds[0]) };
        tcp.set_nonblocking(false).unwrap();
        tcp
    }

    #[test]
    fn the_listener_passes_its_unpaced_congestion_control_to_what_it_accepts() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        loopback_congestion(&listener);
        let _c = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (s, _) = listener.accept().unwrap();
        let name =
            nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::TcpCongestion).unwrap();
        assert_eq!(
            name.to_string_lossy().trim_end_matches('\0'),
            LOOPBACK_CONGESTION
        );
    }

    #[test]
    fn a_connection_is_handed_over_and_the_relay_keeps_nothing_of_it() {
        let (_dir, worker, addr) = relaying(true);
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"CONNECT x:443 HTTP/1.1\r\n\r\n").unwrap();
        let mut s = handed(&worker);
        // The sandbox's own socket: what the client sent is on it.
        let mut head = [0u8; 26];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"CONNECT x:443 HTTP/1.1\r\n\r\n");
        s.write_all(b"hello").unwrap();
        // Dropped here without a shutdown: the client sees its end only
        // if no other copy of the socket is open (the relay kept none).
        drop(s);
        c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"hello");
        // The next connection is handed over too.
        let _c2 = TcpStream::connect(addr).unwrap();
        let _s2 = handed(&worker);
    }

    #[test]
    fn bytes_go_both_ways_whole_and_eof_is_passed_on() {
        let (_dir, worker, addr) = relaying(false);
        // The worker's side echoes, upper-cased, until EOF, then says bye.
        let echo = std::thread::spawn(move || {
            let mut s = carried(&worker);
            let mut all = Vec::new();
            s.read_to_end(&mut all).unwrap();
            s.write_all(&all.to_ascii_uppercase()).unwrap();
            s.write_all(b"BYE").unwrap();
            all.len()
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let big: Vec<u8> = (0..5 * BUF_BYTES).map(|i| b'a' + (i % 26) as u8).collect();
        c.write_all(&big).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        assert_eq!(echo.join().unwrap(), big.len());
        assert_eq!(&back[..big.len()], &big.to_ascii_uppercase()[..]);
        assert_eq!(&back[big.len()..], b"BYE");
    }

    #[test]
    fn past_its_bound_a_connection_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("proxy.sock");
        let worker = UnixListener::bind(&sock).unwrap();
        // The worker's side takes every connection and holds it.
        let held = std::thread::spawn(move || {
            let mut all = Vec::new();
            for _ in 0..MAX_CONNECTIONS {
                all.push(carried(&worker));
            }
            all
        });
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve_with(listener, &sock, false));
        let open: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let _held = held.join().unwrap();
        let mut over = TcpStream::connect(addr).unwrap();
        let mut back = String::new();
        over.read_to_string(&mut back).unwrap();
        assert!(back.starts_with("HTTP/1.1 429"), "{back}");
        assert!(back.contains("reason=too_many_connections"), "{back}");
        drop(open);
    }

    #[test]
    fn an_answer_to_a_request_the_worker_stopped_reading_still_arrives() {
        let (_dir, worker, addr) = relaying(false);
        // The worker reads a little, refuses, and goes.
        std::thread::spawn(move || {
            let mut s = carried(&worker);
            let mut head = [0u8; 1024];
            s.read_exact(&mut head).unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let big = vec![b'a'; 1 << 20];
        c.write_all(&big).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut back = String::new();
        c.read_to_string(&mut back).unwrap();
        assert_eq!(back, "HTTP/1.1 400 Bad Request\r\n\r\n");
    }

    #[test]
    fn no_worker_is_a_clear_refusal() {
        for hand in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("absent.sock");
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            std::thread::spawn(move || serve_with(listener, &sock, hand));
            let mut c = TcpStream::connect(addr).unwrap();
            let mut back = String::new();
            c.read_to_string(&mut back).unwrap();
            assert!(back.starts_with("HTTP/1.1 503"), "{back}");
            assert!(back.contains("reason=unavailable"), "{back}");
        }
    }
}
