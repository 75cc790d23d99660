//! The HTTP/JSON face of Corral's gRPC services, served on the same
//! listener (HTTP/1.1 and HTTP/2) by the worker and the front door.
//!
//! Every method of the services named is `POST /v1/<service>/<Method>`
//! (`/v1/corral.v1.Worker/CreateSandbox`), and the main ones also have a
//! resource path ([`Route`]: `POST /v1/sandboxes`, `GET
//! /v1/sandboxes/{id}`, ...). A request is transcoded by the services'
//! descriptors (the canonical protobuf JSON mapping, field names as in
//! the `.proto`, 64-bit integers as numbers, `bytes` as base64, enums by
//! name; an unknown field is refused) and made as a gRPC call to the same
//! server in-process, with the caller's `Authorization` (the same token or
//! key, as a `Bearer`): the same checks, the same answers. A stream
//! answers as newline-delimited JSON, or as Server-Sent Events when the
//! client accepts `text/event-stream`; a stream of requests (`BuildImage`)
//! is sent as newline-delimited JSON. Archives move as raw tar
//! (`GET`/`PUT /v1/sandboxes/{sandbox_id}/archive?path=...`). An error is
//! `{"error": {"code", "reason", "message", "flag"}}` with the HTTP status
//! of its gRPC code and the `corral-reason` the gRPC call carries.
//! `GET /openapi.json` is the OpenAPI 3.1 document made from the same
//! descriptors ([`openapi`]).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use http_body_util::BodyExt;
use prost::Message;
pub use prost_reflect::DescriptorPool;
use prost_reflect::{
    DeserializeOptions, DynamicMessage, Kind, MessageDescriptor, MethodDescriptor, ReflectMessage,
    SerializeOptions, Value,
};
use tonic::Code;
use tower::ServiceExt;

pub mod openapi;

/// The largest JSON body of a call that may carry a file's data (a submit,
/// alone or with its watch): its message's bound as base64, and room.
pub const MAX_JSON_BODY: usize = crate::limits::MAX_REQUEST_BYTES / 3 * 4 + (64 << 10);
/// The largest JSON body of any other call (an input chunk as base64, and
/// room for ids and a path).
pub const MAX_OTHER_JSON_BODY: usize =
    (crate::limits::MAX_INPUT_CHUNK_BYTES + (1 << 20)) / 3 * 4 + (64 << 10);
/// Bytes of JSON bodies being read and parsed at once, across all callers
/// (more wait): parsing is done off the async threads, and a body's
/// message takes more memory than its text.
pub const JSON_BUDGET: usize = 2 * MAX_JSON_BODY;
/// The longest a request body may pause between two pieces.
const BODY_IDLE: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest a request body may take in all (and a body may wait for
/// its share of [`JSON_BUDGET`]).
const BODY_TIME: std::time::Duration = std::time::Duration::from_secs(120);

/// The largest JSON body a call of `method` takes.
fn body_limit(method: &MethodDescriptor) -> usize {
    match method.name() {
        "SubmitOperation" | "RunOperation" => MAX_JSON_BODY,
        _ => MAX_OTHER_JSON_BODY,
    }
}
/// The longest line of a newline-delimited JSON request stream (a 1 MiB
/// `bytes` field in base64, and the rest).
pub const MAX_NDJSON_LINE: usize = 2 << 20;
/// How long a stream's first message is waited for before its headers go
/// out without it.
const FIRST_MESSAGE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// A quiet stream's keepalive: an empty line (NDJSON) or a comment (SSE).
const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(15);
/// The bytes of a raw archive sent in one upload message.
const UPLOAD_CHUNK: usize = 1 << 20;
/// Marks a field (in the fields a route sets) that takes a fresh random
/// id if the request leaves it empty.
const FRESH: &str = "\u{0}fresh:";

/// How a resource path's request is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body_ {
    /// A JSON body (optional: none is `{}`), its fields joined by the
    /// path's and the query's.
    Json,
    /// The request is the path and the query; the answer is the archive's
    /// bytes (`Download`).
    TarOut,
    /// The body is the archive's bytes (`Upload`); the answer the
    /// finished operation.
    TarIn,
}

/// A resource path for one method: `{name}` segments and query parameters
/// set the request's fields of those names (`rename` maps a query name to
/// a field path, `path` to `archive.path`).
#[derive(Debug, Clone)]
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    /// `corral.v1.Worker/GetSandbox`.
    pub rpc: &'static str,
    pub body: Body_,
    pub rename: &'static [(&'static str, &'static str)],
    /// Id fields given a fresh random id when the request leaves them
    /// empty (an operation's, where the call makes one).
    pub fresh: &'static [&'static str],
    pub summary: &'static str,
}

impl Route {
    pub const fn new(
        method: Method,
        path: &'static str,
        rpc: &'static str,
        summary: &'static str,
    ) -> Self {
        Self {
            method,
            path,
            rpc,
            body: Body_::Json,
            rename: &[],
            fresh: &[],
            summary,
        }
    }
}

