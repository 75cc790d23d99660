//! The worker's side of egress by policy: reading what a sandbox's
//! connection asks for (an HTTP proxy request's head, a TLS ClientHello's
//! server name) and deciding on it. Every byte here comes from a sandbox
//! and is hostile: parsers are bounded, total, and never allocate more than
//! their limits.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use corral_proto::egress::{Cidr, Rule, internal_range, normalize_name};

pub mod http;

/// Most bytes of a proxy request's head (request line and headers).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header lines of a proxy request.
pub const MAX_HEADERS: usize = 64;
/// Most bytes of a TLS ClientHello record read for its server name.
pub const MAX_HELLO_BYTES: usize = 16 * 1024 + 5;

/// Why a connection is refused: the words of the `X-Corral-Egress` header,
/// the event and the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    NotAllowed,
    InternalAddress,
    SniMismatch,
    HostMismatch,
    Port,
    ResolveFailed,
    BadRequest,
    /// Allowed, but no address of it answered.
    Unreachable,
    /// Over the sandbox's bound of open connections (not read at all).
    TooManyConnections,
}

impl Blocked {
    pub fn as_str(self) -> &'static str {
        match self {
            Blocked::NotAllowed => "not_allowed",
            Blocked::InternalAddress => "internal_address",
            Blocked::SniMismatch => "sni_mismatch",
            Blocked::HostMismatch => "host_mismatch",
            Blocked::Port => "port",
            Blocked::ResolveFailed => "resolve_failed",
            Blocked::BadRequest => "bad_request",
            Blocked::Unreachable => "unreachable",
            Blocked::TooManyConnections => "too_many_connections",
        }
    }
}

/// What a proxy request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// `CONNECT host:port`: a tunnel (TLS, usually).
    Connect { host: String, port: u16 },
    /// `GET http://host[:port]/path`: a plain request, forwarded.
    Forward {
        method: String,
        host: String,
        port: u16,
        /// The target as sent upstream (origin form: `/path?query`).
        path: String,
        /// The request's `Host` header, lower-case, when it has one.
        host_header: Option<String>,
    },
}

/// A malformed or oversized request head.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad proxy request: {0}")]
pub struct BadHead(pub String);

/// The host (a name, or an IP literal) and port of `authority`
/// (`host:port`, `[v6]:port`, or `host` with `default`).
pub fn host_port(authority: &str, default: Option<u16>) -> Result<(String, u16), BadHead> {
    let bad = |why: &str| BadHead(format!("{authority:?}: {why}"));
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(|| bad("an unclosed '['"))?;
        h.parse::<std::net::Ipv6Addr>()
            .map_err(|_| bad("not an IPv6 address in brackets"))?;
        (h.to_string(), after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (authority.to_string(), None),
        }
    };
    let port = match port {
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => return Err(bad("not a port")),
        },
        None => default.ok_or_else(|| bad("no port"))?,
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    let host = if host.parse::<std::net::IpAddr>().is_ok() {
        host
    } else {
        normalize_name(&host).map_err(BadHead)?
    };
    Ok((host, port))
}

/// A request's head as it was sent: its request line and header lines,
/// checked for form but not yet judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    pub method: &'a str,
    pub target: &'a str,
    pub version: &'a str,
    /// Names as sent, values trimmed.
    pub headers: Vec<(&'a str, &'a str)>,
    /// The head's length in bytes, its blank line included.
    pub len: usize,
}

impl Message<'_> {
    /// The values of the headers named `name` (any case).
    pub fn values<'b>(&'b self, name: &'b str) -> impl Iterator<Item = &'b str> + 'b {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    }
}

/// The head of a request in `buf`; `None` while it is not whole yet (and
/// under [`MAX_HEAD_BYTES`]).
pub fn parse_message(buf: &[u8]) -> Result<Option<Message<'_>>, BadHead> {
    // A line ends in CRLF only: a bare LF (which some servers take for a
    // line end, others not) is no way to hide a line. Only the head is
    // looked at: what follows it is a body's, or a tunnel's.
    let head = find(buf, b"\r\n\r\n").map_or(buf, |end| &buf[..end + 4]);
    if head
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
    {
        return Err(BadHead("a bare LF".into()));
    }
    let Some(end) = find(buf, b"\r\n\r\n") else {
        if buf.len() > MAX_HEAD_BYTES {
            return Err(BadHead(format!("a head over {MAX_HEAD_BYTES} bytes")));
        }
        return Ok(None);
    };
    let len = end + 4;
    if len > MAX_HEAD_BYTES {
        return Err(BadHead(format!("a head over {MAX_HEAD_BYTES} bytes")));
    }
    let text = std::str::from_utf8(&buf[..end]).map_err(|_| BadHead("not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let request = lines.next().unwrap_or("");
    let mut parts = request.split(' ');
    let (method, target, version) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v), None) if !m.is_empty() && !t.is_empty() => (m, t, v),
        _ => return Err(BadHead(format!("request line {request:?}"))),
    };
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(BadHead(format!("version {version:?}")));
    }
    if !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(BadHead(format!("method {method:?}")));
    }
    if target.bytes().any(|b| b.is_ascii_control()) {
        return Err(BadHead("a control character in the target".into()));
    }
    let mut headers = Vec::new();
    for line in lines {
        if headers.len() >= MAX_HEADERS {
            return Err(BadHead(format!("more than {MAX_HEADERS} headers")));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| BadHead(format!("header line {line:?}")))?;
        if name.is_empty()
            || name
                .bytes()
                .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err(BadHead(format!("header name {name:?}")));
        }
        if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(BadHead(format!("a control character in header {name}")));
        }
        headers.push((name, value.trim_matches([' ', '\t'])));
    }
    Ok(Some(Message {
        method,
        target,
        version,
        headers,
        len,
    }))
}

/// The `Host` header of `m`, lower-case, if it has one; two are refused.
pub fn host_header(m: &Message<'_>) -> Result<Option<String>, BadHead> {
    let mut hosts = m.values("host");
    let first = hosts.next().map(str::to_ascii_lowercase);
    if hosts.next().is_some() {
        return Err(BadHead("two Host headers".into()));
    }
    Ok(first)
}

/// The head of a proxy request in `buf`, and its length in bytes; `None`
/// while it is not whole yet (and under [`MAX_HEAD_BYTES`]).
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, BadHead> {
    let Some(m) = parse_message(buf)? else {
        return Ok(None);
    };
    let host_header = host_header(&m)?;
    let (method, target, len) = (m.method, m.target, m.len);
    let head = if method == "CONNECT" {
        let (host, port) = host_port(target, None)?;
        Head::Connect { host, port }
    } else {
        let (host, port, path) = absolute_target(target)?;
        Head::Forward {
            method: method.to_string(),
            host,
            port,
            path,
            host_header,
        }
    };
    Ok(Some((head, len)))
}

/// The host, port and origin-form path of an absolute `http://` target.
pub fn absolute_target(target: &str) -> Result<(String, u16, String), BadHead> {
    let rest = target.strip_prefix("http://").ok_or_else(|| {
        BadHead(format!(
            "target {target:?}: only http:// URLs (https goes by CONNECT)"
        ))
    })?;
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err(BadHead("credentials in the URL".into()));
    }
    let (host, port) = host_port(authority, Some(80))?;
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    Ok((host, port, path))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What the first bytes of a tunnel say of its TLS server name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not whole yet: read more (the record is under [`MAX_HELLO_BYTES`]).
    More,
    /// A ClientHello naming this server (lower-case, no trailing dot).
    Sni(String),
    /// A ClientHello with no server name.
    NoSni,
    /// Not a TLS ClientHello at all.
    NotTls,
}

