//! `corral-worker`'s command line. Every flag also reads a `CORRAL_*`
//! environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

use corral_proto::units::{parse_rate, parse_size};

use crate::docker::Defaults;
use crate::process::{
    ConfigError, LogFormat, default_state_dir, read_token, server_tls, token_or_new,
};
use crate::worker::WorkerConfig;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "corral-worker",
    version,
    about = "Runs Corral operations in hardened Docker sandboxes, served over gRPC"
)]
pub struct WorkerArgs {
    /// Every error status carries one fixed text instead of its own: for
    /// tests that show clients decide by the status's reason alone.
    #[arg(long, env = "CORRAL_WITHHOLD_ERROR_TEXT", hide = true)]
    pub withhold_error_text: bool,
    /// Address to serve gRPC on.
    #[arg(long, env = "CORRAL_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// File holding the bearer token clients must present (at least 16
    /// characters, readable by its owner only). Default: `token` in the
    /// state directory, made on first start; `corral` run by the same user
    /// finds it there.
    #[arg(long, env = "CORRAL_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Let sandboxes run as root (uid 0 in the container, still without
    /// capabilities unless --allow-cap grants some).
    #[arg(long, env = "CORRAL_ALLOW_ROOT")]
    pub allow_root: bool,
    /// Let sandboxes have a writable root filesystem.
    #[arg(long, env = "CORRAL_ALLOW_WRITABLE_ROOTFS")]
    pub allow_writable_rootfs: bool,
    /// Let sandboxes have a network other than none.
    #[arg(long, env = "CORRAL_ALLOW_NETWORK")]
    pub allow_network: bool,
    /// A capability sandboxes may add, e.g. CAP_CHOWN (repeat, or a comma
    /// list). CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE and the other
    /// capabilities that reach the host are never granted.
    #[arg(long = "allow-cap", env = "CORRAL_ALLOW_CAPS", value_delimiter = ',')]
    pub allow_caps: Vec<String>,
    /// An image sandboxes may name besides --default-image: an exact name,
    /// or a prefix ending in '*' ('*' alone: any image). Repeat, or a comma
    /// list.
    #[arg(
        long = "allow-image",
        env = "CORRAL_ALLOW_IMAGES",
        value_delimiter = ','
    )]
    pub allow_images: Vec<String>,
    /// Docker engine to use (unix:///var/run/docker.sock, tcp://host:2375);
    /// default: DOCKER_HOST or the local socket.
    #[arg(long, env = "CORRAL_DOCKER_HOST")]
    pub docker_host: Option<String>,
    /// Most sandboxes this worker runs at once.
    #[arg(long, env = "CORRAL_MAX_SANDBOXES", default_value_t = 64)]
    pub max_sandboxes: u32,
    /// Where the worker keeps its id and sandbox records.
    #[arg(long, env = "CORRAL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// This worker's id (labels its containers); default: stored in the state dir.
    #[arg(long, env = "CORRAL_WORKER_ID")]
    pub worker_id: Option<String>,
    /// The static corral-init binary; default: next to this executable or in
    /// the Cargo target directory.
    #[arg(long, env = "CORRAL_INIT_BINARY")]
    pub init_binary: Option<PathBuf>,
    /// Serve TLS with this certificate (PEM; a chain is fine).
    #[arg(long, env = "CORRAL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Key of --tls-cert (PEM).
    #[arg(long, env = "CORRAL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS).
    #[arg(long, env = "CORRAL_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Idle timeout of sandboxes that name none: removed once no client has
    /// used them for this long (e.g. 2h; default: never).
    #[arg(long, env = "CORRAL_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    pub idle_timeout: Option<std::time::Duration>,
    /// Longest a sandbox may live, whatever it does (e.g. 24h; default:
    /// forever); a sandbox's own --ttl can only be shorter.
    #[arg(long, env = "CORRAL_MAX_LIFETIME", value_parser = humantime::parse_duration)]
    pub max_lifetime: Option<std::time::Duration>,
    /// How often to remove containers of this worker that have no record.
    #[arg(long, env = "CORRAL_SWEEP_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    pub sweep_interval: std::time::Duration,
    /// Most watch streams open at once, over all sandboxes.
    #[arg(long, env = "CORRAL_MAX_WATCHERS", default_value_t = 4096)]
    pub max_watchers: usize,
    /// Most watch streams of one sandbox at once.
    #[arg(long, env = "CORRAL_MAX_WATCHERS_PER_SANDBOX", default_value_t = 64)]
    pub max_watchers_per_sandbox: usize,
    /// A watch that takes nothing while it holds its sandbox's output back
    /// for this long is dropped (its client resumes from its cursor).
    #[arg(long, env = "CORRAL_WATCH_STALL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub watch_stall: std::time::Duration,
    /// OCI runtime a sandbox may name besides the default, e.g. runsc
    /// (gVisor), registered with the Docker engine (repeat, or a comma list).
    #[arg(
        long = "allow-runtime",
        env = "CORRAL_ALLOW_RUNTIMES",
        value_delimiter = ','
    )]
    pub allow_runtimes: Vec<String>,
    /// Egress by policy: a rule sandboxes' egress rules may fall within
    /// (repeat, or a comma list): DOMAIN[:PORT], *.DOMAIN[:PORT],
    /// CIDR[:PORT], or '*' for any public destination. A sandbox's
    /// connections go through a proxy this worker serves; internal
    /// addresses are refused whatever the rule. None: no sandbox has egress.
    #[arg(
        long = "allow-egress",
        env = "CORRAL_ALLOW_EGRESS",
        value_delimiter = ','
    )]
    pub allow_egress: Vec<String>,
    /// An internal range (RFC 1918, loopback, link-local, ...) sandboxes'
    /// egress may reach all the same, e.g. 10.20.0.0/16 for a package
    /// mirror (repeat, or a comma list). This worker's own listening ports
    /// are never reached.
    #[arg(
        long = "egress-allow-internal",
        env = "CORRAL_EGRESS_ALLOW_INTERNAL",
        value_delimiter = ','
    )]
    pub egress_allow_internal: Vec<String>,
    /// The DNS server (HOST:PORT, UDP) egress names are resolved with;
    /// default: the system's resolver.
    #[arg(long, env = "CORRAL_EGRESS_RESOLVER")]
    pub egress_resolver: Option<SocketAddr>,
    /// A warm pool (repeatable): IMAGE=N[,max=M][,memory=SIZE][,cpus=N]
    /// [,pids=N][,runtime=NAME] keeps N sandboxes of that template started
    /// and idle (with max=M: as many as the largest burst of creates within
    /// 10 s of the last 5 minutes, from N up to M); a create that matches it
    /// takes one at once (its id, env, labels and lifetimes applied then).
    /// Members take slots of --max-sandboxes, and give them up to a create
    /// that finds the worker full.
    #[arg(long = "pool", env = "CORRAL_POOL", value_parser = |s: &str| s.parse::<crate::pool::Template>())]
    pub pools: Vec<crate::pool::Template>,
    /// Most egress connections one sandbox has open at once.
    #[arg(long, env = "CORRAL_EGRESS_MAX_CONNECTIONS", default_value_t = crate::proxy::DEFAULT_MAX_CONNECTIONS)]
    pub egress_max_connections: usize,
    /// Most bytes a second one sandbox's egress moves each way, across
    /// all its connections (e.g. 10m); default: no bound.
    #[arg(long, env = "CORRAL_EGRESS_MAX_BYTES_PER_SECOND", value_parser = parse_rate)]
    pub egress_max_bytes_per_second: Option<u64>,
    /// OCI runtime of sandboxes that name none (default: the engine's).
    #[arg(long, env = "CORRAL_RUNTIME")]
    pub runtime: Option<String>,
    /// Most working memory a sandbox may ask for (e.g. 16g).
    #[arg(long, env = "CORRAL_MAX_MEMORY", default_value = "16g", value_parser = parse_size)]
    pub max_memory: u64,
    /// Most CPUs a sandbox may ask for (default: this host's).
    #[arg(long, env = "CORRAL_MAX_CPUS")]
    pub max_cpus: Option<f64>,
    /// Most processes a sandbox may ask for (default: 4096, or less where
    /// --max-sandboxes of them would take more than three quarters of the
    /// host's pid_max).
    #[arg(long, env = "CORRAL_MAX_PIDS")]
    pub max_pids: Option<u32>,
    /// Largest /workspace a sandbox may ask for (it counts as memory).
    #[arg(long, env = "CORRAL_MAX_WORKSPACE", default_value = "16g", value_parser = parse_size)]
    pub max_workspace: u64,
    /// Largest /tmp a sandbox may ask for (it counts as memory).
    #[arg(long, env = "CORRAL_MAX_TMP", default_value = "4g", value_parser = parse_size)]
    pub max_tmp: u64,
    /// Bytes of request messages read at once, across every connection
    /// (e.g. 512m): a request that does not fit waits, unread, for room.
    #[arg(long, env = "CORRAL_MAX_REQUEST_MEMORY", default_value = "512m", value_parser = parse_size)]
    pub max_request_memory: u64,
    /// Connections served at once.
    #[arg(long, env = "CORRAL_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// How long a new connection may take to send its HTTP/2 preface (or
    /// TLS record header) before it is closed.
    #[arg(long, env = "CORRAL_HANDSHAKE_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub handshake_timeout: std::time::Duration,
    /// How long a connection may go without a call that passes the token
    /// check before it is closed.
    #[arg(long, env = "CORRAL_FIRST_CALL_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub first_call_timeout: std::time::Duration,
    /// Connections one client address may have open before one of its
    /// calls passes the token check (half the served connections at most
    /// are unauthenticated, whatever their address).
    #[arg(
        long,
        env = "CORRAL_MAX_UNAUTHENTICATED_PER_PEER",
        default_value_t = 256
    )]
    pub max_unauthenticated_per_peer: usize,
    /// Start draining: take no new sandboxes (creates are refused with
    /// UNAVAILABLE) and report NOT_SERVING on the gRPC health service, while
    /// the sandboxes here are served until they end or --drain-deadline
    /// passes. SIGUSR1 and the Drain call do the same at run time; a drain
    /// survives restarts until the Drain call ends it.
    #[arg(long, env = "CORRAL_DRAIN")]
    pub drain: bool,
    /// Build images from clients' Dockerfiles on this worker's engine
    /// (BuildImage): each base image must be one a sandbox may name (see
    /// --allow-image); sandboxes may then name what was built. Build steps
    /// run under the engine's default runtime (not --runtime), with
    /// --build-network: offer this to clients you would let run containers.
    #[arg(long, env = "CORRAL_ALLOW_BUILD")]
    pub allow_build: bool,
    /// The network of build steps: none, or bridge (steps that download
    /// packages need it).
    #[arg(long, env = "CORRAL_BUILD_NETWORK", default_value = "none", value_parser = ["none", "bridge"])]
    pub build_network: String,
    /// The largest build context taken.
    #[arg(long, env = "CORRAL_MAX_BUILD_CONTEXT", default_value = "512m", value_parser = parse_size)]
    pub max_build_context: u64,
    /// The longest a build may take; a client may ask for less.
    #[arg(long, env = "CORRAL_MAX_BUILD_TIME", default_value = "30m", value_parser = humantime::parse_duration)]
    pub max_build_time: std::time::Duration,
    /// Memory of each build step (at most 2g).
    #[arg(long, env = "CORRAL_BUILD_MEMORY", default_value = "2g", value_parser = parse_size)]
    pub build_memory: u64,
    /// The fleet's registry, HOST:PORT (a registry on 127.0.0.0/8 is
    /// reached over plain HTTP; another must serve TLS the engine trusts):
    /// templates built here are pushed there, and a create of a template
    /// this worker lacks, or has an older build of, pulls it from there.
    #[arg(long, env = "CORRAL_REGISTRY")]
    pub registry: Option<String>,
    /// Most templates each tenant (and the operator) keeps on this worker
    /// (built or saved ones; a Harbor dataset keeps one per task). A
    /// template is an image on the engine: the disk is the real bound.
    #[arg(long, env = "CORRAL_MAX_TEMPLATES", default_value_t = corral_proto::template::MAX_TEMPLATES as u32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_templates: u32,
    /// The size of a volume whose create names none.
    #[arg(long, env = "CORRAL_DEFAULT_VOLUME_SIZE", default_value = "1g", value_parser = parse_size)]
    pub default_volume_size: u64,
    /// The largest volume a client may make. A volume's blocks are taken
    /// from the state directory's disk when it is made (a create that
    /// would leave less than 1 GiB free is refused).
    #[arg(long, env = "CORRAL_MAX_VOLUME_SIZE", default_value = "100g", value_parser = parse_size)]
    pub max_volume_size: u64,
    /// Most bytes of volumes one tenant (or the operator, with no
    /// tenant) keeps on this worker, e.g. 200g (default: as the disk has).
    #[arg(long, env = "CORRAL_TENANT_VOLUME_BYTES", value_parser = parse_size)]
    pub tenant_volume_bytes: Option<u64>,
    /// Export a span for each operation submitted with a W3C traceparent
    /// (OpenTelemetry, OTLP over gRPC) to this collector, e.g.
    /// http://127.0.0.1:4317. Off by default.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// How long a drain serves the sandboxes it found before removing what
    /// is left.
    #[arg(long, env = "CORRAL_DRAIN_DEADLINE", default_value = "1h", value_parser = humantime::parse_duration)]
    pub drain_deadline: std::time::Duration,
    /// Serve sandboxes' exposed ports (HTTP/1.1, HTTP/2 by prior
    /// knowledge, WebSockets, CONNECT tunnels) on ADDR:
    /// URLs /p/{sandbox}/{port}/ (or {port}-{sandbox}.{domain} with
    /// --ports-domain). Off by default.
    #[arg(long, env = "CORRAL_PORTS_LISTEN")]
    pub ports_listen: Option<SocketAddr>,
    /// The URL clients reach --ports-listen at, when it is not the address
    /// itself (a load balancer or TLS proxy in front), e.g.
    /// https://ports.example.com
    #[arg(long, env = "CORRAL_PORTS_URL")]
    pub ports_url: Option<String>,
    /// A wildcard domain whose names reach --ports-listen: URLs are then
    /// {port}-{sandbox}.DOMAIN (the same Host for every request and
    /// WebSocket of an app), else /p/{sandbox}/{port}/.
    #[arg(long, env = "CORRAL_PORTS_DOMAIN")]
    pub ports_domain: Option<String>,
    /// Let clients expose ports with public access (no credential at all).
    #[arg(long, env = "CORRAL_ALLOW_PUBLIC_PORTS")]
    pub allow_public_ports: bool,
    /// Most bytes a second one sandbox's exposed ports move each way,
    /// across all their connections (e.g. 10m); default: no bound.
    #[arg(long, env = "CORRAL_PORTS_MAX_BYTES_PER_SECOND", value_parser = parse_rate)]
    pub ports_max_bytes_per_second: Option<u64>,
    /// Cut a connection to a sandbox's port (a tunnel, a WebSocket, a
    /// kept-alive one to its server) that moves nothing either way for
    /// this long, so that idle clients hold none of its connections; 0:
    /// never.
    #[arg(long, env = "CORRAL_PORTS_IDLE_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub ports_idle_timeout: std::time::Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics (a port of its own,
    /// without the token: bind it where only the scraper reaches).
    #[arg(long, env = "CORRAL_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Log format: json (one object per line), text, or auto (text on a
    /// terminal, else json).
    #[arg(long, env = "CORRAL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto)]
    pub log_format: LogFormat,
    /// The uids sandboxes' commands run as, FIRST-LAST: each sandbox gets
    /// one of its own, at random (default 1879048192-2147352575, a range
    /// where no distribution puts accounts; 10000-59999 on an engine that
    /// remaps uids, as rootless Docker does). Refused when it overlaps an
    /// account of /etc/passwd or a range of /etc/subuid.
    #[arg(long, env = "CORRAL_SANDBOX_UIDS")]
    pub sandbox_uids: Option<crate::uids::UidRange>,
    /// Image for sandboxes that name none (corral-debian:latest: python3,
    /// pip, venv, git and a C toolchain; corral-sandbox:latest is a small
    /// busybox one).
    #[arg(
        long,
        env = "CORRAL_DEFAULT_IMAGE",
        default_value = corral_proto::sandbox::DEFAULT_IMAGE
    )]
    pub default_image: String,
}