/// The resource paths of `corral.v1.Worker` (the worker's and the front
/// door's).
pub fn worker_routes() -> Vec<Route> {
    vec![
        Route::new(
            Method::POST,
            "/v1/sandboxes",
            "corral.v1.Worker/CreateSandbox",
            "Make a sandbox",
        ),
        Route::new(
            Method::GET,
            "/v1/sandboxes",
            "corral.v1.Worker/ListSandboxes",
            "List the sandboxes",
        ),
        Route::new(
            Method::GET,
            "/v1/sandboxes/{id}",
            "corral.v1.Worker/GetSandbox",
            "One sandbox",
        ),
        Route::new(
            Method::DELETE,
            "/v1/sandboxes/{id}",
            "corral.v1.Worker/DestroySandbox",
            "Remove a sandbox and everything in it",
        ),
        Route {
            fresh: &["operation_id"],
            ..Route::new(
                Method::POST,
                "/v1/sandboxes/{sandbox_id}/operations",
                "corral.v1.Worker/SubmitOperation",
                "Start an operation (an operation_id of its own unless given)",
            )
        },
        Route {
            fresh: &["operation_id"],
            ..Route::new(
                Method::POST,
                "/v1/sandboxes/{sandbox_id}/run",
                "corral.v1.Worker/RunOperation",
                "Start an operation and stream its events to its end",
            )
        },
        Route::new(
            Method::GET,
            "/v1/sandboxes/{sandbox_id}/operations",
            "corral.v1.Worker/ListOperations",
            "The sandbox's operations",
        ),
        Route::new(
            Method::GET,
            "/v1/sandboxes/{sandbox_id}/operations/{operation_id}",
            "corral.v1.Worker/GetOperation",
            "One operation",
        ),
        Route::new(
            Method::POST,
            "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/cancel",
            "corral.v1.Worker/CancelOperation",
            "Cancel a running operation",
        ),
        Route::new(
            Method::POST,
            "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/signal",
            "corral.v1.Worker/SignalOperation",
            "Signal a running command's process group",
        ),
        Route::new(
            Method::POST,
            "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/input",
            "corral.v1.Worker/WriteInput",
            "Feed input to a running operation",
        ),
        Route::new(
            Method::GET,
            "/v1/sandboxes/{sandbox_id}/events",
            "corral.v1.Worker/WatchSandbox",
            "The sandbox's events after after_seq, then live ones",
        ),
        Route::new(
            Method::GET,
            "/v1/sandboxes/{sandbox_id}/stats",
            "corral.v1.Worker/GetSandboxStats",
            "What the sandbox uses now",
        ),
        Route {
            body: Body_::TarOut,
            fresh: &["operation_id"],
            rename: &[("path", "archive.path"), ("contents", "archive.contents")],
            ..Route::new(
                Method::GET,
                "/v1/sandboxes/{sandbox_id}/archive",
                "corral.v1.Worker/Download",
                "A path of the sandbox as a tar stream",
            )
        },
        Route {
            body: Body_::TarIn,
            fresh: &["operation_id"],
            ..Route::new(
                Method::PUT,
                "/v1/sandboxes/{sandbox_id}/archive",
                "corral.v1.Worker/Upload",
                "A tar stream unpacked into the sandbox at path",
            )
        },
        Route::new(
            Method::GET,
            "/v1/info",
            "corral.v1.Worker/GetWorkerInfo",
            "What the worker is and allows",
        ),
    ]
}

/// The resource paths of `corral.v1.Control` (a front door's sessions).
pub fn control_routes() -> Vec<Route> {
    vec![
        Route::new(
            Method::POST,
            "/v1/sessions",
            "corral.v1.Control/StartSession",
            "Start a session (request_json: the session's request, as `corral run --request` takes it)",
        ),
        Route::new(
            Method::GET,
            "/v1/sessions",
            "corral.v1.Control/ListSessions",
            "List the sessions",
        ),
        Route::new(
            Method::GET,
            "/v1/sessions/{session_id}/events",
            "corral.v1.Control/WatchSession",
            "A session's events after `after`, as they come, to its run's end",
        ),
        Route::new(
            Method::POST,
            "/v1/sessions/{session_id}/input",
            "corral.v1.Control/SendInput",
            "Give a session's run a message",
        ),
        Route::new(
            Method::POST,
            "/v1/sessions/{session_id}/stop",
            "corral.v1.Control/StopSession",
            "Stop a session's run (`leave`: let it go on unwatched)",
        ),
        Route::new(
            Method::POST,
            "/v1/sessions/{session_id}/fork",
            "corral.v1.Control/ForkSession",
            "A new session from this one (at `turn`)",
        ),
        Route::new(
            Method::GET,
            "/v1/sessions/{session_id}/export",
            "corral.v1.Control/ExportSession",
            "A session's log, as it is kept",
        ),
        Route::new(
            Method::DELETE,
            "/v1/sessions/{session_id}",
            "corral.v1.Control/RemoveSession",
            "Remove a session (and its sandbox unless `keep_sandbox`)",
        ),
    ]
}

/// The resource paths of `corral.v1.Admin` (a front door's keys and
/// quotas, for an admin key).
pub fn admin_routes() -> Vec<Route> {
    vec![
        Route::new(
            Method::POST,
            "/v1/admin/keys",
            "corral.v1.Admin/CreateKey",
            "Make a key (its secret is in this answer alone)",
        ),
        Route::new(
            Method::GET,
            "/v1/admin/keys",
            "corral.v1.Admin/ListKeys",
            "List the keys (no secrets)",
        ),
        Route::new(
            Method::DELETE,
            "/v1/admin/keys/{id}",
            "corral.v1.Admin/RevokeKey",
            "Revoke a key",
        ),
        Route::new(
            Method::PUT,
            "/v1/admin/quotas/{tenant}",
            "corral.v1.Admin/SetQuota",
            "Set a tenant's quotas (`quotas`: NAME=VALUE each)",
        ),
        Route::new(
            Method::GET,
            "/v1/admin/quotas",
            "corral.v1.Admin/ListQuotas",
            "Every tenant's quotas and use",
        ),
    ]
}

