//! The front door's port listener (`corral serve --ports-listen`): the way
//! in to every sandbox of its fleet through one address, for clients that
//! reach the front door and not the workers. A request names its sandbox
//! and port by path (`/p/{sandbox}/{port}/...`, as a worker's listener
//! does) or, for a raw TCP tunnel, as `CONNECT {sandbox}:{port}`; it goes
//! whole to the port listener of the sandbox's worker, which checks the
//! exposure and carries it into the sandbox.
//!
//! What the front door adds is its callers' keys. A bearer that is a key
//! of this front door (or its token) is taken out of the request, checked
//! (a key that does not hold is refused here, `unauthenticated`), and the
//! sandbox must be its tenant's (another's is `not_exposed`, as one that
//! does not exist); the request then reaches the worker with the workers'
//! token, which a private port takes. No key of the front door's ever
//! reaches a worker's listener or a sandbox. Anything else (a signed URL's
//! token, a public port's request, the server's own credentials) passes as
//! it came, for the worker to judge.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral_harness::tenants::{Principal, Scope};
use corral_proto::SandboxId;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::debug;

use super::front::{FrontDoor, Gate};

type Body = BoxBody<Bytes, hyper::Error>;
type Sender = hyper::client::conn::http1::SendRequest<Incoming>;

/// How long a client has to send a request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes of a request's head.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// How long a worker's listener has to take a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the listener needs of the front door.
pub struct PortsProxy {
    front: Arc<FrontDoor>,
    gate: Gate,
    /// What a worker's listener takes for a private port: the workers'
    /// token (`None`: the front door reaches its workers without one).
    worker_token: Option<String>,
}

impl PortsProxy {
    pub fn new(front: Arc<FrontDoor>, gate: Gate, worker_token: Option<String>) -> Self {
        Self {
            front,
            gate,
            worker_token,
        }
    }

