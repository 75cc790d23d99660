//! The port listener: HTTP/1.1 (with upgrades: WebSockets and any other
//! protocol switched to) and HTTP/2 by prior knowledge, to sandboxes'
//! exposed ports (whose servers are spoken to in HTTP/1.1). Each request is
//! routed by its Host (`{port}-{id}.{domain}`) or its path
//! (`/p/{id}/{port}/...`), checked against the port's exposure, stripped
//! of what only the listener may say (its credentials, `X-Corral-Verified-*`),
//! and carried to the sandbox's server on a connection of its way in, with
//! the Host and Origin the client sent. An upgraded connection is carried
//! both ways until either side ends or the exposure is revoked; so is a
//! raw TCP tunnel, asked for with `CONNECT {sandbox}:{port}`.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use corral_proto::SandboxId;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{Access, Exposure, Link, Refusal};
use crate::sandbox::Sandbox;
use crate::worker::PortTarget;
use crate::worker::Worker;

type Body = BoxBody<Bytes, hyper::Error>;

/// The cookie a signed URL's first use leaves (its value: the token).
pub const COOKIE: &str = "corral_port_token";
/// Headers only the listener says (a client's are dropped).
const VERIFIED_PREFIX: &str = "x-corral-verified-";
/// How long a client has to send a request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an open upgraded connection counts as its sandbox's use.
const TOUCH_EVERY: Duration = Duration::from_secs(10);
/// Most bytes of a request's head.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// Most requests at once on one HTTP/2 connection.
const MAX_STREAMS: u32 = 256;

/// Serves `listener` until `shutdown`.
pub async fn serve(worker: Worker, listener: TcpListener, shutdown: CancellationToken) {
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => break,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    debug!(error = %e, "the port listener could not accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let worker = worker.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let upstream = std::sync::Arc::new(Upstream::default());
            let service = hyper::service::service_fn(move |req| {
                let worker = worker.clone();
                let upstream = upstream.clone();
                async move {
                    let mut reached = None;
                    let answer = handle(&worker, req, &upstream, &mut reached).await;
                    let refused = answer.extensions().get::<Refusal>().copied();
                    worker
                        .metrics()
                        .ports_answered(refused.map_or("carried", Refusal::reason));
                    // Told to the sandbox it reached, as its event.
                    if let (Some(r), Some((sandbox, port))) = (refused, reached) {
                        sandbox.ports().tell_refused(port, r.reason());
                    }
                    Ok::<_, Infallible>(answer)
                }
            });
            // HTTP/1.1, or HTTP/2 by prior knowledge (h2c: what a proxy
            // that ends TLS in front of the listener may speak to it).
            let mut builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_header_list_size(MAX_HEAD_BYTES as u32)
                .max_concurrent_streams(MAX_STREAMS);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r {
                    debug!(error = %e, "a port connection ended");
                },
                () = stop.cancelled() => {}
            }
        });
    }
    connections.close();
}

fn refuse(r: Refusal) -> Response<Body> {
    let body = serde_json::json!({
        "error": { "reason": r.reason(), "message": r.message() }
    });
    let mut answer = Response::builder()
        .status(r.status())
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-store");
    if r == Refusal::SandboxWaking {
        answer = answer.header(header::RETRY_AFTER, "1");
    }
    let mut answer = answer
        .body(full(body.to_string()))
        .unwrap_or_else(|_| Response::new(full("")));
    // Said to the worker's metrics by whoever answered.
    answer.extensions_mut().insert(r);
    answer
}

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into()).map_err(|n| match n {}).boxed()
}

/// Where a request goes: the sandbox, its port, the path and query the
/// server is to see, and the prefix the listener took off (path routing).
#[derive(Debug, PartialEq, Eq)]
struct Route {
    sandbox: SandboxId,
    port: u16,
    path_and_query: String,
    prefix: Option<String>,
}

