//! `corral mcp` over Streamable HTTP, served by a front door (`corral
//! serve`) at `/mcp` on its own address: the same tools as over stdio, for
//! an agent that reaches MCP servers by URL. Every request carries the
//! caller's key as a `Bearer` (a missing or wrong one is `401` with the
//! `WWW-Authenticate` that names the protected-resource metadata, served at
//! `/.well-known/oauth-protected-resource`); `initialize` opens a session
//! (`Mcp-Session-Id`), bound to the key that opened it, whose tools call the
//! front door in-process with that key: the tenant's sandboxes, scopes and
//! quotas, as for any of its calls. A request is answered with JSON (a tool
//! call, to a client that takes them, with Server-Sent Events: its progress
//! notifications, then its result); a notification with `202`; `DELETE /mcp` ends the session (its sandboxes
//! are removed), as does its idle timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use corral_harness::client::WorkerClient;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

use super::mcp::{Server, end, handle};

/// Sessions open at once (more are refused until one ends).
const MAX_SESSIONS: usize = 1024;
/// Sessions one key may have open at once: one tenant cannot take them
/// all.
const MAX_SESSIONS_PER_KEY: usize = 64;
/// The largest message taken.
const MAX_MESSAGE: usize = 16 << 20;
const SESSION_HEADER: &str = "mcp-session-id";

struct Session {
    server: Arc<Server>,
    tasks: TaskTracker,
    /// The key that opened it: the only one it answers.
    key: String,
    last: Mutex<Instant>,
}