    /// The caller `bearer` names, if it is a credential of this front
    /// door's: a key of its tenants (whether it holds or not: a key is
    /// never passed on), or its token.
    fn principal_of(&self, bearer: &str) -> Option<Result<Principal, tonic::Status>> {
        let ours = match &self.gate {
            Gate::Keys(_) => bearer.starts_with("corral_"),
            Gate::Token(_) => true,
        };
        if !ours {
            return None;
        }
        let mut req = tonic::Request::new(());
        let value = tonic::metadata::MetadataValue::try_from(format!("Bearer {bearer}")).ok()?;
        req.metadata_mut().insert("authorization", value);
        match self.gate.check(req) {
            Ok(mut req) => req.extensions_mut().remove::<Principal>().map(Ok),
            // The service's token compared with what is not it: not ours.
            Err(_) if matches!(self.gate, Gate::Token(_)) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// Serves `listener` until `shutdown`.
pub async fn serve(proxy: Arc<PortsProxy>, listener: TcpListener, shutdown: CancellationToken) {
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
        let proxy = proxy.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let upstream = Arc::new(tokio::sync::Mutex::new(None::<(String, Sender)>));
            let service = hyper::service::service_fn(move |req| {
                let proxy = proxy.clone();
                let upstream = upstream.clone();
                async move { Ok::<_, Infallible>(handle(&proxy, req, &upstream).await) }
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

fn full(s: impl Into<Bytes>) -> Body {
    Full::new(s.into()).map_err(|n| match n {}).boxed()
}

/// A refusal, shaped as a worker's listener shapes its own.
fn refuse(status: u16, reason: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "error": { "reason": reason, "message": message } });
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-store")
        .body(full(body.to_string()))
        .unwrap_or_else(|_| Response::new(full("")))
}

fn not_exposed() -> Response<Body> {
    refuse(
        404,
        "not_exposed",
        "this port of the sandbox is not exposed",
    )
}

/// The sandbox and port a request names: `CONNECT {sandbox}:{port}`, or a
/// path `/p/{sandbox}/{port}[/...]`.
fn target(req: &Request<Incoming>) -> Option<(SandboxId, u16)> {
    if req.method() == http::Method::CONNECT {
        let a = req.uri().authority()?;
        let port = a.port_u16().filter(|p| *p > 0)?;
        return Some((SandboxId::new(a.host().to_string()).ok()?, port));
    }
    let rest = req.uri().path().strip_prefix("/p/")?;
    let (id, rest) = rest.split_once('/').unwrap_or((rest, ""));
    let port = rest.split('/').next().unwrap_or_default();
    Some((
        SandboxId::new(id.to_string()).ok()?,
        port.parse().ok().filter(|p| *p > 0)?,
    ))
}

fn bearer_of(v: &HeaderValue) -> Option<String> {
    let v = v.to_str().ok()?.trim();
    let (scheme, rest) = v.split_once(|c: char| c.is_ascii_whitespace())?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim().to_string())
}

/// The sandbox and port a request's Host names, when its first label has
/// the shape a worker's wildcard domain routes by (`{port}-{sandbox}`).
fn host_names(req: &Request<Incoming>) -> Option<(SandboxId, u16)> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())?
        .to_ascii_lowercase();
    let label = host.split(['.', ':']).next()?;
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    Some((SandboxId::new(id.to_string()).ok()?, port))
}

/// Where a key-shaped value is in the request besides the bearers taken
/// out already: its URL or one of its headers.
fn key_elsewhere(req: &Request<Incoming>) -> Option<String> {
    let has_key = |t: &str| corral_harness::tenants::redact(t) != t;
    if has_key(&req.uri().to_string()) {
        return Some("URL".into());
    }
    req.headers()
        .iter()
        .find(|(_, v)| has_key(&String::from_utf8_lossy(v.as_bytes())))
        .map(|(k, _)| format!("{k} header"))
}

/// Takes the front door's credentials out of `headers`: the caller the
/// first one names (an error: one that does not hold).
fn take_ours(
    proxy: &PortsProxy,
    headers: &mut http::HeaderMap,
) -> Result<Option<(Principal, String)>, tonic::Status> {
    let mut who = None;
    for name in [header::AUTHORIZATION, header::PROXY_AUTHORIZATION] {
        let all: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        if all.is_empty() {
            continue;
        }
        let mut kept = Vec::new();
        let mut refused = None;
        for v in all {
            let bearer = bearer_of(&v);
            match bearer.as_deref().and_then(|b| proxy.principal_of(b)) {
                Some(Ok(p)) => {
                    who.get_or_insert((p, bearer.unwrap_or_default()));
                }
                Some(Err(e)) => {
                    refused.get_or_insert(e);
                }
                None => kept.push(v),
            }
        }
        headers.remove(&name);
        for v in kept {
            headers.append(name.clone(), v);
        }
        if let Some(e) = refused
            && who.is_none()
        {
            return Err(e);
        }
    }
    Ok(who)
}

async fn handle(
    proxy: &Arc<PortsProxy>,
    mut req: Request<Incoming>,
    upstream: &tokio::sync::Mutex<Option<(String, Sender)>>,
) -> Response<Body> {
    let Some((id, port)) = target(&req) else {
        return refuse(
            404,
            "bad_route",
            "the URL names no sandbox and port: /p/{sandbox}/{port}/...",
        );
    };
    // A worker with a wildcard domain routes by Host before the path: a
    // Host naming another sandbox would reach it past the check below.
    if let Some(named) = host_names(&req)
        && named != (id.clone(), port)
    {
        return refuse(
            400,
            "bad_route",
            "the Host names another sandbox's port than the path: reach a sandbox by path here",
        );
    }
    let (who, key) = match take_ours(proxy, req.headers_mut()) {
        Ok(Some((who, key))) => (Some(who), Some(key)),
        Ok(None) => (None, None),
        Err(e) => {
            return refuse(
                401,
                "unauthenticated",
                &corral_harness::tenants::redact(e.message()),
            );
        }
    };
    // A key anywhere else (a query, a cookie, another header) would go on
    // to the worker and the sandbox's server: refused, and said where.
    if let Some(place) = key_elsewhere(&req) {
        return refuse(
            400,
            "misplaced_key",
            &format!(
                "a key of this front door in the request's {place}: present it only as Authorization: Bearer (or Proxy-Authorization for CONNECT)"
            ),
        );
    }
    if let Some(w) = &who
        && !w.allows(Scope::Run)
    {
        return refuse(
            403,
            "permission_denied",
            "this key may not reach into sandboxes (it needs the run scope)",
        );
    }
    let base = match proxy.front.ports_of(who.as_ref(), &id).await {
        Ok(base) => base,
        Err(s) if s.code() == Code::NotFound => return not_exposed(),
        Err(s) => {
            debug!(sandbox = %id, error = %s, "no port listener found for a sandbox");
            return refuse(
                503,
                "sandbox_unavailable",
                "the sandbox's worker did not answer",
            );
        }
    };
    if who.is_some() {
        let Some(v) = proxy
            .worker_token
            .as_deref()
            .and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok())
        else {
            return refuse(
                503,
                "sandbox_unavailable",
                "this front door reaches its workers without a token: use a signed URL",
            );
        };
        let name = if req.method() == http::Method::CONNECT {
            header::PROXY_AUTHORIZATION
        } else {
            header::AUTHORIZATION
        };
        req.headers_mut().append(name, v);
    }
    // A connection the caller's key let in ends when the key no longer
    // holds (revoked, expired).
    let held = key.map(|key| Held {
        proxy: proxy.clone(),
        key,
    });
    forward(&base, req, upstream, held).await
}

