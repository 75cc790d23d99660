//! The worker's end of a sandbox's egress proxy: a Unix socket of the
//! sandbox's own, in a directory mounted (read-only) into that sandbox
//! alone, so a connection on it is the sandbox's whatever it says. The
//! sandbox's relay (`corral_init::relay`) carries each connection of its
//! loopback proxy here; this decides it by the sandbox's policy (see
//! [`crate::egress`]), connects and relays, bounded per sandbox, and
//! reports every decision.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::egress::Rule;
use corral_proto::event::{Egress, EgressDecision};
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::egress::{Blocked, Gate, Meter, Meters, admit, relay_spliced, too_many};
use crate::metrics::WorkerMetrics;

/// The socket's name in its directory (as `corral_init::relay` expects).
pub const SOCKET_NAME: &str = "proxy.sock";
/// Where the directory is mounted in the sandbox.
pub const SANDBOX_DIR: &str = "/run/corral-egress";
/// The proxy's address in the sandbox, as its environment names it.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";
/// The environment that names the proxy to a sandbox's commands (loopback
/// itself not through it).
pub fn proxy_env() -> impl Iterator<Item = (&'static str, &'static str)> {
    ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
        .into_iter()
        .map(|k| (k, PROXY_URL))
        .chain(
            ["NO_PROXY", "no_proxy"]
                .into_iter()
                .map(|k| (k, "localhost,127.0.0.1,::1")),
        )
}

/// Connections one sandbox may have open through its proxy by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

/// The worker's egress settings, shared by every sandbox's proxy.
#[derive(Debug, Clone)]
pub struct Settings {
    pub gate: Gate,
    /// Connections one sandbox may have open at once; more are refused
    /// (429, `too_many_connections`) without reading them.
    pub max_connections: usize,
    /// Bytes a second one sandbox's egress may move each way, across its
    /// connections (`--egress-max-bytes-per-second`); `None`: no bound.
    pub max_bytes_per_second: Option<u64>,
}

impl Default for Settings {
    /// This host's addresses refused, ten seconds to connect, the default
    /// bound; no exemption, no own port (the caller adds them).
    fn default() -> Self {
        Self {
            gate: Gate {
                connect_timeout: Duration::from_secs(10),
                own_ips: host_addresses(),
                ..Gate::default()
            },
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_bytes_per_second: None,
        }
    }
}

