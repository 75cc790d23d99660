//! Exposing a sandbox's ports (see [`crate::ports`]): what clients ask
//! for, and what the port listener looks up for each request.

use std::time::Duration;

use corral_proto::SandboxId;

use super::Worker;
use crate::error::{Result, WorkerError};
use crate::ports::{Access, Exposure, Refusal};
use crate::sandbox::Sandbox;

/// A sandbox's exposed ports: its own, or (checkpointed) those its file
/// keeps, with the lock on changing them.
enum PortsOf<'a> {
    Running(Sandbox),
    Kept {
        ports: crate::ports::SandboxPorts,
        _held: tokio::sync::MutexGuard<'a, ()>,
    },
}

impl PortsOf<'_> {
    fn ports(&self) -> &crate::ports::SandboxPorts {
        match self {
            PortsOf::Running(s) => s.ports(),
            PortsOf::Kept { ports, .. } => ports,
        }
    }
}

/// How the worker's ports are reached (`--ports-listen`, `--ports-url`,
/// `--ports-domain`, `--allow-public-ports`).
#[derive(Debug, Clone, Default)]
pub struct PortsSettings {
    /// The URL clients reach the port listener at (else that of the address
    /// it listens on).
    pub url: Option<String>,
    /// The wildcard domain whose names `{port}-{sandbox}.{domain}` reach
    /// the listener (else URLs route by path).
    pub domain: Option<String>,
    pub allow_public: bool,
    /// Most bytes a second one sandbox's way in moves, each direction,
    /// across its connections (`--ports-max-bytes-per-second`).
    pub max_bytes_per_second: Option<u64>,
    /// A connection to a sandbox's port that moves nothing either way
    /// for this long is cut (`--ports-idle-timeout`; `None`: never).
    pub idle_timeout: Option<Duration>,
}

/// An exposure as a client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExposureInfo {
    pub sandbox: SandboxId,
    pub port: u16,
    pub access: Access,
    pub url: String,
    /// Signed access: its token (only when made).
    pub token: Option<String>,
    pub expires_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub wake_on_request: bool,
}

/// What a request to a sandbox's port finds.
pub(crate) enum PortTarget {
    /// The sandbox runs: it, and the port's exposure in force (`None`:
    /// not exposed).
    Running(Box<Sandbox>, Option<Exposure>),
    /// The sandbox is checkpointed, and the port's exposure wakes it.
    Asleep(Exposure),
}

/// The longest time to live an exposure of any access may ask for.
const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 86_400);

/// How long a request that wakes its sandbox waits for it before it is
/// told to come again (`sandbox_waking`; the restore goes on).
const WAKE_WAIT: Duration = Duration::from_secs(20);

fn invalid(field: &'static str, why: String) -> WorkerError {
    WorkerError::Invalid(corral_proto::ProtocolError::invalid(field, why))
}

/// Whether `id` can be a DNS label (a name `{port}-{id}.{domain}`).
fn dns_label(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 56
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-')
}

impl Worker {
    /// The port listener is up at `url` (what URLs name, unless the
    /// operator named another).
    pub fn ports_listening(&self, url: String) {
        let _ = self.inner.ports_url.set(url);
    }

    /// The worker's token, which private ports take (`None`: it has none).
    pub fn set_ports_token(&self, token: Option<String>) {
        let _ = self.inner.ports_token.set(token);
    }

    pub(crate) fn ports_token(&self) -> Option<&str> {
        self.inner.ports_token.get().and_then(|t| t.as_deref())
    }

    pub(crate) fn ports_key(&self) -> &crate::ports::Key {
        &self.inner.ports_key
    }

    /// Whether clients reach the port listener over TLS (its URL is
    /// https): cookies are then `Secure`.
    pub(crate) fn ports_secure(&self) -> bool {
        self.inner
            .ports_settings
            .url
            .as_deref()
            .is_some_and(|u| u.starts_with("https://"))
    }