fn route(host: Option<&str>, domain: Option<&str>, path_and_query: &str) -> Option<Route> {
    if let (Some(host), Some(domain)) = (host, domain) {
        let name = host.rsplit_once(':').map_or(host, |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        });
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        if name == domain {
            return None;
        }
        if let Some(label) = name.strip_suffix(&format!(".{domain}")) {
            // A host of the domain is routed by its name alone: a path
            // there never names another sandbox (its pages would take it
            // for their own origin).
            if label.contains('.') {
                return None;
            }
            let (port, id) = label.split_once('-')?;
            return Some(Route {
                sandbox: SandboxId::new(id.to_string()).ok()?,
                port: port.parse().ok().filter(|p| *p > 0)?,
                path_and_query: path_and_query.to_string(),
                prefix: None,
            });
        }
    }
    let rest = path_and_query.strip_prefix("/p/")?;
    let (id, rest) = rest.split_once('/')?;
    let (port, rest) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let path = if rest.starts_with('/') {
        rest.to_string()
    } else {
        format!("/{rest}")
    };
    Some(Route {
        sandbox: SandboxId::new(id.to_string()).ok()?,
        port: port.parse().ok().filter(|p| *p > 0)?,
        prefix: Some(format!("/p/{id}/{port}")),
        path_and_query: path,
    })
}

/// Where the credential that admitted a request came from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Used {
    Bearer,
    /// A `token` of the query (its value).
    Query(String),
    Cookie,
}

/// The credentials a request brings: its bearers (the scheme in any
/// case, every `Authorization` header), the `token`s of its query, and the
/// listener's cookies (every one of that name: a sibling host may have set
/// one for the whole domain).
#[derive(Debug, Default, PartialEq, Eq)]
struct Creds {
    bearers: Vec<String>,
    queries: Vec<String>,
    cookies: Vec<String>,
}

fn bearer_of(v: &HeaderValue) -> Option<String> {
    let v = v.to_str().ok()?.trim();
    let (scheme, rest) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim().to_string())
}

fn credentials(headers: &HeaderMap, query: Option<&str>) -> Creds {
    Creds {
        bearers: headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(bearer_of)
            .collect(),
        queries: query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter_map(|kv| kv.strip_prefix("token=").map(str::to_string))
            .collect(),
        cookies: cookies(headers)
            .filter(|(k, _)| *k == COOKIE)
            .map(|(_, v)| v.to_string())
            .collect(),
    }
}

fn cookies(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
}

/// Whether `t` has the form of a token this listener makes
/// (`{expiry}.{nonce}.{mac}`): such a value is the listener's, whoever it
/// was made for, and never reaches a server.
fn looks_signed(t: &str) -> bool {
    let mut parts = t.split('.');
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(e), Some(n), Some(m), None)
            if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) && hex(n, 24) && hex(m, 64)
    )
}

fn constant_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether the request may reach the port: the access it was let in by,
/// and where the credential that did it came from (`None`: none was
/// needed). The worker's own token counts as a bearer only (never in a
/// URL or a cookie, where pages could read or keep it); a signed token in
/// the bearer, the query or (host routing only) the cookie. Each is tried
/// in turn, so a server's own `token` in a query passes through when
/// another credential admits the request; refused, the first one's
/// refusal is said.
fn admit(
    worker: &Worker,
    route: &Route,
    exposure: Option<&Exposure>,
    creds: &Creds,
) -> Result<(Access, Option<Used>), Refusal> {
    let owner = |t: &str| worker.ports_token().is_some_and(|w| constant_eq(t, w));
    let cookies: &[String] = if route.prefix.is_none() {
        &creds.cookies
    } else {
        &[]
    };
    let verify = |t: &str, e: Option<&Exposure>| {
        worker
            .ports_key()
            .verify(t, &route.sandbox, route.port, e, worker.now_ms())
    };
    let Some(e) = exposure else {
        // A genuine token of a revoked exposure says so.
        if let Some(t) = creds
            .bearers
            .iter()
            .chain(&creds.queries)
            .find(|t| !owner(t))
        {
            verify(t, None)?;
        }
        return Err(Refusal::NotExposed);
    };
    if e.access == Access::Public {
        return Ok((Access::Public, None));
    }
    if worker.ports_token().is_none() {
        return Ok((Access::Private, None));
    }
    if creds.bearers.iter().any(|t| owner(t)) {
        return Ok((Access::Private, Some(Used::Bearer)));
    }
    let signed = creds
        .bearers
        .iter()
        .map(|t| (t, Used::Bearer))
        .chain(creds.queries.iter().map(|t| (t, Used::Query(t.clone()))))
        .chain(cookies.iter().map(|t| (t, Used::Cookie)));
    let mut first = None;
    for (t, used) in signed {
        let checked = if owner(t) || e.access != Access::Signed {
            // The worker's token where it must not be, or a port that
            // takes no signed token.
            Err(Refusal::InvalidToken)
        } else {
            verify(t, Some(e))
        };
        match checked {
            Ok(()) => return Ok((Access::Signed, Some(used))),
            Err(r) => {
                first.get_or_insert(r);
            }
        }
    }
    Err(first.unwrap_or(Refusal::Unauthenticated))
}

