//! Egress rules: which destinations a sandbox's connections may reach
//! through its worker, as clients ask for them and as workers bound them.
//!
//! A rule is `DOMAIN[:PORT]`, `*.DOMAIN[:PORT]` (any depth below DOMAIN,
//! never DOMAIN itself), `CIDR[:PORT]` (`[CIDR]:PORT` for IPv6) or, on a
//! worker's bound only, `*` (any public destination, any port; `*:PORT`
//! on that port). A rule without a port means 80 and 443. Names are compared lower-case without a trailing dot;
//! an IP address matches CIDR rules only, never a name.

use std::net::IpAddr;
use std::str::FromStr;

use crate::ProtocolError;

/// Rules a sandbox may carry.
pub const MAX_RULES: usize = 256;

/// What a rule names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    /// Exactly this name.
    Name(String),
    /// Any name below this one (`*.example.com`: `a.example.com`,
    /// `a.b.example.com`, not `example.com`).
    Below(String),
    /// Addresses in this network.
    Net(Cidr),
    /// Any public destination (a worker's bound only).
    Any,
}

/// An IP network: an address and a prefix length, host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, String> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("prefix /{prefix} is over /{max}"));
        }
        let c = Self { addr, prefix };
        if c.masked(addr) != addr {
            return Err(format!(
                "{addr}/{prefix} has host bits set (the network is {}/{prefix})",
                c.masked(addr)
            ));
        }
        Ok(c)
    }

    fn masked(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(a) => {
                let bits = u32::from(a);
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u32::MAX << (32 - self.prefix)
                };
                IpAddr::V4((bits & mask).into())
            }
            IpAddr::V6(a) => {
                let bits = u128::from(a);
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u128::MAX << (128 - self.prefix)
                };
                IpAddr::V6((bits & mask).into())
            }
        }
    }

    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts
    /// as its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        ip.is_ipv4() == self.addr.is_ipv4() && self.masked(ip) == self.addr
    }

    /// Whether every address of `other` is in this network.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IP address"))?;
        let addr = canonical(addr);
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .map_err(|_| format!("{p:?} is not a prefix length"))?,
            None if addr.is_ipv4() => 32,
            None => 128,
        };
        Cidr::new(addr, prefix)
    }
}

/// An IPv4-mapped IPv6 address as its IPv4 one.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(a) => a.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The ranges no egress rule reaches unless a worker's operator exempts
/// them: where an address is, when it is in one.
pub fn internal_range(ip: IpAddr) -> Option<&'static str> {
    const RANGES: &[(&str, &str)] = &[
        ("0.0.0.0/8", "this network (0.0.0.0/8)"),
        ("127.0.0.0/8", "loopback"),
        ("10.0.0.0/8", "private (RFC 1918)"),
        ("172.16.0.0/12", "private (RFC 1918)"),
        ("192.168.0.0/16", "private (RFC 1918)"),
        (
            "169.254.0.0/16",
            "link-local (the cloud metadata address among them)",
        ),
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("198.18.0.0/15", "benchmarking"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved (broadcast among them)"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("fc00::/7", "unique local (IPv6 ULA)"),
        ("fe80::/10", "link-local"),
        ("ff00::/8", "multicast"),
        ("::/96", "IPv4-compatible (an IPv4 address inside)"),
        (
            "::ffff:0:0:0/96",
            "IPv4-translated (an IPv4 address inside)",
        ),
        ("64:ff9b::/96", "NAT64 (an IPv4 address inside)"),
        (
            "64:ff9b:1::/48",
            "NAT64, local use (an IPv4 address inside)",
        ),
        ("100::/64", "discard-only"),
        ("2002::/16", "6to4 (an IPv4 address inside)"),
    ];
    let ip = canonical(ip);
    // Every entry parses (the tests hold the table to it).
    RANGES.iter().find_map(|(net, what)| {
        net.parse::<Cidr>()
            .ok()
            .filter(|n| n.contains(ip))
            .map(|_| *what)
    })
}

