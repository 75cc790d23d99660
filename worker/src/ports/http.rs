//! The port listener: HTTP/1.1 (with upgrades: WebSockets and any other
//! protocol switched to) to sandboxes' exposed ports. Each request is
//! routed by its Host (`{port}-{id}.{domain}`) or its path
//! (`/p/{id}/{port}/...`), checked against the port's exposure, stripped
//! of what only the listener may say (its credentials, `X-Corral-Verified-*`),
//! and carried to the sandbox's server on a connection of its way in, with
//! the Host and Origin the client sent. An upgraded connection is carried
//! both ways until either side ends or the exposure is revoked.

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

use super::{Access, Exposure, Refusal};
use crate::sandbox::Sandbox;
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
            let service = hyper::service::service_fn(move |req| {
                let worker = worker.clone();
                async move { Ok::<_, Infallible>(handle(&worker, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
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
    Response::builder()
        .status(r.status())
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-store")
        .body(full(body.to_string()))
        .unwrap_or_else(|_| Response::new(full("")))
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
        if let Some(label) = name
            .to_ascii_lowercase()
            .strip_suffix(&format!(".{}", domain.to_ascii_lowercase()))
            .filter(|l| !l.contains('.'))
        {
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

/// The credential a request brings, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Credential {
    Bearer(String),
    Query(String),
    Cookie(String),
}

/// The credentials a request brings, in the order they are tried: its
/// bearer, a `token` of its query, the listener's cookie.
fn credentials(headers: &HeaderMap, query: Option<&str>) -> Vec<Credential> {
    let mut all = Vec::new();
    if let Some(b) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        all.push(Credential::Bearer(b.trim().to_string()));
    }
    if let Some(t) = query.and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("token=").map(str::to_string))
    }) {
        all.push(Credential::Query(t));
    }
    if let Some(c) = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            (k == COOKIE).then(|| Credential::Cookie(v.to_string()))
        })
    {
        all.push(c);
    }
    all
}

/// The query without its `token`.
fn without_token(query: &str) -> String {
    query
        .split('&')
        .filter(|kv| !kv.starts_with("token=") && !kv.is_empty())
        .collect::<Vec<_>>()
        .join("&")
}

fn constant_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether the request may reach the port: the access it was let in by,
/// and the credential that did it (`None`: none was needed). Each
/// credential is tried in turn, so that a server's own `token` in a query
/// (Jupyter's, say) passes through when the listener's cookie is what
/// admits the request; refused, the first credential's refusal is said.
fn admit(
    worker: &Worker,
    route: &Route,
    exposure: Option<&Exposure>,
    creds: &[Credential],
) -> Result<(Access, Option<usize>), Refusal> {
    let token = |c: &Credential| match c {
        Credential::Bearer(t) | Credential::Query(t) | Credential::Cookie(t) => t.clone(),
    };
    let owner = |t: &str| {
        worker
            .ports_token()
            .is_none_or(|expected| constant_eq(t, expected))
    };
    let Some(e) = exposure else {
        // A genuine token of a revoked exposure says so.
        if let Some(t) = creds.first().map(token).filter(|t| !owner(t)) {
            worker
                .ports_key()
                .verify(&t, &route.sandbox, route.port, None, worker.now_ms())?;
        }
        return Err(Refusal::NotExposed);
    };
    if e.access == Access::Public {
        return Ok((Access::Public, None));
    }
    if worker.ports_token().is_none() {
        return Ok((Access::Private, None));
    }
    let mut first = None;
    for (i, c) in creds.iter().enumerate() {
        let t = token(c);
        if owner(&t) {
            return Ok((Access::Private, Some(i)));
        }
        let checked = match e.access {
            Access::Signed => {
                worker
                    .ports_key()
                    .verify(&t, &route.sandbox, route.port, Some(e), worker.now_ms())
            }
            _ => Err(Refusal::InvalidToken),
        };
        match checked {
            Ok(()) => return Ok((Access::Signed, Some(i))),
            Err(r) => {
                first.get_or_insert(r);
            }
        }
    }
    Err(first.unwrap_or(Refusal::Unauthenticated))
}