/// The resource paths of those of `services` that have some.
pub fn routes_of(services: &[&str]) -> Vec<Route> {
    [worker_routes(), control_routes(), admin_routes()]
        .into_iter()
        .flatten()
        .filter(|r| services.iter().any(|s| r.rpc.split('/').next() == Some(*s)))
        .collect()
}

/// The server's own check of a caller's credentials (its token, or a front
/// door's keys), made before a request's body is read.
pub type AuthCheck =
    Arc<dyn Fn(&HeaderMap, &http::Extensions) -> Result<(), tonic::Status> + Send + Sync>;

/// Serves the HTTP/JSON face of `services` (full names, as
/// `corral.v1.Worker`) of `pool`, calling `grpc` (the server's own gRPC
/// routes) for each request once `auth` lets its caller in. Requests of no
/// path of its own go to `grpc` when they are gRPC, else answer 404.
pub fn router(
    pool: DescriptorPool,
    services: &[&str],
    routes: Vec<Route>,
    grpc: axum::Router,
    auth: AuthCheck,
) -> Result<axum::Router, GatewayError> {
    let mut methods = HashMap::new();
    for name in services {
        let service = pool
            .get_service_by_name(name)
            .ok_or_else(|| GatewayError(format!("no service {name} in the descriptors")))?;
        for m in service.methods() {
            methods.insert(format!("{name}/{}", m.name()), m);
        }
    }
    for r in &routes {
        if !methods.contains_key(r.rpc) {
            return Err(GatewayError(format!("{}: no method {}", r.path, r.rpc)));
        }
    }
    let document = openapi::document(&pool, services, &routes);
    let gw = Arc::new(Gateway {
        methods,
        grpc: grpc.clone(),
        document,
        auth,
        bodies: Arc::new(tokio::sync::Semaphore::new(JSON_BUDGET)),
    });
    let mut app = axum::Router::new()
        .route(
            "/openapi.json",
            axum::routing::get({
                let gw = gw.clone();
                move |req: http::Request<Body>| {
                    let gw = gw.clone();
                    async move { gw.openapi(req).await }
                }
            }),
        )
        .route(
            "/v1/{service}/{method}",
            axum::routing::post({
                let gw = gw.clone();
                move |axum::extract::Path((service, method)): axum::extract::Path<(String, String)>,
                      req: http::Request<Body>| {
                    let gw = gw.clone();
                    async move {
                        let Some(m) = gw.methods.get(&format!("{service}/{method}")).cloned()
                        else {
                            return error_response(
                                StatusCode::NOT_FOUND,
                                "NOT_FOUND",
                                None,
                                &format!("no method {service}/{method} here (GET /openapi.json lists them)"),
                                None,
                            );
                        };
                        gw.call_json(&m, req, HashMap::new()).await
                    }
                }
            }),
        );
    // Resource paths, grouped by path (one axum route per path).
    let mut by_path: Vec<(&'static str, Vec<Route>)> = Vec::new();
    for r in routes {
        match by_path.iter_mut().find(|(p, _)| *p == r.path) {
            Some((_, rs)) => rs.push(r),
            None => by_path.push((r.path, vec![r])),
        }
    }
    for (path, rs) in by_path {
        let mut method_router = axum::routing::MethodRouter::new();
        for r in rs {
            let gw = gw.clone();
            let m = gw.methods[r.rpc].clone();
            let filter = axum::routing::MethodFilter::try_from(r.method.clone())
                .map_err(|e| GatewayError(format!("{path}: {e}")))?;
            let handler =
                move |axum::extract::Path(params): axum::extract::Path<HashMap<String, String>>,
                      req: http::Request<Body>| {
                    let gw = gw.clone();
                    let m = m.clone();
                    let r = r.clone();
                    async move {
                        if req.method() == Method::HEAD {
                            return error_response(
                                StatusCode::METHOD_NOT_ALLOWED,
                                "UNIMPLEMENTED",
                                None,
                                "HEAD is not answered: it would make the call",
                                None,
                            );
                        }
                        let pairs = match query_pairs(req.uri().query().unwrap_or("")) {
                            Ok(p) => p,
                            Err(s) => return status_response(&s),
                        };
                        let mut fields = HashMap::new();
                        for (k, v) in pairs {
                            let k = r
                                .rename
                                .iter()
                                .find(|(from, _)| *from == k)
                                .map_or(k, |(_, to)| (*to).to_string());
                            fields.insert(k, v);
                        }
                        // The path's fields last: the query never overrides them.
                        fields.extend(params);
                        for f in r.fresh {
                            fields.entry(format!("{FRESH}{f}")).or_default();
                        }
                        match r.body {
                            Body_::Json => gw.call_json(&m, req, fields).await,
                            Body_::TarOut => gw.download(&m, req, fields).await,
                            Body_::TarIn => gw.upload(&m, req, fields).await,
                        }
                    }
                };
            method_router = method_router.on(filter, handler);
        }
        app = app.route(path, method_router);
    }
    // What is not the gateway's: gRPC to the services, anything else a 404
    // that says so (never an empty 200 of gRPC's own).
    let app = app.fallback_service(tower::service_fn(move |req: http::Request<Body>| {
        let grpc = grpc.clone();
        async move {
            let is_grpc = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/grpc"));
            if is_grpc {
                return grpc.oneshot(req).await;
            }
            Ok(error_response(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                None,
                &format!(
                    "no {} {} here (GET /openapi.json lists the API's paths)",
                    req.method(),
                    req.uri().path()
                ),
                None,
            ))
        }
    }));
    Ok(app)
}

/// A gateway that cannot be made (a route naming a method that is not
/// there): a bug of the server, said at its start.
#[derive(Debug, thiserror::Error)]
#[error("the HTTP/JSON gateway: {0}")]
pub struct GatewayError(String);

struct Gateway {
    methods: HashMap<String, MethodDescriptor>,
    grpc: axum::Router,
    document: serde_json::Value,
    auth: AuthCheck,
    /// Bytes of [`JSON_BUDGET`] not held by a body being read or parsed.
    bodies: Arc<tokio::sync::Semaphore>,
}

fn serialize_options() -> SerializeOptions {
    SerializeOptions::new()
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false)
}

