//! Plain HTTP through a sandbox's proxy, one request at a time. A
//! connection that carries plain HTTP (a proxy request for an `http://`
//! URL, or a `CONNECT` tunnel whose client speaks HTTP instead of TLS) may
//! carry more requests after its first (keep-alive, pipelining), each of
//! which could name another host than the one the connection was allowed
//! for: at a shared front end, or where the allowed host is itself a proxy,
//! that request would reach wherever it names. So every request is read
//! here before a byte of it goes upstream: its head is parsed and its host
//! checked, its body followed by its framing (refused where the framing is
//! ambiguous: a request smuggled inside another's body is none), and only
//! then is it passed on.
//!
//! A request that asks to change protocols (`Upgrade`, a WebSocket) must be
//! the connection's first; nothing of what follows it goes upstream until
//! the server has answered `101 Switching Protocols`, and then the rest is
//! the new protocol's, passed as it comes. Any other answer closes the
//! connection.

use super::{BadHead, Blocked, MAX_HEAD_BYTES, absolute_target, host_header, parse_message};

/// Most bytes of a chunk-size line or of a trailer section.
const MAX_LINE_BYTES: usize = 4096;

/// How requests name their target on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A proxy connection: every request names its absolute `http://` URL,
    /// sent upstream in origin form.
    Proxy,
    /// A `CONNECT` tunnel: requests in origin form, their `Host` header
    /// naming the tunnel's host.
    Tunnel,
}

/// Where in the stream of requests the client is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// A head, read so far.
    Head(Vec<u8>),
    /// A `Content-Length` body: bytes left.
    Body(u64),
    /// A chunked body.
    Chunked(Chunk),
    /// An `Upgrade` request was sent: nothing more until its answer.
    Upgrading,
    /// Upgraded: the new protocol's bytes pass as they come.
    Raw,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line, read so far.
    Size(Vec<u8>),
    /// Chunk data: bytes left.
    Data(u64),
    /// The CRLF after a chunk's data: bytes of it seen.
    DataEnd(u8),
    /// The trailer section after the last chunk, read so far.
    Trailers(Vec<u8>),
}

/// One connection's requests, checked as they come.
#[derive(Debug)]
pub struct Guard {
    target: Target,
    state: State,
    requests: u64,
}

/// Where a connection was allowed to, and how its requests name it.
#[derive(Debug)]
struct Target {
    mode: Mode,
    host: String,
    port: u16,
}

fn bad(why: impl Into<String>) -> Blocked {
    tracing::debug!(why = %why.into(), "egress: a plain HTTP request refused");
    Blocked::BadRequest
}

impl Guard {
    /// A guard for a connection allowed to `host` (a name, lower-case, or
    /// an IP literal) on `port`.
    pub fn new(mode: Mode, host: &str, port: u16) -> Self {
        Self {
            target: Target {
                mode,
                host: host.to_string(),
                port,
            },
            state: State::Head(Vec::new()),
            requests: 0,
        }
    }

    /// Requests whose heads have been passed.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Whether the guard holds the client back until the server answers an
    /// `Upgrade` request (see [`Guard::answered`]).
    pub fn awaiting_upgrade(&self) -> bool {
        self.state == State::Upgrading
    }

    /// The server's first bytes after an `Upgrade` request: `Some(true)`
    /// when its answer is `101`, `Some(false)` for any other, `None` while
    /// its status line is not whole.
    pub fn answered(&mut self, first: &[u8]) -> Option<bool> {
        let line_end = first.windows(2).position(|w| w == b"\r\n");
        let Some(end) = line_end else {
            return (first.len() > MAX_LINE_BYTES).then_some(false);
        };
        let line = &first[..end];
        let ok = line.starts_with(b"HTTP/1.1 101") || line.starts_with(b"HTTP/1.0 101");
        if ok {
            self.state = State::Raw;
        }
        Some(ok)
    }