impl WorkerArgs {
    fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| default_state_dir("worker"))
    }

    /// Where the token is: --token-file, else `token` in the state dir.
    pub fn token_path(&self) -> PathBuf {
        self.token_file
            .clone()
            .unwrap_or_else(|| self.state_dir().join("token"))
    }

    /// The token every call must present, loopback included: other local
    /// users must not reach the worker. Made on first start when no
    /// --token-file is given.
    pub fn token(&self) -> Result<String, ConfigError> {
        match &self.token_file {
            Some(path) => read_token(path),
            None => token_or_new(&self.token_path()),
        }
    }

    /// Limits on connections.
    pub fn admission(&self) -> crate::admission::Admission {
        crate::admission::Admission {
            max_connections: self.max_connections,
            handshake_timeout: self.handshake_timeout,
            first_call_timeout: self.first_call_timeout,
            max_unauthenticated_per_peer: self.max_unauthenticated_per_peer,
            ..crate::admission::Admission::default()
        }
    }

    /// The operator's policy on what sandboxes may be.
    pub fn policy(&self) -> Result<corral_proto::SandboxPolicy, ConfigError> {
        let policy = corral_proto::SandboxPolicy {
            allow_root: self.allow_root,
            allow_writable_rootfs: self.allow_writable_rootfs,
            allow_network: self.allow_network,
            allowed_capabilities: self
                .allow_caps
                .iter()
                .map(|c| crate::policy::capability_name(c))
                .collect(),
            allowed_images: self
                .allow_images
                .iter()
                .filter(|i| *i != "*")
                .cloned()
                .collect(),
            allow_any_image: self.allow_images.iter().any(|i| i == "*"),
            allowed_runtimes: self.allow_runtimes.clone(),
            allow_build: self.allow_build,
            allowed_egress: corral_proto::egress::parse_rules(&self.allow_egress, true)
                .map_err(|e| ConfigError::Policy(format!("--allow-egress: {e}")))?,
            ceilings: corral_proto::Ceilings {
                memory_bytes: self.max_memory,
                cpu_millis: match self.max_cpus {
                    Some(c) if c.is_finite() && c > 0.0 => (c * 1000.0).round() as u32,
                    Some(c) => {
                        return Err(ConfigError::Policy(format!(
                            "--max-cpus {c}: not a positive number"
                        )));
                    }
                    None => std::thread::available_parallelism()
                        .map_or(1, std::num::NonZeroUsize::get)
                        .saturating_mul(1000) as u32,
                },
                pids: self
                    .max_pids
                    .unwrap_or_else(|| default_max_pids(read_pid_max(), self.max_sandboxes)),
                workspace_bytes: self.max_workspace,
                tmp_bytes: self.max_tmp,
            },
        };
        crate::policy::check_policy(&policy).map_err(ConfigError::Policy)?;
        Ok(policy)
    }

    /// The TLS configuration, when --tls-cert is given.
    pub fn tls(&self) -> Result<Option<crate::process::ServerTls>, ConfigError> {
        server_tls(
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_client_ca.as_deref(),
        )
    }

    pub fn worker_config(&self) -> Result<WorkerConfig, ConfigError> {
        if let Some(r) = &self.registry {
            let ok = !r.is_empty()
                && r.len() <= 255
                && r.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
            if !ok {
                return Err(ConfigError::Policy(format!(
                    "--registry {r:?}: a registry's HOST:PORT (no scheme, no path), e.g. 127.0.0.1:5000"
                )));
            }
        }
        let policy = self.policy()?;
        let pids_ceiling = policy.ceilings.pids;
        let pid_max = read_pid_max();
        if u64::from(pids_ceiling) * u64::from(self.max_sandboxes) > u64::from(pid_max) {
            tracing::warn!(
                max_pids = pids_ceiling,
                max_sandboxes = self.max_sandboxes,
                pid_max,
                "--max-sandboxes sandboxes at --max-pids processes each would take more than this host's pid_max: a sandbox's fork bomb at its bound could leave the host without pids"
            );
        }
        let defaults = Defaults::default();
        Ok(WorkerConfig {
            state_dir: self.state_dir(),
            worker_id: self.worker_id.clone(),
            docker_host: self.docker_host.clone(),
            init_binary: self.init_binary.clone(),
            max_sandboxes: self.max_sandboxes,
            sweep_interval: self.sweep_interval,
            default_idle_timeout: self.idle_timeout,
            max_lifetime: self.max_lifetime,
            drain: self.drain,
            drain_deadline: self.drain_deadline,
            defaults: Defaults {
                image: self.default_image.clone(),
                runtime: self.runtime.clone(),
                // The default within the ceiling.
                pids_limit: defaults.pids_limit.min(pids_ceiling),
                ..defaults
            },
            policy,
            sandbox_limits: crate::sandbox::Limits {
                watch_stall: self.watch_stall,
                max_watchers: self.max_watchers_per_sandbox,
            },
            max_watchers: self.max_watchers,
            sandbox_uids: self.sandbox_uids,
            egress: self.egress()?,
            pools: self.pools.clone(),
            ports: crate::worker::PortsSettings {
                url: self.ports_url.clone(),
                domain: self.ports_domain.clone(),
                allow_public: self.allow_public_ports,
                max_bytes_per_second: self.ports_max_bytes_per_second,
                idle_timeout: Some(self.ports_idle_timeout).filter(|t| !t.is_zero()),
            },
            otlp_endpoint: self.otlp_endpoint.clone(),
            registry: self.registry.clone(),
            max_templates: self.max_templates as usize,
            volumes: crate::volumes::VolumeSettings {
                default_bytes: self.default_volume_size,
                max_bytes: self.max_volume_size,
                tenant_bytes: self.tenant_volume_bytes,
            },
            build: crate::build::BuildSettings {
                network: self.build_network.clone(),
                max_context_bytes: self.max_build_context,
                max_time: self.max_build_time,
                memory_bytes: self.build_memory,
                ..crate::build::BuildSettings::default()
            },
        })
    }

    /// Where egress connections may go, whatever a sandbox's policy: never
    /// this worker's own listening sockets.
    pub fn egress(&self) -> Result<crate::proxy::Settings, ConfigError> {
        let allow_internal = self
            .egress_allow_internal
            .iter()
            .map(|c| {
                c.parse::<corral_proto::egress::Cidr>()
                    .map_err(|e| ConfigError::Policy(format!("--egress-allow-internal {c}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if self.egress_max_connections == 0 {
            return Err(ConfigError::Policy(
                "--egress-max-connections: at least 1".into(),
            ));
        }
        let mut own = vec![self.listen];
        own.extend(self.metrics_listen);
        own.extend(self.ports_listen);
        let defaults = crate::proxy::Settings::default();
        Ok(crate::proxy::Settings {
            gate: crate::egress::Gate {
                allow_internal,
                own,
                resolver: self.egress_resolver,
                ..defaults.gate
            },
            max_connections: self.egress_max_connections,
            max_bytes_per_second: self.egress_max_bytes_per_second,
        })
    }
}

/// The host's `kernel.pid_max` (32,768 where it cannot be read: Linux's
/// default on small hosts).
pub fn read_pid_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(32_768)
}

/// The most processes a sandbox may ask for when the operator names no
/// bound: 4096, or less where `sandboxes` sandboxes at that bound would
/// take more than three quarters of the host's `pid_max` (the rest is the
/// host's and the worker's). Never below 64.
pub fn default_max_pids(pid_max: u32, sandboxes: u32) -> u32 {
    let share = u64::from(pid_max) * 3 / 4 / u64::from(sandboxes.max(1));
    u32::try_from(share).unwrap_or(u32::MAX).clamp(64, 4096)
}

#[cfg(test)]
mod tests {

    #[test]
    fn every_client_gets_the_debian_image_unless_it_names_another() {
        let cmd = <super::WorkerArgs as clap::CommandFactory>::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "default_image")
            .unwrap();
        assert_eq!(arg.get_default_values(), ["corral-debian:latest"]);
        assert_eq!(
            crate::docker::Defaults::default().image,
            "corral-debian:latest"
        );
    }

    #[test]
    fn the_default_pid_ceiling_leaves_the_host_a_quarter_of_its_pids() {
        // This host's default pid_max, 64 sandboxes: 384 each.
        assert_eq!(default_max_pids(32_768, 64), 384);
        assert!(u64::from(default_max_pids(32_768, 64)) * 64 <= 32_768 * 3 / 4);
        // A large pid_max: the usual 4096; many sandboxes: never below 64.
        assert_eq!(default_max_pids(4_194_304, 64), 4096);
        assert_eq!(default_max_pids(32_768, 10_000), 64);
        assert_eq!(default_max_pids(32_768, 0), 4096);
    }

    use super::*;

    #[test]
    fn a_token_is_made_on_first_start_for_the_owner_only_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let state = state.to_str().unwrap();
        let args = WorkerArgs::parse_from(["corral-worker", "--state-dir", state]);
        let token = args.token().unwrap();
        assert!(token.len() >= crate::process::MIN_TOKEN_CHARS);
        let path = args.token_path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            args.token().unwrap(),
            token,
            "the same token on the next start"
        );
    }

    #[test]
    fn a_policy_that_grants_a_host_capability_is_refused_at_start() {
        let args = WorkerArgs::parse_from(["corral-worker", "--allow-cap", "CAP_CHOWN,sys_admin"]);
        let e = args.policy().unwrap_err().to_string();
        assert!(
            e.contains("CAP_SYS_ADMIN") && e.contains("never granted"),
            "{e}"
        );
        let args = WorkerArgs::parse_from([
            "corral-worker",
            "--allow-image",
            "*",
            "--allow-cap",
            "chown",
        ]);
        let p = args.policy().unwrap();
        assert!(p.allow_any_image);
        assert_eq!(p.allowed_capabilities, ["CAP_CHOWN"]);
    }
}
