//! The way in: connections from the worker to ports of the sandbox's
//! loopback (a server an agent started), for the worker's port proxy. A
//! sandbox has no interface but loopback, so the worker cannot dial it;
//! this relay dials for it, from inside.
//!
//! It runs as a process of its own (`corral-init --ingress-relay`),
//! started by the supervisor when the worker first asks for it (and again
//! if it dies), as the supervisor's user, out of the commands' reach. It
//! holds one *control* connection to the worker's socket
//! ([`SOCKET_NAME`] in the directory the worker mounted for this sandbox
//! alone), opened with [`CONTROL`]. On it the worker asks [`Dial`]s, and
//! the relay answers each one:
//! - it connects to `127.0.0.1:port` in the sandbox; refused (nothing
//!   listens), it says so on the control connection ([`Refused`]);
//! - connected, it opens a new connection to the worker's socket and
//!   either *hands* the sandbox's socket over ([`HANDED`], the dial's id,
//!   the descriptor attached: the bytes then go between the worker and the
//!   sandbox's server with no process between them), or, where descriptors
//!   cannot cross (gVisor's own network stack has no host descriptor to
//!   give), says [`RELAYED`] with the dial's id and carries the bytes
//!   itself, as the egress relay does.
//!
//! The worker knows the sandbox by the socket, never by what the relay
//! says; all it takes from the relay is a connection to the sandbox's own
//! server, which is the sandbox's to serve anyway.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::relay::{Conn, HANDED, Half, RELAYED, connect_worker};

/// The worker's socket for the way in, beside the egress one.
pub const SOCKET_NAME: &str = "ingress.sock";
/// The first byte of the relay's control connection (its secret follows).
pub const CONTROL: u8 = 2;
/// The length of the secret the worker gives each relay.
pub const SECRET_LEN: usize = 32;
/// The environment variable the supervisor gives the relay its secret in
/// (hex), which no command can read (the relay runs as the supervisor's
/// user, not dumpable).
pub const SECRET_ENV: &str = "CORRAL_INGRESS_SECRET";
/// The relay's exit code when no worker listens on its socket: the
/// supervisor starts it again only when the worker asks.
pub const NO_WORKER: u8 = 3;
/// Most connections carried at once (handed ones are the worker's).
pub const MAX_CONNECTIONS: usize = 1024;

/// The worker's request on the control connection: connect to `port`,
/// and name the connection `id`. 10 bytes: the id, then the port, big
/// endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dial {
    pub id: u64,
    pub port: u16,
}

impl Dial {
    pub const LEN: usize = 10;

    pub fn encode(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.id.to_be_bytes());
        b[8..].copy_from_slice(&self.port.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[..8]);
        Self {
            id: u64::from_be_bytes(id),
            port: u16::from_be_bytes([b[8], b[9]]),
        }
    }
}

/// The relay's answer to a dial it could not make: 12 bytes, the dial's
/// id and the error number of the connect (`ECONNREFUSED`: nothing
/// listens on the port), big endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub id: u64,
    pub errno: u32,
}

impl Refused {
    pub const LEN: usize = 12;

    pub fn encode(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.id.to_be_bytes());
        b[8..].copy_from_slice(&self.errno.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[..8]);
        Self {
            id: u64::from_be_bytes(id),
            errno: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
        }
    }
}

/// The header of a connection that brings a dial's socket: its kind
/// ([`HANDED`] or [`RELAYED`]) and the dial's id.
pub const HEADER_LEN: usize = 9;

fn header(kind: u8, id: u64) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0] = kind;
    b[1..].copy_from_slice(&id.to_be_bytes());
    b
}

/// Hands `tcp` to the worker over a new connection: the header, with the
/// descriptor attached.
fn hand_over(unix: &UnixStream, id: u64, tcp: &TcpStream) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let fds = [std::os::fd::AsRawFd::as_raw_fd(tcp)];
    let head = header(HANDED, id);
    let iov = [io::IoSlice::new(&head)];
    let sent = sendmsg::<()>(
        std::os::fd::AsRawFd::as_raw_fd(unix),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent == HEADER_LEN {
        Ok(())
    } else {
        Err(io::ErrorKind::WriteZero.into())
    }
}

/// Serves the worker's dials on the control connection to `socket` until
/// it ends (the worker went away: the supervisor starts this again). The
/// control connection opens with [`CONTROL`] and `secret`, which the
/// worker gave the supervisor for this relay alone: a process of the
/// sandbox's that connects to the socket itself cannot take its place.
pub fn serve(socket: &Path, secret: &[u8]) -> io::Error {
    serve_with(socket, secret, true)
}

/// How long a dial's connect may take (a server whose backlog is full
/// never answers it).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A dial whose connect is under way.
struct Connecting {
    dial: Dial,
    tcp: TcpStream,
    deadline: Instant,
}

/// Starts a connect to `127.0.0.1:port` without waiting for it.
fn connect_start(port: u16) -> io::Result<TcpStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, connect, socket};
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    match connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::new(127, 0, 0, 1, port),
    ) {
        Ok(()) | Err(Errno::EINPROGRESS) => Ok(TcpStream::from(fd)),
        Err(e) => Err(e.into()),
    }
}

