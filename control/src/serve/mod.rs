//! `corral serve`: the control plane as a long-running service: its flags
//! made into the harness's session host ([`corral_harness::host`]: many
//! sessions at once, each one's events where a watcher can read them from
//! any point), served over gRPC ([`service`]: `corral.v1.Control`, behind the same bearer
//! token or mutual TLS as a worker, with gRPC health checking open to
//! anyone). Sessions run on the workers of `--worker` (or the local one),
//! through the harness's runner, as `corral run` runs them. It is also the
//! fleet's front door ([`front`]: `corral.v1.Worker`, each sandbox placed
//! on and passed to its worker), and with `--tenants DIR` it serves
//! tenants: callers present keys, each reaches its tenant's alone; with
//! `--peers`, its replicas pass each other a tenant's calls ([`peers`]).

pub mod admin;
pub mod front;
pub mod peers;
pub mod ports;
pub mod service;

use std::io::Write;
use std::path::PathBuf;

use corral_proto::limits::MAX_GRPC_MESSAGE_BYTES;
use corral_proto::limits::MAX_REQUEST_BYTES;
use corral_proto::pb::admin_server::AdminServer;
use corral_proto::pb::control_server::ControlServer;
use corral_proto::pb::worker_server::WorkerServer;

use crate::cli::{ApiKind, ConnArgs, LostPolicy, ServeArgs};
use corral_harness::host::{Defaults, Host, HostError};

/// How long an MCP session over HTTP may stay idle before it ends (and
/// its sandboxes are removed).
const MCP_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Config(#[from] corral_worker::process::ConfigError),
    #[error(transparent)]
    Connect(#[from] crate::connect::ConnectError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Gateway(#[from] corral_worker::server::ServeError),
}

impl ServeError {
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            ServeError::Usage(_)
                | ServeError::Config(_)
                | ServeError::Connect(crate::connect::ConnectError::Usage(_))
        )
    }
}