/// The query without what is the listener's: a `token` that is the
/// worker's or has the form of a signed one.
fn query_without_ours(query: &str, worker_token: Option<&str>) -> String {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .filter(|kv| match kv.strip_prefix("token=") {
            Some(t) => !(looks_signed(t) || worker_token.is_some_and(|w| constant_eq(t, w))),
            None => true,
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// `path?query` with the listener's tokens taken out of the query.
fn path_without_ours(path_and_query: &str, worker_token: Option<&str>) -> String {
    match path_and_query.split_once('?') {
        Some((path, q)) => {
            let rest = query_without_ours(q, worker_token);
            if rest.is_empty() {
                path.to_string()
            } else {
                format!("{path}?{rest}")
            }
        }
        None => path_and_query.to_string(),
    }
}

/// A path said back in a `Location`: one leading slash, whatever the
/// request had (`//host/...` or `/\host` would name another site).
fn local_location(path: &str) -> String {
    format!("/{}", path.trim_start_matches(['/', '\\']))
}

/// Most bytes of a request's header fields, names and values.
const MAX_HEADER_BYTES: usize = 64 << 10;

/// What a client connection's requests to one exposed port go on: one
/// connection to the sandbox's server, kept while the client sends more
/// (for the same sandbox, port and exposure), as a browser's keep-alive
/// expects.
#[derive(Default)]
struct Upstream(tokio::sync::Mutex<Option<(UpstreamKey, Server)>>);

type Sender = hyper::client::conn::http1::SendRequest<Body>;
/// A connection to a sandbox's server: what sends on it, and its link.
type Server = (Sender, std::sync::Arc<Link>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct UpstreamKey {
    sandbox: SandboxId,
    port: u16,
    nonce: String,
    /// The caller's access (the owner's, private, counts against the
    /// owner's share of the sandbox's connections).
    access: Access,
}

/// Answers `req`; `reached`: the running sandbox and port it reached, if
/// it got that far (a refusal from there on is the sandbox's event).
async fn handle(
    worker: &Worker,
    req: Request<Incoming>,
    upstream: &Upstream,
    reached: &mut Option<(Sandbox, u16)>,
) -> Response<Body> {
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > MAX_HEADER_BYTES {
        return refuse(Refusal::HeadTooLarge);
    }
    if req.method() == http::Method::CONNECT {
        return tunnel(worker, req, reached).await;
    }
    // HTTP/2 names the host in the request's authority.
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()));
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let Some(route) = route(host.as_deref(), worker.ports_domain(), &pq) else {
        return refuse(Refusal::BadRoute);
    };
    let query = route.path_and_query.split_once('?').map(|(_, q)| q);
    let creds = credentials(req.headers(), query);
    let (sandbox, exposure) = match reach(worker, &route, &creds).await {
        Ok(found) => found,
        Err(r) => return refuse(r),
    };
    *reached = Some((sandbox.clone(), route.port));
    let (access, used) = match admit(worker, &route, exposure.as_ref(), &creds) {
        Ok(a) => a,
        Err(r) => return refuse(r),
    };
    let Some(exposure) = exposure else {
        return refuse(Refusal::NotExposed);
    };
    // A page of another origin (a sibling sandbox's, say) cannot have the
    // browser change anything here with the cookie it holds.
    if used == Some(Used::Cookie)
        && !matches!(
            *req.method(),
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        )
        && !same_origin(req.headers(), host.as_deref())
    {
        return refuse(Refusal::CrossOrigin);
    }
    let worker_token = worker.ports_token();
    // A token in the URL, by Host: kept as a cookie of this host, and the
    // URL said again without it, so it leaves no trace in histories and
    // Referer headers. By path no cookie is set: every sandbox shares that
    // origin, so a browser session there would be every sandbox's.
    if let Some(Used::Query(token)) = &used
        && route.prefix.is_none()
    {
        let location = local_location(&path_without_ours(&route.path_and_query, worker_token));
        let max_age = exposure
            .expires_at_ms
            .map(|t| (t - worker.now_ms()).max(0) / 1000);
        let mut cookie = format!("{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax");
        if let Some(a) = max_age {
            cookie.push_str(&format!("; Max-Age={a}"));
        }
        if worker.ports_secure() {
            cookie.push_str("; Secure");
        }
        return Response::builder()
            .status(StatusCode::SEE_OTHER)
            .header(header::LOCATION, location)
            .header(header::SET_COOKIE, cookie)
            .header(header::CACHE_CONTROL, "no-store")
            .body(full(""))
            .unwrap_or_else(|_| refuse(Refusal::BadRoute));
    }
    sandbox.touch();
    let (mut parts, body) = req.into_parts();
    strip(&mut parts.headers, worker_token);
    // The sandbox's server is spoken to in HTTP/1.1, whatever the client
    // spoke: an HTTP/2 request's authority becomes its Host.
    if parts.version != http::Version::HTTP_11 && parts.version != http::Version::HTTP_10 {
        parts.version = http::Version::HTTP_11;
        if !parts.headers.contains_key(header::HOST)
            && let Some(h) = host.as_deref().and_then(|h| HeaderValue::from_str(h).ok())
        {
            parts.headers.insert(header::HOST, h);
        }
    }
    if let Ok(v) = HeaderValue::from_str(access.as_str()) {
        parts.headers.insert("x-corral-verified-access", v);
    }
    if let Some(p) = route
        .prefix
        .as_deref()
        .and_then(|p| HeaderValue::from_str(p).ok())
    {
        parts.headers.insert("x-forwarded-prefix", p);
    }
    match path_without_ours(&route.path_and_query, worker_token).parse() {
        Ok(uri) => parts.uri = uri,
        Err(_) => return refuse(Refusal::BadRoute),
    }
    // Trailers are headers too: the listener's are dropped there as well.
    let body = body
        .map_frame(|mut f| {
            if let Some(t) = f.trailers_mut() {
                strip_ours(t);
            }
            f
        })
        .boxed();
    let ends = Ends {
        expires: expiry(worker, &exposure),
        revoked: exposure.revoked,
        idle: worker.ports_idle_timeout(),
    };
    let req = Request::from_parts(parts, body);
    let key = UpstreamKey {
        sandbox: route.sandbox.clone(),
        port: route.port,
        nonce: exposure.nonce.clone(),
        access,
    };
    forward(worker, &sandbox, (key, upstream), req, ends).await
}

/// A raw TCP tunnel to an exposed port: `CONNECT {sandbox}:{port}`, the
/// credential (for a private or signed port) a bearer in
/// `Proxy-Authorization` or `Authorization` (never a cookie or a query: a
/// tunnel is no browser's). Answered `200` once the sandbox's server took
/// the connection, then carried both ways as an upgrade is, so any TCP
/// protocol (a database's, SSH) reaches the port through a client that
/// speaks HTTP proxies' CONNECT (`corral port forward` is one).
async fn tunnel(
    worker: &Worker,
    mut req: Request<Incoming>,
    reached: &mut Option<(Sandbox, u16)>,
) -> Response<Body> {
    let Some((sandbox_id, port)) = connect_target(req.uri()) else {
        return refuse(Refusal::BadRoute);
    };
    let route = Route {
        sandbox: sandbox_id,
        port,
        path_and_query: String::new(),
        prefix: None,
    };
    let mut creds = credentials(req.headers(), None);
    creds.cookies.clear();
    creds.bearers.extend(
        req.headers()
            .get_all(header::PROXY_AUTHORIZATION)
            .iter()
            .filter_map(bearer_of),
    );
    let (sandbox, exposure) = match reach(worker, &route, &creds).await {
        Ok(found) => found,
        Err(r) => return refuse(r),
    };
    *reached = Some((sandbox.clone(), port));
    let access = match admit(worker, &route, exposure.as_ref(), &creds) {
        Ok((access, _)) => access,
        Err(r) => return refuse(r),
    };
    let Some(exposure) = exposure else {
        return refuse(Refusal::NotExposed);
    };
    let server = match worker.dial_port(&sandbox, port, access).await {
        Ok(s) => s,
        Err(r) => return refuse(r),
    };
    sandbox.touch();
    let client = hyper::upgrade::on(&mut req);
    let ends = Ends {
        revoked: exposure.revoked.clone(),
        expires: expiry(worker, &exposure),
        idle: worker.ports_idle_timeout(),
    };
    tokio::spawn(async move {
        let Some(link) = server.link() else { return };
        match client.await {
            Ok(client) => carry(TokioIo::new(client), server, &link, &sandbox, &ends).await,
            Err(e) => {
                link.end("ended");
                debug!(error = %e, "a tunnel's client went before it was carried");
            }
        }
    });
    Response::new(full(""))
}

/// The running sandbox a request goes to, and its port's exposure in
/// force (`None`: not exposed). A checkpointed sandbox whose port wakes it
/// is restored first, for a request whose credential the port takes.
async fn reach(
    worker: &Worker,
    route: &Route,
    creds: &Creds,
) -> Result<(Sandbox, Option<Exposure>), Refusal> {
    match worker.port_route(&route.sandbox, route.port).await? {
        PortTarget::Running(s, e) => Ok((*s, e)),
        PortTarget::Asleep(e) => {
            admit(worker, route, Some(&e), creds)?;
            worker.wake(&route.sandbox).await?;
            match worker.port_route(&route.sandbox, route.port).await? {
                PortTarget::Running(s, e) => Ok((*s, e)),
                PortTarget::Asleep(_) => Err(Refusal::SandboxWaking),
            }
        }
    }
}

/// The sandbox and port a `CONNECT` names (`{sandbox}:{port}`).
fn connect_target(uri: &http::Uri) -> Option<(SandboxId, u16)> {
    let authority = uri.authority()?;
    let port = authority.port_u16().filter(|p| *p > 0)?;
    Some((SandboxId::new(authority.host().to_string()).ok()?, port))
}

/// When an exposure ends, on the runtime's clock.
fn expiry(worker: &Worker, exposure: &Exposure) -> Option<tokio::time::Instant> {
    exposure.expires_at_ms.map(|t| {
        tokio::time::Instant::now()
            + Duration::from_millis(u64::try_from(t - worker.now_ms()).unwrap_or(0))
    })
}

/// What ends a connection to a sandbox's port besides its two sides: its
/// exposure's revocation or end, and a time with nothing moved.
#[derive(Clone)]
struct Ends {
    revoked: CancellationToken,
    expires: Option<tokio::time::Instant>,
    idle: Option<Duration>,
}

/// Carries bytes both ways between a client and a sandbox's server until
/// either side ends, or [`cut`] says why not to go on; traffic keeps the
/// sandbox from being idle.
async fn carry<C, S>(mut client: C, mut server: S, link: &Link, sandbox: &Sandbox, ends: &Ends)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let why = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => "ended",
        why = cut(link, || sandbox.touch(), sandbox.closed(), ends) => why,
    };
    link.end(why);
}

