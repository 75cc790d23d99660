//! A connection's admission: its first bytes read (within bounds and a
//! time), what it asks for decided, and the refusal written when it is not
//! allowed.

use super::*;

/// How long a sandbox may take to send a request's head, and a tunnel's
/// TLS ClientHello once its first byte has come (a tunnel whose client
/// says nothing at first is connected: see [`SERVER_FIRST_WAIT`]).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a relayed connection may carry nothing either way.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) fn refusal(reason: Blocked) -> Vec<u8> {
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
    pub(crate) client: S,
    pub(crate) upstream: tokio::net::TcpStream,
    pub(crate) outcome: Outcome,
    /// A tunnel whose client had not spoken when it was connected (the
    /// server speaks first): the relay checks the client's first bytes, as
    /// [`admit`] does, before any of them goes upstream.
    pub(crate) hello_pending: bool,
    /// A connection that carries plain HTTP: each of its requests is
    /// checked before it goes upstream.
    pub(crate) http: Option<http::Guard>,
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
pub(crate) enum Verdict {
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
pub(crate) fn http_request_line(first: &[u8]) -> Option<bool> {
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
pub(crate) fn hello_verdict(first: &[u8], host: &str) -> Verdict {
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
