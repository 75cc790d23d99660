//! A typed client for a worker's gRPC API: domain types in, domain types
//! out, the bearer token on every call.

use std::time::Duration;

use corral_proto::init::OperationRecord;
use corral_proto::limits::MAX_GRPC_MESSAGE_BYTES;
use corral_proto::pb::worker_client::WorkerClient as PbClient;
use corral_proto::{
    Event, OperationId, OperationSpec, Reason, SandboxId, SandboxInfo, SandboxSpec, WorkerInfo, pb,
};
use futures_util::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

/// HTTP/2 pings on every connection, idle or not, one every
/// `KEEPALIVE`; a ping unanswered for `KEEPALIVE_TIMEOUT` ends the
/// connection. A worker whose host or network is gone is noticed within
/// 30 s, well inside the deadline after which its sandboxes are taken for
/// lost; a host busy enough to leave a ping unanswered for a few seconds
/// (dozens of sandboxes starting on two cores) does not lose its calls.
pub const KEEPALIVE: Duration = Duration::from_secs(10);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid worker address {url:?}: {reason}")]
    BadAddress { url: String, reason: String },
    #[error("cannot reach the worker at {url}: {reason}")]
    Connect { url: String, reason: String },
    /// Said in full by its message (not also as a source, which would
    /// repeat it with tonic's wording).
    #[error("{}", describe(.0))]
    Status(Status),
    #[error("the worker sent an invalid message: {0}")]
    Protocol(#[from] corral_proto::ProtocolError),
}

impl From<Status> for ClientError {
    fn from(s: Status) -> Self {
        Self::Status(s)
    }
}

fn describe(s: &Status) -> String {
    use tonic::Code;
    let msg = status_text(s);
    match s.code() {
        Code::Unauthenticated => format!(
            "the worker refused the call: {msg} (pass --token-file with that worker's token: the file its --token-file names, by default `token` in its state directory, which it prints at start)"
        ),
        Code::Unavailable => format!("worker unavailable: {msg}"),
        _ => msg,
    }
}

impl ClientError {
    /// The machine-readable reason the worker sent with its status (none
    /// for a status made by the transport, or by a worker too old to say).
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Self::Status(s) => corral_proto::reason::of(s),
            _ => None,
        }
    }

    /// The worker flag a refusal by the worker's policy names.
    pub fn flag(&self) -> Option<String> {
        match self {
            Self::Status(s) => corral_proto::reason::flag_of(s),
            _ => None,
        }
    }

    /// The worker takes no new sandbox: at capacity or draining. Another
    /// worker may.
    pub fn is_refusal(&self) -> bool {
        matches!(self.reason(), Some(Reason::AtCapacity | Reason::Draining))
    }

    /// Worth retrying after a reconnect (the worker restarted or the network blinked).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. } => true,
            Self::Status(s) => {
                // ABORTED: the worker dropped a watch that fell behind.
                // INTERNAL or CANCELLED with no reason but a cause: the
                // transport's own (an h2 stream reset, a connection that
                // closed under a call), never the worker's.
                matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Aborted
                ) || (matches!(s.code(), tonic::Code::Internal | tonic::Code::Cancelled)
                    && corral_proto::reason::of(s).is_none()
                    && std::error::Error::source(s).is_some())
            }
            _ => false,
        }
    }
}

#[derive(Clone)]
pub struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// TLS for a connection: whom to trust, and who we are (mutual TLS).
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM of the CA that signed the worker's certificate; `None`: the
    /// system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate and key presented to a worker that asks for one.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the worker's certificate must carry, when it is not the
    /// address's host (workers found through a DNS name, reached by IP).
    pub domain: Option<String>,
}

/// Streams a connection remembers having reset (a caller that drops a
/// watch, a front door whose client went away), so that the frames still
/// on their way for them are ignored. HTTP/2's default, 50 within 30 s,
/// is passed by a busy client in a second; a frame for a forgotten one
/// counts against the connection, which goes away at 1,024 of them.
const RESET_STREAMS_REMEMBERED: usize = 8192;

/// How long the end of a run's stream is waited for once its operation
/// has ended (it comes at once).
const STREAM_END_PATIENCE: Duration = Duration::from_secs(1);

/// What a client presents to a worker.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub token: Option<String>,
    /// Used for `https://` addresses.
    pub tls: Option<ClientTls>,
    /// Besides this user and root, whose socket on this machine may get
    /// the token (the token file's owner): see [`channel`].
    pub token_owner: Option<u32>,
}

impl Credentials {
    pub fn token(token: Option<&str>) -> Self {
        Self {
            token: token.map(String::from),
            ..Self::default()
        }
    }
}