/// The key an upgraded connection or tunnel was let in by.
struct Held {
    proxy: Arc<PortsProxy>,
    key: String,
}

/// How often an open connection's key is checked again.
const RECHECK: Duration = Duration::from_secs(1);

impl Held {
    /// Resolves when the key no longer holds.
    async fn lapsed(&self) {
        let mut every = tokio::time::interval(RECHECK);
        loop {
            every.tick().await;
            if !matches!(self.proxy.principal_of(&self.key), Some(Ok(_))) {
                return;
            }
        }
    }
}

/// `host:port` of a worker's listener URL (plain http only).
pub(crate) fn address_of(base: &str) -> Option<String> {
    let rest = base.strip_prefix("http://")?;
    let authority = rest.split('/').next().filter(|a| !a.is_empty())?;
    Some(
        if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        },
    )
}

/// Carries `req` to the worker's listener at `base` and its answer back;
/// an upgrade (or a tunnel) is carried both ways until either side ends
/// (the worker cuts it when the exposure ends).
async fn forward(
    base: &str,
    mut req: Request<Incoming>,
    upstream: &tokio::sync::Mutex<Option<(String, Sender)>>,
    held: Option<Held>,
) -> Response<Body> {
    let Some(addr) = address_of(base) else {
        return refuse(
            502,
            "sandbox_unavailable",
            "the sandbox's worker serves its ports over TLS, which this front door does not speak to it yet",
        );
    };
    let tunnel = req.method() == http::Method::CONNECT;
    let switching = tunnel || req.headers().contains_key(header::UPGRADE);
    let client_side = switching.then(|| hyper::upgrade::on(&mut req));
    let mut kept = upstream.lock().await;
    let cached = match kept.take() {
        Some((b, mut sender)) if b == base && !sender.is_closed() => {
            sender.ready().await.ok().map(|()| sender)
        }
        _ => None,
    };
    let mut sender = match cached {
        Some(s) => s,
        None => {
            // The workers' token goes to a listener on this machine only
            // if its socket is this user's or root's (a port a stopped
            // worker left may have been taken by another user).
            if let Some((host, port)) = corral_harness::client::host_port(base)
                && corral_harness::client::is_loopback(base)
                && let Some(uid) = corral_harness::client::stranger_listening(&host, port, None)
            {
                tracing::warn!(%base, uid, "a worker's port listener is another user's socket: nothing sent");
                return refuse(
                    503,
                    "sandbox_unavailable",
                    "the sandbox's worker did not answer",
                );
            }
            let stream =
                match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&addr))
                    .await
                {
                    Ok(Ok(s)) => s,
                    _ => {
                        return refuse(
                            503,
                            "sandbox_unavailable",
                            "the sandbox's worker did not answer",
                        );
                    }
                };
            let _ = stream.set_nodelay(true);
            let (sender, conn) =
                match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                    Ok(c) => c,
                    Err(_) => {
                        return refuse(
                            503,
                            "sandbox_unavailable",
                            "the sandbox's worker did not answer",
                        );
                    }
                };
            tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    debug!(error = %e, "a connection to a worker's port listener ended");
                }
            });
            sender
        }
    };
    let mut resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            debug!(error = %e, "a worker's port listener did not answer");
            return refuse(
                503,
                "sandbox_unavailable",
                "the sandbox's worker did not answer",
            );
        }
    };
    if !switching {
        *kept = Some((base.to_string(), sender));
    }
    drop(kept);
    let switched =
        resp.status() == StatusCode::SWITCHING_PROTOCOLS || (tunnel && resp.status().is_success());
    if switched && let Some(client_side) = client_side {
        let server_side = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (Ok(client), Ok(server)) = (client_side.await, server_side.await) else {
                return;
            };
            let (mut client, mut server) = (TokioIo::new(client), TokioIo::new(server));
            let carried = tokio::io::copy_bidirectional(&mut client, &mut server);
            match held {
                Some(held) => {
                    tokio::select! {
                        _ = carried => {}
                        () = held.lapsed() => debug!("a key no longer holds: its connection is cut"),
                    }
                }
                None => {
                    let _ = carried.await;
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
    fn a_workers_listener_is_reached_by_its_address() {
        assert_eq!(
            address_of("http://10.0.0.5:7080").as_deref(),
            Some("10.0.0.5:7080")
        );
        assert_eq!(
            address_of("http://w.example/").as_deref(),
            Some("w.example:80")
        );
        assert_eq!(address_of("https://w.example:443"), None);
    }
}