/// What a call was about, as its audit line names it.
pub(crate) enum About<'a> {
    Session(&'a str),
    Sandbox(&'a str),
    /// An admin call's subject: `key:ID`, `tenant:NAME`, or nothing.
    Subject(&'a str),
}

/// Writes `call`'s line in the audit log (when there is one): who asked,
/// what about, and its outcome (`ok`, or the reason it was refused).
pub(crate) async fn audited<T>(
    log: Option<&corral_harness::audit::AuditLog>,
    who: &corral_harness::tenants::Principal,
    call: &str,
    about: About<'_>,
    r: Result<T, tonic::Status>,
) -> Result<T, tonic::Status> {
    let Some(log) = log else {
        return r;
    };
    let outcome = match &r {
        Ok(_) => "ok".to_string(),
        Err(s) => corral_proto::reason::of(s)
            .map_or_else(|| format!("{:?}", s.code()), |r| r.as_str().to_string()),
    };
    let id = |s: &str| (!s.is_empty()).then(|| corral_harness::audit::bounded(s));
    let (session, sandbox, subject) = match about {
        About::Session(s) => (id(s), None, None),
        About::Sandbox(s) => (None, id(s), None),
        About::Subject(s) => (None, None, id(s)),
    };
    let entry = corral_harness::audit::Entry {
        tenant: who.tenant.clone(),
        key: who.key_id.clone(),
        call: call.into(),
        session,
        sandbox,
        subject,
        outcome,
    };
    if let Err(e) = log.record(entry).await {
        tracing::error!(error = %e, call, "the call was not written to the audit log");
    }
    r
}

/// How long a worker may take to say how full it is, for the service.
const SERVE_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long open streams may hold a stopping service up.
const SHUTDOWN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

fn state_dir(args: &ServeArgs) -> PathBuf {
    args.serve_state_dir
        .clone()
        .unwrap_or_else(|| corral_worker::process::default_state_dir("control"))
}

/// Serves until SIGINT, SIGTERM or SIGHUP. The sessions it hosts are
/// left as a crash would leave them (their operations go on on their
/// workers) and resumed at the next start.
pub async fn serve(conn: &ConnArgs, args: &ServeArgs) -> Result<(), ServeError> {
    if args.withhold_error_text {
        corral_proto::reason::withhold_text();
    }
    let state = state_dir(args);
    std::fs::create_dir_all(&state)
        .map_err(|e| ServeError::Usage(format!("--serve-state-dir {}: {e}", state.display())))?;
    let token_path = args
        .serve_token_file
        .clone()
        .unwrap_or_else(|| state.join("token"));
    let token = match &args.serve_token_file {
        Some(path) => corral_worker::process::read_token(path)?,
        None => corral_worker::process::token_or_new(&token_path)?,
    };
    let tls = corral_worker::process::server_tls(
        args.serve_tls_cert.as_deref(),
        args.serve_tls_key.as_deref(),
        args.serve_tls_client_ca.as_deref(),
    )?;
    let defaults = Defaults {
        model: args.model.clone(),
        base_url: args.base_url.clone(),
        api: args.api.map(|a| match a {
            ApiKind::Responses => corral_harness::llm::Api::Responses,
            ApiKind::Chat => corral_harness::llm::Api::Chat,
        }),
        api_key: crate::commands::key_from(args.api_key_file.as_deref())
            .map_err(ServeError::Usage)?,
        image: args
            .image
            .clone()
            .unwrap_or_else(|| crate::commands::DEFAULT_IMAGE.to_string()),
        heartbeat: (!args.heartbeat.is_zero()).then_some(args.heartbeat),
        grace: args.grace,
        worker_lost_after: conn.worker_lost_after,
        on_sandbox_lost: args.on_sandbox_lost.map(|p| match p {
            LostPolicy::Fail => corral_harness::agent::OnSandboxLost::Fail,
            LostPolicy::NewSandbox => corral_harness::agent::OnSandboxLost::NewSandbox,
        }),
        allowed_endpoints: args.allow_base_url.clone(),
        telemetry: match &args.otlp_endpoint {
            Some(e) => Some(
                corral_harness::telemetry::Telemetry::otlp(e, "corral-serve")
                    .map_err(|e| ServeError::Usage(format!("--otlp-endpoint: {e}")))?,
            ),
            None => None,
        },
    };
    // The hosted runs' spans go out before the service ends.
    let _flush = corral_harness::telemetry::FlushOnDrop(defaults.telemetry.clone());
    let store = crate::commands::sessions(args.sessions_dir.as_deref());
    // A long-lived caller: one connection per worker, kept; and a worker
    // busy with many starts at once is given time to say how full it is.
    let fleet = crate::connect::fleet(conn)?
        .keeping_connections()
        .with_probe_timeout(SERVE_PROBE_TIMEOUT);
    let max = usize::try_from(args.max_sessions).unwrap_or(usize::MAX);
    let host = Host::new(store, fleet.clone(), defaults, max, &state)?;
    let listener =
        corral_worker::server::listen(args.listen).map_err(|source| ServeError::Bind {
            addr: args.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: args.listen,
        source,
    })?;
    // The signal handlers are in place before anyone is told the address.
    let stop = crate::signals::stop_signal();

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<ControlServer<service::ControlService>>()
        .await;
    health_reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let peers = match (&args.advertise, args.peers.is_empty()) {
        (Some(own), false) => {
            // The replicas' shared secret: the workers' token, which every
            // replica holds and no client does.
            let secret = fleet
                .credentials(&args.peers)
                .ok()
                .and_then(|c| c.token)
                .ok_or_else(|| {
                    ServeError::Usage(
                        "--peers: the replicas mark the calls they pass each other with the workers' token; give it (--token-file)".into(),
                    )
                })?;
            Some(
                front::Peers::new(own.clone(), args.peers.clone(), &secret)
                    .map_err(ServeError::Usage)?,
            )
        }
        (Some(_), true) => {
            return Err(ServeError::Usage(
                "--advertise names this replica among --peers: give --peers too".into(),
            ));
        }
        (None, _) => None,
    };
    let keys_stop = tokio_util::sync::CancellationToken::new();
    let (gate, keys, keys_task) = match &args.tenants {
        Some(dir) => {
            let (keys, task) = corral_harness::tenants::watch(dir.clone(), keys_stop.clone())
                .map_err(|e| ServeError::Usage(format!("--tenants: {e}")))?;
            (front::Gate::keys(keys.clone()), Some(keys), Some(task))
        }
        None => (front::Gate::token(token), None, None),
    };
    let (audit, audit_writer) = match &args.audit_log {
        Some(path) => {
            let (log, writer) = corral_harness::audit::AuditLog::open(path)
                .map_err(|e| ServeError::Usage(format!("--audit-log: {e}")))?;
            (Some(log), Some(writer))
        }
        None => (None, None),
    };
    // The way in through the front door: its own port listener.
    let ports_listener = match args.ports_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })?,
        ),
        None => None,
    };
    let mut front = front::FrontDoor::new(fleet.clone(), audit.clone(), keys.clone(), peers);
    if let Some(l) = &ports_listener {
        let url = match &args.ports_url {
            Some(u) => u.clone(),
            None => format!(
                "http://{}",
                l.local_addr().map_err(|source| ServeError::Bind {
                    addr: args.ports_listen.unwrap_or(args.listen),
                    source,
                })?
            ),
        };
        front = front.with_ports_url(url);
    }
    // The sandbox API's quotas hold for the sandboxes sessions make too.
    let front = std::sync::Arc::new(front);
    let ports_task = ports_listener.map(|listener| {
        let worker_token = fleet.credentials(&[]).ok().and_then(|c| c.token);
        let proxy = std::sync::Arc::new(ports::PortsProxy::new(
            front.clone(),
            gate.clone(),
            worker_token,
        ));
        tokio::spawn(ports::serve(proxy, listener, keys_stop.clone()))
    });
    let control = ControlServer::new(service::ControlService::new(
        host.clone(),
        audit.clone(),
        keys.clone(),
        front.clone(),
    ))
    .max_decoding_message_size(MAX_REQUEST_BYTES);
    let control = tonic::service::interceptor::InterceptedService::new(control, {
        let gate = gate.clone();
        move |req| gate.check(req)
    });
    let admin = AdminServer::new(admin::AdminService::new(
        args.tenants.clone(),
        keys.clone(),
        audit.clone(),
    ));
    let admin = tonic::service::interceptor::InterceptedService::new(admin, {
        let gate = gate.clone();
        move |req| gate.check(req)
    });
    let sandboxes = WorkerServer::from_arc(front)
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
    let sandboxes = tonic::service::interceptor::InterceptedService::new(sandboxes, {
        let gate = gate.clone();
        move |req| gate.check(req)
    });
    // HTTP/1.1 too, for the HTTP/JSON gateway on the same address.
    let mut builder = tonic::transport::Server::builder()
        .accept_http1(true)
        .max_concurrent_streams(corral_worker::server::MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)));
    // TLS, when there is one, is done by admission (offering HTTP/1.1
    // beside HTTP/2).
    let https = tls.is_some();
    let grpc = tonic::service::Routes::new(health)
        .add_service(control)
        .add_service(admin)
        .add_service(sandboxes)
        .into_axum_router();
    // MCP over HTTP at /mcp: its tools call these routes in-process, with
    // the caller's key.
    let may_run: crate::commands::mcp_http::MayRun = match &keys {
        Some(keys) => {
            let keys = keys.clone();
            std::sync::Arc::new(move |key: &str| {
                keys.current()
                    .authenticate(key, corral_harness::tenants::now_ms())
                    .is_ok_and(|p| p.allows(corral_harness::tenants::Scope::Run))
            })
        }
        None => std::sync::Arc::new(|_: &str| true),
    };
    let mcp = crate::commands::mcp_http::router(grpc.clone(), https, MCP_IDLE, may_run);
    let check = gate.clone();
    let auth: corral_proto::gateway::AuthCheck = std::sync::Arc::new(move |headers, extensions| {
        check
            .check(corral_worker::server::request_of(headers, extensions))
            .map(|_| ())
    });
    let http = corral_worker::server::with_http_gateway(
        grpc,
        &["corral.v1.Worker", "corral.v1.Control", "corral.v1.Admin"],
        auth,
    )?
    .merge(mcp);
    let router = builder.add_routes(http.into());
    // Admitted as a worker admits its clients: bounded handshakes and
    // unauthenticated connections per address, and TCP_NODELAY (without
    // it every reply waits on Nagle and the peer's delayed ACK, 40 ms).
    let (incoming, accept) = corral_worker::admission::admit(
        listener,
        corral_worker::admission::Admission::default(),
        prometheus_client::metrics::counter::Counter::default(),
        tls,
    );
    // Sessions it hosted when it last stopped are taken before anyone may
    // ask about them (a watcher waits for their runs), then go on.
    let marked = host.reserve_marked();
    // One line for whoever started it; a closed stdout is no failure.
    let who = match &args.tenants {
        Some(dir) => format!("clients present keys of {}", dir.display()),
        None => format!("clients present the token in {}", token_path.display()),
    };
    let _ = writeln!(
        std::io::stdout(),
        "corral serve listening on {addr} ({who})"
    );
    let _ = std::io::stdout().flush();
    let resuming = tokio::spawn({
        let host = host.clone();
        async move { host.resume_marked(marked).await }
    });
    let stopped = tokio_util::sync::CancellationToken::new();
    let stalls = tokio::spawn(corral_worker::stall::watch("corral serve", stopped.clone()));
    let shutdown = {
        let host = host.clone();
        let stopped = stopped.clone();
        async move {
            stop.await;
            tracing::info!("stopping: the hosted sessions resume at the next start");
            health_reporter
                .set_not_serving::<ControlServer<service::ControlService>>()
                .await;
            health_reporter
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            host.shut_down().await;
            stopped.cancel();
        }
    };
    let served = router.serve_with_incoming_shutdown(incoming, shutdown);
    // Streams its clients keep open (a health watch, say) hold a graceful
    // stop up for this long at most.
    let served = tokio::select! {
        r = served => r,
        () = async {
            stopped.cancelled().await;
            tokio::time::sleep(SHUTDOWN_PATIENCE).await;
        } => {
            tracing::warn!(
                "streams still open {} s after the stop; left",
                SHUTDOWN_PATIENCE.as_secs()
            );
            Ok(())
        }
    };
    resuming.abort();
    accept.abort();
    stopped.cancel();
    keys_stop.cancel();
    if let Some(task) = ports_task {
        let _ = task.await;
    }
    if let Some(task) = keys_task {
        let _ = task.await;
    }
    let _ = stalls.await;
    // Every call answered is in the log before the service is gone (the
    // writer ends once every handle to the log is dropped, this one too).
    drop(audit);
    if let Some(writer) = audit_writer
        && let Err(e) = writer.finish().await
    {
        tracing::error!(error = %e, "the audit log's last records");
    }
    Ok(served?)
}