    /// Takes what the client sent next, appending to `out` what may go
    /// upstream. An error refuses the connection (nothing more goes).
    /// While [`Guard::awaiting_upgrade`], nothing is taken: the caller
    /// waits for the answer before reading on.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), Blocked> {
        while !input.is_empty() {
            match &mut self.state {
                State::Raw => {
                    out.extend_from_slice(input);
                    return Ok(());
                }
                State::Upgrading => return Err(bad("bytes after an Upgrade request")),
                State::Body(left) => {
                    let n = (*left).min(input.len() as u64) as usize;
                    out.extend_from_slice(&input[..n]);
                    *left -= n as u64;
                    input = &input[n..];
                    if *left == 0 {
                        self.state = State::Head(Vec::new());
                    }
                }
                State::Head(buf) => {
                    // Up to the end of the head, at most its bound.
                    let room = MAX_HEAD_BYTES + 1 - buf.len().min(MAX_HEAD_BYTES + 1);
                    let take = input.len().min(room);
                    let before = buf.len();
                    buf.extend_from_slice(&input[..take]);
                    let message = parse_message(buf).map_err(|BadHead(e)| bad(e))?;
                    let Some(m) = message else {
                        if take < input.len() {
                            return Err(bad("a head over its bound"));
                        }
                        return Ok(());
                    };
                    let used = m.len - before;
                    let (head, next) = self.target.judge(self.requests, &m)?;
                    out.extend_from_slice(&head);
                    input = &input[used..];
                    self.requests += 1;
                    self.state = next;
                }
                State::Chunked(chunk) => {
                    let used = chunked(chunk, input, out)?;
                    input = &input[used..];
                    if matches!(chunk, Chunk::Trailers(t) if t.ends_with(b"\r\n\r\n") || t == b"\r\n")
                    {
                        self.state = State::Head(Vec::new());
                    }
                }
            }
        }
        Ok(())
    }
}