/// The MCP endpoint's state: its sessions, and the front door's own gRPC
/// routes, which its tools call in-process.
pub struct McpHttp {
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Whether a key may run (not only read): its session's tools follow.
    may_run: MayRun,
    grpc: axum::Router,
    https: bool,
    idle: Duration,
    /// Sessions being ended: their cleanup goes on whether or not the
    /// request that ended them waits for it.
    ending: TaskTracker,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Equal, in a time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether a key may run commands (else its session lists the read-only
/// tools alone; the front door refuses the rest of its calls anyway).
pub type MayRun = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The routes of MCP over HTTP, calling `grpc` (the server's own gRPC
/// routes) for its tools; sessions idle for `idle` end.
pub fn router(grpc: axum::Router, https: bool, idle: Duration, may_run: MayRun) -> axum::Router {
    let state = Arc::new(McpHttp {
        sessions: Mutex::new(HashMap::new()),
        may_run,
        grpc,
        https,
        idle,
        ending: TaskTracker::new(),
    });
    axum::Router::new()
        .route(
            "/mcp",
            axum::routing::post(post)
                .delete(delete)
                .get(|| async {
                    // No stream of the server's own: it sends nothing unasked.
                    (
                        StatusCode::METHOD_NOT_ALLOWED,
                        [(header::ALLOW, "POST, DELETE")],
                    )
                })
                // Its own bound (a file of upload_file in base64), not
                // axum's 2 MiB.
                .layer(axum::extract::DefaultBodyLimit::max(MAX_MESSAGE + 1)),
        )
        .route(
            "/.well-known/oauth-protected-resource",
            axum::routing::get(metadata),
        )
        .route(
            "/.well-known/oauth-protected-resource/mcp",
            axum::routing::get(metadata),
        )
        .with_state(state)
}

impl McpHttp {
    fn base(&self, headers: &HeaderMap) -> String {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            // A name or address and a port: nothing that could end the
            // quoted value it goes into.
            .filter(|h| {
                !h.is_empty()
                    && h.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
            })
            .unwrap_or("localhost");
        format!("{}://{host}", if self.https { "https" } else { "http" })
    }

    /// `401`, naming the metadata that says how to authenticate.
    fn unauthorized(&self, headers: &HeaderMap, why: &str) -> Response {
        let challenge = format!(
            "Bearer resource_metadata=\"{}/.well-known/oauth-protected-resource/mcp\"",
            self.base(headers)
        );
        let mut r = respond(
            StatusCode::UNAUTHORIZED,
            rpc_error(Value::Null, -32001, why),
        );
        if let Ok(v) = HeaderValue::from_str(&challenge) {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, v);
        }
        r
    }

    /// Ends sessions idle past their time (their sandboxes removed), in
    /// the background.
    fn end_expired(&self) {
        let old: Vec<Arc<Session>> = {
            let mut all = lock(&self.sessions);
            let old: Vec<String> = all
                .iter()
                .filter(|(_, s)| lock(&s.last).elapsed() > self.idle)
                .map(|(k, _)| k.clone())
                .collect();
            old.iter().filter_map(|k| all.remove(k)).collect()
        };
        for s in old {
            self.end(s);
        }
    }

    /// Ends `session` (its calls canceled, its sandboxes removed) in a task
    /// of its own: a client that goes away meanwhile leaves nothing behind.
    fn end(&self, session: Arc<Session>) -> tokio::task::JoinHandle<()> {
        self.ending
            .spawn(async move { end(&session.server, &session.tasks).await })
    }
}

fn respond(status: StatusCode, v: Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn rpc_error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

async fn metadata(State(mcp): State<Arc<McpHttp>>, headers: HeaderMap) -> Response {
    let base = mcp.base(&headers);
    respond(
        StatusCode::OK,
        json!({
            "resource": format!("{base}/mcp"),
            "resource_name": "Corral",
            "bearer_methods_supported": ["header"],
        }),
    )
}

/// A client to the front door itself, in-process (an HTTP/2 connection
/// over a pipe to its own routes), presenting `token`.
fn in_process(grpc: axum::Router, token: &str) -> Result<WorkerClient, String> {
    let connector = tower::service_fn(move |_: http::Uri| {
        let grpc = grpc.clone();
        async move {
            let (ours, theirs) = tokio::io::duplex(1 << 16);
            // Served until the client's side closes (its session ends).
            tokio::spawn(async move {
                let service = hyper_util::service::TowerToHyperService::new(grpc);
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(theirs), service)
                        .await;
            });
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(ours))
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://front-door.in-process")
        .connect_with_connector_lazy(connector);
    WorkerClient::over("in-process", channel, Some(token)).map_err(|e| e.to_string())
}

/// The answer to request `msg` of `session` (none if it was canceled);
/// what it notified on the way is left out (see [`streamed`]).
async fn answer(session: &Session, msg: Value) -> Option<Value> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    handle(&session.server, msg, &tx, &session.tasks).await;
    drop(tx);
    while let Some(v) = rx.recv().await {
        if v.get("id").is_some() {
            return Some(v);
        }
    }
    None
}

/// The answer to request `msg` as Server-Sent Events: its notifications
/// (progress) as they come, then its reply.
async fn streamed(session: &Session, msg: Value) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    handle(&session.server, msg, &tx, &session.tasks).await;
    drop(tx);
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        let v = rx.recv().await?;
        Some((
            Ok::<_, std::io::Error>(format!("event: message\ndata: {v}\n\n")),
            rx,
        ))
    });
    let mut r = axum::body::Body::from_stream(events).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Whether the client takes an answer as Server-Sent Events.
fn accepts_sse(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"))
}

/// Tells admission that this request's connection carries a key that was
/// let in, so it is kept like any authenticated connection.
fn authenticated(headers: &HeaderMap, extensions: &http::Extensions) {
    corral_worker::server::mark_authenticated(&corral_worker::server::request_of(
        headers, extensions,
    ));
}

async fn post(
    State(mcp): State<Arc<McpHttp>>,
    headers: HeaderMap,
    extensions: http::Extensions,
    body: Bytes,
) -> Response {
    mcp.end_expired();
    let Some(key) = bearer(&headers).map(str::to_string) else {
        return mcp.unauthorized(&headers, "a key is needed: Authorization: Bearer KEY");
    };
    if body.len() > MAX_MESSAGE {
        return respond(
            StatusCode::PAYLOAD_TOO_LARGE,
            rpc_error(Value::Null, -32600, "a message over 16 MiB"),
        );
    }
    let msg: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return respond(
                StatusCode::BAD_REQUEST,
                rpc_error(Value::Null, -32700, &format!("not JSON: {e}")),
            );
        }
    };
    if !msg.is_object() {
        return respond(
            StatusCode::BAD_REQUEST,
            rpc_error(
                Value::Null,
                -32600,
                "one JSON-RPC message, an object (no batches)",
            ),
        );
    }
    let id = msg.get("id").cloned();
    if msg.get("method").and_then(Value::as_str) == Some("initialize") {
        let client = match in_process(mcp.grpc.clone(), &key) {
            Ok(c) => c,
            Err(e) => return mcp.unauthorized(&headers, &e),
        };
        // The key checked before a session is opened for it.
        if let Err(e) = client.worker_info().await {
            return mcp.unauthorized(&headers, &format!("refused: {e}"));
        }
        authenticated(&headers, &extensions);
        let (all, mine) = {
            let sessions = lock(&mcp.sessions);
            let mine = sessions.values().filter(|s| same(&s.key, &key)).count();
            (sessions.len(), mine)
        };
        if mine >= MAX_SESSIONS_PER_KEY {
            return respond(
                StatusCode::TOO_MANY_REQUESTS,
                rpc_error(
                    id.unwrap_or(Value::Null),
                    -32000,
                    &format!(
                        "this key has {MAX_SESSIONS_PER_KEY} MCP sessions open, the most one key may: end one (DELETE /mcp)"
                    ),
                ),
            );
        }
        if all >= MAX_SESSIONS {
            return respond(
                StatusCode::SERVICE_UNAVAILABLE,
                rpc_error(
                    id.unwrap_or(Value::Null),
                    -32000,
                    "too many MCP sessions are open here: end one (DELETE /mcp) or try later",
                ),
            );
        }
        let session = Arc::new(Session {
            server: Arc::new(Server::new(
                client,
                None,
                false,
                Some(mcp.idle.as_millis() as u64),
                None,
                !(mcp.may_run)(&key),
            )),
            tasks: TaskTracker::new(),
            key,
            last: Mutex::new(Instant::now()),
        });
        let sid = uuid::Uuid::new_v4().simple().to_string();
        lock(&mcp.sessions).insert(sid.clone(), session.clone());
        let reply = answer(&session, msg).await.unwrap_or(Value::Null);
        let mut r = respond(StatusCode::OK, reply);
        if let Ok(v) = HeaderValue::from_str(&sid) {
            r.headers_mut().insert(SESSION_HEADER, v);
        }
        return r;
    }
    let Some(sid) = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()) else {
        return respond(
            StatusCode::BAD_REQUEST,
            rpc_error(
                id.unwrap_or(Value::Null),
                -32600,
                "no Mcp-Session-Id: initialize first",
            ),
        );
    };
    // Another key's session answers as one that does not exist.
    let session = lock(&mcp.sessions)
        .get(sid)
        .filter(|s| same(&s.key, &key))
        .cloned();
    let Some(session) = session else {
        return respond(
            StatusCode::NOT_FOUND,
            rpc_error(
                id.unwrap_or(Value::Null),
                -32001,
                "no such session (ended, or idle too long): initialize again",
            ),
        );
    };
    authenticated(&headers, &extensions);
    *lock(&session.last) = Instant::now();
    if id.is_none() {
        // A notification (a cancellation, say) or a client's answer.
        handle(
            &session.server,
            msg,
            &tokio::sync::mpsc::channel(1).0,
            &session.tasks,
        )
        .await;
        return StatusCode::ACCEPTED.into_response();
    }
    // A tool call to a client that takes a stream: its progress as it comes.
    if accepts_sse(&headers) && msg.get("method").and_then(Value::as_str) == Some("tools/call") {
        return streamed(&session, msg).await;
    }
    match answer(&session, msg).await {
        Some(reply) => respond(StatusCode::OK, reply),
        // Canceled by the client: nothing to say.
        None => StatusCode::ACCEPTED.into_response(),
    }
}

async fn delete(
    State(mcp): State<Arc<McpHttp>>,
    headers: HeaderMap,
    extensions: http::Extensions,
) -> Response {
    let Some(key) = bearer(&headers) else {
        return mcp.unauthorized(&headers, "a key is needed: Authorization: Bearer KEY");
    };
    let sid = headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let session = {
        let mut all = lock(&mcp.sessions);
        match all.get(sid) {
            Some(s) if same(&s.key, key) => all.remove(sid),
            _ => None,
        }
    };
    match session {
        Some(s) => {
            authenticated(&headers, &extensions);
            // Waited for, but not undone if this request is dropped.
            let _ = mcp.end(s).await;
            StatusCode::OK.into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