/// Resolves, with why, when a connection to a sandbox's port is to be cut:
/// the sandbox goes, the exposure is revoked or ends, or nothing moved
/// either way for the idle timeout. Meanwhile, each time `link` has moved
/// something, `touch` (the sandbox was used).
async fn cut(
    link: &Link,
    touch: impl Fn(),
    closed: &CancellationToken,
    ends: &Ends,
) -> &'static str {
    let expired = async {
        match ends.expires {
            Some(t) => tokio::time::sleep_until(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expired);
    // Looked at often enough to cut an idle one within a quarter of its
    // timeout past it.
    let every = ends.idle.map_or(TOUCH_EVERY, |i| TOUCH_EVERY.min(i / 4));
    let mut looks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut seen, mut since) = (link.moved(), tokio::time::Instant::now());
    loop {
        tokio::select! {
            () = closed.cancelled() => return "sandbox_gone",
            () = ends.revoked.cancelled() => return "revoked",
            () = &mut expired => return "expired",
            now = looks.tick() => {
                let moved = link.moved();
                if moved != seen {
                    (seen, since) = (moved, now);
                    touch();
                } else if ends.idle.is_some_and(|i| now.duration_since(since) >= i) {
                    return "idle";
                }
            }
        }
    }
}

/// Whether the request's Origin, if it names one, is its own host's.
fn same_origin(headers: &HeaderMap, host: Option<&str>) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) else {
        return true;
    };
    let named = origin.split_once("://").map_or(origin, |(_, h)| h);
    host.is_some_and(|h| named.eq_ignore_ascii_case(h))
}