async fn handle(worker: &Worker, mut req: Request<Incoming>) -> Response<Body> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string);
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let Some(route) = route(host.as_deref(), worker.ports_domain(), &pq) else {
        return refuse(Refusal::BadRoute);
    };
    let (sandbox, exposure) = match worker.port_route(&route.sandbox, route.port).await {
        Ok(found) => found,
        Err(r) => return refuse(r),
    };
    let query = route.path_and_query.split_once('?').map(|(_, q)| q);
    let creds = credentials(req.headers(), query);
    let (access, used) = match admit(worker, &route, exposure.as_ref(), &creds) {
        Ok(a) => a,
        Err(r) => return refuse(r),
    };
    let cred = used.and_then(|i| creds.get(i)).cloned();
    let Some(exposure) = exposure else {
        return refuse(Refusal::NotExposed);
    };
    // A token in the URL: kept as a cookie of this host (and path), and
    // the URL said again without it, so it leaves no trace in histories
    // and Referer headers.
    if let Some(Credential::Query(token)) = &cred
        && access == Access::Signed
    {
        let (path, q) = route
            .path_and_query
            .split_once('?')
            .unwrap_or((&route.path_and_query, ""));
        let rest = without_token(q);
        let prefix = route.prefix.clone().unwrap_or_default();
        let location = if rest.is_empty() {
            format!("{prefix}{path}")
        } else {
            format!("{prefix}{path}?{rest}")
        };
        let cookie_path = route
            .prefix
            .as_deref()
            .map_or_else(|| "/".to_string(), |p| format!("{p}/"));
        let max_age = exposure
            .expires_at_ms
            .map(|t| (t - worker.now_ms()).max(0) / 1000);
        let mut cookie = format!("{COOKIE}={token}; Path={cookie_path}; HttpOnly; SameSite=Lax");
        if let Some(a) = max_age {
            cookie.push_str(&format!("; Max-Age={a}"));
        }
        if forwarded_https(req.headers()) {
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
    strip(req.headers_mut(), cred.as_ref());
    let headers = req.headers_mut();
    if let Ok(v) = HeaderValue::from_str(access.as_str()) {
        headers.insert("x-corral-verified-access", v);
    }
    if let Some(p) = route
        .prefix
        .as_deref()
        .and_then(|p| HeaderValue::from_str(p).ok())
    {
        headers.insert("x-forwarded-prefix", p);
    }
    let pq = match (&cred, route.path_and_query.split_once('?')) {
        (Some(Credential::Query(_)), Some((path, q))) => {
            let rest = without_token(q);
            if rest.is_empty() {
                path.to_string()
            } else {
                format!("{path}?{rest}")
            }
        }
        _ => route.path_and_query.clone(),
    };
    match pq.parse() {
        Ok(uri) => *req.uri_mut() = uri,
        Err(_) => return refuse(Refusal::BadRoute),
    }
    forward(worker, &sandbox, route.port, req, exposure.revoked).await
}

fn forwarded_https(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// Drops what only the listener may say, and the listener's credential.
fn strip(headers: &mut HeaderMap, cred: Option<&Credential>) {
    let ours: Vec<header::HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with(VERIFIED_PREFIX))
        .cloned()
        .collect();
    for k in ours {
        headers.remove(k);
    }
    if matches!(cred, Some(Credential::Bearer(_))) {
        headers.remove(header::AUTHORIZATION);
    }
    // The listener's cookie goes; the server's own stay.
    let cookies: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|kv| !kv.is_empty() && !kv.starts_with(&format!("{COOKIE}=")))
        .map(str::to_string)
        .collect();
    headers.remove(header::COOKIE);
    if !cookies.is_empty()
        && let Ok(v) = HeaderValue::from_str(&cookies.join("; "))
    {
        headers.insert(header::COOKIE, v);
    }
}

/// Carries `req` to `port` of `sandbox` and its answer back; an upgrade
/// is carried both ways until one side ends or `revoked`.
async fn forward(
    worker: &Worker,
    sandbox: &Sandbox,
    port: u16,
    mut req: Request<Incoming>,
    revoked: CancellationToken,
) -> Response<Body> {
    let stream = match worker.dial_port(sandbox, port).await {
        Ok(s) => s,
        Err(r) => return refuse(r),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(c) => c,
        Err(_) => return refuse(Refusal::PortNotListening),
    };
    let closed = sandbox.closed().clone();
    let cut = revoked.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = conn.with_upgrades() => if let Err(e) = r {
                debug!(error = %e, "a connection to a sandbox's port ended");
            },
            () = cut.cancelled() => {}
            () = closed.cancelled() => {}
        }
    });
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .is_some()
        .then(|| hyper::upgrade::on(&mut req));
    let mut resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            debug!(error = %e, "a sandbox's server did not answer");
            return refuse(Refusal::PortNotListening);
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_side) = upgrade
    {
        let server_side = hyper::upgrade::on(&mut resp);
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            let (Ok(client), Ok(server)) = (client_side.await, server_side.await) else {
                return;
            };
            let mut client = TokioIo::new(client);
            let mut server = TokioIo::new(server);
            let carried = tokio::io::copy_bidirectional(&mut client, &mut server);
            tokio::pin!(carried);
            // An open connection keeps its sandbox from being idle.
            let mut used = tokio::time::interval(TOUCH_EVERY);
            loop {
                tokio::select! {
                    _ = &mut carried => break,
                    () = revoked.cancelled() => break,
                    () = sandbox.closed().cancelled() => break,
                    _ = used.tick() => sandbox.touch(),
                }
            }
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
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer secret"),
        );
        h.insert(
            "x-corral-verified-access",
            HeaderValue::from_static("public"),
        );
        h.insert("X-Corral-Verified-User", HeaderValue::from_static("admin"));
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; corral_port_token=tok; b=2"),
        );
        let creds = credentials(&h, Some("a=1&token=t"));
        assert_eq!(
            creds,
            vec![
                Credential::Bearer("secret".into()),
                Credential::Query("t".into()),
                Credential::Cookie("tok".into())
            ]
        );
        strip(&mut h, creds.first());
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.keys().all(|k| !k.as_str().starts_with(VERIFIED_PREFIX)));
        assert_eq!(h.get(header::COOKIE).unwrap(), "a=1; b=2");
        assert_eq!(without_token("a=1&token=x&b=2"), "a=1&b=2");
    }
}