/// Whether `url` names this machine by a loopback address or `localhost`.
pub fn is_loopback(url: &str) -> bool {
    let Some((host, _)) = host_port(url) else {
        return false;
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The host (an IP address without brackets, or a name) and port of `url`.
pub fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let authority = rest.split('/').next()?;
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (h, p) = v6.split_once(']')?;
            (h, p.strip_prefix(':')?)
        }
        None => authority.rsplit_once(':')?,
    };
    Some((host.to_string(), port.parse().ok()?))
}

/// Whether a socket on this machine of `uid` may not get a token: `uid` is
/// neither this user, root, nor `token_owner`.
fn stranger(uid: u32, token_owner: Option<u32>) -> bool {
    uid != nix::unistd::geteuid().as_raw() && uid != 0 && Some(uid) != token_owner
}

/// The owner of a socket listening at `host:port` on this machine that may
/// not get a token (see [`connect_checked`]), if there is one.
pub fn stranger_listening(host: &str, port: u16, token_owner: Option<u32>) -> Option<u32> {
    crate::listeners::owners(host, port)
        .into_iter()
        .find(|uid| stranger(*uid, token_owner))
}

/// Connects to `host:port` on this machine for a caller that will send a
/// token, and hands the connection over only if the socket at its other
/// end belongs to this user, root or `token_owner`: checked on this very
/// connection, so a port a stopped worker left free and another local user
/// took gets no token, on the first connection or on any reconnect. Where
/// the kernel cannot say who owns that socket, the listeners on the port
/// are asked instead.
pub async fn connect_checked(
    host: &str,
    port: u16,
    token_owner: Option<u32>,
) -> std::io::Result<tokio::net::TcpStream> {
    let stream = tokio::net::TcpStream::connect((host, port)).await?;
    stream.set_nodelay(true)?;
    let (local, peer) = (stream.local_addr()?, stream.peer_addr()?);
    let refused = |uid: u32| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the socket at {peer} belongs to uid {uid}, not to you, root or the token's owner: the token is not sent (is the worker running?)"
            ),
        )
    };
    let mut owner = None;
    for _ in 0..50 {
        match crate::listeners::peer_owner(local, peer) {
            Ok(Some(uid)) => {
                owner = Some(uid);
                break;
            }
            // Still a connection request: accepted in a moment.
            Ok(None) => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(e) => {
                tracing::debug!(error = %e, "sock_diag cannot name the peer; asking for the listeners");
                break;
            }
        }
    }
    let uids = match owner {
        Some(uid) => vec![uid],
        None => crate::listeners::owners(host, port),
    };
    match uids.into_iter().find(|uid| stranger(*uid, token_owner)) {
        Some(uid) => Err(refused(uid)),
        None => Ok(stream),
    }
}

/// What a listener speaks, judged from its first answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Speaks {
    /// A TLS record (a ServerHello, or an alert).
    Tls,
    /// An HTTP/2 SETTINGS frame.
    PlainHttp2,
}

/// Whether the listener at `host:port` answers `hello` as a TLS or a
/// plain HTTP/2 server would (within a second; `None`: neither, or no
/// answer).
async fn sniff(addr: &str, hello: &[u8]) -> Option<Speaks> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(hello).await.ok()?;
        let mut head = [0u8; 5];
        let mut got = 0;
        while got < head.len() {
            match s.read(&mut head[got..]).await.ok()? {
                0 => break,
                n => got += n,
            }
        }
        match head {
            [0x15 | 0x16, 0x03, ..] if got >= 2 => Some(Speaks::Tls),
            [_, _, _, 0x04, _] if got == 5 => Some(Speaks::PlainHttp2),
            _ => None,
        }
    };
    tokio::time::timeout(Duration::from_secs(1), probe)
        .await
        .ok()
        .flatten()
}

/// An HTTP/2 client preface and an empty SETTINGS frame: a plain HTTP/2
/// server answers with its SETTINGS.
const H2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// The start of a TLS ClientHello that no server can take (its body is
/// cut short): a TLS server answers with an alert.
const TLS_HELLO: &[u8] = &[0x16, 0x03, 0x01, 0x00, 0x04, 0x01, 0x00, 0x00, 0x00];

/// Why a connection to `url` failed when its listener speaks the other
/// protocol: TLS behind `http://`, plain HTTP/2 behind `https://`.
async fn mismatch(url: &str) -> Option<String> {
    let (tls, rest) = match url.split_once("://")? {
        ("https", rest) => (true, rest),
        ("http", rest) => (false, rest),
        _ => return None,
    };
    let addr = rest.split('/').next()?;
    if tls {
        (sniff(addr, H2_HELLO).await == Some(Speaks::PlainHttp2)).then(|| {
            format!("it speaks plain HTTP/2, not TLS: use http://{addr} (without the TLS options)")
        })
    } else {
        (sniff(addr, TLS_HELLO).await == Some(Speaks::Tls)).then(|| {
            format!("it speaks TLS: use https://{addr} (with --tls-ca if its certificate is not from a public CA)")
        })
    }
}