impl Target {
    /// Checks a request's head (after `requests` others); the head as it
    /// goes upstream, and what follows it.
    fn judge(&self, requests: u64, m: &super::Message<'_>) -> Result<(Vec<u8>, State), Blocked> {
        if m.method == "CONNECT" {
            return Err(bad("CONNECT inside a connection"));
        }
        let named = host_header(m).map_err(|BadHead(e)| bad(e))?;
        let wanted_port = |h: &str| -> bool {
            // The header names the host, with its port or the default one.
            let Ok((host, port)) = super::host_port(
                h,
                Some(if self.mode == Mode::Proxy {
                    80
                } else {
                    self.port
                }),
            ) else {
                return false;
            };
            host == self.host && port == self.port
        };
        let path = match self.mode {
            Mode::Proxy => {
                let (host, port, path) = absolute_target(m.target).map_err(|BadHead(e)| bad(e))?;
                if host != self.host || port != self.port {
                    tracing::debug!(%host, port, "egress: a request for another host than its connection's");
                    return Err(Blocked::HostMismatch);
                }
                if named.as_deref().is_some_and(|h| !wanted_port(h)) {
                    tracing::debug!(host = ?named, "egress: a Host header of another host than its connection's");
                    return Err(Blocked::HostMismatch);
                }
                path
            }
            Mode::Tunnel => {
                // Origin form, `*` (OPTIONS), or an absolute URL of the
                // tunnel's host: a server routes by an absolute target
                // before its Host header, so one that does not parse as
                // the tunnel's is refused.
                let origin =
                    m.target.starts_with('/') || (m.target == "*" && m.method == "OPTIONS");
                if !origin {
                    let (host, port, _) =
                        absolute_target(m.target).map_err(|_| Blocked::HostMismatch)?;
                    if host != self.host || port != self.port {
                        return Err(Blocked::HostMismatch);
                    }
                }
                match named.as_deref() {
                    Some(h) if wanted_port(h) => {}
                    Some(_) => return Err(Blocked::HostMismatch),
                    None if m.version == "HTTP/1.0" => {}
                    None => return Err(bad("an HTTP/1.1 request without a Host header")),
                }
                m.target.to_string()
            }
        };
        // The body's framing: one way to read it, or the request is refused.
        let lengths: Vec<&str> = m.values("content-length").collect();
        let codings: Vec<&str> = m.values("transfer-encoding").collect();
        let next = match (lengths.as_slice(), codings.as_slice()) {
            ([], []) => State::Head(Vec::new()),
            ([], [coding]) if coding.eq_ignore_ascii_case("chunked") => {
                if m.version == "HTTP/1.0" {
                    return Err(bad("Transfer-Encoding in an HTTP/1.0 request"));
                }
                State::Chunked(Chunk::Size(Vec::new()))
            }
            ([], _) => return Err(bad("a Transfer-Encoding other than chunked")),
            ([len], []) => {
                if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) || len.len() > 18 {
                    return Err(bad(format!("Content-Length {len:?}")));
                }
                match len.parse::<u64>() {
                    Ok(0) => State::Head(Vec::new()),
                    Ok(n) => State::Body(n),
                    Err(_) => return Err(bad(format!("Content-Length {len:?}"))),
                }
            }
            (_, []) => return Err(bad("more than one Content-Length")),
            (_, _) => return Err(bad("both Content-Length and Transfer-Encoding")),
        };
        let upgrade = m.values("upgrade").next().is_some();
        let next = if upgrade {
            if requests > 0 {
                return Err(bad("Upgrade after the connection's first request"));
            }
            if next != State::Head(Vec::new()) {
                return Err(bad("an Upgrade request with a body"));
            }
            State::Upgrading
        } else {
            next
        };
        // The head as the server takes it: origin form, the header lines
        // as sent (a Host header added where there was none).
        let mut head = format!("{} {path} {}\r\n", m.method, m.version).into_bytes();
        if named.is_none() {
            let host = if self.host.contains(':') {
                format!("[{}]", self.host)
            } else {
                self.host.clone()
            };
            let host = if self.port == 80 {
                host
            } else {
                format!("{host}:{}", self.port)
            };
            head.extend_from_slice(format!("Host: {host}\r\n").as_bytes());
        }
        for (name, value) in &m.headers {
            head.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        Ok((head, next))
    }
}