/// A message as JSON.
fn to_json(msg: &DynamicMessage) -> serde_json::Value {
    msg.serialize_with_options(serde_json::value::Serializer, &serialize_options())
        .unwrap_or_else(|e| serde_json::json!({ "unserializable": e.to_string() }))
}

/// `?a=1&b=x%20y` as pairs, decoded; text that is not UTF-8 once decoded
/// is refused.
fn query_pairs(q: &str) -> Result<Vec<(String, String)>, tonic::Status> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Ok((percent_decode(k)?, percent_decode(v)?))
        })
        .collect()
}

fn percent_decode(s: &str) -> Result<String, tonic::Status> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|c| (*c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'+', _, _) => out.push(b' '),
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 2;
            }
            (c, _, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out)
        .map_err(|_| invalid(format!("the query {s:?} is not UTF-8 once decoded")))
}

/// Sets the fields a route gives (the path's and the query's), then a
/// fresh id in each field marked [`FRESH`] that is still empty.
fn set_fields(
    msg: &mut DynamicMessage,
    fields: &HashMap<String, String>,
) -> Result<(), tonic::Status> {
    for (k, v) in fields {
        if k.starts_with(FRESH) {
            continue;
        }
        set_field(msg, k, v)?;
    }
    for k in fields.keys() {
        let Some(name) = k.strip_prefix(FRESH) else {
            continue;
        };
        let empty = matches!(
            msg.get_field_by_name(name).as_deref(),
            Some(Value::String(s)) if s.is_empty()
        );
        if empty {
            set_field(msg, name, crate::OperationId::random().as_str())?;
        }
    }
    Ok(())
}

/// Sets the field at `path` (`a.b`: field b of message field a) of `msg`
/// from its text in a URL.
fn set_field(msg: &mut DynamicMessage, path: &str, text: &str) -> Result<(), tonic::Status> {
    let (head, rest) = match path.split_once('.') {
        Some((h, r)) => (h, Some(r)),
        None => (path, None),
    };
    let desc = msg.descriptor();
    let field = desc.get_field_by_name(head).ok_or_else(|| {
        invalid(format!(
            "{path}: no such field of {} (a path or query parameter names one)",
            desc.name()
        ))
    })?;
    if let Some(rest) = rest {
        let Kind::Message(_) = field.kind() else {
            return Err(invalid(format!("{path}: {head} is not a message")));
        };
        let inner = msg.get_field_mut(&field);
        let Value::Message(inner) = inner else {
            return Err(invalid(format!("{path}: not a message")));
        };
        return set_field(inner, rest, text);
    }
    let bad = |what: &str| invalid(format!("{path}={text:?}: not {what}"));
    let value = match field.kind() {
        Kind::String => Value::String(text.to_string()),
        Kind::Bool => Value::Bool(text.parse().map_err(|_| bad("true or false"))?),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            Value::I32(text.parse().map_err(|_| bad("an integer"))?)
        }
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            Value::I64(text.parse().map_err(|_| bad("an integer"))?)
        }
        Kind::Uint32 | Kind::Fixed32 => Value::U32(text.parse().map_err(|_| bad("a count"))?),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(text.parse().map_err(|_| bad("a count"))?),
        Kind::Double => Value::F64(text.parse().map_err(|_| bad("a number"))?),
        Kind::Float => Value::F32(text.parse().map_err(|_| bad("a number"))?),
        Kind::Enum(e) => Value::EnumNumber(
            e.get_value_by_name(text)
                .map(|v| v.number())
                .or_else(|| text.parse().ok())
                .ok_or_else(|| bad("one of the enum's names"))?,
        ),
        Kind::Bytes | Kind::Message(_) => {
            return Err(bad("a value a URL can carry (give it in the body)"));
        }
    };
    if field.is_list() || field.is_map() {
        return Err(bad("a single value (give lists in the body)"));
    }
    msg.set_field(&field, value);
    Ok(())
}

/// A request the gateway refuses before any call, with the reason a
/// client reads (`invalid_argument`), as a server's refusal has.
fn invalid(message: impl Into<String>) -> tonic::Status {
    crate::reason::status(
        Code::InvalidArgument,
        crate::Reason::InvalidArgument,
        None,
        message,
    )
}