/// One egress rule.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    pub dest: Dest,
    /// `None`: 80 and 443.
    pub port: Option<u16>,
}

/// The ports of a rule that names none.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

impl Rule {
    fn port_ok(&self, port: u16) -> bool {
        match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// Whether a connection to `host` (a name, lower-case, no trailing dot)
    /// on `port` is within this rule. `*` matches every name: the worker's
    /// checks of the address it resolves to keep it public.
    pub fn allows_name(&self, host: &str, port: u16) -> bool {
        self.port_ok(port)
            && match &self.dest {
                Dest::Name(n) => n == host,
                Dest::Below(n) => host.len() > n.len() + 1 && host.ends_with(&format!(".{n}")),
                Dest::Net(_) => false,
                Dest::Any => true,
            }
    }

    /// Whether a connection to the IP literal `ip` on `port` is within this
    /// rule (CIDR rules only, and `*`).
    pub fn allows_ip(&self, ip: IpAddr, port: u16) -> bool {
        self.port_ok(port)
            && match &self.dest {
                Dest::Net(c) => c.contains(ip),
                Dest::Any => true,
                Dest::Name(_) | Dest::Below(_) => false,
            }
    }

    /// Whether everything `asked` allows, this rule allows too: how a
    /// worker bounds what a client asks for.
    pub fn covers(&self, asked: &Rule) -> bool {
        // `*` alone is any public destination, on any port.
        if self.dest == Dest::Any && self.port.is_none() {
            return true;
        }
        let ports = match (self.port, asked.port) {
            (None, None) => true,
            (None, Some(p)) => DEFAULT_PORTS.contains(&p),
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        ports
            && match (&self.dest, &asked.dest) {
                (Dest::Any, _) => true,
                (_, Dest::Any) => false,
                (Dest::Name(a), Dest::Name(b)) => a == b,
                (Dest::Below(a), Dest::Name(b)) => {
                    b.len() > a.len() + 1 && b.ends_with(&format!(".{a}"))
                }
                (Dest::Below(a), Dest::Below(b)) => a == b || b.ends_with(&format!(".{a}")),
                (Dest::Net(a), Dest::Net(b)) => a.covers(b),
                _ => false,
            }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dest = match &self.dest {
            Dest::Name(n) => n.clone(),
            Dest::Below(n) => format!("*.{n}"),
            Dest::Net(c) if c.addr.is_ipv6() && self.port.is_some() => format!("[{c}]"),
            Dest::Net(c) => c.to_string(),
            Dest::Any => "*".into(),
        };
        match self.port {
            Some(p) => write!(f, "{dest}:{p}"),
            None => f.write_str(&dest),
        }
    }
}

/// A host name as rules compare it, or why it is none: lower-case, no
/// trailing dot, labels of letters, digits and hyphens (1-63 each, 253 in
/// all; `_` too, as some services use).
pub fn normalize_name(raw: &str) -> Result<String, String> {
    let name = raw.strip_suffix('.').unwrap_or(raw).to_ascii_lowercase();
    if name.is_empty() || name.len() > 253 {
        return Err(format!("{raw:?} is not a host name (1-253 characters)"));
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(format!(
                "{raw:?} is not a host name (label {label:?}: letters, digits and inner hyphens, 1-63 of them)"
            ));
        }
    }
    if name.parse::<IpAddr>().is_ok() || name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!(
            "{raw:?} is an address, not a name: give it as a CIDR"
        ));
    }
    Ok(name)
}