    /// How long a connection to a sandbox's port may move nothing.
    pub(crate) fn ports_idle_timeout(&self) -> Option<Duration> {
        self.inner.ports_settings.idle_timeout
    }

    pub(crate) fn ports_domain(&self) -> Option<&str> {
        self.inner.ports_settings.domain.as_deref()
    }

    pub(crate) fn now_ms(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    /// The port listener's URL: `--ports-url`, else that of the address
    /// it listens on (`None`: it has none).
    pub(crate) fn ports_base(&self) -> Option<&str> {
        self.inner
            .ports_settings
            .url
            .as_deref()
            .or(self.inner.ports_url.get().map(String::as_str))
    }

    fn url_of(&self, id: &SandboxId, port: u16) -> Result<String> {
        let base = self
            .ports_base()
            .ok_or_else(|| {
                WorkerError::NotApplicable(
                    "this worker has no port listener: start it with --ports-listen ADDR".into(),
                )
            })?
            .trim_end_matches('/');
        Ok(match self.ports_domain() {
            Some(domain) if dns_label(id.as_str()) => {
                let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
                // The listener's port, if the base names one.
                let after_host = rest.find([':', '/']).map_or("", |i| &rest[i..]);
                let port_part = after_host
                    .strip_prefix(':')
                    .map(|p| format!(":{}", p.split('/').next().unwrap_or("")))
                    .unwrap_or_default();
                format!("{scheme}://{port}-{id}.{domain}{port_part}/")
            }
            _ => format!("{base}/p/{id}/{port}/"),
        })
    }

    fn info_of_exposure(
        &self,
        id: &SandboxId,
        e: &Exposure,
        with_token: bool,
    ) -> Result<ExposureInfo> {
        Ok(ExposureInfo {
            sandbox: id.clone(),
            port: e.port,
            access: e.access,
            url: self.url_of(id, e.port)?,
            token: (with_token && e.access == Access::Signed)
                .then(|| self.inner.ports_key.sign(id, e)),
            expires_at_ms: e.expires_at_ms,
            created_at_ms: e.created_at_ms,
            wake_on_request: e.wake_on_request,
        })
    }

    /// Exposes `port` of sandbox `id` with `access`, for `ttl` (`None`:
    /// until revoked; signed access: an hour); `wake_on_request`: a
    /// request to it while the sandbox is checkpointed restores it.
    pub async fn expose_port(
        &self,
        id: &SandboxId,
        port: u16,
        access: Access,
        ttl: Option<Duration>,
        wake_on_request: bool,
    ) -> Result<ExposureInfo> {
        if port == 0 {
            return Err(invalid("port", "1 to 65535".into()));
        }
        if access == Access::Public && !self.inner.ports_settings.allow_public {
            return Err(WorkerError::Denied {
                flag: Some("--allow-public-ports"),
                what: "public ports: this worker's operator allows none".into(),
            });
        }
        let ttl = match (access, ttl) {
            (Access::Signed, None) => Some(crate::ports::DEFAULT_SIGNED_TTL),
            (Access::Signed, Some(t)) if t > crate::ports::MAX_SIGNED_TTL => {
                return Err(invalid(
                    "ttl",
                    format!(
                        "a signed URL lives at most {:?}",
                        crate::ports::MAX_SIGNED_TTL
                    ),
                ));
            }
            (_, Some(t)) if t > MAX_TTL => {
                return Err(invalid(
                    "ttl",
                    format!(
                        "an exposure lives at most {} days",
                        MAX_TTL.as_secs() / 86_400
                    ),
                ));
            }
            (_, t) => t,
        };
        // The URL first: no listener, nothing to expose.
        self.url_of(id, port)?;
        let sandbox = self.sandbox(id).await?;
        self.ingress_of(&sandbox).await?;
        let now = self.now_ms();
        let e = sandbox
            .ports()
            .expose(Exposure {
                port,
                access,
                expires_at_ms: ttl
                    .map(|t| now + i64::try_from(t.as_millis()).unwrap_or(i64::MAX / 2)),
                created_at_ms: now,
                nonce: crate::ports::nonce(),
                wake_on_request,
                revoked: tokio_util::sync::CancellationToken::new(),
            })
            .map_err(|why| invalid("port", why))?;
        tracing::info!(sandbox = %id, port, access = access.as_str(), "port exposed");
        self.info_of_exposure(id, &e, true)
    }

    /// The sandbox's way in: its socket bound, its relay asked for.
    pub(super) async fn ingress_of(
        &self,
        sandbox: &Sandbox,
    ) -> Result<std::sync::Arc<crate::ports::ingress::Ingress>> {
        let dir = self.egress_dir(&sandbox.id);
        let ingress = sandbox
            .ports()
            .ingress(&dir, sandbox.closed(), &self.inner.tracker)
            .await
            .map_err(|e| WorkerError::state(&dir, e))?;
        if !ingress.relay_connected() {
            sandbox.start_ingress(ingress.secret()).await?;
        }
        Ok(ingress)
    }

    /// The exposed ports of sandbox `id`, running or checkpointed (then
    /// as its file keeps them, changed by one caller at a time: they come
    /// back with it).
    async fn ports_of(&self, id: &SandboxId) -> Result<PortsOf<'_>> {
        let mut found = self.settled(id).await?;
        if let super::table::Lookup::Checkpointed(_) = found {
            // Taken, then looked at again: a restore that began meanwhile
            // waits for this change before it reads the file, and one that
            // ended has the exposures in its sandbox.
            let held = self.inner.ports_files.lock().await;
            found = self.inner.table.lookup(id);
            if let super::table::Lookup::Checkpointed(_) = found {
                return Ok(PortsOf::Kept {
                    ports: crate::ports::SandboxPorts::kept_at(self.inner.state.ports_path(id)),
                    _held: held,
                });
            }
            drop(held);
            found = self.settled(id).await?;
        }
        match found {
            super::table::Lookup::Running(sandbox) => {
                sandbox.touch();
                Ok(PortsOf::Running(sandbox))
            }
            other => Err(super::not_running(id, other)),
        }
    }

