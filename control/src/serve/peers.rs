//! The replicas of a front door and what passes between them. Each
//! tenant has one home replica (rendezvous hashing of its name over
//! `--peers`, the same answer on every replica): its creates and forks
//! are checked against its quotas there, and its sessions live there. The
//! others pass such calls on whole, with the caller's own key and the
//! [`FORWARDED`] mark, and the home answers (and audits) them as if they
//! had come to it; it passes nothing further.

use std::collections::HashMap;
use std::sync::Mutex;

use corral_harness::fleet::Fleet;
use corral_proto::Reason;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

/// The metadata a replica sends with a call it passes to another.
pub const FORWARDED: &str = "x-corral-forwarded";

/// The replicas of a front door, this one among them.
pub struct Peers {
    own: String,
    all: Vec<String>,
    channels: Mutex<HashMap<String, Channel>>,
    /// The value of [`FORWARDED`] on a call one replica passes to another:
    /// a digest of the secret they share (the workers' token), so that a
    /// client cannot pass its call off as a replica's.
    mark: MetadataValue<Ascii>,
}

impl Peers {
    /// `all` must name `own`; `secret` is what every replica shares and
    /// no client holds.
    pub fn new(own: String, all: Vec<String>, secret: &str) -> Result<Self, String> {
        let all: Vec<String> = all
            .into_iter()
            .map(|p| p.trim().trim_end_matches('/').to_string())
            .filter(|p| !p.is_empty())
            .collect();
        let own = own.trim().trim_end_matches('/').to_string();
        if !all.contains(&own) {
            return Err(format!(
                "--advertise {own} is not among --peers ({})",
                all.join(", ")
            ));
        }
        let digest =
            corral_harness::tenants::sha256_hex(format!("corral-forwarded\0{secret}").as_bytes());
        let mark = MetadataValue::try_from(digest.as_str())
            .map_err(|e| format!("the replicas' mark: {e}"))?;
        Ok(Self {
            own,
            all,
            channels: Mutex::new(HashMap::new()),
            mark,
        })
    }

    /// Whether `req` was passed on by another replica (it carries the
    /// replicas' mark; a client's mark of its own is ignored).
    pub fn passed<T>(&self, req: &Request<T>) -> bool {
        req.metadata().get(FORWARDED).is_some_and(|given| {
            let (a, b) = (given.as_bytes(), self.mark.as_bytes());
            a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
        })
    }

    /// `msg` as passed to another replica: with the caller's key, marked as
    /// passed on (that replica passes it no further).
    pub fn forwarded<T>(&self, msg: T, key: MetadataValue<Ascii>) -> Request<T> {
        let mut req = Request::new(msg);
        req.metadata_mut().insert("authorization", key);
        req.metadata_mut().insert(FORWARDED, self.mark.clone());
        req
    }

    /// This replica's URL.
    pub fn own(&self) -> &str {
        &self.own
    }

    /// Every other replica's URL.
    pub fn others(&self) -> impl Iterator<Item = &str> {
        self.all
            .iter()
            .map(String::as_str)
            .filter(move |p| *p != self.own)
    }

    /// The replica whose the tenant's creates and sessions are: the
    /// highest of a hash of the tenant's name with each replica's
    /// (rendezvous hashing: the same answer on every replica, and few
    /// tenants move when one is added or goes).
    pub fn home(&self, tenant: &str) -> &str {
        let score = |peer: &str| {
            // FNV-1a: the same in every process (std's hasher is not).
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in tenant.bytes().chain([0u8]).chain(peer.bytes()) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            h
        };
        self.all
            .iter()
            .max_by_key(|p| (score(p), p.as_str()))
            .map_or(self.own.as_str(), String::as_str)
    }

    /// A channel to replica `url`, made once: with the fleet's TLS
    /// settings, never the workers' token.
    pub async fn channel(&self, fleet: &Fleet, url: &str) -> Result<Channel, Status> {
        let known = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(url)
            .cloned();
        if let Some(c) = known {
            return Ok(c);
        }
        let mut creds = fleet
            .credentials(&[url.to_string()])
            .map_err(|e| unreachable(url, e))?;
        creds.token = None;
        let c = corral_harness::client::channel(url, &creds)
            .await
            .map_err(|e| unreachable(url, e))?;
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(url.to_string(), c.clone());
        Ok(c)
    }
}

