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
}

impl Peers {
    /// `all` must name `own`.
    pub fn new(own: String, all: Vec<String>) -> Result<Self, String> {
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
        Ok(Self {
            own,
            all,
            channels: Mutex::new(HashMap::new()),
        })
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

/// Whether `req` was passed on by another replica.
pub fn is_forwarded<T>(req: &Request<T>) -> bool {
    req.metadata().get(FORWARDED).is_some()
}

/// `msg` as passed to another replica: with the caller's key, marked as
/// passed on (that replica passes it no further).
pub fn forwarded<T>(msg: T, key: MetadataValue<Ascii>) -> Request<T> {
    let mut req = Request::new(msg);
    req.metadata_mut().insert("authorization", key);
    req.metadata_mut()
        .insert(FORWARDED, MetadataValue::from_static("1"));
    req
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
                Peers::new(own.to_string(), order).unwrap()
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
        assert!(Peers::new("http://d:7071".into(), vec!["http://a:7071".into()]).is_err());
    }
}
