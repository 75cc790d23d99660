//! Who owns the TCP sockets of this machine that a token may be sent to:
//! the socket at the other end of a connection made on loopback (asked of
//! the kernel by its four addresses), and the sockets listening on a port.
//! Asked over `NETLINK_SOCK_DIAG` (listening sockets only, the way `ss -l`
//! asks), or read from `/proc/net/tcp` and `tcp6` where netlink is refused
//! (a sandbox's seccomp profile, gVisor).
//!
//! Reading `/proc/net/tcp` walks every socket of the machine, established
//! ones included: about 8 ms on a quiet 2-core host, more on a busy one,
//! paid by every command that reaches a worker on loopback. The netlink
//! dump of listening sockets takes a few tens of microseconds.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd as _;

/// A socket listening on this machine: its address, port and owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    pub ip: IpAddr,
    pub port: u16,
    pub uid: u32,
}

/// The sockets listening on `port` (at any address), over netlink, else
/// from `/proc`.
pub fn on_port(port: u16) -> Vec<Listener> {
    match diag(port) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag refused; reading /proc/net/tcp");
            from_proc(port)
        }
    }
}

/// The owners (uids) of the sockets listening on `port` at `host` (an IP
/// address or `localhost`), or at every address.
pub fn owners(host: &str, port: u16) -> Vec<u32> {
    let wanted: Vec<IpAddr> = match host {
        "localhost" => vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()],
        h => h.parse().into_iter().collect(),
    };
    on_port(port)
        .into_iter()
        .filter(|l| {
            let v4_mapped = match l.ip {
                IpAddr::V6(a) => a.to_ipv4_mapped().map(IpAddr::V4),
                IpAddr::V4(_) => None,
            };
            l.ip.is_unspecified()
                || wanted.contains(&l.ip)
                || v4_mapped.is_some_and(|m| wanted.contains(&m))
        })
        .map(|l| l.uid)
        .collect()
}

/// The owner (uid) of the socket at the other end of a TCP connection on
/// this machine from `local` to `peer`: for a connection to a listener,
/// the listener's owner (an accepted socket is its listener's). `Ok(None)`
/// while the other end is only a connection request (the kernel names no
/// owner for one; asked again shortly, it is a socket).
pub fn peer_owner(local: SocketAddr, peer: SocketAddr) -> std::io::Result<Option<u32>> {
    use nix::sys::socket::{MsgFlags, recv};
    let (family, src, dst) = match (peer.ip(), local.ip()) {
        (IpAddr::V4(p), IpAddr::V4(l)) => {
            let (mut s, mut d) = ([0u8; 16], [0u8; 16]);
            s[..4].copy_from_slice(&p.octets());
            d[..4].copy_from_slice(&l.octets());
            (AF_INET, s, d)
        }
        (IpAddr::V6(p), IpAddr::V6(l)) => (AF_INET6, p.octets(), l.octets()),
        _ => return Err(invalid("the two ends of one connection in two families")),
    };
    // struct inet_diag_sockid: its source (the peer: the other end's own
    // address) and destination (us), the interface (any), and no cookie.
    let mut id = Vec::with_capacity(48);
    id.extend_from_slice(&peer.port().to_be_bytes());
    id.extend_from_slice(&local.port().to_be_bytes());
    id.extend_from_slice(&src);
    id.extend_from_slice(&dst);
    id.extend_from_slice(&0u32.to_ne_bytes());
    id.extend_from_slice(&u32::MAX.to_ne_bytes());
    id.extend_from_slice(&u32::MAX.to_ne_bytes());
    let seq: u32 = 2;
    // One socket, named by its id: no dump.
    let fd = ask(family, NLM_F_REQUEST, seq, u32::MAX, &id)?;
    let mut buf = vec![0u8; 8 * 1024];
    let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    if n < HEADER {
        return Err(invalid("a reply shorter than its header"));
    }
    let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap_or_default()) as usize;
    let kind = u16::from_ne_bytes([buf[4], buf[5]]);
    if len < HEADER || len > n {
        return Err(invalid("a message longer than what came"));
    }
    if u32::from_ne_bytes(buf[8..12].try_into().unwrap_or_default()) != seq {
        return Err(invalid("a reply to another request"));
    }
    match kind {
        NLMSG_ERROR => {
            let code = i32::from_ne_bytes(
                buf.get(HEADER..HEADER + 4)
                    .and_then(|b| b.try_into().ok())
                    .unwrap_or_default(),
            );
            Err(std::io::Error::from_raw_os_error(
                code.saturating_neg().max(1),
            ))
        }
        SOCK_DIAG_BY_FAMILY => {
            let m = &buf[HEADER..len];
            if m.len() < MSG_UID_END {
                return Err(invalid("a socket's message too short"));
            }
            // A connection request (SYN_RECV) has no owner yet.
            if u32::from(m[1]) == TCP_SYN_RECV {
                return Ok(None);
            }
            let found = parse_msg(m).ok_or_else(|| invalid("a socket of another family"))?;
            if found.port != peer.port() {
                return Err(invalid("another socket than the one asked for"));
            }
            Ok(Some(found.uid))
        }
        _ => Err(invalid("an unexpected reply")),
    }
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TCP_LISTEN: u32 = 10;
const TCP_SYN_RECV: u32 = 3;
/// `struct nlmsghdr`.
const HEADER: usize = 16;
/// `struct inet_diag_msg`, up to and with `idiag_uid`.
const MSG_UID_END: usize = 68;
/// How many messages a dump may bring before it is given up (a machine
/// has far fewer listening sockets on one port).
const MAX_MESSAGES: usize = 100_000;