/// The gRPC code's canonical name and the HTTP status that goes with it.
fn code_of(code: Code) -> (&'static str, StatusCode) {
    match code {
        Code::Ok => ("OK", StatusCode::OK),
        Code::Cancelled => (
            "CANCELLED",
            StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        ),
        Code::Unknown => ("UNKNOWN", StatusCode::INTERNAL_SERVER_ERROR),
        Code::InvalidArgument => ("INVALID_ARGUMENT", StatusCode::BAD_REQUEST),
        Code::DeadlineExceeded => ("DEADLINE_EXCEEDED", StatusCode::GATEWAY_TIMEOUT),
        Code::NotFound => ("NOT_FOUND", StatusCode::NOT_FOUND),
        Code::AlreadyExists => ("ALREADY_EXISTS", StatusCode::CONFLICT),
        Code::PermissionDenied => ("PERMISSION_DENIED", StatusCode::FORBIDDEN),
        Code::ResourceExhausted => ("RESOURCE_EXHAUSTED", StatusCode::TOO_MANY_REQUESTS),
        Code::FailedPrecondition => ("FAILED_PRECONDITION", StatusCode::BAD_REQUEST),
        Code::Aborted => ("ABORTED", StatusCode::CONFLICT),
        Code::OutOfRange => ("OUT_OF_RANGE", StatusCode::BAD_REQUEST),
        Code::Unimplemented => ("UNIMPLEMENTED", StatusCode::NOT_IMPLEMENTED),
        Code::Internal => ("INTERNAL", StatusCode::INTERNAL_SERVER_ERROR),
        Code::Unavailable => ("UNAVAILABLE", StatusCode::SERVICE_UNAVAILABLE),
        Code::DataLoss => ("DATA_LOSS", StatusCode::INTERNAL_SERVER_ERROR),
        Code::Unauthenticated => ("UNAUTHENTICATED", StatusCode::UNAUTHORIZED),
    }
}

/// A status as the JSON an error answers with.
fn error_json(status: &tonic::Status) -> serde_json::Value {
    let (code, _) = code_of(status.code());
    let mut e = serde_json::json!({ "code": code, "message": status.message() });
    if let Some(r) = crate::reason::of(status) {
        e["reason"] = r.as_str().into();
    }
    if let Some(f) = crate::reason::flag_of(status) {
        e["flag"] = f.into();
    }
    serde_json::json!({ "error": e })
}

fn status_response(status: &tonic::Status) -> http::Response<Body> {
    let (_, http_status) = code_of(status.code());
    json_response(http_status, &error_json(status))
}

fn error_response(
    http_status: StatusCode,
    code: &str,
    reason: Option<&str>,
    message: &str,
    flag: Option<&str>,
) -> http::Response<Body> {
    let mut e = serde_json::json!({ "code": code, "message": message });
    if let Some(r) = reason {
        e["reason"] = r.into();
    }
    if let Some(f) = flag {
        e["flag"] = f.into();
    }
    json_response(http_status, &serde_json::json!({ "error": e }))
}

fn json_response(status: StatusCode, v: &serde_json::Value) -> http::Response<Body> {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = http::Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A gRPC message framed (uncompressed).
fn frame(msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.extend_from_slice(&[0]);
    b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    b.extend_from_slice(msg);
    b.freeze()
}

/// The messages of a gRPC response body, then its status.
struct Frames {
    body: Body,
    buf: BytesMut,
    ended: Option<tonic::Status>,
    done: bool,
}

impl Frames {
    /// The next message; `None` at a clean end; an error status as it ends.
    async fn next(&mut self) -> Option<Result<Bytes, tonic::Status>> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf[0] != 0 {
                    return Some(Err(tonic::Status::internal("a compressed message")));
                }
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    return Some(Ok(self.buf.split_to(len).freeze()));
                }
            }
            if self.done {
                if !self.buf.is_empty() {
                    self.buf.clear();
                    return Some(Err(tonic::Status::internal("the answer ended mid-message")));
                }
                return self.ended.take().map(Err);
            }
            match self.body.frame().await {
                None => {
                    self.done = true;
                    if self.ended.is_none() {
                        self.ended = Some(tonic::Status::unknown(
                            "the answer ended without its status",
                        ));
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    self.ended = Some(tonic::Status::unavailable(format!(
                        "the answer broke off: {e}"
                    )));
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => self.buf.extend_from_slice(&data),
                    Err(f) => {
                        if let Ok(trailers) = f.into_trailers() {
                            self.done = true;
                            self.ended = tonic::Status::from_header_map(&trailers)
                                .filter(|s| s.code() != Code::Ok);
                        }
                    }
                },
            }
        }
    }
}

/// What a client asked a stream to come as.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StreamAs {
    Ndjson,
    Sse,
}

impl Gateway {
    async fn openapi(&self, req: http::Request<Body>) -> http::Response<Body> {
        // The document describes the API: only to those who may call it
        // (as gRPC reflection is).
        if let Err(s) = (self.auth)(req.headers(), req.extensions()) {
            return status_response(&s);
        }
        json_response(StatusCode::OK, &self.document)
    }

    /// Calls `method` of the server in-process with `requests` (framed
    /// messages): the answer's messages once its headers say it began.
    async fn invoke(
        &self,
        method: &MethodDescriptor,
        parts: &http::request::Parts,
        requests: impl Stream<Item = Result<Bytes, tonic::Status>> + Send + 'static,
    ) -> Result<Frames, tonic::Status> {
        let headers = &parts.headers;
        let path = format!("/{}/{}", method.parent_service().full_name(), method.name());
        let mut req = http::Request::new(Body::from_stream(requests));
        // What the server knows of the connection (its peer, its TLS
        // certificates, its admission), as for a gRPC call on it.
        *req.extensions_mut() = parts.extensions.clone();
        *req.method_mut() = Method::POST;
        *req.uri_mut() = path
            .parse()
            .map_err(|_| tonic::Status::internal("a method's path"))?;
        *req.version_mut() = http::Version::HTTP_2;
        let h = req.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        // The caller's credentials and trace, nothing else of theirs.
        for name in [header::AUTHORIZATION.as_str(), "traceparent"] {
            if let Some(v) = headers.get(name) {
                h.insert(http::HeaderName::from_static(name), v.clone());
            }
        }
        let resp = match self.grpc.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        if let Some(s) = tonic::Status::from_header_map(resp.headers())
            && s.code() != Code::Ok
        {
            return Err(s);
        }
        Ok(Frames {
            body: resp.into_body(),
            buf: BytesMut::new(),
            ended: None,
            done: false,
        })
    }