/// Takes what belongs to a chunked body from `input`, passing it to `out`;
/// returns how many bytes were taken.
fn chunked(chunk: &mut Chunk, input: &[u8], out: &mut Vec<u8>) -> Result<usize, Blocked> {
    let mut at = 0;
    while at < input.len() {
        match chunk {
            Chunk::Size(line) => {
                let b = input[at];
                at += 1;
                out.push(b);
                line.push(b);
                if line.len() > MAX_LINE_BYTES {
                    return Err(bad("a chunk-size line over its bound"));
                }
                if !line.ends_with(b"\r\n") {
                    if b == b'\n' {
                        return Err(bad("a bare LF in a chunk-size line"));
                    }
                    continue;
                }
                let text = &line[..line.len() - 2];
                let size = text.split(|b| *b == b';').next().unwrap_or_default();
                if size.is_empty() || size.len() > 15 || !size.iter().all(u8::is_ascii_hexdigit) {
                    return Err(bad("a chunk size that is not hex digits"));
                }
                if text.iter().any(|b| b.is_ascii_control() && *b != b'\t') {
                    return Err(bad("a control character in a chunk extension"));
                }
                let n = u64::from_str_radix(std::str::from_utf8(size).unwrap_or("x"), 16)
                    .map_err(|_| bad("a chunk size that is not hex digits"))?;
                *chunk = if n == 0 {
                    Chunk::Trailers(Vec::new())
                } else {
                    Chunk::Data(n)
                };
            }
            Chunk::Data(left) => {
                let n = (*left).min((input.len() - at) as u64) as usize;
                out.extend_from_slice(&input[at..at + n]);
                at += n;
                *left -= n as u64;
                if *left == 0 {
                    *chunk = Chunk::DataEnd(0);
                }
            }
            Chunk::DataEnd(seen) => {
                let want = if *seen == 0 { b'\r' } else { b'\n' };
                if input[at] != want {
                    return Err(bad("chunk data longer than its size"));
                }
                out.push(input[at]);
                at += 1;
                *seen += 1;
                if *seen == 2 {
                    *chunk = Chunk::Size(Vec::new());
                }
            }
            Chunk::Trailers(t) => {
                let b = input[at];
                at += 1;
                out.push(b);
                t.push(b);
                if t == b"\r\n" || t.ends_with(b"\r\n\r\n") {
                    if t.iter()
                        .any(|b| b.is_ascii_control() && !matches!(b, b'\r' | b'\n' | b'\t'))
                    {
                        return Err(bad("a control character in a trailer"));
                    }
                    return Ok(at);
                }
                if t.len() > MAX_LINE_BYTES {
                    return Err(bad("trailers over their bound"));
                }
                if b == b'\n' && !t.ends_with(b"\r\n") {
                    return Err(bad("a bare LF in a trailer"));
                }
            }
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(g: &mut Guard, input: &[u8]) -> Result<Vec<u8>, Blocked> {
        let mut out = Vec::new();
        g.feed(input, &mut out)?;
        Ok(out)
    }

    #[test]
    fn every_request_of_a_proxy_connection_is_checked_and_rewritten() {
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let two = b"GET http://example.com/a HTTP/1.1\r\nHost: example.com\r\n\r\n\
                    POST http://example.com/b HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
        let out = passed(&mut g, two).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /a HTTP/1.1\r\nHost: example.com\r\n\r\n\
             POST /b HTTP/1.1\r\nHost: example.com\r\nContent-Length: 3\r\n\r\nabc"
        );
        assert_eq!(g.requests(), 2);
        // A third, pipelined, for another host: refused, nothing of it passed.
        let other = b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n";
        assert_eq!(passed(&mut g, other), Err(Blocked::HostMismatch));
        // The URL's host with another Host header.
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let fronted = b"GET http://example.com/ HTTP/1.1\r\nHost: other.test\r\n\r\n";
        assert_eq!(passed(&mut g, fronted), Err(Blocked::HostMismatch));
    }

    #[test]
    fn a_request_smuggled_in_a_body_is_read_as_the_body_and_ambiguous_framing_refused() {
        // The body is the body: what looks like a request inside it passes
        // as body bytes, and the next head is read where the body ends.
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let body = b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n";
        let mut req = format!(
            "POST http://example.com/ HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        assert!(passed(&mut g, &req).is_ok());
        assert_eq!(g.requests(), 1);
        for framing in [
            "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
            "Content-Length: 5\r\nContent-Length: 6\r\n",
            "Content-Length: 5\r\nContent-Length: 5\r\n",
            "Transfer-Encoding: gzip, chunked\r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            "Content-Length: +5\r\n",
            "Content-Length: 0x5\r\n",
        ] {
            let mut g = Guard::new(Mode::Proxy, "example.com", 80);
            let req = format!("POST http://example.com/ HTTP/1.1\r\n{framing}\r\n");
            assert_eq!(
                passed(&mut g, req.as_bytes()),
                Err(Blocked::BadRequest),
                "{framing:?}"
            );
        }
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let req = b"POST http://example.com/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(passed(&mut g, req), Err(Blocked::BadRequest));
    }

    #[test]
    fn chunked_bodies_are_followed_byte_by_byte_to_their_end() {
        let whole = b"POST http://example.com/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
                      5;ext=1\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n\
                      GET http://example.com/next HTTP/1.1\r\n\r\n";
        // Whole, and a byte at a time: the same.
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let at_once = passed(&mut g, whole).unwrap();
        assert_eq!(g.requests(), 2);
        let mut g = Guard::new(Mode::Proxy, "example.com", 80);
        let mut bytewise = Vec::new();
        for b in whole.iter() {
            g.feed(std::slice::from_ref(b), &mut bytewise).unwrap();
        }
        assert_eq!(at_once, bytewise);
        assert_eq!(g.requests(), 2);
        // A chunk longer than its size, a size that is not hex, a bare LF.
        for bad_body in ["3\r\nhello\r\n0\r\n\r\n", "zz\r\nhi\r\n", "5\nhello\r\n"] {
            let mut g = Guard::new(Mode::Proxy, "example.com", 80);
            let req = format!(
                "POST http://example.com/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{bad_body}"
            );
            assert_eq!(
                passed(&mut g, req.as_bytes()),
                Err(Blocked::BadRequest),
                "{bad_body:?}"
            );
        }
    }

    #[test]
    fn a_tunnel_that_speaks_http_names_its_host_in_every_request() {
        let mut g = Guard::new(Mode::Tunnel, "example.com", 8080);
        let ok = b"GET / HTTP/1.1\r\nHost: example.com:8080\r\n\r\nGET /b HTTP/1.1\r\nHost: Example.com:8080\r\n\r\n";
        assert_eq!(passed(&mut g, ok).unwrap(), ok.to_vec());
        assert_eq!(
            passed(&mut g, b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n"),
            Err(Blocked::HostMismatch)
        );
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        assert!(passed(&mut g, b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n").is_ok());
        assert_eq!(
            passed(&mut g, b"GET / HTTP/1.1\r\n\r\n"),
            Err(Blocked::BadRequest)
        );
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        assert_eq!(
            passed(
                &mut g,
                b"GET http://other.test/ HTTP/1.1\r\nHost: example.com\r\n\r\n"
            ),
            Err(Blocked::HostMismatch)
        );
    }

    #[test]
    fn a_tunnels_absolute_target_must_parse_as_its_own_host() {
        for target in [
            "http://x@evil.test/",
            "https://evil.test/",
            "HTTP://evil.test/",
            "http://evil.test:0/",
            "http://evil.test/",
            "evil.test:80",
        ] {
            let mut g = Guard::new(Mode::Tunnel, "pkg.test", 80);
            let req = format!("GET {target} HTTP/1.1\r\nHost: pkg.test\r\n\r\n");
            assert_eq!(
                passed(&mut g, req.as_bytes()),
                Err(Blocked::HostMismatch),
                "{target}"
            );
        }
        let mut g = Guard::new(Mode::Tunnel, "pkg.test", 80);
        let ok = b"GET http://pkg.test/a HTTP/1.1\r\nHost: pkg.test\r\n\r\nOPTIONS * HTTP/1.1\r\nHost: pkg.test\r\n\r\n";
        assert!(passed(&mut g, ok).is_ok());
        assert_eq!(g.requests(), 2);
    }

    #[test]
    fn an_upgrade_holds_the_rest_until_the_server_says_101() {
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        let up = b"GET /ws HTTP/1.1\r\nHost: example.com\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        assert!(passed(&mut g, up).is_ok());
        assert!(g.awaiting_upgrade());
        assert_eq!(g.answered(b"HTTP/1.1 10"), None);
        assert_eq!(
            g.answered(b"HTTP/1.1 101 Switching Protocols\r\n"),
            Some(true)
        );
        assert_eq!(passed(&mut g, b"\x81\x05frame").unwrap(), b"\x81\x05frame");
        // Refused: another answer, or an upgrade after the first request.
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        assert!(passed(&mut g, up).is_ok());
        assert_eq!(g.answered(b"HTTP/1.1 400 Bad Request\r\n"), Some(false));
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        let mut two = b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n".to_vec();
        two.extend_from_slice(up);
        assert_eq!(passed(&mut g, &two), Err(Blocked::BadRequest));
        // Bytes sent before the answer are not taken.
        let mut g = Guard::new(Mode::Tunnel, "example.com", 80);
        let mut early = up.to_vec();
        early.extend_from_slice(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n");
        assert_eq!(passed(&mut g, &early), Err(Blocked::BadRequest));
    }
}