/// A connection to one worker.
/// What a fork made (see [`WorkerClient::fork_sandbox`]).
#[derive(Debug, Clone)]
pub struct Forked {
    pub children: Vec<SandboxInfo>,
    /// How long the parent was frozen.
    pub frozen: std::time::Duration,
    /// What each child was given.
    pub copied_entries: u64,
    pub copied_bytes: u64,
    /// Entries left out (sockets, device nodes), with notes on some.
    pub left_out: u64,
    pub notes: Vec<String>,
}

/// The generated client of a worker, with its credentials.
pub type RawClient = PbClient<tonic::service::interceptor::InterceptedService<Channel, Auth>>;

#[derive(Clone)]
pub struct WorkerClient {
    url: String,
    inner: RawClient,
}

/// A gRPC channel to `url` (`http://host:port`, or `https://` with the
/// TLS of `creds`), failing fast if nobody answers: the one way Corral's
/// clients connect (to workers, and to a control plane service).
pub async fn channel(url: &str, creds: &Credentials) -> Result<Channel, ClientError> {
    let bad = |reason: String| ClientError::BadAddress {
        url: url.to_string(),
        reason,
    };
    let mut endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .http2_max_concurrent_reset_streams(RESET_STREAMS_REMEMBERED);
    if url.starts_with("https://") {
        let tls = creds.tls.clone().unwrap_or_default();
        let mut cfg = ClientTlsConfig::new();
        cfg = match tls.ca_pem {
            Some(ca) => cfg.ca_certificate(Certificate::from_pem(ca)),
            None => cfg.with_native_roots(),
        };
        if let Some((cert, key)) = tls.identity {
            cfg = cfg.identity(Identity::from_pem(cert, key));
        }
        if let Some(name) = tls.domain {
            cfg = cfg.domain_name(name);
        }
        endpoint = endpoint
            .tls_config(cfg)
            .map_err(|e| bad(source_chain(&e)))?;
    } else if creds.tls.is_some() {
        return Err(bad("TLS options need an https:// address".into()));
    }
    // A token goes to a socket on this machine only if its user may have it.
    let checked = match host_port(url) {
        Some((host, port)) if creds.token.is_some() && is_loopback(url) => {
            let owner = creds.token_owner;
            Some(tower::service_fn(move |_: tonic::transport::Uri| {
                let host = host.clone();
                async move {
                    let stream = connect_checked(&host, port, owner).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
        }
        _ => None,
    };
    let connected = match checked {
        Some(connector) => endpoint.connect_with_connector(connector).await,
        None => endpoint.connect().await,
    };
    match connected {
        Ok(c) => Ok(c),
        Err(e) => {
            // A listener that speaks the other protocol says so, not
            // "h2 protocol error" or "InvalidContentType".
            let reason = match mismatch(url).await {
                Some(why) => why,
                None => source_chain(&e),
            };
            Err(ClientError::Connect {
                url: url.to_string(),
                reason,
            })
        }
    }
}

impl Auth {
    /// Presents `token` (as `authorization: Bearer TOKEN`) on every call.
    pub fn bearer(url: &str, token: Option<&str>) -> Result<Self, ClientError> {
        match token {
            Some(t) => Ok(Auth(Some(format!("Bearer {t}").parse().map_err(|_| {
                ClientError::BadAddress {
                    url: url.to_string(),
                    reason: "the token is not valid header text".into(),
                }
            })?))),
            None => Ok(Auth(None)),
        }
    }
}

/// Connections kept by address, for a caller that talks to the same
/// workers again and again (`corral serve`): one HTTP/2 connection per
/// worker, shared by every call, instead of a connection (and its
/// handshakes) per session. A kept connection reconnects by itself when
/// its worker comes back.
#[derive(Clone, Default)]
pub struct ClientCache {
    kept: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Slot>>>,
}

/// One worker's connection, made once however many callers ask for it at
/// the same time.
type Slot = std::sync::Arc<tokio::sync::OnceCell<WorkerClient>>;

impl std::fmt::Debug for ClientCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCache")
            .field("workers", &self.kept().len())
            .finish()
    }
}

impl ClientCache {
    fn kept(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Slot>> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The connection to `url`, made (with `creds`) if there is none yet:
    /// callers that ask at once wait for the one connection being made (a
    /// failed one is tried again by the next caller).
    pub async fn connect(
        &self,
        url: &str,
        creds: &Credentials,
    ) -> Result<WorkerClient, ClientError> {
        self.connect_lazily(url, || Ok(creds.clone())).await
    }

    /// [`Self::connect`], with the credentials worked out only when a
    /// connection is made: a kept connection is handed out without reading
    /// a token file or asking who listens on the port again (its
    /// reconnections are checked as they are made).
    pub async fn connect_lazily<E, F>(&self, url: &str, creds: F) -> Result<WorkerClient, E>
    where
        F: FnOnce() -> Result<Credentials, E>,
        E: From<ClientError>,
    {
        let slot = {
            let mut kept = self.kept();
            match kept.get(url) {
                Some(slot) => slot.clone(),
                None => kept.entry(url.to_string()).or_default().clone(),
            }
        };
        if let Some(client) = slot.get() {
            return Ok(client.clone());
        }
        slot.get_or_try_init(|| async {
            let creds = creds()?;
            WorkerClient::connect_with(url, &creds)
                .await
                .map_err(E::from)
        })
        .await
        .cloned()
    }
}

/// Connects to `url`, through `cache` when there is one.
pub async fn connect_via(
    cache: Option<&ClientCache>,
    url: &str,
    creds: &Credentials,
) -> Result<WorkerClient, ClientError> {
    match cache {
        Some(c) => c.connect(url, creds).await,
        None => WorkerClient::connect_with(url, creds).await,
    }
}

pub type EventStream = std::pin::Pin<Box<dyn Stream<Item = Result<Event, ClientError>> + Send>>;

impl WorkerClient {
    /// Connects to `url` (`http://host:port`), failing fast if nobody answers.
    pub async fn connect(url: &str, token: Option<&str>) -> Result<Self, ClientError> {
        Self::connect_with(url, &Credentials::token(token)).await
    }

    /// Connects with a token and, for `https://` addresses, TLS.
    pub async fn connect_with(url: &str, creds: &Credentials) -> Result<Self, ClientError> {
        let token = creds.token.as_deref();
        if let Some(path) = url.strip_prefix("unix://") {
            return Self::connect_unix(url, std::path::PathBuf::from(path), token).await;
        }
        let channel = channel(url, creds).await?;
        Self::over(url, channel, token)
    }

    /// Connects to a worker on a Unix socket (`unix:///path`).
    async fn connect_unix(
        url: &str,
        path: std::path::PathBuf,
        token: Option<&str>,
    ) -> Result<Self, ClientError> {
        // The address is a placeholder: the connector below decides.
        let endpoint = Endpoint::from_static("http://local.worker")
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .http2_max_concurrent_reset_streams(RESET_STREAMS_REMEMBERED);
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|e| ClientError::Connect {
                url: url.to_string(),
                reason: source_chain(&e),
            })?;
        Self::over(url, channel, token)
    }

    /// A client over `channel` (made by the caller: an in-process one, say),
    /// named `url`, presenting `token`.
    pub fn over(url: &str, channel: Channel, token: Option<&str>) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::BadAddress {
            url: url.to_string(),
            reason,
        };
        let auth = match token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| bad("the token is not valid header text".into()))?,
            ),
            None => None,
        };
        let inner = PbClient::with_interceptor(channel, Auth(auth))
            .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
        Ok(Self {
            url: url.to_string(),
            inner,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The generated client over the same connection and credentials: for
    /// a caller that passes calls through whole (a front door).
    pub fn raw(&self) -> RawClient {
        self.inner.clone()
    }

    /// One call's answer; a failure of the transport whose listener speaks
    /// the other protocol (TLS behind `http://`, found at the first call)
    /// says so.
    async fn rpc<T>(
        &self,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, ClientError> {
        match call.await {
            Ok(v) => Ok(v),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unknown
                        | tonic::Code::Internal
                        | tonic::Code::Unavailable
                        | tonic::Code::Cancelled
                ) && std::error::Error::source(&s).is_some() =>
            {
                match mismatch(&self.url).await {
                    Some(reason) => Err(ClientError::Connect {
                        url: self.url.clone(),
                        reason,
                    }),
                    None => Err(ClientError::Status(s)),
                }
            }
            Err(s) => Err(ClientError::Status(s)),
        }
    }

    pub async fn create_sandbox(
        &self,
        id: Option<&SandboxId>,
        spec: SandboxSpec,
    ) -> Result<SandboxInfo, ClientError> {
        self.create_sandbox_traced(id, spec, None).await
    }

    /// [`Self::create_sandbox`], the request carrying `traceparent` (W3C
    /// trace context) in its metadata.
    pub async fn create_sandbox_traced(
        &self,
        id: Option<&SandboxId>,
        spec: SandboxSpec,
        traceparent: Option<&str>,
    ) -> Result<SandboxInfo, ClientError> {
        let mut req = tonic::Request::new(pb::CreateSandboxRequest {
            id: id.map(ToString::to_string).unwrap_or_default(),
            spec: Some(spec.into()),
        });
        if let Some(v) = traceparent.and_then(|t| t.parse().ok()) {
            req.metadata_mut().insert("traceparent", v);
        }
        Ok(self
            .rpc(self.inner.clone().create_sandbox(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    pub async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ClientError> {
        let req = pb::GetSandboxRequest { id: id.to_string() };
        Ok(self
            .rpc(self.inner.clone().get_sandbox(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    /// Replaces the egress policy of a sandbox made with one.
    pub async fn set_sandbox_egress(
        &self,
        id: &SandboxId,
        rules: &[corral_proto::egress::Rule],
    ) -> Result<SandboxInfo, ClientError> {
        let req = pb::SetSandboxEgressRequest {
            id: id.to_string(),
            rules: rules.iter().map(ToString::to_string).collect(),
        };
        Ok(self
            .rpc(self.inner.clone().set_sandbox_egress(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    /// Checkpoints a gVisor sandbox: its processes and memory saved, its
    /// container stopped, until [`Self::restore_sandbox`].
    pub async fn checkpoint_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ClientError> {
        let req = pb::CheckpointSandboxRequest { id: id.to_string() };
        Ok(self
            .rpc(self.inner.clone().checkpoint_sandbox(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    /// Exposes `port` of sandbox `id` through the worker's port listener:
    /// its URL, and for signed access its token.
    pub async fn expose_port(
        &self,
        id: &SandboxId,
        port: u16,
        access: pb::PortAccess,
        ttl: Option<Duration>,
    ) -> Result<pb::PortExposure, ClientError> {
        self.expose_port_waking(id, port, access, ttl, false).await
    }

    /// [`Self::expose_port`], and whether a request to the port while the
    /// sandbox is checkpointed restores it.
    pub async fn expose_port_waking(
        &self,
        id: &SandboxId,
        port: u16,
        access: pb::PortAccess,
        ttl: Option<Duration>,
        wake_on_request: bool,
    ) -> Result<pb::PortExposure, ClientError> {
        let mut req = pb::ExposePortRequest {
            sandbox_id: id.to_string(),
            port: u32::from(port),
            ttl_ms: ttl.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            wake_on_request,
            ..Default::default()
        };
        req.set_access(access);
        Ok(self
            .rpc(self.inner.clone().expose_port(req))
            .await?
            .into_inner())
    }

    /// Ends the exposure of `port`: whether there was one.
    pub async fn revoke_access(&self, id: &SandboxId, port: u16) -> Result<bool, ClientError> {
        let req = pb::RevokeAccessRequest {
            sandbox_id: id.to_string(),
            port: u32::from(port),
        };
        Ok(self
            .rpc(self.inner.clone().revoke_access(req))
            .await?
            .into_inner()
            .revoked)
    }

    /// The exposed ports of sandbox `id` (no tokens).
    pub async fn list_exposures(
        &self,
        id: &SandboxId,
    ) -> Result<Vec<pb::PortExposure>, ClientError> {
        let req = pb::ListExposuresRequest {
            sandbox_id: id.to_string(),
        };
        Ok(self
            .rpc(self.inner.clone().list_exposures(req))
            .await?
            .into_inner()
            .exposures)
    }

    /// Starts a checkpointed sandbox again from its checkpoint.
    pub async fn restore_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ClientError> {
        let req = pb::RestoreSandboxRequest { id: id.to_string() };
        Ok(self
            .rpc(self.inner.clone().restore_sandbox(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    /// Forks sandbox `id` into the children `child_ids` (new ids), or into
    /// `count` children with ids the worker picks when `child_ids` is
    /// empty.
    pub async fn fork_sandbox(
        &self,
        id: &SandboxId,
        child_ids: &[SandboxId],
        count: u32,
    ) -> Result<Forked, ClientError> {
        let req = pb::ForkSandboxRequest {
            id: id.to_string(),
            child_ids: child_ids.iter().map(ToString::to_string).collect(),
            count,
        };
        let r = self
            .rpc(self.inner.clone().fork_sandbox(req))
            .await?
            .into_inner();
        Ok(Forked {
            children: r
                .children
                .into_iter()
                .map(TryInto::try_into)
                .collect::<Result<_, _>>()?,
            frozen: std::time::Duration::from_micros(r.frozen_us),
            copied_entries: r.copied_entries,
            copied_bytes: r.copied_bytes,
            left_out: r.left_out,
            notes: r.notes,
        })
    }

    pub async fn list_sandboxes(&self) -> Result<Vec<SandboxInfo>, ClientError> {
        let resp = self
            .rpc(
                self.inner
                    .clone()
                    .list_sandboxes(pb::ListSandboxesRequest {}),
            )
            .await?;
        Ok(resp
            .into_inner()
            .sandboxes
            .into_iter()
            .map(TryInto::try_into)
            .collect::<Result<_, _>>()?)
    }

    /// Returns whether the sandbox existed.
    pub async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool, ClientError> {
        let req = pb::DestroySandboxRequest { id: id.to_string() };
        Ok(self
            .rpc(self.inner.clone().destroy_sandbox(req))
            .await?
            .into_inner()
            .existed)
    }

    pub async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: OperationSpec,
    ) -> Result<OperationRecord, ClientError> {
        self.submit_traced(sandbox, id, spec, None).await
    }

    /// [`Self::submit`], the request carrying `traceparent` (W3C trace
    /// context) in its metadata.
    pub async fn submit_traced(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: OperationSpec,
        traceparent: Option<&str>,
    ) -> Result<OperationRecord, ClientError> {
        let mut req = tonic::Request::new(pb::SubmitOperationRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
            spec: Some(spec.into()),
        });
        if let Some(v) = traceparent.and_then(|t| t.parse().ok()) {
            req.metadata_mut().insert("traceparent", v);
        }
        let op = self
            .rpc(self.inner.clone().submit_operation(req))
            .await?
            .into_inner();
        Ok(op.try_into()?)
    }

    /// Submits an operation and watches its events, in one call
    /// (`RunOperation`): the operation as submitted, and its events from
    /// its first to its `Finished`, after which the stream ends (one that
    /// ends before is resumed with [`Self::watch`] for the operation). A
    /// worker or front door of an earlier release, which has no such
    /// call, is asked in two (a submit, then a watch from the sandbox's
    /// last event before it).
    pub async fn run(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: OperationSpec,
        traceparent: Option<&str>,
    ) -> Result<(OperationRecord, EventStream), ClientError> {
        use pb::run_operation_response::Kind;
        let mut req = tonic::Request::new(pb::SubmitOperationRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
            spec: Some(spec.clone().into()),
        });
        if let Some(v) = traceparent.and_then(|t| t.parse().ok()) {
            req.metadata_mut().insert("traceparent", v);
        }
        let mut stream = match self.rpc(self.inner.clone().run_operation(req)).await {
            Ok(s) => s.into_inner(),
            Err(ClientError::Status(s)) if s.code() == tonic::Code::Unimplemented => {
                let before = self.get_sandbox(sandbox).await?.last_seq;
                let record = self.submit_traced(sandbox, id, spec, traceparent).await?;
                let after = match record.first_seq {
                    0 => before,
                    first => before.min(first - 1),
                };
                return Ok((record, self.watch(sandbox, after, Some(id)).await?));
            }
            Err(e) => return Err(e),
        };
        let first = stream
            .message()
            .await?
            .ok_or(corral_proto::ProtocolError::Missing(
                "run_operation.submitted",
            ))?;
        let Some(Kind::Submitted(op)) = first.kind else {
            return Err(corral_proto::ProtocolError::Missing("run_operation.submitted").into());
        };
        // The operation's end is the stream's last event, and the
        // stream's own end (its trailers) follows at once: it is read
        // before the end is handed out, so that a caller that stops at
        // the end leaves the stream ended, not reset. (Every reset stream
        // whose last frames arrive after HTTP/2 has forgotten it counts
        // against the connection, which goes away at 1,024 of them.)
        let this = id.clone();
        let events = futures_util::stream::unfold(Some(stream), move |left| {
            let op = this.clone();
            async move {
                let mut stream = left?;
                let item = match stream.message().await {
                    Ok(None) => return None,
                    Err(s) => return Some((Err(s.into()), None)),
                    Ok(Some(item)) => item,
                };
                let event = match item.kind {
                    Some(Kind::Event(e)) => Event::try_from(e).map_err(ClientError::from),
                    _ => Err(corral_proto::ProtocolError::Missing("run_operation.event").into()),
                };
                let last = matches!(&event, Ok(e)
                    if matches!(e.kind, corral_proto::EventKind::Finished(_))
                        && e.operation_id.as_ref() == Some(&op));
                if !last {
                    return Some((event, Some(stream)));
                }
                let _ = tokio::time::timeout(STREAM_END_PATIENCE, async {
                    while let Ok(Some(_)) = stream.message().await {}
                })
                .await;
                Some((event, None))
            }
        });
        Ok((op.try_into()?, Box::pin(events)))
    }

    pub async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, ClientError> {
        let req = pb::GetOperationRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
        };
        Ok(self
            .rpc(self.inner.clone().get_operation(req))
            .await?
            .into_inner()
            .try_into()?)
    }

    /// A tar stream into the sandbox's `path` in one call (see `Upload` in
    /// worker.proto): `chunks` are the archive's bytes (each at most 1 MiB),
    /// their end its end. Returns the finished operation.
    pub async fn upload(
        &self,
        sandbox: &SandboxId,
        op: &OperationId,
        path: &str,
        chunks: impl futures_util::Stream<Item = bytes::Bytes> + Send + 'static,
    ) -> Result<OperationRecord, ClientError> {
        let first = pb::UploadRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: op.to_string(),
            path: path.to_string(),
            data: bytes::Bytes::new(),
            eof: false,
        };
        let rest = chunks.map(|data| pb::UploadRequest {
            data,
            ..pb::UploadRequest::default()
        });
        let end = pb::UploadRequest {
            eof: true,
            ..pb::UploadRequest::default()
        };
        let requests = futures_util::stream::once(async move { first })
            .chain(rest)
            .chain(futures_util::stream::once(async move { end }));
        let resp = self.rpc(self.inner.clone().upload(requests)).await?;
        Ok(resp.into_inner().try_into()?)
    }

    /// A path of the sandbox as a tar stream in one call (see `Download` in
    /// worker.proto): the archive's pieces, then the finished operation.
    pub async fn download(
        &self,
        sandbox: &SandboxId,
        op: &OperationId,
        archive: corral_proto::ArchiveSpec,
    ) -> Result<
        impl futures_util::Stream<Item = Result<DownloadPart, ClientError>> + use<>,
        ClientError,
    > {
        let req = pb::DownloadRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: op.to_string(),
            archive: Some(pb::ArchiveSpec {
                path: archive.path,
                contents: archive.contents,
            }),
        };
        let stream = self
            .rpc(self.inner.clone().download(req))
            .await?
            .into_inner();
        Ok(stream.map(|m| {
            let m = m?;
            match m.finished {
                Some(op) => Ok(DownloadPart::Finished(Box::new(op.try_into()?))),
                None => Ok(DownloadPart::Data(m.data)),
            }
        }))
    }

    /// The sandbox's operations, oldest first.
    pub async fn list_operations(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Vec<OperationRecord>, ClientError> {
        let mut all = Vec::new();
        let mut page_token = String::new();
        // Pages of a few MiB each; a worker that keeps answering a token
        // already seen is broken, not endless.
        let mut seen = std::collections::HashSet::new();
        loop {
            let req = pb::ListOperationsRequest {
                sandbox_id: sandbox.to_string(),
                page_token: page_token.clone(),
            };
            let resp = self
                .rpc(self.inner.clone().list_operations(req))
                .await?
                .into_inner();
            for op in resp.operations {
                all.push(OperationRecord::try_from(op)?);
            }
            if resp.next_page_token.is_empty() {
                return Ok(all);
            }
            if !seen.insert(resp.next_page_token.clone()) {
                return Err(ClientError::Protocol(corral_proto::ProtocolError::invalid(
                    "next_page_token",
                    "the same page of operations given twice",
                )));
            }
            page_token = resp.next_page_token;
        }
    }

    pub async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, ClientError> {
        let req = pb::CancelOperationRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
        };
        Ok(self
            .rpc(self.inner.clone().cancel_operation(req))
            .await?
            .into_inner()
            .canceling)
    }

    /// Events after `after_seq`, optionally of one operation only.
    pub async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<&OperationId>,
    ) -> Result<EventStream, ClientError> {
        let req = pb::WatchSandboxRequest {
            sandbox_id: sandbox.to_string(),
            after_seq,
            operation_id: only.map(ToString::to_string).unwrap_or_default(),
        };
        let stream = self
            .rpc(self.inner.clone().watch_sandbox(req))
            .await?
            .into_inner();
        Ok(Box::pin(stream.map(|item| {
            let event = item?;
            Ok(Event::try_from(event)?)
        })))
    }

    /// Feeds `data` at `offset` of an operation's input; returns the
    /// input's end and whether it takes more.
    pub async fn write_input(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        offset: u64,
        data: bytes::Bytes,
        eof: bool,
    ) -> Result<(u64, bool), ClientError> {
        let req = pb::WriteInputRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
            offset,
            data,
            eof,
        };
        let r = self
            .rpc(self.inner.clone().write_input(req))
            .await?
            .into_inner();
        Ok((r.input_bytes, r.closed))
    }

    pub async fn resize_terminal(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        size: corral_proto::TerminalSize,
    ) -> Result<(), ClientError> {
        let req = pb::ResizeTerminalRequest {
            sandbox_id: sandbox.to_string(),
            operation_id: id.to_string(),
            size: Some(size.into()),
        };
        self.rpc(self.inner.clone().resize_terminal(req)).await?;
        Ok(())
    }

    /// Kills every process of the sandbox but its supervisor; returns how
    /// many there were.
    pub async fn reset_sandbox(&self, id: &SandboxId) -> Result<u32, ClientError> {
        let req = pb::ResetSandboxRequest { id: id.to_string() };
        Ok(self
            .rpc(self.inner.clone().reset_sandbox(req))
            .await?
            .into_inner()
            .killed)
    }

    /// What the sandbox uses now (about a second).
    pub async fn sandbox_stats(
        &self,
        id: &SandboxId,
    ) -> Result<corral_proto::SandboxStats, ClientError> {
        let req = pb::GetSandboxStatsRequest {
            sandbox_id: id.to_string(),
        };
        let resp = self.rpc(self.inner.clone().get_sandbox_stats(req)).await?;
        Ok(resp.into_inner().try_into()?)
    }

    /// Whether this worker holds template `name` of `tenant` (None: the
    /// worker's own), built there or pulled from the fleet's registry.
    pub async fn has_template(
        &self,
        tenant: Option<&str>,
        name: &str,
    ) -> Result<bool, ClientError> {
        let mut req = tonic::Request::new(pb::ListTemplatesRequest {});
        if let Some(t) = tenant {
            let value = t.parse().map_err(|_| {
                ClientError::Status(Status::invalid_argument(format!(
                    "tenant {t:?} is not valid header text"
                )))
            })?;
            req.metadata_mut()
                .insert(corral_proto::sandbox::TENANT_HEADER, value);
        }
        let resp = self.rpc(self.inner.clone().list_templates(req)).await?;
        Ok(resp.into_inner().templates.iter().any(|t| t.name == name))
    }

    pub async fn worker_info(&self) -> Result<WorkerInfo, ClientError> {
        let resp = self
            .rpc(
                self.inner
                    .clone()
                    .get_worker_info(pb::GetWorkerInfoRequest {}),
            )
            .await?;
        Ok(resp.into_inner().into())
    }

    /// Starts (`true`) or ends a drain; see `Drain` in worker.proto.
    pub async fn drain(&self, drain: bool) -> Result<WorkerInfo, ClientError> {
        let resp = self
            .rpc(self.inner.clone().drain(pb::DrainRequest { drain }))
            .await?;
        Ok(resp.into_inner().into())
    }
}

/// A status's message with what caused it on this side, when the
/// transport made it ("http2 error: keep-alive timed out", not "http2
/// error").
pub fn status_text(s: &Status) -> String {
    with_causes(s.message().to_string(), std::error::Error::source(s))
}

/// An error with its causes, on one line.
pub fn source_chain(e: &dyn std::error::Error) -> String {
    with_causes(e.to_string(), e.source())
}

/// `text`, then each cause from `first` on that it does not say already.
fn with_causes(mut text: String, first: Option<&(dyn std::error::Error + 'static)>) -> String {
    let mut cur = first;
    while let Some(c) = cur {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cur = c.source();
    }
    text
}

/// A piece of a [`WorkerClient::download`].
#[derive(Debug, Clone, PartialEq)]
pub enum DownloadPart {
    /// Bytes of the archive, in order.
    Data(bytes::Bytes),
    /// The operation, finished: the archive is whole if it exited 0.
    Finished(Box<OperationRecord>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made_by_transport(mut s: Status) -> ClientError {
        s.set_source(std::sync::Arc::new(std::io::Error::other(
            "connection closed",
        )));
        ClientError::Status(s)
    }

    #[test]
    fn a_status_the_transport_made_says_what_caused_it() {
        let e = made_by_transport(Status::unavailable("http2 error"));
        assert_eq!(
            e.to_string(),
            "worker unavailable: http2 error: connection closed"
        );
        // A worker's own status has no cause on this side.
        let said = ClientError::Status(Status::unavailable("draining"));
        assert_eq!(said.to_string(), "worker unavailable: draining");
    }

    #[test]
    fn what_the_transport_breaks_is_tried_again_and_what_a_worker_says_is_not() {
        // A call the connection dropped, or an h2 reset: no reason, a cause.
        assert!(made_by_transport(Status::cancelled("operation was canceled")).is_transient());
        assert!(made_by_transport(Status::internal("h2 protocol error")).is_transient());
        assert!(ClientError::Status(Status::unavailable("restarting")).is_transient());
        // The same codes without a cause, or with a worker's reason, are
        // answers.
        assert!(!ClientError::Status(Status::cancelled("x")).is_transient());
        let said = corral_proto::reason::status(
            tonic::Code::Internal,
            Reason::Internal,
            None,
            "state directory",
        );
        assert!(!made_by_transport(said).is_transient());
    }
}
