//! The decision: a host and port against a sandbox's rules, then the
//! name resolved once and every address checked before it is connected to.

use super::*;

/// Whether `policy` lets a connection to `host` (a name, or an IP
/// literal) on `port` out; the reason when it does not.
pub fn decide(policy: &[Rule], host: &str, port: u16) -> Result<(), Blocked> {
    let allowed = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => policy.iter().any(|r| r.allows_ip(ip, port)),
        Err(_) => policy.iter().any(|r| r.allows_name(host, port)),
    };
    if allowed {
        return Ok(());
    }
    // The host is listed on another port: say so.
    let any_port = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => policy.iter().any(|r| {
            let mut all = r.clone();
            all.port = Some(port);
            all.allows_ip(ip, port)
        }),
        Err(_) => policy.iter().any(|r| {
            let mut all = r.clone();
            all.port = Some(port);
            all.allows_name(host, port)
        }),
    };
    Err(if any_port {
        Blocked::Port
    } else {
        Blocked::NotAllowed
    })
}

/// Where the worker lets connections go, whatever a sandbox's policy: no
/// internal address unless its operator exempts the range, never the
/// worker's own listening sockets.
#[derive(Debug, Clone, Default)]
pub struct Gate {
    /// Internal ranges the operator exempts (`--egress-allow-internal`).
    pub allow_internal: Vec<Cidr>,
    /// The worker's own listening sockets (gRPC, metrics): never reached,
    /// exempt or not.
    pub own: Vec<SocketAddr>,
    /// The worker's host's own addresses (its interfaces'): refused as
    /// internal ones are, public or not, unless a range exempts them.
    pub own_ips: Vec<IpAddr>,
    /// How long one connection attempt (or lookup) may take.
    pub connect_timeout: Duration,
    /// The resolver names are asked of (`--egress-resolver`); `None`: the
    /// system's.
    pub resolver: Option<SocketAddr>,
}

impl Gate {
    /// Whether a connection to `addr` may be made.
    pub fn check(&self, addr: SocketAddr) -> Result<(), Blocked> {
        let ip = corral_proto::egress::canonical(addr.ip());
        let own = self.own.iter().any(|o| {
            o.port() == addr.port()
                && (o.ip().is_unspecified() || corral_proto::egress::canonical(o.ip()) == ip)
        });
        if own {
            return Err(Blocked::InternalAddress);
        }
        let internal = internal_range(ip).is_some()
            || self
                .own_ips
                .iter()
                .any(|o| corral_proto::egress::canonical(*o) == ip);
        if internal && !self.allow_internal.iter().any(|c| c.contains(ip)) {
            return Err(Blocked::InternalAddress);
        }
        Ok(())
    }

    /// The addresses a connection to `host` (a name or an IP literal) on
    /// `port` may go to, for a sandbox whose policy is `policy`: decided,
    /// resolved here (never an address the sandbox chose for a name), every
    /// address checked. The caller connects to these and no others, so no
    /// later lookup can rebind the name.
    pub async fn resolve(
        &self,
        policy: &[Rule],
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, Blocked> {
        decide(policy, host, port)?;
        let addrs: Vec<SocketAddr> = match (host.parse::<IpAddr>(), self.resolver) {
            (Ok(ip), _) => vec![SocketAddr::new(ip, port)],
            (Err(_), Some(resolver)) => crate::dns::resolve(resolver, host, self.connect_timeout)
                .await
                .map_err(|_| Blocked::ResolveFailed)?
                .into_iter()
                .map(|ip| SocketAddr::new(ip, port))
                .collect(),
            (Err(_), None) => {
                tokio::time::timeout(self.connect_timeout, tokio::net::lookup_host((host, port)))
                    .await
                    .map_err(|_| Blocked::ResolveFailed)?
                    .map_err(|_| Blocked::ResolveFailed)?
                    .collect()
            }
        };
        if addrs.is_empty() {
            return Err(Blocked::ResolveFailed);
        }
        let allowed: Vec<SocketAddr> = addrs
            .into_iter()
            .filter(|a| self.check(*a).is_ok())
            .collect();
        if allowed.is_empty() {
            return Err(Blocked::InternalAddress);
        }
        Ok(allowed)
    }

    /// A connection to the first of `addrs` (checked by [`Self::resolve`])
    /// that answers.
    pub async fn connect_to(
        &self,
        addrs: &[SocketAddr],
    ) -> Result<(tokio::net::TcpStream, SocketAddr), Blocked> {
        for addr in addrs {
            if self.check(*addr).is_err() {
                continue;
            }
            if let Ok(Ok(stream)) =
                tokio::time::timeout(self.connect_timeout, tokio::net::TcpStream::connect(addr))
                    .await
            {
                let _ = stream.set_nodelay(true);
                return Ok((stream, *addr));
            }
        }
        Err(Blocked::Unreachable)
    }

    /// [`Self::resolve`], then [`Self::connect_to`].
    pub async fn connect(
        &self,
        policy: &[Rule],
        host: &str,
        port: u16,
    ) -> Result<(tokio::net::TcpStream, SocketAddr), Blocked> {
        let addrs = self.resolve(policy, host, port).await?;
        self.connect_to(&addrs).await
    }
}

/// How one proxied connection went: for the sandbox's `egress` event, the
/// metrics and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub host: String,
    pub port: u16,
    /// `None`: allowed.
    pub blocked: Option<Blocked>,
    /// Allowed, then closed because the policy no longer allows it. (A
    /// tunnel connected before its client spoke whose first bytes were then
    /// refused has `blocked` set and `cut` not: it was blocked, late.)
    pub cut: bool,
    pub bytes_out: u64,
    pub bytes_in: u64,
}

impl Outcome {
    pub(crate) fn new() -> Self {
        Self {
            host: String::new(),
            port: 0,
            blocked: None,
            cut: false,
            bytes_out: 0,
            bytes_in: 0,
        }
    }
}