impl FromStr for Rule {
    type Err = ProtocolError;
    fn from_str(raw: &str) -> Result<Self, ProtocolError> {
        let bad = |why: String| ProtocolError::invalid("egress", format!("rule {raw:?}: {why}"));
        let s = raw.trim();
        // A URL pasted for a host: said as such, not as a bad port.
        if let Some((scheme, rest)) = s.split_once("://") {
            let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
            return Err(bad(format!(
                "a rule names a host, not a {scheme} URL (e.g. {host:?})"
            )));
        }
        // [v6 or v6/len]:port
        let (dest, port) = if let Some(rest) = s.strip_prefix('[') {
            let (inner, after) = rest
                .split_once(']')
                .ok_or_else(|| bad("an unclosed '['".into()))?;
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| bad(format!("{p:?} after ']'")))?,
                ),
            };
            (inner, port)
        } else if s.matches(':').count() > 1 {
            // A bare IPv6 address or network, no port.
            (s, None)
        } else {
            match s.rsplit_once(':') {
                Some((d, p)) => (d, Some(p)),
                None => (s, None),
            }
        };
        let port = port
            .map(|p| match p.parse::<u16>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(bad(format!("{p:?} is not a port (1-65535)"))),
            })
            .transpose()?;
        let dest = if dest == "*" {
            Dest::Any
        } else if let Some(below) = dest.strip_prefix("*.") {
            Dest::Below(normalize_name(below).map_err(bad)?)
        } else if dest.contains('/') || dest.parse::<IpAddr>().is_ok() {
            Dest::Net(dest.parse().map_err(bad)?)
        } else {
            Dest::Name(normalize_name(dest).map_err(bad)?)
        };
        Ok(Rule { dest, port })
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Rule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Rules as a list, parsed and checked (no `*` unless `allow_any`, at most
/// [`MAX_RULES`]).
pub fn parse_rules<S: AsRef<str>>(raw: &[S], allow_any: bool) -> Result<Vec<Rule>, ProtocolError> {
    if raw.len() > MAX_RULES {
        return Err(ProtocolError::invalid(
            "egress",
            format!("{} rules; at most {MAX_RULES}", raw.len()),
        ));
    }
    raw.iter()
        .map(|r| {
            let rule: Rule = r.as_ref().parse()?;
            if rule.dest == Dest::Any && !allow_any {
                return Err(ProtocolError::invalid(
                    "egress",
                    "`*` is a worker's bound, not a sandbox's rule: name the hosts",
                ));
            }
            Ok(rule)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn rules_parse_as_written_and_print_back() {
        for s in [
            "pypi.org",
            "pypi.org:8080",
            "*.github.com",
            "*.github.com:22",
            "10.0.0.0/8",
            "192.0.2.7/32:443",
            "2001:db8::/32",
            "[2001:db8::/32]:443",
            "*",
            "*:8443",
        ] {
            let rule = r(s);
            assert_eq!(rule.to_string(), s, "{rule:?}");
        }
        assert_eq!(r("PyPI.Org.").to_string(), "pypi.org");
        assert_eq!(r("192.0.2.7").to_string(), "192.0.2.7/32");
        assert_eq!(r("::ffff:192.0.2.7").to_string(), "192.0.2.7/32");
    }

    #[test]
    fn bad_rules_say_why() {
        for s in [
            "",
            "exa mple.com",
            "-x.com",
            "x..com",
            "x.com:0",
            "x.com:70000",
            "x.com:http",
            "10.0.0.1/8",
            "10.0.0.0/33",
            "[2001:db8::/32",
            "*.*.x.com",
            "1.2.3",
            &format!("{}.com", "a".repeat(64)),
        ] {
            let e = s.parse::<Rule>().expect_err(s);
            assert!(e.to_string().contains("rule"), "{s}: {e}");
        }
        let e = "https://pypi.org/simple/".parse::<Rule>().unwrap_err();
        assert!(
            e.to_string()
                .contains("not a https URL (e.g. \"pypi.org\")"),
            "{e}"
        );
        assert!(parse_rules(&["*"], false).is_err());
        assert!(parse_rules(&["*"], true).is_ok());
        let many: Vec<String> = (0..=MAX_RULES).map(|i| format!("h{i}.com")).collect();
        assert!(parse_rules(&many, false).is_err());
    }

    #[test]
    fn names_match_exactly_or_below_never_both() {
        let exact = r("example.com");
        assert!(exact.allows_name("example.com", 443));
        assert!(exact.allows_name("example.com", 80));
        assert!(!exact.allows_name("example.com", 8080));
        assert!(!exact.allows_name("a.example.com", 443));
        assert!(!exact.allows_name("badexample.com", 443));
        let below = r("*.example.com");
        assert!(below.allows_name("a.example.com", 443));
        assert!(below.allows_name("a.b.example.com", 443));
        assert!(!below.allows_name("example.com", 443));
        assert!(!below.allows_name("badexample.com", 443));
        assert!(!below.allows_name(".example.com", 443));
        let port = r("example.com:8080");
        assert!(port.allows_name("example.com", 8080));
        assert!(!port.allows_name("example.com", 443));
        // An address is never a name.
        assert!(!exact.allows_ip("93.184.216.34".parse().unwrap(), 443));
    }

    #[test]
    fn addresses_match_networks_only() {
        let net = r("192.0.2.0/24");
        assert!(net.allows_ip("192.0.2.200".parse().unwrap(), 443));
        assert!(net.allows_ip("::ffff:192.0.2.200".parse().unwrap(), 80));
        assert!(!net.allows_ip("192.0.3.1".parse().unwrap(), 443));
        assert!(!net.allows_name("192.0.2.1", 443));
        let v6 = r("[2001:db8::/32]:443");
        assert!(v6.allows_ip("2001:db8:1::5".parse().unwrap(), 443));
        assert!(!v6.allows_ip("2001:db9::5".parse().unwrap(), 443));
        assert!(!v6.allows_ip("192.0.2.1".parse().unwrap(), 443));
    }

    #[test]
    fn internal_addresses_are_named_and_public_ones_are_not() {
        // One address of each range of the table is inside it.
        for ip in [
            "0.1.2.3",
            "127.0.0.53",
            "10.1.2.3",
            "172.31.255.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "224.0.0.251",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            // IPv4-compatible, IPv4-translated and NAT64 local-use forms of
            // the metadata address and of loopback.
            "::169.254.169.254",
            "::127.0.0.1",
            "::ffff:0:a9fe:a9fe",
            "64:ff9b:1::a9fe:a9fe",
            "100::1",
        ] {
            assert!(internal_range(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["93.184.216.34", "8.8.8.8", "172.32.0.1", "2606:4700::1111"] {
            assert_eq!(internal_range(ip.parse().unwrap()), None, "{ip}");
        }
    }

    #[test]
    fn a_bound_covers_only_what_is_within_it() {
        let cases = [
            ("*", "pypi.org", true),
            ("*", "*.github.com:22", true),
            ("*:443", "*.github.com:22", false),
            ("*:22", "*.github.com:22", true),
            ("*", "10.0.0.0/8", true),
            ("pypi.org", "pypi.org", true),
            ("pypi.org", "pypi.org:443", true),
            ("pypi.org", "pypi.org:8080", false),
            ("pypi.org:443", "pypi.org", false),
            ("pypi.org", "files.pypi.org", false),
            ("*.pypi.org", "files.pypi.org", true),
            ("*.pypi.org", "pypi.org", false),
            ("*.pypi.org", "*.files.pypi.org", true),
            ("*.files.pypi.org", "*.pypi.org", false),
            ("10.0.0.0/8", "10.1.0.0/16", true),
            ("10.1.0.0/16", "10.0.0.0/8", false),
            ("10.0.0.0/8", "pypi.org", false),
            ("pypi.org", "*", false),
        ];
        for (bound, asked, want) in cases {
            assert_eq!(r(bound).covers(&r(asked)), want, "{bound} covers {asked}");
        }
    }
}