/// The server name of the TLS ClientHello at the start of `buf`. Only the
/// first record is read (a ClientHello split over records is taken for one
/// without a name, and refused by the caller).
pub fn client_hello_sni(buf: &[u8]) -> Hello {
    // Record: type 22 (handshake), version 3.x, length.
    if buf.is_empty() {
        return Hello::More;
    }
    if buf[0] != 22 {
        return Hello::NotTls;
    }
    if buf.len() < 5 {
        return Hello::More;
    }
    if buf[1] != 3 {
        return Hello::NotTls;
    }
    let rec_len = u16::from_be_bytes([buf[3], buf[4]]) as usize;
    if rec_len == 0 || rec_len + 5 > MAX_HELLO_BYTES {
        return Hello::NotTls;
    }
    if buf.len() < 5 + rec_len {
        return Hello::More;
    }
    let mut r = Reader(&buf[5..5 + rec_len]);
    parse_hello(&mut r).unwrap_or(Hello::NoSni)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize)
    }
    fn vec8(&mut self) -> Option<Reader<'a>> {
        let n = self.u8()? as usize;
        self.take(n).map(Reader)
    }
    fn vec16(&mut self) -> Option<Reader<'a>> {
        let n = self.u16()?;
        self.take(n).map(Reader)
    }
}

fn parse_hello(r: &mut Reader<'_>) -> Option<Hello> {
    if r.u8()? != 1 {
        return Some(Hello::NotTls); // not a ClientHello
    }
    let len = r.u24()?;
    let mut body = Reader(r.take(len)?);
    body.take(2)?; // legacy version
    body.take(32)?; // random
    body.vec8()?; // session id
    body.vec16()?; // cipher suites
    body.vec8()?; // compression methods
    if body.0.is_empty() {
        return Some(Hello::NoSni);
    }
    let mut exts = body.vec16()?;
    let mut found: Option<String> = None;
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let mut data = exts.vec16()?;
        if kind != 0 {
            continue;
        }
        if found.is_some() {
            return Some(Hello::NoSni); // two server_name extensions: refused
        }
        let mut list = data.vec16()?;
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type != 0 {
                continue;
            }
            if found.is_some() {
                return Some(Hello::NoSni); // two host names: refused
            }
            let text = std::str::from_utf8(name.0).ok()?;
            found = Some(normalize_name(text).ok()?);
        }
    }
    Some(found.map_or(Hello::NoSni, Hello::Sni))
}

/// Whether `policy` lets a connection to `host` (a name, or an IP
/// literal) on `port` out; the reason when it does not.
pub fn decide(policy: &[Rule], host: &str, port: u16) -> Result<(), Blocked> {
    let allowed = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => policy.iter().any(|r| r.allows_ip(ip, port)),
        Err(_) => policy.iter().any(|r| r.allows_name(host, port)),
    };
    if allowed {
        return Ok(());
    }
    // The host is listed on another port: say so.
    let any_port = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => policy.iter().any(|r| {
            let mut all = r.clone();
            all.port = Some(port);
            all.allows_ip(ip, port)
        }),
        Err(_) => policy.iter().any(|r| {
            let mut all = r.clone();
            all.port = Some(port);
            all.allows_name(host, port)
        }),
    };
    Err(if any_port {
        Blocked::Port
    } else {
        Blocked::NotAllowed
    })
}

/// Where the worker lets connections go, whatever a sandbox's policy: no
/// internal address unless its operator exempts the range, never the
/// worker's own listening sockets.
#[derive(Debug, Clone, Default)]
pub struct Gate {
    /// Internal ranges the operator exempts (`--egress-allow-internal`).
    pub allow_internal: Vec<Cidr>,
    /// The worker's own listening sockets (gRPC, metrics): never reached,
    /// exempt or not.
    pub own: Vec<SocketAddr>,
    /// The worker's host's own addresses (its interfaces'): refused as
    /// internal ones are, public or not, unless a range exempts them.
    pub own_ips: Vec<IpAddr>,
    /// How long one connection attempt (or lookup) may take.
    pub connect_timeout: Duration,
    /// The resolver names are asked of (`--egress-resolver`); `None`: the
    /// system's.
    pub resolver: Option<SocketAddr>,
}

impl Gate {
    /// Whether a connection to `addr` may be made.
    pub fn check(&self, addr: SocketAddr) -> Result<(), Blocked> {
        let ip = corral_proto::egress::canonical(addr.ip());
        let own = self.own.iter().any(|o| {
            o.port() == addr.port()
                && (o.ip().is_unspecified() || corral_proto::egress::canonical(o.ip()) == ip)
        });
        if own {
            return Err(Blocked::InternalAddress);
        }
        let internal = internal_range(ip).is_some()
            || self
                .own_ips
                .iter()
                .any(|o| corral_proto::egress::canonical(*o) == ip);
        if internal && !self.allow_internal.iter().any(|c| c.contains(ip)) {
            return Err(Blocked::InternalAddress);
        }
        Ok(())
    }