    /// A request of `method` from a JSON body and `fields` (the path's and
    /// the query's), framed: the body read within the method's bound and
    /// [`JSON_BUDGET`], parsed off the async threads.
    async fn request(
        &self,
        method: &MethodDescriptor,
        body: Body,
        fields: HashMap<String, String>,
    ) -> Result<Bytes, tonic::Status> {
        let limit = body_limit(method);
        let too_big = |what: &str| {
            invalid(format!(
                "the request's body: {what} (at most {limit} bytes of JSON for {})",
                method.name()
            ))
        };
        // Said before a byte is read when its length is given; a body of a
        // given length holds that much of the budget, not its call's bound.
        let hint = axum::body::HttpBody::size_hint(&body);
        if hint.lower() > limit as u64 {
            return Err(too_big("length limit exceeded"));
        }
        let reserve = hint
            .upper()
            .map_or(limit, |n| usize::try_from(n).unwrap_or(limit).min(limit))
            .max(1);
        let _held = tokio::time::timeout(
            BODY_TIME,
            self.bodies
                .clone()
                .acquire_many_owned(u32::try_from(reserve).unwrap_or(u32::MAX)),
        )
        .await
        .map_err(|_| {
            tonic::Status::resource_exhausted(
                "the server is reading as many request bodies as it may hold: try again",
            )
        })?
        .map_err(|_| tonic::Status::unavailable("shutting down"))?;
        // A client that stops sending holds its share for a bounded time:
        // each piece within BODY_IDLE, the whole within BODY_TIME.
        let mut body = http_body_util::Limited::new(body, limit);
        let mut bytes = bytes::BytesMut::with_capacity(reserve.min(1 << 20));
        let deadline = tokio::time::Instant::now() + BODY_TIME;
        loop {
            let wait =
                BODY_IDLE.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            let piece = tokio::time::timeout(wait, http_body_util::BodyExt::frame(&mut body))
                .await
                .map_err(|_| {
                    invalid(format!(
                        "the request's body did not come: nothing for {} s, or not all of it within {} s",
                        BODY_IDLE.as_secs(),
                        BODY_TIME.as_secs()
                    ))
                })?;
            match piece {
                None => break,
                Some(Err(e)) => return Err(too_big(&e.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        bytes.extend_from_slice(&data);
                    }
                }
            }
        }
        let bytes = bytes.freeze();
        let desc = method.input();
        tokio::task::spawn_blocking(move || {
            let mut msg = if bytes.iter().all(u8::is_ascii_whitespace) {
                DynamicMessage::new(desc)
            } else {
                parse_message(desc, &bytes)?
            };
            set_fields(&mut msg, &fields)?;
            Ok(frame(&msg.encode_to_vec()))
        })
        .await
        .map_err(|e| tonic::Status::internal(format!("parsing the request: {e}")))?
    }