/// The listening TCP sockets on `port`, IPv4 then IPv6, from the kernel.
fn diag(port: u16) -> std::io::Result<Vec<Listener>> {
    let mut out = Vec::new();
    for family in [AF_INET, AF_INET6] {
        out.extend(diag_family(family, port)?);
    }
    Ok(out)
}

/// Sends a `SOCK_DIAG_BY_FAMILY` request (`struct inet_diag_req_v2`: TCP
/// sockets of `family` in `states`, named by the 48 bytes of `id`, a
/// `struct inet_diag_sockid`) on a netlink socket of its own, whose
/// replies are then read from it (never waited for more than 2 s).
fn ask(
    family: u8,
    flags: u16,
    seq: u32,
    states: u32,
    id: &[u8],
) -> std::io::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sendto, socket,
    };
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )?;
    let timeout = nix::sys::time::TimeVal::new(2, 0);
    nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)?;
    let len = HEADER + 8 + id.len();
    let mut req = Vec::with_capacity(len);
    req.extend_from_slice(&(len as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // family, protocol (TCP), extensions, padding, states.
    req.extend_from_slice(&[family, 6, 0, 0]);
    req.extend_from_slice(&states.to_ne_bytes());
    req.extend_from_slice(id);
    sendto(
        fd.as_raw_fd(),
        &req,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )?;
    Ok(fd)
}

/// One family's dump: a request for listening sockets (the port named, so
/// the kernel may skip the others), then messages until `NLMSG_DONE`.
fn diag_family(family: u8, port: u16) -> std::io::Result<Vec<Listener>> {
    use nix::sys::socket::{MsgFlags, recv};
    // struct inet_diag_sockid: the source port (network order), the rest 0.
    let mut id = [0u8; 48];
    id[0..2].copy_from_slice(&port.to_be_bytes());
    let seq: u32 = 1;
    let fd = ask(
        family,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        1 << TCP_LISTEN,
        &id,
    )?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    let mut seen = 0usize;
    loop {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if n == 0 {
            return Err(invalid("the dump ended without NLMSG_DONE"));
        }
        let mut at = 0;
        while at + HEADER <= n {
            let field = |o: usize| {
                u32::from_ne_bytes(buf[at + o..at + o + 4].try_into().unwrap_or_default())
            };
            let len = field(0) as usize;
            let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
            if len < HEADER || at + len > n {
                return Err(invalid("a message longer than what came"));
            }
            if field(8) != seq {
                return Err(invalid("a reply to another request"));
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(
                        buf.get(at + HEADER..at + HEADER + 4)
                            .and_then(|b| b.try_into().ok())
                            .unwrap_or_default(),
                    );
                    return Err(std::io::Error::from_raw_os_error(
                        code.saturating_neg().max(1),
                    ));
                }
                SOCK_DIAG_BY_FAMILY => {
                    if let Some(l) = parse_msg(&buf[at + HEADER..at + len])
                        && l.port == port
                    {
                        out.push(l);
                    }
                }
                _ => {}
            }
            seen += 1;
            if seen > MAX_MESSAGES {
                return Err(invalid("too many messages"));
            }
            // Messages are aligned to 4 bytes.
            at += (len + 3) & !3;
        }
    }
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("sock_diag: {what}"),
    )
}

/// A `struct inet_diag_msg`: family, state, timer, retransmits, then the
/// socket's id (source port and address at 4 and 8), ..., the uid at 64.
fn parse_msg(m: &[u8]) -> Option<Listener> {
    if m.len() < MSG_UID_END {
        return None;
    }
    let port = u16::from_be_bytes([m[4], m[5]]);
    let ip: IpAddr = match m[0] {
        AF_INET => Ipv4Addr::new(m[8], m[9], m[10], m[11]).into(),
        AF_INET6 => {
            let b: [u8; 16] = m[8..24].try_into().ok()?;
            Ipv6Addr::from(b).into()
        }
        _ => return None,
    };
    let uid = u32::from_ne_bytes(m[64..68].try_into().ok()?);
    Some(Listener { ip, port, uid })
}