/// The addresses of this host's interfaces (none if they cannot be read).
pub fn host_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<std::net::IpAddr> = addrs
        .filter_map(|a| a.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| std::net::IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// A sandbox's socket directory under the worker's state directory.
pub fn socket_dir(state_root: &Path, id: &SandboxId) -> PathBuf {
    state_root.join("egress").join(id.as_str())
}

/// Makes a sandbox's socket directory, 0755: what reaches it is the mount
/// in one sandbox; on the host it sits in the private state directory.
pub fn make_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

/// Makes `dir` and binds its socket anew (a stale one from an earlier run
/// is replaced), 0666 (see [`make_dir`]).
pub fn bind(dir: &Path) -> std::io::Result<UnixListener> {
    make_dir(dir)?;
    let path = dir.join(SOCKET_NAME);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    // A Unix socket's path has at most 107 bytes; a state directory may be
    // deeper. Bound through the directory's descriptor, the path is short.
    let listener = if path.as_os_str().len() < 100 {
        UnixListener::bind(&path)?
    } else {
        let d = std::fs::File::open(dir)?;
        let short = format!(
            "/proc/self/fd/{}/{SOCKET_NAME}",
            std::os::fd::AsRawFd::as_raw_fd(&d)
        );
        UnixListener::bind(short)?
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Makes `dir` (a sandbox's socket directory) name the directory of the
/// pool member it was claimed from, beside it (see [`socket_dir`]).
pub fn link_dir(dir: &Path, member: &SandboxId) -> std::io::Result<()> {
    std::os::unix::fs::symlink(member.as_str(), dir)
}

/// Removes a sandbox's socket directory (nothing if it has none), and the
/// member's directory it names if it is a link made by [`link_dir`].
pub fn remove(dir: &Path) {
    let removed = match std::fs::read_link(dir) {
        Ok(target) => {
            // Only a sibling's name, as link_dir makes it.
            let sibling = target
                .file_name()
                .filter(|n| target.as_os_str() == *n)
                .and_then(|n| dir.parent().map(|p| p.join(n)));
            if let Some(real) = sibling {
                remove(&real);
            }
            std::fs::remove_file(dir)
        }
        Err(_) => std::fs::remove_dir_all(dir),
    };
    match removed {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            warn!(dir = %dir.display(), error = %e, "removing an egress socket directory");
        }
        _ => {}
    }
}

/// What the proxy tells its sandbox: each decision, as an event.
pub type Reports = mpsc::Sender<Egress>;

/// Serves a sandbox's socket until `closed`: each connection is admitted
/// or refused, relayed, and reported (to `reports`, and the metrics). At
/// most `settings.max_connections` at once; a task per connection, owned
/// by `tracker`, ended by `closed` too.
pub async fn serve(
    listener: UnixListener,
    policy: watch::Receiver<Arc<Vec<Rule>>>,
    settings: Arc<Settings>,
    reports: Reports,
    metrics: Arc<WorkerMetrics>,
    tracker: TaskTracker,
    closed: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    // One rate a direction for all of this sandbox's connections.
    let meter = |direction: &str| Meter {
        bytes: metrics
            .egress_bytes
            .get_or_create(&vec![("direction", direction.to_string())])
            .clone(),
        rate: settings
            .max_bytes_per_second
            .map(|n| Arc::new(crate::rate::Rate::new(n))),
    };
    let meters = Arc::new(Meters {
        out: meter("out"),
        inward: meter("in"),
    });
    loop {
        let accepted = tokio::select! {
            () = closed.cancelled() => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, say: the next try may do.
                warn!(error = %e, "egress accept failed");
                tokio::select! {
                    () = closed.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            let reason = Blocked::TooManyConnections.as_str();
            metrics.egress_decided(EgressDecision::Blocked.as_str(), reason);
            // Said without waiting on the sandbox: it may not be reading.
            // Its head is not read, so the event names no host; a flood
            // that fills the event queue is not waited for either.
            let _ = stream.try_write(too_many());
            let _ = reports.try_send(Egress {
                host: String::new(),
                port: 0,
                decision: EgressDecision::Blocked,
                reason: reason.to_string(),
            });
            continue;
        };
        let (policy, settings, reports, metrics, meters, closed) = (
            policy.clone(),
            Arc::clone(&settings),
            reports.clone(),
            Arc::clone(&metrics),
            Arc::clone(&meters),
            closed.clone(),
        );
        tracker.spawn(async move {
            let _slot = slot;
            tokio::select! {
                () = closed.cancelled() => {}
                () = one(stream, policy, &settings, &reports, &metrics, &meters) => {}
            }
        });
    }
}

async fn one(
    stream: tokio::net::UnixStream,
    mut policy: watch::Receiver<Arc<Vec<Rule>>>,
    settings: &Settings,
    reports: &Reports,
    metrics: &WorkerMetrics,
    meters: &Meters,
) {
    let report = |host: &str, port: u16, decision: EgressDecision, reason: Option<Blocked>| {
        let reason = reason.map_or("", Blocked::as_str);
        metrics.egress_decided(decision.as_str(), reason);
        debug!(host, port, decision = decision.as_str(), reason, "egress");
        Egress {
            host: host.to_string(),
            port,
            decision,
            reason: reason.to_string(),
        }
    };
    match admit(stream, &mut policy, &settings.gate).await {
        Err(refused) => {
            // Reported before the client hears of it: the sandbox's event
            // comes before whatever its command does next.
            let out = &refused.outcome;
            let e = report(&out.host, out.port, EgressDecision::Blocked, out.blocked);
            let _ = reports.send(e).await;
            refused.answer().await;
        }
        Ok(admitted) => {
            let (host, port) = (admitted.outcome().host.clone(), admitted.outcome().port);
            let e = report(&host, port, EgressDecision::Allowed, None);
            let _ = reports.send(e).await;
            // The request's head, sent upstream as it was admitted.
            meters.out.charge(admitted.outcome().bytes_out).await;
            let out = {
                let _open = Open::new(&metrics.egress_open);
                relay_spliced(admitted, policy, meters).await
            };
            if out.cut {
                let e = report(&host, port, EgressDecision::Closed, out.blocked);
                let _ = reports.send(e).await;
            }
        }
    }
}

/// One open connection on the gauge, for as long as it lives (a cancelled
/// relay counts down too).
struct Open<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> Open<'a> {
    fn new(g: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_claimed_members_directory_is_the_sandboxs_and_goes_with_it() {
        let root = tempfile::tempdir().unwrap();
        let member = SandboxId::new("m-pool-1").unwrap();
        let sandbox = SandboxId::new("s1").unwrap();
        let (m, s) = (
            socket_dir(root.path(), &member),
            socket_dir(root.path(), &sandbox),
        );
        make_dir(&m).unwrap();
        link_dir(&s, &member).unwrap();
        // Bound under the sandbox's name, the socket is in the member's
        // directory (the one a container mounted).
        let _listener = bind(&s).unwrap();
        assert!(m.join(SOCKET_NAME).exists());
        remove(&s);
        assert!(!s.exists() && !m.exists());
        // A plain directory goes as before; nothing there is nothing done.
        make_dir(&s).unwrap();
        remove(&s);
        assert!(!s.exists());
        remove(&s);
    }
}