    async fn call_json(
        &self,
        method: &MethodDescriptor,
        req: http::Request<Body>,
        fields: HashMap<String, String>,
    ) -> http::Response<Body> {
        let stream_as = stream_as(req.headers());
        let (parts, body) = req.into_parts();
        // Who asks, before a byte of what they send is read.
        if let Err(s) = (self.auth)(&parts.headers, &parts.extensions) {
            return status_response(&s);
        }
        let requests: futures_util::stream::BoxStream<'static, Result<Bytes, tonic::Status>> =
            if method.is_client_streaming() {
                // Newline-delimited JSON, one message a line, as it comes.
                ndjson_messages(method.input(), body, fields).boxed()
            } else {
                match self.request(method, body, fields).await {
                    Ok(framed) => futures_util::stream::iter([Ok(framed)]).boxed(),
                    Err(s) => return status_response(&s),
                }
            };
        let mut frames = match self.invoke(method, &parts, requests).await {
            Ok(f) => f,
            Err(s) => return status_response(&s),
        };
        let output = method.output();
        if !method.is_server_streaming() {
            return match frames.next().await {
                Some(Ok(b)) => match DynamicMessage::decode(output, b) {
                    Ok(m) => json_response(StatusCode::OK, &to_json(&m)),
                    Err(e) => status_response(&tonic::Status::internal(format!("the answer: {e}"))),
                },
                Some(Err(s)) => status_response(&s),
                None => status_response(&tonic::Status::internal("the answer had no message")),
            };
        }
        // A stream: its first message (or its error) before the headers, so
        // that a call refused at once answers with its status; a quiet one
        // (a watch with nothing new) gets its headers after a moment all
        // the same.
        let first = match tokio::time::timeout(FIRST_MESSAGE_WAIT, frames.next()).await {
            Ok(Some(Ok(b))) => Some(b),
            Ok(Some(Err(s))) => return status_response(&s),
            Ok(None) | Err(_) => None,
        };
        let lines = futures_util::stream::unfold(
            (frames, first, false),
            move |(mut frames, first, over)| {
                let output = output.clone();
                async move {
                    if over {
                        return None;
                    }
                    let next = match first {
                        Some(b) => Some(Ok(b)),
                        // Quiet for a while: a line that says nothing, so
                        // that proxies and clients keep the stream.
                        None => match tokio::time::timeout(KEEPALIVE, frames.next()).await {
                            Ok(next) => next,
                            Err(_) => {
                                let alive = match stream_as {
                                    StreamAs::Ndjson => Bytes::from_static(b"\n"),
                                    StreamAs::Sse => Bytes::from_static(b": keepalive\n\n"),
                                };
                                return Some((Ok(alive), (frames, None, false)));
                            }
                        },
                    };
                    let (text, over) = match next {
                        None => return None,
                        Some(Ok(b)) => match DynamicMessage::decode(output, b) {
                            Ok(m) => (line(stream_as, None, &to_json(&m)), false),
                            Err(e) => (
                                line(
                                    stream_as,
                                    Some("error"),
                                    &error_json(&tonic::Status::internal(format!(
                                        "the answer: {e}"
                                    ))),
                                ),
                                true,
                            ),
                        },
                        Some(Err(s)) => (line(stream_as, Some("error"), &error_json(&s)), true),
                    };
                    Some((Ok::<_, std::io::Error>(text), (frames, None, over)))
                }
            },
        );
        let mut r = http::Response::new(Body::from_stream(lines));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(match stream_as {
                StreamAs::Ndjson => "application/x-ndjson",
                StreamAs::Sse => "text/event-stream",
            }),
        );
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    }

    /// `Download` as raw tar: the archive's bytes; a failure before the
    /// first byte is an error answer, one after it breaks the answer off
    /// (a client sees a cut transfer, never a short archive taken whole).
    async fn download(
        &self,
        method: &MethodDescriptor,
        req: http::Request<Body>,
        fields: HashMap<String, String>,
    ) -> http::Response<Body> {
        let (parts, body) = req.into_parts();
        if let Err(s) = (self.auth)(&parts.headers, &parts.extensions) {
            return status_response(&s);
        }
        let framed = match self.request(method, body, fields).await {
            Ok(f) => f,
            Err(s) => return status_response(&s),
        };
        let requests = futures_util::stream::iter([Ok(framed)]);
        let mut frames = match self.invoke(method, &parts, requests).await {
            Ok(f) => f,
            Err(s) => return status_response(&s),
        };
        let output = method.output();
        // The first bytes of the archive (or its end, or why it failed).
        let first = match frames.next().await {
            None => None,
            Some(Err(s)) => return status_response(&s),
            Some(Ok(b)) => match archive_piece(&output, b) {
                Ok(Piece::Data(d)) => Some(d),
                Ok(Piece::Finished(None)) => None,
                Ok(Piece::Finished(Some(failure))) | Err(failure) => {
                    return status_response(&failure);
                }
            },
        };
        let bytes = futures_util::stream::unfold(
            (frames, first, output),
            |(mut frames, first, output)| async move {
                if let Some(d) = first {
                    return Some((Ok(d), (frames, None, output)));
                }
                loop {
                    let next = match frames.next().await {
                        None => return None,
                        Some(Err(s)) => Err(std::io::Error::other(s.message().to_string())),
                        Some(Ok(b)) => match archive_piece(&output, b) {
                            Ok(Piece::Data(d)) => Ok(d),
                            Ok(Piece::Finished(None)) => continue,
                            Ok(Piece::Finished(Some(s))) | Err(s) => {
                                Err(std::io::Error::other(s.message().to_string()))
                            }
                        },
                    };
                    return Some((next, (frames, None, output)));
                }
            },
        );
        let mut r = http::Response::new(Body::from_stream(bytes));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-tar"),
        );
        r
    }

    /// `Upload` from raw tar: the body in messages of at most 1 MiB, the
    /// first with the path's and the query's fields; the answer the
    /// finished operation.
    async fn upload(
        &self,
        method: &MethodDescriptor,
        req: http::Request<Body>,
        fields: HashMap<String, String>,
    ) -> http::Response<Body> {
        let desc = method.input();
        let (parts, body) = req.into_parts();
        if let Err(s) = (self.auth)(&parts.headers, &parts.extensions) {
            return status_response(&s);
        }
        let mut head = DynamicMessage::new(desc.clone());
        if let Err(s) = set_fields(&mut head, &fields) {
            return status_response(&s);
        }
        let (Some(data), Some(eof)) = (
            desc.get_field_by_name("data"),
            desc.get_field_by_name("eof"),
        ) else {
            return status_response(&tonic::Status::internal("an upload without data and eof"));
        };
        let chunks = rechunk(body.into_data_stream(), UPLOAD_CHUNK);
        let requests = futures_util::stream::unfold(
            (chunks.boxed(), Some(head), false),
            move |(mut chunks, head, over)| {
                let (data, eof, desc) = (data.clone(), eof.clone(), desc.clone());
                async move {
                    if over {
                        return None;
                    }
                    let mut msg = head.unwrap_or_else(|| DynamicMessage::new(desc));
                    let over = match chunks.next().await {
                        Some(Ok(b)) => {
                            msg.set_field(&data, Value::Bytes(b));
                            false
                        }
                        Some(Err(e)) => {
                            let s = invalid(format!("the archive's body: {e}"));
                            return Some((Err(s), (chunks, None, true)));
                        }
                        None => {
                            msg.set_field(&eof, Value::Bool(true));
                            true
                        }
                    };
                    Some((Ok(frame(&msg.encode_to_vec())), (chunks, None, over)))
                }
            },
        );
        let mut frames = match self.invoke(method, &parts, requests).await {
            Ok(f) => f,
            Err(s) => return status_response(&s),
        };
        match frames.next().await {
            Some(Ok(b)) => match DynamicMessage::decode(method.output(), b) {
                Ok(m) => json_response(StatusCode::OK, &to_json(&m)),
                Err(e) => status_response(&tonic::Status::internal(format!("the answer: {e}"))),
            },
            Some(Err(s)) => status_response(&s),
            None => status_response(&tonic::Status::internal("the answer had no message")),
        }
    }
}