    /// The addresses a connection to `host` (a name or an IP literal) on
    /// `port` may go to, for a sandbox whose policy is `policy`: decided,
    /// resolved here (never an address the sandbox chose for a name), every
    /// address checked. The caller connects to these and no others, so no
    /// later lookup can rebind the name.
    pub async fn resolve(
        &self,
        policy: &[Rule],
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, Blocked> {
        decide(policy, host, port)?;
        let addrs: Vec<SocketAddr> = match (host.parse::<IpAddr>(), self.resolver) {
            (Ok(ip), _) => vec![SocketAddr::new(ip, port)],
            (Err(_), Some(resolver)) => crate::dns::resolve(resolver, host, self.connect_timeout)
                .await
                .map_err(|_| Blocked::ResolveFailed)?
                .into_iter()
                .map(|ip| SocketAddr::new(ip, port))
                .collect(),
            (Err(_), None) => {
                tokio::time::timeout(self.connect_timeout, tokio::net::lookup_host((host, port)))
                    .await
                    .map_err(|_| Blocked::ResolveFailed)?
                    .map_err(|_| Blocked::ResolveFailed)?
                    .collect()
            }
        };
        if addrs.is_empty() {
            return Err(Blocked::ResolveFailed);
        }
        let allowed: Vec<SocketAddr> = addrs
            .into_iter()
            .filter(|a| self.check(*a).is_ok())
            .collect();
        if allowed.is_empty() {
            return Err(Blocked::InternalAddress);
        }
        Ok(allowed)
    }

    /// A connection to the first of `addrs` (checked by [`Self::resolve`])
    /// that answers.
    pub async fn connect_to(
        &self,
        addrs: &[SocketAddr],
    ) -> Result<(tokio::net::TcpStream, SocketAddr), Blocked> {
        for addr in addrs {
            if self.check(*addr).is_err() {
                continue;
            }
            if let Ok(Ok(stream)) =
                tokio::time::timeout(self.connect_timeout, tokio::net::TcpStream::connect(addr))
                    .await
            {
                let _ = stream.set_nodelay(true);
                return Ok((stream, *addr));
            }
        }
        Err(Blocked::Unreachable)
    }

    /// [`Self::resolve`], then [`Self::connect_to`].
    pub async fn connect(
        &self,
        policy: &[Rule],
        host: &str,
        port: u16,
    ) -> Result<(tokio::net::TcpStream, SocketAddr), Blocked> {
        let addrs = self.resolve(policy, host, port).await?;
        self.connect_to(&addrs).await
    }
}

/// How one proxied connection went: for the sandbox's `egress` event, the
/// metrics and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub host: String,
    pub port: u16,
    /// `None`: allowed.
    pub blocked: Option<Blocked>,
    /// Allowed, then closed because the policy no longer allows it. (A
    /// tunnel connected before its client spoke whose first bytes were then
    /// refused has `blocked` set and `cut` not: it was blocked, late.)
    pub cut: bool,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

impl Outcome {
    fn new() -> Self {
        Self {
            host: String::new(),
            port: 0,
            blocked: None,
            cut: false,
            bytes_out: 0,
            bytes_in: 0,
        }
    }
}

/// How long a sandbox may take to send a request's head, and a tunnel's
/// TLS ClientHello once its first byte has come (a tunnel whose client
/// says nothing at first is connected: see [`SERVER_FIRST_WAIT`]).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a relayed connection may carry nothing either way.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

fn refusal(reason: Blocked) -> Vec<u8> {
    let status = match reason {
        Blocked::Unreachable => "502 Bad Gateway",
        Blocked::BadRequest => "400 Bad Request",
        Blocked::TooManyConnections => "429 Too Many Requests",
        _ => "403 Forbidden",
    };
    format!(
        "HTTP/1.1 {status}\r\nX-Corral-Egress: blocked; reason={}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        reason.as_str()
    )
    .into_bytes()
}

/// The answer to a connection refused before its head is read: too many
/// at once.
pub fn too_many() -> &'static [u8] {
    b"HTTP/1.1 429 Too Many Requests\r\nX-Corral-Egress: blocked; reason=too_many_connections\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
}

/// A connection refused: why, and the answer it is owed (a 403 that says
/// why; nothing for a tunnel already let in, or a client that sent no
/// whole head), given by [`Refused::answer`] once the refusal is reported.
pub struct Refused<S> {
    pub outcome: Outcome,
    client: S,
    answer: bool,
}

impl<S: tokio::io::AsyncWrite + Unpin> Refused<S> {
    fn answered(client: S, outcome: Outcome) -> Self {
        Self {
            outcome,
            client,
            answer: true,
        }
    }

    fn closed(client: S, outcome: Outcome) -> Self {
        Self {
            outcome,
            client,
            answer: false,
        }
    }

    /// Says why to the client (when it is owed an answer), and closes.
    pub async fn answer(mut self) -> Outcome {
        use tokio::io::AsyncWriteExt;
        if self.answer
            && let Some(reason) = self.outcome.blocked
        {
            let _ = self.client.write_all(&refusal(reason)).await;
            let _ = self.client.shutdown().await;
        }
        self.outcome
    }
}

/// A connection let through, upstream connected, its first bytes sent.
pub struct Admitted<S> {
    client: S,
    upstream: tokio::net::TcpStream,
    outcome: Outcome,
    /// A tunnel whose client had not spoken when it was connected (the
    /// server speaks first): the relay checks the client's first bytes, as
    /// [`admit`] does, before any of them goes upstream.
    hello_pending: bool,
    /// A connection that carries plain HTTP: each of its requests is
    /// checked before it goes upstream.
    http: Option<http::Guard>,
}

impl<S> Admitted<S> {
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }
}

/// How long a tunnel's client may stay silent after its 200 before the
/// tunnel is connected anyway: a client of a protocol whose server speaks
/// first (SMTP, FTP, MySQL, plain IMAP) waits for the server's greeting,
/// while a TLS client sends its ClientHello at once. The first bytes such a
/// client sends later are checked all the same (see [`Admitted`]).
pub const SERVER_FIRST_WAIT: Duration = Duration::from_millis(50);

/// What a tunnel's first bytes from its client allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Not enough to tell: read more.
    More,
    /// Upstream they go.
    Go,
    /// Plain HTTP: upstream through an [`http::Guard`].
    Http,
    /// No name, another name, or a hello past its bound.
    Refuse,
}

/// Whether a tunnel's first bytes may be read as HTTP by a server, as
/// leniently as servers read: empty lines before the request line, bare LF
/// line ends, any case, any whitespace between parts. A line that ends in
/// an `HTTP/` version (any case) is HTTP; so is text that has no line end
/// yet past the head's bound. Then the [`http::Guard`] reads it, strictly,
/// and refuses what is not a well-formed request. `None` while the first
/// line is not whole; `Some(false)`: another protocol (a binary one, or a
/// first line that is no request: SSH's, an SMTP client's).
fn http_request_line(first: &[u8]) -> Option<bool> {
    let start = first.iter().position(|b| !matches!(b, b'\r' | b'\n'))?;
    let rest = &first[start..];
    let text = |b: &u8| b.is_ascii_graphic() || matches!(b, b' ' | b'\t' | b'\r');
    let Some(end) = rest.iter().position(|b| *b == b'\n') else {
        // A binary protocol shows itself early; text without a line end
        // goes to the guard past the bound (which refuses it).
        if !rest.iter().all(text) {
            return Some(false);
        }
        return (rest.len() >= MAX_HEAD_BYTES).then_some(true);
    };
    let line = &rest[..end];
    if !line.iter().all(text) {
        return Some(false);
    }
    let words: Vec<&[u8]> = line
        .split(|b| b.is_ascii_whitespace())
        .filter(|w| !w.is_empty())
        .collect();
    let http = words.len() >= 2
        && words
            .last()
            .is_some_and(|v| v.len() >= 5 && v[..5].eq_ignore_ascii_case(b"HTTP/"));
    Some(http)
}

/// A TLS tunnel names its server: it must be the `host` asked for. A
/// tunnel that speaks plain HTTP has each request checked.
fn hello_verdict(first: &[u8], host: &str) -> Verdict {
    if first.first().is_some_and(|b| *b != 22) {
        match http_request_line(first) {
            Some(true) => return Verdict::Http,
            None => return Verdict::More,
            Some(false) => {}
        }
    }
    match client_hello_sni(first) {
        Hello::More if first.len() < MAX_HELLO_BYTES => Verdict::More,
        Hello::Sni(name) if name == host => Verdict::Go,
        // An address, allowed by a CIDR rule: TLS names no address
        // (RFC 6066), so a hello without a name goes on to the address
        // decided on; one that names a host is refused.
        Hello::NoSni if host.parse::<IpAddr>().is_ok() => Verdict::Go,
        // Another protocol (ssh, say) to the host allowed. A handshake
        // record that does not parse is no way around the name check.
        Hello::NotTls if first.first() != Some(&22) => Verdict::Go,
        _ => Verdict::Refuse,
    }
}