    /// Whether `e` may be used now: a public exposure only while the
    /// operator allows public ports (one kept from before the flag was
    /// withdrawn is not).
    fn in_force(&self, e: &Exposure) -> bool {
        e.access != Access::Public || self.inner.ports_settings.allow_public
    }

    /// Ends the exposure of `port`: whether there was one.
    pub async fn revoke_access(&self, id: &SandboxId, port: u16) -> Result<bool> {
        let revoked = self.ports_of(id).await?.ports().revoke(port);
        if revoked {
            tracing::info!(sandbox = %id, port, "port access revoked");
        }
        Ok(revoked)
    }

    pub async fn list_exposures(&self, id: &SandboxId) -> Result<Vec<ExposureInfo>> {
        self.ports_of(id)
            .await?
            .ports()
            .list(self.now_ms())
            .iter()
            .filter(|e| self.in_force(e))
            .map(|e| self.info_of_exposure(id, e, false))
            .collect()
    }

    /// What a request to `port` of sandbox `id` reaches.
    pub(crate) async fn port_route(
        &self,
        id: &SandboxId,
        port: u16,
    ) -> std::result::Result<PortTarget, Refusal> {
        match self.inner.table.lookup(id) {
            super::table::Lookup::Running(s) if !s.is_lost() => {
                let exposure = s
                    .ports()
                    .get(port, self.now_ms())
                    .filter(|e| self.in_force(e));
                Ok(PortTarget::Running(Box::new(s), exposure))
            }
            // Checkpointed, or being restored (the request then waits
            // for the restore under way): asleep, if the port wakes it.
            super::table::Lookup::Checkpointed(_) | super::table::Lookup::Busy(_) => {
                crate::ports::SandboxPorts::kept_at(self.inner.state.ports_path(id))
                    .get(port, self.now_ms())
                    .filter(|e| e.wake_on_request && self.in_force(e))
                    .map(PortTarget::Asleep)
                    .ok_or(Refusal::NotExposed)
            }
            // Said as a port not exposed: whoever asks learns nothing
            // more of which sandboxes there are.
            _ => Err(Refusal::NotExposed),
        }
    }