fn serve_with(socket: &Path, secret: &[u8], mut hand: bool) -> io::Error {
    let control = match UnixStream::connect(socket) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut hello = vec![CONTROL];
    hello.extend_from_slice(secret);
    if let Err(e) = (&control).write_all(&hello) {
        return e;
    }
    if let Err(e) = control.set_nonblocking(true) {
        return e;
    }
    let mut asked: Vec<u8> = Vec::new();
    let mut conns: Vec<Conn> = Vec::new();
    let mut connecting: Vec<Connecting> = Vec::new();
    loop {
        let mut fds = Vec::with_capacity(1 + connecting.len() + 2 * conns.len());
        fds.push(PollFd::new(control.as_fd(), PollFlags::POLLIN));
        for c in &connecting {
            fds.push(PollFd::new(c.tcp.as_fd(), PollFlags::POLLOUT));
        }
        for c in &conns {
            let (tcp, unix) = c.interest();
            fds.push(PollFd::new(c.tcp.as_fd(), tcp));
            fds.push(PollFd::new(c.unix.as_fd(), unix));
        }
        let timeout = connecting
            .iter()
            .map(|c| c.deadline.saturating_duration_since(Instant::now()))
            .min()
            .map_or(PollTimeout::NONE, |d| {
                PollTimeout::try_from(d.as_millis().saturating_add(1).min(60_000) as i32)
                    .unwrap_or(PollTimeout::MAX)
            });
        match poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return e.into(),
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let mut ready = ready.into_iter();
        let refuse = |id: u64, errno: u32| {
            // A full control socket (a worker that stopped reading) loses
            // the refusal; the worker's dial times out.
            let _ = (&control).write(&Refused { id, errno }.encode());
        };
        if ready.next() == Some(true) {
            let mut buf = [0u8; 4096];
            loop {
                match (&control).read(&mut buf) {
                    Ok(0) => return io::ErrorKind::UnexpectedEof.into(),
                    Ok(n) => asked.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return e,
                }
            }
            let whole = asked.len() - asked.len() % Dial::LEN;
            let dials: Vec<Dial> = asked[..whole]
                .chunks_exact(Dial::LEN)
                .map(|c| Dial::decode(c.try_into().unwrap_or(&[0; Dial::LEN])))
                .collect();
            asked.drain(..whole);
            for dial in dials {
                if dial.port == 0 {
                    refuse(dial.id, libc::EINVAL as u32);
                } else if connecting.len() + conns.len() >= MAX_CONNECTIONS {
                    refuse(dial.id, libc::EMFILE as u32);
                } else {
                    match connect_start(dial.port) {
                        Ok(tcp) => connecting.push(Connecting {
                            dial,
                            tcp,
                            deadline: Instant::now() + CONNECT_TIMEOUT,
                        }),
                        Err(e) => refuse(dial.id, errno_of(&e)),
                    }
                }
            }
        }
        // Connects that ended (or ran out of time) are answered.
        let done: Vec<bool> = connecting
            .iter()
            .map(|c| ready.next().unwrap_or(false) || Instant::now() >= c.deadline)
            .collect();
        let mut i = 0;
        let mut finished = Vec::new();
        connecting.retain_mut(|c| {
            let keep = !done.get(i).copied().unwrap_or(false);
            i += 1;
            if !keep {
                finished.push((c.dial, c.deadline, c.tcp.try_clone()));
            }
            keep
        });
        for (dial, deadline, tcp) in finished {
            let connected = tcp.and_then(|tcp| match tcp.take_error()? {
                Some(e) => Err(e),
                None => match tcp.peer_addr() {
                    Ok(_) => Ok(Some(tcp)),
                    // Woken before it connected (some stacks say so early):
                    // waited for again, until its deadline.
                    Err(_) if Instant::now() < deadline => {
                        connecting.push(Connecting {
                            dial,
                            tcp,
                            deadline,
                        });
                        Ok(None)
                    }
                    Err(_) => Err(io::Error::from_raw_os_error(libc::ETIMEDOUT)),
                },
            });
            let connected = match connected {
                Ok(Some(tcp)) => Ok(tcp),
                Ok(None) => continue,
                Err(e) => Err(e),
            };
            let answered = connected
                .map_err(|e| errno_of(&e))
                .and_then(|tcp| answer(socket, dial, tcp, &mut hand, &mut conns));
            if let Err(errno) = answered {
                refuse(dial.id, errno);
            }
        }
        let woke: Vec<bool> = (0..conns.len())
            .map(|_| {
                let a = ready.next().unwrap_or(false);
                let b = ready.next().unwrap_or(false);
                a || b
            })
            .collect();
        let mut i = 0;
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

fn errno_of(e: &io::Error) -> u32 {
    e.raw_os_error().map_or(libc::EIO as u32, |n| n as u32)
}

/// Gives the worker the connected `tcp` of `dial`: handed over, or carried.
/// The error number of what failed.
fn answer(
    socket: &Path,
    dial: Dial,
    tcp: TcpStream,
    hand: &mut bool,
    conns: &mut Vec<Conn>,
) -> Result<(), u32> {
    let errno = |e: io::Error| errno_of(&e);
    let _ = tcp.set_nodelay(true);
    crate::relay::loopback_congestion(&tcp);
    if *hand {
        let unix = connect_worker(socket).map_err(errno)?;
        match hand_over(&unix, dial.id, &tcp) {
            Ok(()) => return Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOBUFS | libc::ENOMEM | libc::EAGAIN | libc::EINTR)
                ) => {}
            Err(e) => {
                eprintln!(
                    "corral-init: the ingress relay cannot hand connections to the worker ({e}); it carries them itself"
                );
                *hand = false;
            }
        }
    }
    let up = Half::new().map_err(errno)?;
    let down = Half::new().map_err(errno)?;
    let mut unix = connect_worker(socket).map_err(errno)?;
    // A fresh socket's buffer takes the header whole.
    unix.write_all(&header(RELAYED, dial.id)).map_err(errno)?;
    tcp.set_nonblocking(true).map_err(errno)?;
    conns.push(Conn::new(tcp, unix, up, down));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    use std::net::TcpListener;
    use std::os::unix::net::UnixListener;

    #[test]
    fn dials_and_refusals_read_back_as_written() {
        let d = Dial {
            id: 0x0102_0304_0506_0708,
            port: 8888,
        };
        assert_eq!(Dial::decode(&d.encode()), d);
        let r = Refused {
            id: u64::MAX,
            errno: 111,
        };
        assert_eq!(Refused::decode(&r.encode()), r);
    }

    /// The worker's side: its listener, and the relay's control connection.
    fn worker(hand: bool) -> (tempfile::TempDir, UnixListener, UnixStream) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join(SOCKET_NAME);
        let listener = UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || serve_with(&sock, SECRET, hand));
        let (mut control, _) = listener.accept().unwrap();
        let mut hello = [0u8; 1 + SECRET.len()];
        control.read_exact(&mut hello).unwrap();
        assert_eq!(hello[0], CONTROL);
        assert_eq!(&hello[1..], SECRET);
        (dir, listener, control)
    }

    #[test]
    fn a_dial_to_a_port_nothing_listens_on_is_refused_by_its_id() {
        let (_dir, _listener, mut control) = worker(true);
        // A port just freed: nothing listens on it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        control.write_all(&Dial { id: 7, port }.encode()).unwrap();
        let mut b = [0u8; Refused::LEN];
        control.read_exact(&mut b).unwrap();
        assert_eq!(
            Refused::decode(&b),
            Refused {
                id: 7,
                errno: libc::ECONNREFUSED as u32
            }
        );
    }

    #[test]
    fn a_dial_is_carried_byte_for_byte_both_ways() {
        let (_dir, listener, mut control) = worker(false);
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        control.write_all(&Dial { id: 42, port }.encode()).unwrap();
        let (mut s, _) = server.accept().unwrap();
        let (mut c, _) = listener.accept().unwrap();
        let mut head = [0u8; HEADER_LEN];
        c.read_exact(&mut head).unwrap();
        assert_eq!(head, header(RELAYED, 42));
        let big: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let echo = std::thread::spawn(move || {
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got).unwrap();
            got.len()
        });
        let writer = {
            let mut c = c.try_clone().unwrap();
            std::thread::spawn(move || {
                c.write_all(&sent).unwrap();
                c.shutdown(std::net::Shutdown::Write).unwrap();
            })
        };
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        writer.join().unwrap();
        assert_eq!(echo.join().unwrap(), big.len());
        assert!(back == big, "the bytes came back changed");
    }

    #[test]
    #[allow(unsafe_code)]
    fn a_dial_is_handed_over_with_its_id() {
        use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
        use std::os::fd::{AsRawFd, FromRawFd, RawFd};
        let (_dir, listener, mut control) = worker(true);
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        control.write_all(&Dial { id: 9, port }.encode()).unwrap();
        let (mut s, _) = server.accept().unwrap();
        let (c, _) = listener.accept().unwrap();
        let mut head = [0u8; HEADER_LEN];
        let mut iov = [io::IoSliceMut::new(&mut head)];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let msg =
            recvmsg::<()>(c.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()).unwrap();
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .unwrap()
            .flat_map(|m| match m {
                ControlMessageOwned::ScmRights(fds) => fds,
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(head, header(HANDED, 9));
        assert_eq!(fds.len(), 1);
        // SAFETY: installed in this process by the recvmsg above.
        let mut tcp = unsafe { TcpStream::from_raw_fd(fds[0]) };
        tcp.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
    }

    #[test]
    fn the_relay_ends_when_the_worker_goes() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join(SOCKET_NAME);
        let listener = UnixListener::bind(&sock).unwrap();
        let relay = std::thread::spawn(move || serve_with(&sock, SECRET, true));
        let (mut control, _) = listener.accept().unwrap();
        let mut hello = [0u8; 1 + SECRET.len()];
        control.read_exact(&mut hello).unwrap();
        drop(control);
        let e = relay.join().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