/// Drops what only the listener may say (`X-Corral-Verified-*`, and the
/// forwarding headers it sets).
fn strip_ours(headers: &mut HeaderMap) {
    let ours: Vec<header::HeaderName> = headers
        .keys()
        .filter(|k| {
            k.as_str().starts_with(VERIFIED_PREFIX)
                || matches!(k.as_str(), "x-forwarded-prefix" | "x-forwarded-proto")
        })
        .cloned()
        .collect();
    for k in ours {
        headers.remove(k);
    }
}

/// Drops what only the listener may say, and every credential of the
/// listener's: bearers that are the worker's token or have a signed
/// token's form, and its cookies (the server's own stay).
fn strip(headers: &mut HeaderMap, worker_token: Option<&str>) {
    strip_ours(headers);
    // A proxy's credential is the proxy's (this listener's), never the
    // server's: whatever it holds.
    headers.remove(header::PROXY_AUTHORIZATION);
    let kept: Vec<HeaderValue> = headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .filter(|v| {
            !bearer_of(v).is_some_and(|t| {
                looks_signed(&t) || worker_token.is_some_and(|w| constant_eq(&t, w))
            })
        })
        .cloned()
        .collect();
    headers.remove(header::AUTHORIZATION);
    for v in kept {
        headers.append(header::AUTHORIZATION, v);
    }
    let theirs: Vec<String> = cookies(headers)
        .filter(|(k, _)| *k != COOKIE)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    headers.remove(header::COOKIE);
    if !theirs.is_empty()
        && let Ok(v) = HeaderValue::from_str(&theirs.join("; "))
    {
        headers.insert(header::COOKIE, v);
    }
}