/// Replica `url` cannot be reached.
pub fn unreachable(url: &str, e: impl std::fmt::Display) -> Status {
    corral_proto::reason::status(
        Code::Unavailable,
        Reason::NoWorker,
        None,
        format!("the front door's replica {url}: {e}"),
    )
}

/// An answer of replica `url`, as passed on: its own refusals (they carry
/// a reason) as they are; a failure to reach it, or a connection to it cut
/// (the transport's, with no reason), typed `no_worker` and naming it, so
/// that a client can tell the one from the other.
pub fn from_replica(url: &str, s: Status) -> Status {
    let transport = matches!(
        s.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::DeadlineExceeded
    );
    if s.metadata().get(corral_proto::reason::REASON_KEY).is_some() || !transport {
        return s;
    }
    unreachable(url, s.message())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_replica_names_the_same_home_for_a_tenant_and_spreads_tenants() {
        let all = ["http://a:7071", "http://b:7071", "http://c:7071/"];
        let peers: Vec<Peers> = all
            .iter()
            .map(|own| {
                let mut order: Vec<String> = all.iter().map(|s| s.to_string()).collect();
                order.rotate_left(own.len() % 3);
                Peers::new(own.to_string(), order, "secret").unwrap()
            })
            .collect();
        let mut homes = HashSet::new();
        for t in 0..60 {
            let tenant = format!("tenant-{t}");
            let home = peers[0].home(&tenant).to_string();
            assert!(peers.iter().all(|p| p.home(&tenant) == home), "{tenant}");
            homes.insert(home);
        }
        assert_eq!(homes.len(), 3, "60 tenants all had one home: {homes:?}");
        assert_eq!(peers[0].others().count(), 2);
        assert!(peers[0].others().all(|p| p != peers[0].own()));
        assert!(Peers::new("http://d:7071".into(), vec!["http://a:7071".into()], "s").is_err());
    }

    #[test]
    fn only_a_replica_marks_a_call_as_passed_on() {
        let all = vec!["http://a:7071".to_string(), "http://b:7071".to_string()];
        let a = Peers::new(all[0].clone(), all.clone(), "shared").unwrap();
        let b = Peers::new(all[1].clone(), all.clone(), "shared").unwrap();
        let key = MetadataValue::from_static("Bearer k");
        assert!(b.passed(&a.forwarded((), key.clone())));
        for spoof in ["1", "0", "", "corral"] {
            let mut req = Request::new(());
            req.metadata_mut()
                .insert(FORWARDED, MetadataValue::try_from(spoof).unwrap());
            assert!(!b.passed(&req), "{spoof:?}");
        }
        assert!(!b.passed(&Request::new(())));
        // Another deployment's replicas (another secret) are not this one's.
        let other = Peers::new(all[0].clone(), all.clone(), "other").unwrap();
        assert!(!b.passed(&other.forwarded((), key)));
    }

    #[test]
    fn a_replica_out_of_reach_is_named_and_typed_its_refusals_passed_as_they_are() {
        let cut = from_replica("http://b:7071", Status::unknown("h2 protocol error"));
        assert_eq!(cut.code(), Code::Unavailable);
        assert_eq!(corral_proto::reason::of(&cut), Some(Reason::NoWorker));
        assert!(cut.message().contains("http://b:7071"), "{}", cut.message());
        let refused = corral_proto::reason::status(
            Code::NotFound,
            Reason::SessionNotFound,
            None,
            "no such session".to_string(),
        );
        let passed = from_replica("http://b:7071", refused);
        assert_eq!(
            corral_proto::reason::of(&passed),
            Some(Reason::SessionNotFound)
        );
        let unreasoned = from_replica("http://b:7071", Status::invalid_argument("bad"));
        assert_eq!(unreasoned.code(), Code::InvalidArgument);
    }
}
