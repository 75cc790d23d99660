//! Reading what a proxy request asks for: an HTTP request's head (request
//! line and headers, bounded), its target and its `Host`.

use super::*;

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

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