/// Carries `req` to `port` of `sandbox` and its answer back; an upgrade
/// is carried both ways until one side ends or `revoked`.
async fn forward(
    worker: &Worker,
    sandbox: &Sandbox,
    (key, upstream): (UpstreamKey, &Upstream),
    mut req: Request<Body>,
    ends: Ends,
) -> Response<Body> {
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .is_some()
        .then(|| hyper::upgrade::on(&mut req));
    // The client's connection to this port, if it is still there and free.
    let mut kept = upstream.0.lock().await;
    let cached = match kept.take() {
        Some((k, (mut sender, link))) if k == key && !sender.is_closed() => {
            sender.ready().await.ok().map(|()| (sender, link))
        }
        _ => None,
    };
    let (mut sender, link) = match cached {
        Some(s) => s,
        None => {
            let stream = match worker.dial_port(sandbox, key.port, key.access).await {
                Ok(s) => s,
                Err(r) => return refuse(r),
            };
            let Some(link) = stream.link() else {
                return refuse(Refusal::SandboxUnavailable);
            };
            let (sender, conn) =
                match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                    Ok(c) => c,
                    Err(_) => {
                        link.end("ended");
                        return refuse(Refusal::PortNotListening);
                    }
                };
            let (held, ends) = (link.clone(), ends.clone());
            let sandbox = sandbox.clone();
            tokio::spawn(async move {
                // Requests touch the sandbox themselves.
                // Ended of itself (or upgraded: then its carrier says why
                // it ends), or cut.
                let why = tokio::select! {
                    r = conn.with_upgrades() => {
                        if let Err(e) = r {
                            debug!(error = %e, "a connection to a sandbox's port ended");
                        }
                        None
                    }
                    why = cut(&held, || {}, sandbox.closed(), &ends) => Some(why),
                };
                if let Some(why) = why {
                    held.end(why);
                }
            });
            (sender, link)
        }
    };
    let mut resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            debug!(error = %e, "a sandbox's server did not answer");
            return refuse(Refusal::PortNotListening);
        }
    };
    // Kept for the client's next request, unless this one switched protocols.
    if upgrade.is_none() {
        *kept = Some((key, (sender, link.clone())));
    }
    drop(kept);
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_side) = upgrade
    {
        let server_side = hyper::upgrade::on(&mut resp);
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            let (Ok(client), Ok(server)) = (client_side.await, server_side.await) else {
                return;
            };
            carry(
                TokioIo::new(client),
                TokioIo::new(server),
                &link,
                &sandbox,
                &ends,
            )
            .await;
        });
    }
    resp.map(|b| b.boxed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_host_where_a_domain_is_set_else_by_path() {
        let r = route(
            Some("8888-abc.ports.test:9000"),
            Some("ports.test"),
            "/x?y=1",
        )
        .unwrap();
        assert_eq!(
            (
                r.sandbox.as_str(),
                r.port,
                r.path_and_query.as_str(),
                r.prefix
            ),
            ("abc", 8888, "/x?y=1", None)
        );
        let r = route(
            Some("127.0.0.1:9000"),
            Some("ports.test"),
            "/p/abc/3000/a/b?c",
        )
        .unwrap();
        assert_eq!(
            (r.sandbox.as_str(), r.port, r.path_and_query.as_str()),
            ("abc", 3000, "/a/b?c")
        );
        assert_eq!(r.prefix.as_deref(), Some("/p/abc/3000"));
        let r = route(None, None, "/p/abc/3000?q").unwrap();
        assert_eq!(r.path_and_query, "/?q");
        for bad in [
            "/",
            "/p/abc",
            "/p/abc/0/",
            "/p/abc/70000/",
            "/p/abc/x/",
            "/p//80/",
        ] {
            assert!(route(None, None, bad).is_none(), "{bad}");
        }
        // A name of another domain, or one label too deep, routes by path.
        assert!(route(Some("8888-abc.evil.test"), Some("ports.test"), "/").is_none());
        assert!(route(Some("a.8888-abc.ports.test"), Some("ports.test"), "/").is_none());
    }

    #[test]
    fn the_listeners_credentials_and_verified_headers_never_reach_the_server() {
        let signed = format!("1796625523589.{}.{}", "a".repeat(24), "b".repeat(64));
        let mut h = HeaderMap::new();
        h.append(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer the-workers-token"),
        );
        h.append(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {signed}")).unwrap(),
        );
        h.append(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic dXNlcg=="),
        );
        h.insert(
            "x-corral-verified-access",
            HeaderValue::from_static("public"),
        );
        h.insert("X-Corral-Verified-User", HeaderValue::from_static("admin"));
        h.insert("x-forwarded-prefix", HeaderValue::from_static("/evil"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.insert(
            header::PROXY_AUTHORIZATION,
            HeaderValue::from_static("Bearer the-workers-token"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; corral_port_token=tok; b=2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("corral_port_token=two"),
        );
        let creds = credentials(&h, Some("a=1&token=t&token=u"));
        assert_eq!(
            creds,
            Creds {
                bearers: vec!["the-workers-token".into(), signed.clone()],
                queries: vec!["t".into(), "u".into()],
                cookies: vec!["tok".into(), "two".into()],
            }
        );
        strip(&mut h, Some("the-workers-token"));
        // The server's own Authorization stays; the listener's go.
        let auth: Vec<_> = h.get_all(header::AUTHORIZATION).iter().collect();
        assert_eq!(auth, vec!["Basic dXNlcg=="]);
        assert!(h.keys().all(|k| !k.as_str().starts_with(VERIFIED_PREFIX)));
        assert!(h.get("x-forwarded-prefix").is_none() && h.get("x-forwarded-proto").is_none());
        assert!(h.get(header::PROXY_AUTHORIZATION).is_none());
        assert_eq!(h.get(header::COOKIE).unwrap(), "a=1; b=2");
        // A server's own token in a query stays; the listener's go.
        let q = format!("a=1&token={signed}&token=jupyters&token=the-workers-token&b=2");
        assert_eq!(
            query_without_ours(&q, Some("the-workers-token")),
            "a=1&token=jupyters&b=2"
        );
    }

    #[test]
    fn a_location_said_back_stays_on_this_site() {
        assert_eq!(local_location("//evil.example/x"), "/evil.example/x");
        assert_eq!(local_location("/\\evil.example/"), "/evil.example/");
        assert_eq!(local_location("/a/b?c"), "/a/b?c");
    }

    #[test]
    fn the_domains_own_hosts_are_never_routed_by_path() {
        let d = Some("ports.test");
        assert!(
            route(Some("8005-b.ports.test"), d, "/p/a/8000/x").is_some_and(|r| {
                r.sandbox.as_str() == "b" && r.port == 8005 && r.path_and_query == "/p/a/8000/x"
            })
        );
        for host in [
            "ports.test",
            "PORTS.TEST.",
            "x.y.ports.test:80",
            "junk.ports.test",
        ] {
            assert!(route(Some(host), d, "/p/a/8000/").is_none(), "{host}");
        }
        // The listener's own address routes by path.
        assert!(route(Some("127.0.0.1:7080"), d, "/p/a/8000/").is_some());
    }

    fn ends(idle: Option<Duration>) -> Ends {
        Ends {
            revoked: CancellationToken::new(),
            expires: None,
            idle,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_cut_once_nothing_moved_for_the_idle_timeout_and_not_before() {
        let link = Link::new(8080, None);
        let touched = std::sync::atomic::AtomicUsize::new(0);
        let touch = || {
            touched.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        let closed = CancellationToken::new();
        let idle = Duration::from_secs(60);
        let ends = ends(Some(idle));
        let started = tokio::time::Instant::now();
        // A byte every 50 s for ten minutes: never idle for 60 s.
        let traffic = async {
            for _ in 0..12 {
                tokio::time::sleep(Duration::from_secs(50)).await;
                link.carried_in(1);
            }
        };
        tokio::select! {
            why = cut(&link, touch, &closed, &ends) => panic!("cut while in use: {why}"),
            () = traffic => {}
        }
        assert!(touched.load(std::sync::atomic::Ordering::Relaxed) >= 10);
        // Then nothing: cut within a quarter of the timeout past it.
        let quiet = tokio::time::Instant::now();
        assert_eq!(cut(&link, || {}, &closed, &ends).await, "idle");
        let waited = quiet.elapsed();
        assert!(waited >= idle && waited <= idle + idle / 4, "{waited:?}");
        assert!(started.elapsed() > Duration::from_secs(600));
    }

    #[tokio::test(start_paused = true)]
    async fn without_an_idle_timeout_only_revocation_expiry_or_the_sandbox_cut() {
        let link = Link::new(8080, None);
        let closed = CancellationToken::new();
        let mut e = ends(None);
        let far = tokio::time::timeout(Duration::from_secs(86_400), cut(&link, || {}, &closed, &e));
        assert!(far.await.is_err(), "cut with nothing to cut it");
        e.expires = Some(tokio::time::Instant::now() + Duration::from_secs(5));
        assert_eq!(cut(&link, || {}, &closed, &e).await, "expired");
        e.expires = None;
        e.revoked.cancel();
        assert_eq!(cut(&link, || {}, &closed, &e).await, "revoked");
        closed.cancel();
        assert_eq!(
            cut(&link, || {}, &closed, &ends(None)).await,
            "sandbox_gone"
        );
    }

    #[tokio::test]
    async fn a_links_end_is_told_with_its_bytes_and_why() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let link = Link::new(5432, Some(crate::reports::Reports::new(tx)));
        link.carried_in(10);
        link.carried_out(7);
        link.end("idle");
        link.end("ended");
        drop(link);
        let told = rx.recv().await.unwrap();
        assert_eq!(
            (
                told.port,
                told.what,
                told.detail.as_str(),
                told.bytes_in,
                told.bytes_out
            ),
            (5432, corral_proto::event::PortWhat::Closed, "idle", 10, 7)
        );
    }
}