enum Piece {
    Data(Bytes),
    /// The finished operation: `Some` a status when it failed.
    Finished(Option<tonic::Status>),
}

/// A `DownloadResponse`: archive bytes, or its finished operation (a
/// failure as the status it would be, with what the sandbox said).
fn archive_piece(_desc: &MessageDescriptor, b: Bytes) -> Result<Piece, tonic::Status> {
    let msg = crate::pb::DownloadResponse::decode(b)
        .map_err(|e| tonic::Status::internal(format!("the answer: {e}")))?;
    if !msg.data.is_empty() {
        return Ok(Piece::Data(msg.data));
    }
    let Some(op) = msg.finished else {
        return Ok(Piece::Finished(None));
    };
    let result = op
        .result
        .map(crate::OperationResult::try_from)
        .transpose()
        .map_err(|e| tonic::Status::internal(format!("the answer: {e}")))?;
    match result {
        Some(r) if !r.outcome.is_success() => {
            let said = String::from_utf8_lossy(&r.stderr.head);
            let kind = match &r.outcome {
                crate::Outcome::FileError {
                    kind: crate::FileErrorKind::NotFound,
                    ..
                } => Code::NotFound,
                _ => Code::FailedPrecondition,
            };
            Ok(Piece::Finished(Some(tonic::Status::new(
                kind,
                format!(
                    "the archive could not be read: {} {}",
                    r.outcome,
                    said.trim()
                ),
            ))))
        }
        _ => Ok(Piece::Finished(None)),
    }
}

/// A message of `desc` from JSON.
fn parse_message(desc: MessageDescriptor, json: &[u8]) -> Result<DynamicMessage, tonic::Status> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let msg = DynamicMessage::deserialize_with_options(desc, &mut de, &DeserializeOptions::new())
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| invalid(format!("the request's JSON: {e}")))?;
    Ok(msg)
}

/// What the client accepts a stream as.
fn stream_as(headers: &HeaderMap) -> StreamAs {
    let accepts_sse = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"));
    if accepts_sse {
        StreamAs::Sse
    } else {
        StreamAs::Ndjson
    }
}

/// One message of a stream as a line (NDJSON) or an event (SSE).
fn line(how: StreamAs, event: Option<&str>, v: &serde_json::Value) -> Bytes {
    let json = serde_json::to_string(v).unwrap_or_default();
    Bytes::from(match (how, event) {
        (StreamAs::Ndjson, _) => format!("{json}\n"),
        (StreamAs::Sse, None) => format!("data: {json}\n\n"),
        (StreamAs::Sse, Some(e)) => format!("event: {e}\ndata: {json}\n\n"),
    })
}

/// A body's bytes in pieces of at most `max` (each `max` but the last).
fn rechunk(
    body: axum::body::BodyDataStream,
    max: usize,
) -> impl Stream<Item = Result<Bytes, axum::Error>> + Send + 'static {
    futures_util::stream::unfold(
        (body, BytesMut::new(), false),
        move |(mut body, mut buf, mut ended)| async move {
            loop {
                if buf.len() >= max || (ended && !buf.is_empty()) {
                    let n = buf.len().min(max);
                    let piece = buf.split_to(n).freeze();
                    return Some((Ok(piece), (body, buf, ended)));
                }
                if ended {
                    return None;
                }
                match body.next().await {
                    Some(Ok(b)) => buf.extend_from_slice(&b),
                    Some(Err(e)) => return Some((Err(e), (body, BytesMut::new(), true))),
                    None => ended = true,
                }
            }
        },
    )
}

/// A newline-delimited JSON body as framed messages of `desc`, one a line
/// (blank lines skipped), the first joined by `fields`; a line that is
/// not a message ends the stream with an error (the call fails).
fn ndjson_messages(
    desc: MessageDescriptor,
    body: Body,
    fields: HashMap<String, String>,
) -> impl Stream<Item = Result<Bytes, tonic::Status>> + Send + 'static {
    futures_util::stream::unfold(
        (
            body.into_data_stream(),
            BytesMut::new(),
            false,
            Some(fields),
            false,
        ),
        move |(mut body, mut buf, mut ended, mut fields, failed)| {
            let desc = desc.clone();
            async move {
                if failed {
                    return None;
                }
                loop {
                    if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                        let line = buf.split_to(nl + 1);
                        if line.iter().all(u8::is_ascii_whitespace) {
                            continue;
                        }
                        let made = parse_message(desc.clone(), &line).and_then(|mut m| {
                            set_fields(&mut m, &fields.take().unwrap_or_default())?;
                            Ok(m)
                        });
                        return Some(match made {
                            Ok(m) => (
                                Ok(frame(&m.encode_to_vec())),
                                (body, buf, ended, fields, false),
                            ),
                            Err(s) => (Err(s), (body, buf, ended, fields, true)),
                        });
                    }
                    if buf.len() > MAX_NDJSON_LINE {
                        let e = invalid(format!(
                            "a line of the request stream is longer than {MAX_NDJSON_LINE} bytes"
                        ));
                        return Some((Err(e), (body, buf, ended, fields, true)));
                    }
                    if ended {
                        if buf.iter().all(u8::is_ascii_whitespace) {
                            return None;
                        }
                        // The last line, without its newline.
                        buf.extend_from_slice(b"\n");
                        continue;
                    }
                    match body.next().await {
                        Some(Ok(b)) => buf.extend_from_slice(&b),
                        Some(Err(e)) => {
                            return Some((
                                Err(invalid(format!("the request's body: {e}"))),
                                (body, buf, true, fields, true),
                            ));
                        }
                        None => ended = true,
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests;