/// Reads a connection's request head and decides on it by `policy` as it
/// is now: a CONNECT's target must be allowed and resolve to addresses the
/// gate allows (a 403 that says why otherwise), and the tunnel's TLS
/// ClientHello must name that host (closed after its 200 otherwise) before
/// anything is sent upstream; a plain request's Host header must match its
/// URL. `Err`: refused, with why.
pub async fn admit<S>(
    mut client: S,
    policy: &mut tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    gate: &Gate,
) -> Result<Admitted<S>, Refused<S>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = Outcome::new();
    let mut buf = Vec::with_capacity(1024);
    let deadline = tokio::time::Instant::now() + HEAD_TIMEOUT;
    // The head, within its bound and its time.
    let (head, used) = loop {
        match parse_head(&buf) {
            Ok(Some(found)) => break found,
            Ok(None) => {}
            Err(_) => {
                out.blocked = Some(Blocked::BadRequest);
                return Err(Refused::answered(client, out));
            }
        }
        let mut chunk = [0u8; 2048];
        let n = match tokio::time::timeout_at(deadline, client.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => {
                out.blocked = Some(Blocked::BadRequest);
                return Err(Refused::closed(client, out));
            }
        };
        buf.extend_from_slice(&chunk[..n]);
    };
    let rest = buf.split_off(used);
    let mut guard = None;
    let (host, port, mut first) = match &head {
        Head::Connect { host, port } => (host.clone(), *port, rest),
        Head::Forward { host, port, .. } => {
            out.host.clone_from(host);
            out.port = *port;
            // Every request of the connection, this one first, checked
            // and sent on in origin form.
            let mut g = http::Guard::new(http::Mode::Proxy, host, *port);
            let mut forwarded = Vec::new();
            buf.extend_from_slice(&rest);
            if let Err(reason) = g.feed(&buf, &mut forwarded) {
                out.blocked = Some(reason);
                return Err(Refused::answered(client, out));
            }
            guard = Some(g);
            (host.clone(), *port, forwarded)
        }
    };
    out.host.clone_from(&host);
    out.port = port;
    let mut hello_pending = false;
    let current = policy.borrow_and_update().clone();
    let addrs = match gate.resolve(&current, &host, port).await {
        Ok(a) => a,
        Err(reason) => {
            out.blocked = Some(reason);
            return Err(Refused::answered(client, out));
        }
    };
    if matches!(head, Head::Connect { .. }) {
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            out.blocked = Some(Blocked::BadRequest);
            return Err(Refused::closed(client, out));
        }
        // A TLS tunnel names its server: it must be the host asked for,
        // before a byte goes upstream.
        let deadline = tokio::time::Instant::now() + HEAD_TIMEOUT;
        loop {
            match hello_verdict(&first, &host) {
                Verdict::More => {
                    // A client silent so far may wait for its server to
                    // speak: after a short wait the tunnel is connected,
                    // its first bytes checked by the relay.
                    let until = if first.is_empty() {
                        deadline.min(tokio::time::Instant::now() + SERVER_FIRST_WAIT)
                    } else {
                        deadline
                    };
                    let mut chunk = [0u8; 4096];
                    match tokio::time::timeout_at(until, client.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 => first.extend_from_slice(&chunk[..n]),
                        Err(_) if first.is_empty() => {
                            hello_pending = true;
                            break;
                        }
                        _ => {
                            out.blocked = Some(Blocked::BadRequest);
                            return Err(Refused::closed(client, out));
                        }
                    }
                }
                Verdict::Go => break,
                Verdict::Http => {
                    // Plain HTTP in the tunnel: each request must name the
                    // tunnel's host.
                    let mut g = http::Guard::new(http::Mode::Tunnel, &host, port);
                    let mut passed = Vec::new();
                    if let Err(reason) = g.feed(&first, &mut passed) {
                        out.blocked = Some(reason);
                        return Err(Refused::closed(client, out));
                    }
                    first = passed;
                    guard = Some(g);
                    break;
                }
                Verdict::Refuse => {
                    // The tunnel is closed (its 200 is sent; TLS then
                    // fails).
                    out.blocked = Some(Blocked::SniMismatch);
                    return Err(Refused::closed(client, out));
                }
            }
        }
    }
    let (mut upstream, _) = match gate.connect_to(&addrs).await {
        Ok(c) => c,
        Err(reason) => {
            out.blocked = Some(reason);
            // A tunnel has its 200 already: it is closed.
            return Err(if matches!(head, Head::Connect { .. }) {
                Refused::closed(client, out)
            } else {
                Refused::answered(client, out)
            });
        }
    };
    // The policy may have been replaced while the hello or the connection
    // was awaited: what goes upstream follows the one in force now.
    let now = policy.borrow_and_update().clone();
    if let Err(reason) = decide(&now, &host, port) {
        out.blocked = Some(reason);
        return Err(if matches!(head, Head::Connect { .. }) {
            Refused::closed(client, out)
        } else {
            Refused::answered(client, out)
        });
    }
    if upstream.write_all(&first).await.is_err() {
        out.blocked = Some(Blocked::Unreachable);
        return Err(Refused::closed(client, out));
    }
    out.bytes_out += first.len() as u64;
    Ok(Admitted {
        client,
        upstream,
        outcome: out,
        hello_pending,
        http: guard,
    })
}

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
async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The size asked of a splicing pipe.
const PIPE_BYTES: i32 = 1 << 20;