/// The listening sockets on `port`, from `/proc/net/tcp` and `tcp6`.
fn from_proc(port: u16) -> Vec<Listener> {
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st queues timer retransmits uid ...; 0A: LISTEN.
            if f.len() < 8 || f[3] != "0A" {
                continue;
            }
            let Some((addr, p)) = f[1].split_once(':') else {
                continue;
            };
            if u16::from_str_radix(p, 16).ok() != Some(port) {
                continue;
            }
            let (Some(ip), Ok(uid)) = (proc_net_ip(addr, v6), f[7].parse()) else {
                continue;
            };
            out.push(Listener { ip, port, uid });
        }
    }
    out
}

/// An address as `/proc/net/tcp*` writes it: 32-bit words in hex, each in
/// this machine's byte order.
fn proc_net_ip(hex: &str, v6: bool) -> Option<IpAddr> {
    let words: Option<Vec<[u8; 4]>> = (0..hex.len() / 8)
        .map(|i| {
            u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16)
                .ok()
                .map(u32::to_ne_bytes)
        })
        .collect();
    let bytes: Vec<u8> = words?.concat();
    match (v6, bytes.len()) {
        (false, 4) => Some(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]).into()),
        (true, 16) => {
            let b: [u8; 16] = bytes.try_into().ok()?;
            Some(Ipv6Addr::from(b).into())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_found_with_their_owners() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(owners("127.0.0.1", port), vec![me]);
        assert_eq!(owners("localhost", port), vec![me]);
        assert!(owners("127.0.0.2", port).is_empty());
        assert_eq!(
            proc_net_ip("0100007F", false),
            Some(Ipv4Addr::LOCALHOST.into())
        );
    }

    #[test]
    fn the_kernel_and_proc_name_the_same_listeners() {
        // Listening on v4 and v6, a socket connected to one (not
        // listening: left out), on a second port (left out).
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = v4.local_addr().unwrap().port();
        let v6 = std::net::TcpListener::bind(("::1", port)).ok();
        let _conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let from_kernel = diag(port).expect("sock_diag answers on this machine");
        let mut expected = vec![Listener {
            ip: Ipv4Addr::LOCALHOST.into(),
            port,
            uid: me,
        }];
        if v6.is_some() {
            expected.push(Listener {
                ip: Ipv6Addr::LOCALHOST.into(),
                port,
                uid: me,
            });
        }
        assert_eq!(from_kernel, expected);
        assert_eq!(from_proc(port), expected);
        let other_port = other.local_addr().unwrap().port();
        assert!(
            diag(other_port)
                .unwrap()
                .iter()
                .all(|l| l.port == other_port)
        );
        // A port nobody listens on: nothing, from either.
        drop(other);
        assert!(diag(other_port).unwrap().is_empty());
        assert!(from_proc(other_port).is_empty());
    }

    #[test]
    fn the_owner_of_a_connections_other_end_is_its_listeners() {
        let me = nix::unistd::geteuid().as_raw();
        for bind in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(bind) else {
                continue;
            };
            let conn = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (local, peer) = (conn.local_addr().unwrap(), conn.peer_addr().unwrap());
            // Not yet accepted, then accepted: the same owner.
            let mut owner = None;
            for _ in 0..100 {
                owner = peer_owner(local, peer).expect("sock_diag answers on this machine");
                if owner.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert_eq!(owner, Some(me), "{bind}");
            let _accepted = listener.accept().unwrap();
            assert_eq!(peer_owner(local, peer).unwrap(), Some(me));
            // A connection that is not there: the kernel says so.
            drop(conn);
            drop(_accepted);
            let gone = SocketAddr::new(peer.ip(), 9);
            assert!(peer_owner(local, gone).is_err());
        }
    }

    #[test]
    fn a_message_too_short_or_of_another_family_is_no_listener() {
        assert_eq!(parse_msg(&[2; 10]), None);
        let mut m = [0u8; 72];
        m[0] = 7;
        assert_eq!(parse_msg(&m), None);
        m[0] = 2;
        m[4..6].copy_from_slice(&8080u16.to_be_bytes());
        m[8..12].copy_from_slice(&[127, 0, 0, 1]);
        m[64..68].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(
            parse_msg(&m),
            Some(Listener {
                ip: Ipv4Addr::LOCALHOST.into(),
                port: 8080,
                uid: 1000
            })
        );
    }
}