    /// Restores checkpointed sandbox `id` for a request to one of its
    /// ports that wakes it, and waits for it (at most [`WAKE_WAIT`]; the
    /// restore goes on if the request gives up).
    pub(crate) async fn wake(&self, id: &SandboxId) -> std::result::Result<(), Refusal> {
        let worker = self.clone();
        let id_of = id.clone();
        let id = id.clone();
        let restoring = self.inner.tracker.spawn(async move {
            let r = worker.restore_sandbox(&id).await;
            match &r {
                Ok(_) => tracing::info!(sandbox = %id, "sandbox woken by a request to its port"),
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "a request to its port could not wake the sandbox"),
            }
            r.is_ok()
        });
        let deadline = tokio::time::Instant::now() + WAKE_WAIT;
        // Whichever restore brought it back (another request's may be
        // the one under way), it is waited for, then its supervisor.
        if tokio::time::timeout_at(deadline, restoring).await.is_err() {
            return Err(Refusal::SandboxWaking);
        }
        // Running once restored, answering once its supervisor has.
        let ready = async {
            match self.settled(&id_of).await {
                Ok(super::table::Lookup::Running(s)) => s
                    .wait_ready(WAKE_WAIT)
                    .await
                    .map_err(|_| Refusal::SandboxUnavailable),
                _ => Err(Refusal::SandboxUnavailable),
            }
        };
        tokio::time::timeout_at(deadline, ready)
            .await
            .unwrap_or(Err(Refusal::SandboxWaking))
    }

    /// A connection to `port` of `sandbox` for a caller of `access`,
    /// through its way in, counted against the sandbox's bound on
    /// connections while it is open, and told as the sandbox's events
    /// (`opened`, then `closed` with its bytes).
    pub(crate) async fn dial_port(
        &self,
        sandbox: &Sandbox,
        port: u16,
        access: Access,
    ) -> std::result::Result<crate::ports::Counted<crate::ports::ingress::PortStream>, Refusal>
    {
        let slot = sandbox
            .ports()
            .admit_connection(access == Access::Private)
            .ok_or(Refusal::TooManyConnections)?;
        let ingress = self
            .ingress_of(sandbox)
            .await
            .map_err(|_| Refusal::SandboxUnavailable)?;
        let stream = ingress.dial(port).await.map_err(|e| match e {
            crate::ports::ingress::DialError::NotListening(_)
            | crate::ports::ingress::DialError::Failed { .. } => Refusal::PortNotListening,
            crate::ports::ingress::DialError::Closed => Refusal::SandboxNotFound,
            crate::ports::ingress::DialError::Unanswered(_) => Refusal::SandboxUnavailable,
        })?;
        let meter = sandbox.ports().meter(|| {
            let metrics = &self.inner.metrics;
            let rate = self
                .inner
                .ports_settings
                .max_bytes_per_second
                .map(crate::rate::Rate::new);
            // One at a time: a family's guard held while the other is
            // made would wait for itself.
            let counter = |direction: &str| {
                metrics
                    .ports_bytes
                    .get_or_create(&vec![("direction", direction.to_string())])
                    .clone()
            };
            let bytes_in = counter("in");
            let bytes_out = counter("out");
            crate::ports::WayMeter {
                inward: rate
                    .as_ref()
                    .map(|r| crate::rate::Rate::new(r.per_second())),
                out: rate,
                bytes_in,
                bytes_out,
            }
        });
        let link = sandbox.ports().link(port, access);
        Ok(slot.hold_metered(stream, &self.inner.metrics.ports_open, meter, link))
    }
}