/// A pipe for splicing, both ends non-blocking.
struct SplicePipe {
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
async fn splice_all(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(r: &[&str]) -> Vec<Rule> {
        corral_proto::egress::parse_rules(r, true).unwrap()
    }

    #[test]
    fn connect_and_absolute_requests_are_read_whole_or_not_at_all() {
        let (h, n) = parse_head(b"CONNECT PyPI.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\nrest")
            .unwrap()
            .unwrap();
        assert_eq!(
            h,
            Head::Connect {
                host: "pypi.org".into(),
                port: 443
            }
        );
        // The head, up to its blank line; "rest" is the tunnel's.
        assert_eq!(n, 53);
        let (h, _) =
            parse_head(b"GET http://example.com/a?b HTTP/1.1\r\nHost: Example.com\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(
            h,
            Head::Forward {
                method: "GET".into(),
                host: "example.com".into(),
                port: 80,
                path: "/a?b".into(),
                host_header: Some("example.com".into())
            }
        );
        let (h, _) = parse_head(b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            h,
            Head::Connect {
                host: "2001:db8::1".into(),
                port: 8443
            }
        );
        assert_eq!(
            parse_head(b"CONNECT x.com:443 HTTP/1.1\r\nHost: x").unwrap(),
            None
        );
    }

    #[test]
    fn hostile_heads_are_refused() {
        let big = format!(
            "GET http://x.com/ HTTP/1.1\r\nA: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        let many: String = (0..=MAX_HEADERS).map(|i| format!("H{i}: v\r\n")).collect();
        let many = format!("GET http://x.com/ HTTP/1.1\r\n{many}\r\n");
        for head in [
            b"CONNECT x.com HTTP/1.1\r\n\r\n".to_vec(),
            b"CONNECT x.com:0 HTTP/1.1\r\n\r\n".to_vec(),
            b"CONNECT x.com:443 HTTP/2\r\n\r\n".to_vec(),
            b"CONNECT  x.com:443 HTTP/1.1\r\n\r\n".to_vec(),
            b"GET https://x.com/ HTTP/1.1\r\n\r\n".to_vec(),
            b"GET /relative HTTP/1.1\r\n\r\n".to_vec(),
            b"GET http://user:pw@x.com/ HTTP/1.1\r\n\r\n".to_vec(),
            b"GET http://x.com/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n".to_vec(),
            b"GET http://x.com/ HTTP/1.1\r\nBad Header: v\r\n\r\n".to_vec(),
            b"GET http://x.com/ HTTP/1.1\r\nA: b\x00c\r\n\r\n".to_vec(),
            b"get http://x.com/ HTTP/1.1\r\n\r\n".to_vec(),
            b"CONNECT [::1:443 HTTP/1.1\r\n\r\n".to_vec(),
            b"CONNECT exa mple.com:443 HTTP/1.1\r\n\r\n".to_vec(),
            b"\xff\xfe HTTP/1.1\r\n\r\n".to_vec(),
            big.into_bytes(),
            many.into_bytes(),
        ] {
            assert!(
                parse_head(&head).is_err(),
                "{}",
                String::from_utf8_lossy(&head)
            );
        }
        // A head that never ends is refused once past the bound.
        assert!(parse_head(&vec![b'a'; MAX_HEAD_BYTES + 1]).is_err());
    }

    /// A ClientHello as a client sends it, with these server names.
    fn hello(names: &[&str]) -> Vec<u8> {
        let mut sni = Vec::new();
        for n in names {
            sni.push(0);
            sni.extend_from_slice(&(n.len() as u16).to_be_bytes());
            sni.extend_from_slice(n.as_bytes());
        }
        let mut ext = Vec::new();
        // An unrelated extension first (supported_groups).
        ext.extend_from_slice(&[0, 10, 0, 4, 0, 2, 0, 29]);
        if !names.is_empty() {
            ext.extend_from_slice(&0u16.to_be_bytes());
            ext.extend_from_slice(&((sni.len() + 2) as u16).to_be_bytes());
            ext.extend_from_slice(&(sni.len() as u16).to_be_bytes());
            ext.extend_from_slice(&sni);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn the_server_name_of_a_client_hello_is_read_and_nothing_else() {
        let h = hello(&["Files.PyPI.org."]);
        assert_eq!(client_hello_sni(&h), Hello::Sni("files.pypi.org".into()));
        for cut in [0, 3, 10, h.len() - 1] {
            assert_eq!(client_hello_sni(&h[..cut]), Hello::More, "cut at {cut}");
        }
        assert_eq!(client_hello_sni(&hello(&[])), Hello::NoSni);
        assert_eq!(client_hello_sni(&hello(&["a.com", "b.com"])), Hello::NoSni);
        assert_eq!(client_hello_sni(&hello(&["bad name"])), Hello::NoSni);
        assert_eq!(client_hello_sni(b"GET / HTTP/1.1\r\n"), Hello::NotTls);
        // Every truncation and every byte flipped: never a panic.
        for i in 5..h.len() {
            let mut bent = h.clone();
            bent[i] ^= 0xff;
            let _ = client_hello_sni(&bent);
            let mut short = h.clone();
            short.truncate(i);
            let _ = client_hello_sni(&short);
        }
    }

    fn gate(allow: &[&str], own: Vec<SocketAddr>) -> Gate {
        Gate {
            allow_internal: allow.iter().map(|c| c.parse().unwrap()).collect(),
            own,
            own_ips: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            resolver: None,
        }
    }

    #[test]
    fn the_hosts_own_addresses_are_refused_public_or_not() {
        let mut g = gate(&[], vec![]);
        g.own_ips = vec![
            "203.0.113.7".parse().unwrap(),
            "2001:db8::7".parse().unwrap(),
        ];
        for a in [
            "203.0.113.7:22",
            "[2001:db8::7]:443",
            "[::ffff:203.0.113.7]:80",
        ] {
            assert_eq!(
                g.check(a.parse().unwrap()),
                Err(Blocked::InternalAddress),
                "{a}"
            );
        }
        assert_eq!(g.check("203.0.113.8:22".parse().unwrap()), Ok(()));
        // An operator's exemption covers them (never the worker's ports).
        g.allow_internal = vec!["203.0.113.0/24".parse().unwrap()];
        assert_eq!(g.check("203.0.113.7:22".parse().unwrap()), Ok(()));
    }

    #[tokio::test]
    async fn a_name_is_resolved_once_and_connected_to_as_checked() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let server = tokio::net::TcpListener::bind("127.0.0.9:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let asked = std::sync::Arc::new(AtomicUsize::new(0));
        let counter = asked.clone();
        // rebind.test answers an exempt address first, then the metadata
        // address; meta.test is the metadata address at once.
        let (dns, task) = crate::dns::testing::serve(move |name, qtype| match (name, qtype) {
            ("rebind.test", 1) => {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    vec!["127.0.0.9".parse().unwrap()]
                } else {
                    vec!["169.254.169.254".parse().unwrap()]
                }
            }
            ("meta.test", 1) => vec!["169.254.169.254".parse().unwrap()],
            ("many.test", 1) => vec!["10.0.0.1".parse().unwrap(), "127.0.0.9".parse().unwrap()],
            _ => vec![],
        })
        .await
        .unwrap();
        let mut g = gate(&["127.0.0.9/32"], vec![]);
        g.resolver = Some(dns);
        let policy = rules(&[
            &format!("rebind.test:{port}"),
            &format!("meta.test:{port}"),
            &format!("many.test:{port}"),
            &format!("gone.test:{port}"),
        ]);
        let (_, to) = g
            .connect(&policy, "rebind.test", port)
            .await
            .expect("first answer");
        assert_eq!(to.ip().to_string(), "127.0.0.9");
        // The second lookup answers internal: refused, never connected.
        assert_eq!(
            g.connect(&policy, "rebind.test", port).await.err(),
            Some(Blocked::InternalAddress)
        );
        assert_eq!(
            g.connect(&policy, "meta.test", port).await.err(),
            Some(Blocked::InternalAddress)
        );
        // Of several answers only the allowed ones are tried.
        let (_, to) = g
            .connect(&policy, "many.test", port)
            .await
            .expect("the exempt one");
        assert_eq!(to.ip().to_string(), "127.0.0.9");
        assert_eq!(
            g.connect(&policy, "gone.test", port).await.err(),
            Some(Blocked::ResolveFailed)
        );
        task.abort();
        drop(server);
    }

    #[tokio::test]
    async fn internal_answers_and_the_workers_own_ports_are_never_reached() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let worker_port = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let own = worker_port.local_addr().unwrap();
        let policy = rules(&[
            &format!("localhost:{port}"),
            &format!("127.0.0.0/8:{port}"),
            &format!("localhost:{}", own.port()),
        ]);
        // Loopback is internal: refused unless exempted.
        let strict = gate(&[], vec![own]);
        assert_eq!(
            strict.connect(&policy, "localhost", port).await.err(),
            Some(Blocked::InternalAddress)
        );
        assert_eq!(
            strict.connect(&policy, "127.0.0.1", port).await.err(),
            Some(Blocked::InternalAddress)
        );
        let open = gate(&["127.0.0.0/8"], vec![own]);
        let (_, to) = open
            .connect(&policy, "localhost", port)
            .await
            .expect("exempted");
        assert_eq!(to.port(), port);
        // The worker's own port, exempt range or not.
        assert_eq!(
            open.connect(&policy, "localhost", own.port()).await.err(),
            Some(Blocked::InternalAddress)
        );
        // An address by a name rule: not allowed; a name not listed either.
        let by_name = rules(&[&format!("localhost:{port}")]);
        assert_eq!(
            open.connect(&by_name, "127.0.0.1", port).await.err(),
            Some(Blocked::NotAllowed)
        );
        assert_eq!(
            open.connect(&by_name, "other.invalid", port).await.err(),
            Some(Blocked::NotAllowed)
        );
        // Allowed, but nothing there.
        drop(server);
        assert_eq!(
            open.connect(&policy, "127.0.0.1", port).await.err(),
            Some(Blocked::Unreachable)
        );
        // (A name that does not resolve is not tried here: its lookup would
        // leave loopback.)
    }

    #[test]
    fn metadata_and_mapped_addresses_are_internal() {
        let g = gate(&[], vec![]);
        for a in [
            "169.254.169.254:80",
            "[::ffff:169.254.169.254]:80",
            "[::1]:443",
            "10.0.0.1:443",
        ] {
            assert_eq!(
                g.check(a.parse().unwrap()),
                Err(Blocked::InternalAddress),
                "{a}"
            );
        }
        assert_eq!(g.check("93.184.216.34:443".parse().unwrap()), Ok(()));
        let own = gate(&["127.0.0.0/8"], vec!["0.0.0.0:7070".parse().unwrap()]);
        assert_eq!(
            own.check("127.0.0.1:7070".parse().unwrap()),
            Err(Blocked::InternalAddress)
        );
        assert_eq!(own.check("127.0.0.1:7071".parse().unwrap()), Ok(()));
    }

    type Policy = tokio::sync::watch::Sender<std::sync::Arc<Vec<Rule>>>;

    fn policy(
        r: &[&str],
    ) -> (
        Policy,
        tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    ) {
        tokio::sync::watch::channel(std::sync::Arc::new(rules(r)))
    }

    /// A loopback server that records what it got and answers `reply`.
    async fn upstream(reply: &'static [u8]) -> (u16, tokio::sync::mpsc::Receiver<Vec<u8>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut got = vec![0u8; 65536];
                    let n = s.read(&mut got).await.unwrap_or(0);
                    let _ = tx.send(got[..n].to_vec()).await;
                    let _ = s.write_all(reply).await;
                    // Held open until the other side goes.
                    let _ = s.read(&mut got).await;
                });
            }
        });
        (port, rx)
    }

    async fn exchange(
        request: &[u8],
        p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    ) -> (Outcome, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let g = gate(&["127.0.0.0/8"], vec![]);
        let (sandbox, proxy) = tokio::io::duplex(1 << 16);
        let (mut from, mut to) = tokio::io::split(sandbox);
        let request = request.to_vec();
        // Written while the proxy reads (a big request fills the pipe).
        let writer = tokio::spawn(async move {
            let _ = to.write_all(&request).await;
            let _ = to.shutdown().await;
        });
        let reader = tokio::spawn(async move {
            let mut back = Vec::new();
            let _ = from.read_to_end(&mut back).await;
            back
        });
        let outcome = serve_connection(proxy, p, &g).await;
        writer.abort();
        (outcome, reader.await.unwrap())
    }

    #[tokio::test]
    async fn a_tls_tunnel_goes_through_only_to_the_server_it_names() {
        let (port, mut got) = upstream(b"server hello").await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        let mut req =
            format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost\r\n\r\n").into_bytes();
        req.extend_from_slice(&hello(&["localhost"]));
        let (o, back) = exchange(&req, p.clone()).await;
        assert_eq!(o.blocked, None, "{o:?}");
        let back = String::from_utf8_lossy(&back);
        assert!(
            back.starts_with("HTTP/1.1 200 Connection established\r\n\r\n"),
            "{back}"
        );
        assert!(back.ends_with("server hello"), "{back}");
        assert_eq!(got.recv().await.unwrap(), hello(&["localhost"]));
        // Another name in the hello: closed after the 200, nothing sent on.
        let mut req = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
        req.extend_from_slice(&hello(&["other.example"]));
        let (o, back) = exchange(&req, p.clone()).await;
        assert_eq!(o.blocked, Some(Blocked::SniMismatch));
        assert!(!String::from_utf8_lossy(&back).contains("server hello"));
        // Decided before any connection: the server never heard of it.
        assert!(got.try_recv().is_err());
        // No name at all.
        let mut req = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
        req.extend_from_slice(&hello(&[]));
        assert_eq!(
            exchange(&req, p.clone()).await.0.blocked,
            Some(Blocked::SniMismatch)
        );
        // Not listed: a 403 that says why.
        let (o, back) = exchange(b"CONNECT elsewhere.test:443 HTTP/1.1\r\n\r\n", p).await;
        assert_eq!(o.blocked, Some(Blocked::NotAllowed));
        assert!(
            String::from_utf8_lossy(&back).contains("X-Corral-Egress: blocked; reason=not_allowed")
        );
    }

    #[tokio::test]
    async fn a_tls_tunnel_to_an_allowed_address_needs_no_name_and_takes_none_other() {
        let (port, mut got) = upstream(b"server hello").await;
        let (_tx, p) = policy(&[&format!("127.0.0.1/32:{port}")]);
        let connect = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").into_bytes();
        // A client names no address in its hello (RFC 6066).
        let mut req = connect.clone();
        req.extend_from_slice(&hello(&[]));
        let (o, back) = exchange(&req, p.clone()).await;
        assert_eq!(o.blocked, None, "{o:?}");
        assert!(String::from_utf8_lossy(&back).ends_with("server hello"));
        assert_eq!(got.recv().await.unwrap(), hello(&[]));
        // A hello that names a host is refused: the rule is for the address.
        let mut req = connect;
        req.extend_from_slice(&hello(&["pypi.org"]));
        let (o, _) = exchange(&req, p).await;
        assert_eq!(o.blocked, Some(Blocked::SniMismatch));
        assert!(got.try_recv().is_err());
    }

    #[test]
    fn whatever_a_server_could_read_as_http_in_a_tunnel_goes_to_the_guard() {
        for first in [
            &b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n"[..],
            b"\r\nGET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            b"get / http/1.1\r\nHost: evil.test\r\n\r\n",
            b"GET / HTTP/1.1\nHost: evil.test\nX: \r\n\n",
            b"GET\t/\tHTTP/1.1\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            assert_eq!(
                hello_verdict(first, "pkg.test"),
                Verdict::Http,
                "{:?}",
                String::from_utf8_lossy(first)
            );
            // And the guard takes none of the odd ones.
            let mut g = http::Guard::new(http::Mode::Tunnel, "pkg.test", 80);
            let mut out = Vec::new();
            let fed = g.feed(first, &mut out);
            if first.starts_with(b"GET / HTTP/1.1\r\n") {
                assert_eq!(fed, Err(Blocked::HostMismatch));
            } else {
                assert!(fed.is_err() || out.is_empty(), "{fed:?} {out:?}");
            }
        }
        // Text without a line end yet: wait; past the bound: the guard's.
        assert_eq!(hello_verdict(b"GET / HTT", "pkg.test"), Verdict::More);
        let long = vec![b'A'; MAX_HEAD_BYTES + 1];
        assert_eq!(hello_verdict(&long, "pkg.test"), Verdict::Http);
        // Other protocols whose clients speak first go on as they are.
        assert_eq!(
            hello_verdict(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n", "pkg.test"),
            Verdict::Go
        );
        assert_eq!(
            hello_verdict(b"\x00\x00\x00\x08\x04\xd2\x16\x2f", "pkg.test"),
            Verdict::Go
        );
        assert_eq!(hello_verdict(b"EHLO me\r\n", "pkg.test"), Verdict::Go);
    }

    #[tokio::test]
    async fn a_bracketed_address_is_refused_as_internal_not_as_another_host() {
        let (_tx, p) = policy(&["::/0"]);
        for req in [
            "GET http://[::1]/ HTTP/1.1\r\nHost: [::1]\r\n\r\n",
            "GET http://[::1]:443/ HTTP/1.1\r\nHost: [::1]:443\r\n\r\n",
            "GET http://[::169.254.169.254]/ HTTP/1.1\r\nHost: [::169.254.169.254]\r\n\r\n",
            "GET http://[64:ff9b:1::a9fe:a9fe]/ HTTP/1.1\r\n\r\n",
        ] {
            let (o, back) = exchange(req.as_bytes(), p.clone()).await;
            assert_eq!(o.blocked, Some(Blocked::InternalAddress), "{req}: {o:?}");
            assert!(
                String::from_utf8_lossy(&back).contains("reason=internal_address"),
                "{req}"
            );
        }
    }

    #[tokio::test]
    async fn a_plain_request_is_forwarded_in_origin_form_if_its_host_matches() {
        let (port, mut got) = upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        let req = format!(
            "GET http://localhost:{port}/simple/pip/?x=1 HTTP/1.1\r\nHost: localhost:{port}\r\nUser-Agent: t\r\n\r\n"
        );
        let (o, back) = exchange(req.as_bytes(), p.clone()).await;
        assert_eq!(o.blocked, None, "{o:?}");
        assert!(String::from_utf8_lossy(&back).ends_with("ok"));
        let sent = String::from_utf8(got.recv().await.unwrap()).unwrap();
        assert!(
            sent.starts_with("GET /simple/pip/?x=1 HTTP/1.1\r\nHost: localhost:"),
            "{sent}"
        );
        assert!(sent.contains("User-Agent: t\r\n"), "{sent}");
        let req = format!("GET http://localhost:{port}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n");
        let (o, back) = exchange(req.as_bytes(), p).await;
        assert_eq!(o.blocked, Some(Blocked::HostMismatch));
        assert!(String::from_utf8_lossy(&back).contains("reason=host_mismatch"));
    }

    #[tokio::test]
    async fn a_policy_replaced_closes_what_it_no_longer_allows() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (port, _got) = upstream(b"").await;
        let (tx, p) = policy(&[&format!("localhost:{port}")]);
        let g = gate(&["127.0.0.0/8"], vec![]);
        let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
        let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
        sandbox
            .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\nSSH-2.0-x\r\n").as_bytes())
            .await
            .unwrap();
        let mut ok = [0u8; 39];
        sandbox.read_exact(&mut ok).await.unwrap();
        // Still allowed: a replaced policy that keeps it changes nothing.
        tx.send(std::sync::Arc::new(rules(&[
            &format!("localhost:{port}"),
            "pypi.org",
        ])))
        .unwrap();
        tokio::task::yield_now().await;
        assert!(!serving.is_finished());
        tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
        let o = tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("closed")
            .unwrap();
        assert_eq!(o.blocked, Some(Blocked::NotAllowed));
    }

    #[tokio::test(start_paused = true)]
    async fn a_tunnel_idle_past_its_timeout_is_closed() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (port, _got) = upstream(b"").await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        let g = gate(&["127.0.0.0/8"], vec![]);
        let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
        let started = tokio::time::Instant::now();
        let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
        sandbox
            .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\nSSH-2.0-x\r\n").as_bytes())
            .await
            .unwrap();
        let mut ok = [0u8; 39];
        sandbox.read_exact(&mut ok).await.unwrap();
        // Nothing either way from here: closed at the idle timeout.
        let o = serving.await.unwrap();
        assert_eq!(o.blocked, None);
        assert!(started.elapsed() >= IDLE_TIMEOUT, "{:?}", started.elapsed());
    }

    /// A connection on a real Unix socket, admitted, relayed by splicing;
    /// its client's first bytes after the CONNECT are `first`.
    async fn spliced_with(
        port: u16,
        p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
        meters: Meters,
        first: &[u8],
    ) -> (tokio::net::UnixStream, tokio::task::JoinHandle<Outcome>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut sandbox, proxy) = tokio::net::UnixStream::pair().unwrap();
        let serving = tokio::spawn(async move {
            let g = gate(&["127.0.0.0/8"], vec![]);
            let mut p = p;
            match admit(proxy, &mut p, &g).await {
                Ok(a) => relay_spliced(a, p, &meters).await,
                Err(r) => r.answer().await,
            }
        });
        let mut hello = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
        hello.extend_from_slice(first);
        sandbox.write_all(&hello).await.unwrap();
        let mut ok = [0u8; 39];
        sandbox.read_exact(&mut ok).await.unwrap();
        assert_eq!(&ok[..], b"HTTP/1.1 200 Connection established\r\n\r\n");
        (sandbox, serving)
    }

    /// [`spliced_with`] a client that speaks SSH.
    async fn spliced(
        port: u16,
        p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
        meters: Meters,
    ) -> (tokio::net::UnixStream, tokio::task::JoinHandle<Outcome>) {
        spliced_with(port, p, meters, b"SSH-2.0-x\r\n").await
    }

    #[tokio::test]
    async fn a_spliced_relay_carries_both_ways_and_a_policy_cuts_it() {
        use tokio::io::AsyncReadExt;
        let (port, mut got) = upstream(b"server hello").await;
        let (tx, p) = policy(&[&format!("localhost:{port}")]);
        let meters = Meters::default();
        let (mut sandbox, serving) = spliced(port, p, meters.clone()).await;
        let mut back = [0u8; 12];
        sandbox.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"server hello");
        // Counted as it moves, not when the connection ends.
        assert_eq!(meters.inward.bytes.get(), 12);
        assert_eq!(got.recv().await.unwrap(), b"SSH-2.0-x\r\n");
        tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
        let o = tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("cut")
            .unwrap();
        assert!(o.cut, "{o:?}");
        assert_eq!(o.blocked, Some(Blocked::NotAllowed));
        assert_eq!((o.bytes_out, o.bytes_in), (11, 12));
    }

    #[tokio::test(start_paused = true)]
    async fn a_spliced_relay_idle_past_its_timeout_is_closed() {
        let (port, _got) = upstream(b"").await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        let started = tokio::time::Instant::now();
        let (_sandbox, serving) = spliced(port, p, Meters::default()).await;
        let o = serving.await.unwrap();
        assert!(!o.cut && o.blocked.is_none(), "{o:?}");
        assert!(started.elapsed() >= IDLE_TIMEOUT, "{:?}", started.elapsed());
    }

    /// A loopback server that speaks first (as SMTP, FTP and MySQL do),
    /// then records each read and answers it.
    async fn greeting_upstream() -> (u16, tokio::sync::mpsc::Receiver<Vec<u8>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = s.write_all(b"220 ready\r\n").await;
                    let mut got = vec![0u8; 65536];
                    while let Ok(n) = s.read(&mut got).await {
                        if n == 0 {
                            break;
                        }
                        let _ = tx.send(got[..n].to_vec()).await;
                        let _ = s.write_all(b"250 ok\r\n").await;
                    }
                });
            }
        });
        (port, rx)
    }

    trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
    impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

    /// A tunnel to `port` whose client says nothing after its 200: on a
    /// real Unix socket, relayed by splicing, or in memory, by copying.
    async fn silent_tunnel(
        port: u16,
        p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
        spliced: bool,
    ) -> (Box<dyn Io>, tokio::task::JoinHandle<Outcome>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if spliced {
            let (sandbox, serving) = spliced_with(port, p, Meters::default(), b"").await;
            return (Box::new(sandbox), serving);
        }
        let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
        let g = gate(&["127.0.0.0/8"], vec![]);
        let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
        sandbox
            .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut ok = [0u8; 39];
        sandbox.read_exact(&mut ok).await.unwrap();
        assert_eq!(&ok[..], b"HTTP/1.1 200 Connection established\r\n\r\n");
        (Box::new(sandbox), serving)
    }

    #[tokio::test]
    async fn a_server_that_speaks_first_is_heard_and_its_client_still_checked() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let within = Duration::from_secs(5);
        for spliced in [true, false] {
            let (port, mut got) = greeting_upstream().await;
            let (_tx, p) = policy(&[&format!("localhost:{port}")]);
            // The client waits for the server's greeting (it used to wait
            // for the client's first bytes, until the head timeout).
            let (mut sandbox, serving) = silent_tunnel(port, p.clone(), spliced).await;
            let mut greeting = [0u8; 11];
            tokio::time::timeout(within, sandbox.read_exact(&mut greeting))
                .await
                .expect("the greeting comes before the client speaks")
                .unwrap();
            assert_eq!(&greeting, b"220 ready\r\n");
            sandbox.write_all(b"EHLO sandbox\r\n").await.unwrap();
            assert_eq!(got.recv().await.unwrap(), b"EHLO sandbox\r\n");
            let mut answer = [0u8; 8];
            sandbox.read_exact(&mut answer).await.unwrap();
            assert_eq!(&answer, b"250 ok\r\n");
            drop(sandbox);
            let o = tokio::time::timeout(within, serving)
                .await
                .unwrap()
                .unwrap();
            assert_eq!((o.blocked, o.cut), (None, false), "{o:?}");
            assert_eq!((o.bytes_out, o.bytes_in), (14, 19), "spliced: {spliced}");
            // A TLS client that spoke only after the server: its hello
            // must still name the host asked for, or none of it goes on.
            let (mut sandbox, serving) = silent_tunnel(port, p.clone(), spliced).await;
            sandbox.read_exact(&mut greeting).await.unwrap();
            sandbox.write_all(&hello(&["other.example"])).await.unwrap();
            let o = tokio::time::timeout(within, serving)
                .await
                .unwrap()
                .unwrap();
            // Blocked, late (not cut by a policy): reported as blocked.
            assert_eq!(
                (o.blocked, o.cut),
                (Some(Blocked::SniMismatch), false),
                "spliced: {spliced}"
            );
            assert!(got.try_recv().is_err(), "the server heard nothing");
            // The name asked for goes through.
            let (mut sandbox, serving) = silent_tunnel(port, p, spliced).await;
            sandbox.read_exact(&mut greeting).await.unwrap();
            sandbox.write_all(&hello(&["localhost"])).await.unwrap();
            assert_eq!(got.recv().await.unwrap(), hello(&["localhost"]));
            drop(sandbox);
            let o = tokio::time::timeout(within, serving)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(o.blocked, None, "{o:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hello_begun_after_the_server_spoke_has_the_heads_time_to_end() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for spliced in [true, false] {
            let (port, mut got) = greeting_upstream().await;
            let (_tx, p) = policy(&[&format!("localhost:{port}")]);
            let (mut sandbox, serving) = silent_tunnel(port, p, spliced).await;
            let mut greeting = [0u8; 11];
            sandbox.read_exact(&mut greeting).await.unwrap();
            // A hello begun, never ended.
            let started = tokio::time::Instant::now();
            sandbox
                .write_all(&hello(&["localhost"])[..3])
                .await
                .unwrap();
            let o = serving.await.unwrap();
            assert_eq!((o.blocked, o.cut), (Some(Blocked::BadRequest), false));
            assert!(started.elapsed() >= HEAD_TIMEOUT, "{:?}", started.elapsed());
            assert!(got.try_recv().is_err(), "the server heard nothing");
        }
    }

    #[tokio::test]
    async fn a_policy_replaced_while_a_hello_is_read_decides_what_goes_upstream() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (port, mut got) = upstream(b"server hello").await;
        let (tx, p) = policy(&[&format!("localhost:{port}")]);
        let g = gate(&["127.0.0.0/8"], vec![]);
        let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
        let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
        sandbox
            .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut ok = [0u8; 39];
        sandbox.read_exact(&mut ok).await.unwrap();
        // Allowed when the CONNECT was read; no longer when the hello comes.
        tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
        sandbox.write_all(&hello(&["localhost"])).await.unwrap();
        let o = tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(o.blocked, Some(Blocked::NotAllowed), "{o:?}");
        // The server's first read ends with nothing (it used to get the
        // hello, before the relay saw the new policy).
        let first = tokio::time::timeout(Duration::from_secs(5), got.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(first.is_empty(), "{} bytes went upstream", first.len());
    }

    #[tokio::test(start_paused = true)]
    async fn slow_and_bloated_heads_are_refused() {
        use tokio::io::AsyncWriteExt;
        let (_tx, p) = policy(&["pypi.org"]);
        let g = gate(&[], vec![]);
        // A CONNECT line that never ends: given up at the head timeout.
        let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
        sandbox
            .write_all(b"CONNECT pypi.org:443 HTTP/1.1\r\nX: ")
            .await
            .unwrap();
        let o = serve_connection(proxy, p.clone(), &g).await;
        assert_eq!(o.blocked, Some(Blocked::BadRequest));
        drop(sandbox);
        // 1 MiB of headers: refused at the bound, not read whole.
        let mut big = b"GET http://pypi.org/ HTTP/1.1\r\n".to_vec();
        big.extend(std::iter::repeat_n(b'a', 1 << 20));
        let (o, back) = exchange(&big, p).await;
        assert_eq!(o.blocked, Some(Blocked::BadRequest));
        assert!(String::from_utf8_lossy(&back).contains("reason=bad_request"));
    }

    #[test]
    fn decisions_name_their_reason() {
        let p = rules(&["pypi.org", "*.pythonhosted.org", "192.0.2.0/24:8080"]);
        assert_eq!(decide(&p, "pypi.org", 443), Ok(()));
        assert_eq!(decide(&p, "files.pythonhosted.org", 443), Ok(()));
        assert_eq!(
            decide(&p, "pythonhosted.org", 443),
            Err(Blocked::NotAllowed)
        );
        assert_eq!(decide(&p, "pypi.org", 22), Err(Blocked::Port));
        assert_eq!(decide(&p, "192.0.2.9", 8080), Ok(()));
        assert_eq!(decide(&p, "192.0.2.9", 443), Err(Blocked::Port));
        assert_eq!(decide(&p, "203.0.113.1", 443), Err(Blocked::NotAllowed));
        assert_eq!(decide(&[], "pypi.org", 443), Err(Blocked::NotAllowed));
    }
}
