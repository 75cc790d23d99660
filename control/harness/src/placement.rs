//! Where a new sandbox goes, among many workers: the workers of a list or
//! of a DNS name (a Kubernetes headless Service), and the choice among
//! them.
//!
//! With few workers, each is asked (`GetWorkerInfo`) and the one with the
//! most free slots is taken. With more, two are picked at random and the
//! freer of the two is taken (power of two choices): a placement costs two
//! probes whatever the size of the fleet, and a silent worker delays it by
//! one short probe timeout, not forever. A worker that does not answer,
//! is full or drains is left out; the create itself may still be refused
//! (the worker's own check at capacity is the real one), and then another
//! worker is tried, up to [`Placer::attempts`] in all.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use corral_proto::WorkerInfo;
use futures_util::StreamExt;

use crate::client::{ClientError, Credentials, WorkerClient, source_chain};

/// How long a DNS answer is used again.
pub const DNS_CACHE: Duration = Duration::from_secs(5);
/// How long a probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Up to this many workers, each is probed.
pub const PROBE_ALL_UP_TO: usize = 8;
/// Workers a placement's create is tried on (probe rounds that find none
/// able to take it: up to three times as many).
pub const ATTEMPTS: usize = 3;
/// Least time the other probes get once one worker could take the sandbox
/// (the default of [`Placer::grace`]).
pub const STRAGGLER_GRACE: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("invalid worker address {entry:?}: {reason}")]
    Invalid { entry: String, reason: String },
    #[error("cannot resolve {host}: {reason}")]
    Resolve { host: String, reason: String },
    #[error("{host} has no addresses")]
    Empty { host: String },
}

/// What `--worker` lists: addresses (`http://host:port`, `https://...`,
/// `unix:///path`; `host:port` is `http://`) and DNS names
/// (`dns:///name:port`) whose A/AAAA records are workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Url(String),
    Dns { host: String, port: u16 },
}

impl Entry {
    /// Parses a comma-separated list.
    pub fn parse_list(list: &str) -> Result<Vec<Entry>, DiscoveryError> {
        list.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(Entry::parse)
            .collect()
    }

    pub fn parse(entry: &str) -> Result<Entry, DiscoveryError> {
        let invalid = |reason: &str| DiscoveryError::Invalid {
            entry: entry.to_string(),
            reason: reason.to_string(),
        };
        if let Some(rest) = entry.strip_prefix("dns:") {
            let rest = rest.trim_start_matches('/');
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| invalid("a DNS name needs a port: dns:///NAME:PORT"))?;
            let port = port
                .parse()
                .map_err(|_| invalid("the port is not a number"))?;
            if host.is_empty() || host.contains('/') {
                return Err(invalid("no host name"));
            }
            return Ok(Entry::Dns {
                host: host.to_string(),
                port,
            });
        }
        Ok(Entry::Url(if entry.contains("://") {
            entry.to_string()
        } else {
            format!("http://{entry}")
        }))
    }
}

/// Answers by name and port, with when they came.
type DnsCache = HashMap<(String, u16), (Instant, Vec<SocketAddr>)>;

static DNS: LazyLock<Mutex<DnsCache>> = LazyLock::new(Default::default);

/// The addresses of `host`, from the cache when it is fresh.
async fn lookup(host: &str, port: u16) -> Result<Vec<SocketAddr>, DiscoveryError> {
    let key = (host.to_string(), port);
    if let Some((at, addrs)) = DNS.lock().unwrap_or_else(|p| p.into_inner()).get(&key)
        && at.elapsed() < DNS_CACHE
    {
        return Ok(addrs.clone());
    }
    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| DiscoveryError::Resolve {
            host: host.to_string(),
            reason: e.to_string(),
        })?
        .collect();
    addrs.sort();
    addrs.dedup();
    if addrs.is_empty() {
        return Err(DiscoveryError::Empty {
            host: host.to_string(),
        });
    }
    DNS.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, (Instant::now(), addrs.clone()));
    Ok(addrs)
}

/// The workers' addresses: the list's, with each DNS name replaced by one
/// `http://` (`https://` when `tls`) address per record. Duplicates go.
pub async fn resolve(entries: &[Entry], tls: bool) -> Result<Vec<String>, DiscoveryError> {
    let scheme = if tls { "https" } else { "http" };
    let mut out: Vec<String> = Vec::new();
    for e in entries {
        match e {
            Entry::Url(u) => out.push(u.clone()),
            Entry::Dns { host, port } => {
                for a in lookup(host, *port).await? {
                    out.push(format!("{scheme}://{a}"));
                }
            }
        }
    }
    let mut seen = HashSet::new();
    out.retain(|u| seen.insert(u.clone()));
    Ok(out)
}

/// The name the workers present in their certificates when they were all
/// found by one DNS name (a Service's), reached by address.
pub fn tls_name(entries: &[Entry]) -> Option<String> {
    let mut names = entries.iter().map(|e| match e {
        Entry::Dns { host, .. } => Some(host.clone()),
        Entry::Url(_) => None,
    });
    let first = names.next()??;
    names.all(|n| n.as_deref() == Some(&first)).then_some(first)
}

/// A uniformly random index below `n` (`n > 0`).
fn random_below(n: usize) -> usize {
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (h.finish() % n as u64) as usize
}

/// Two distinct random picks of `items` (all of them when fewer).
fn two_of<T: Clone>(items: &[T]) -> Vec<T> {
    if items.len() <= 2 {
        return items.to_vec();
    }
    let a = random_below(items.len());
    let mut b = random_below(items.len() - 1);
    if b >= a {
        b += 1;
    }
    vec![items[a].clone(), items[b].clone()]
}

/// How a placement's create went on the chosen worker.
#[derive(Debug)]
pub enum Attempt<E> {
    /// At capacity or draining: another worker is tried.
    Refused(String),
    /// Anything else: the placement fails with it.
    Failed(E),
}

#[derive(Debug, thiserror::Error)]
pub enum PlaceError<E: std::fmt::Display> {
    #[error("no worker can take it: {0}")]
    NoWorker(String),
    #[error("{0}")]
    Failed(E),
}

/// A placement's result: the worker, what the create made, and what it
/// cost.
#[derive(Debug)]
pub struct Placed<T> {
    pub url: String,
    pub value: T,
    /// `GetWorkerInfo` calls made.
    pub probes: usize,
    /// Workers a create was tried on.
    pub attempts: usize,
}

/// Places new sandboxes among workers; see the module docs.
#[derive(Debug, Clone)]
pub struct Placer {
    pub creds: Credentials,
    pub probe_timeout: Duration,
    pub probe_all_up_to: usize,
    pub attempts: usize,
    /// Least time the other probes get once one worker could take the
    /// sandbox ([`STRAGGLER_GRACE`] by default).
    pub grace: Duration,
    /// The sandbox placed, when known: a worker with a warm pool member
    /// ready that its create would take is preferred to any without (its
    /// create is a claim, not a cold start).
    pub warm: Option<corral_proto::SandboxSpec>,
    /// Connections kept across placements (see [`crate::client::ClientCache`]).
    pub cache: Option<crate::client::ClientCache>,
}

/// A probed worker that could take a sandbox.
struct Candidate {
    url: String,
    client: WorkerClient,
    /// Holds the template the spec names (none named: true).
    has: bool,
    warm: bool,
    free: u32,
    running: u32,
}

impl Placer {
    pub fn new(creds: Credentials) -> Self {
        Self {
            creds,
            probe_timeout: PROBE_TIMEOUT,
            probe_all_up_to: PROBE_ALL_UP_TO,
            attempts: ATTEMPTS,
            grace: STRAGGLER_GRACE,
            warm: None,
            cache: None,
        }
    }

    /// Prefers workers that hold the template `spec` names (asked with
    /// its tenant: a tenant's templates are its own), then those with a
    /// ready pool member a create of `spec` would take (see
    /// [`corral_proto::PoolInfo::fits`]). A worker without the template
    /// still takes it when none has it (it pulls it from the fleet's
    /// registry, or says `no_such_template`).
    pub fn preferring_warm(mut self, spec: &corral_proto::SandboxSpec) -> Self {
        self.warm = Some(spec.clone());
        self
    }

    fn is_warm(&self, info: &WorkerInfo) -> bool {
        let Some(spec) = &self.warm else {
            return false;
        };
        info.pools
            .iter()
            .any(|p| p.ready > 0 && p.fits(spec, &info.default_image))
    }

    /// The template the preferred spec names, and its tenant.
    fn template(&self) -> Option<(Option<&str>, &str)> {
        let spec = self.warm.as_ref()?;
        let name = spec.template.as_deref()?;
        let tenant = spec
            .labels
            .get(corral_proto::sandbox::TENANT_LABEL)
            .map(String::as_str);
        Some((tenant, name))
    }

    /// Asks `url` how full it is (and whether it holds the template the
    /// spec names), within the probe timeout.
    async fn probe(&self, url: &str) -> Result<(WorkerClient, WorkerInfo, bool), String> {
        let started = Instant::now();
        let asked = tokio::time::timeout(self.probe_timeout, async {
            let client = crate::client::connect_via(self.cache.as_ref(), url, &self.creds).await?;
            let (info, has) = match self.template() {
                Some((tenant, name)) => {
                    let (info, has) = futures_util::future::join(
                        client.worker_info(),
                        client.has_template(tenant, name),
                    )
                    .await;
                    (info?, has?)
                }
                None => (client.worker_info().await?, true),
            };
            Ok::<_, ClientError>((client, info, has))
        })
        .await;
        crate::metrics::control()
            .probe_seconds
            .observe(started.elapsed().as_secs_f64());
        match asked {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(source_chain(&e)),
            Err(_) => Err(format!(
                "no answer within {} ms",
                self.probe_timeout.as_millis()
            )),
        }
    }

    /// Picks a worker of `urls` and runs `create` on it (with a client
    /// connected to it), trying others while it is refused. See the
    /// module docs.
    pub async fn place<T, E, F, Fut>(
        &self,
        urls: &[String],
        mut create: F,
    ) -> Result<Placed<T>, PlaceError<E>>
    where
        E: std::fmt::Display,
        F: FnMut(String, WorkerClient) -> Fut,
        Fut: Future<Output = Result<T, Attempt<E>>>,
    {
        let metrics = crate::metrics::control();
        let mut excluded: HashSet<String> = HashSet::new();
        let mut why: Vec<String> = Vec::new();
        let (mut probes, mut attempts) = (0, 0);
        // Creates are tried on at most `attempts` workers; rounds of probes
        // that find no worker able to take it are bounded too.
        let mut rounds = 0;
        while attempts < self.attempts.max(1) && rounds < 3 * self.attempts.max(1) {
            rounds += 1;
            let left: Vec<String> = urls
                .iter()
                .filter(|u| !excluded.contains(*u))
                .cloned()
                .collect();
            if left.is_empty() {
                break;
            }
            let asked = if left.len() <= self.probe_all_up_to {
                left
            } else {
                two_of(&left)
            };
            probes += asked.len();
            // Answers as they come; once one could take the sandbox, the
            // others get as long again as it took (at least
            // [`Self::grace`]): a slow or silent worker costs a
            // placement little, not the probe timeout.
            let started = tokio::time::Instant::now();
            let mut pending: futures_util::stream::FuturesUnordered<_> = asked
                .into_iter()
                .map(|url| async move {
                    let answer = self.probe(&url).await;
                    (url, answer)
                })
                .collect();
            let mut cutoff: Option<tokio::time::Instant> = None;
            let mut best: Option<Candidate> = None;
            loop {
                let next = match cutoff {
                    Some(at) => match tokio::time::timeout_at(at, pending.next()).await {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                    None => pending.next().await,
                };
                let Some((url, answer)) = next else { break };
                let (client, info, has) = match answer {
                    Ok(a) => a,
                    Err(e) => {
                        metrics.attempt("no_answer");
                        why.push(format!("{url}: {e}"));
                        excluded.insert(url);
                        continue;
                    }
                };
                let free = info.max_sandboxes.saturating_sub(info.sandboxes);
                tracing::debug!(worker = %url, free, draining = info.draining, "worker answered");
                if info.draining || free == 0 {
                    let state = if info.draining { "draining" } else { "full" };
                    metrics.attempt(state);
                    why.push(format!("{url}: {state} ({} sandboxes)", info.sandboxes));
                    excluded.insert(url);
                    continue;
                }
                if cutoff.is_none() {
                    cutoff = Some(tokio::time::Instant::now() + started.elapsed().max(self.grace));
                }
                let warm = self.is_warm(&info);
                let better = best.as_ref().is_none_or(|b| {
                    (has, warm, free, std::cmp::Reverse(info.running_operations))
                        > (b.has, b.warm, b.free, std::cmp::Reverse(b.running))
                });
                if better {
                    best = Some(Candidate {
                        url,
                        client,
                        has,
                        warm,
                        free,
                        running: info.running_operations,
                    });
                }
            }
            let Some(chosen) = best else { continue };
            attempts += 1;
            match create(chosen.url.clone(), chosen.client).await {
                Ok(value) => {
                    metrics.attempt("placed");
                    return Ok(Placed {
                        url: chosen.url,
                        value,
                        probes,
                        attempts,
                    });
                }
                Err(Attempt::Refused(e)) => {
                    metrics.attempt("refused");
                    tracing::info!(worker = %chosen.url, error = %e, "refused; trying another worker");
                    why.push(format!("{}: {e}", chosen.url));
                    excluded.insert(chosen.url);
                }
                Err(Attempt::Failed(e)) => {
                    metrics.attempt("failed");
                    return Err(PlaceError::Failed(e));
                }
            }
        }
        if why.is_empty() {
            why.push("no workers given".into());
        }
        Err(PlaceError::NoWorker(why.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_addresses_or_dns_names() {
        assert_eq!(
            Entry::parse_list("127.0.0.1:7070, https://w:1,dns:///corral-worker.corral.svc:7070")
                .unwrap(),
            vec![
                Entry::Url("http://127.0.0.1:7070".into()),
                Entry::Url("https://w:1".into()),
                Entry::Dns {
                    host: "corral-worker.corral.svc".into(),
                    port: 7070
                },
            ]
        );
        for bad in ["dns:///name", "dns:///name:port", "dns:///:7070"] {
            assert!(Entry::parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_dns_name_becomes_one_address_per_record() {
        let entries = Entry::parse_list("dns:///localhost:7070,http://127.0.0.1:7070").unwrap();
        let urls = resolve(&entries, false).await.unwrap();
        assert!(
            urls.contains(&"http://127.0.0.1:7070".to_string()),
            "{urls:?}"
        );
        assert_eq!(
            urls.iter()
                .filter(|u| *u == "http://127.0.0.1:7070")
                .count(),
            1,
            "duplicates go: {urls:?}"
        );
        let tls = resolve(&entries[..1], true).await.unwrap();
        assert!(tls.iter().all(|u| u.starts_with("https://")), "{tls:?}");
        assert_eq!(tls_name(&entries[..1]).as_deref(), Some("localhost"));
        // Mixed with an address: no one name for all.
        assert_eq!(tls_name(&entries), None);
        let none = resolve(
            &Entry::parse_list("dns:///no-such-host.invalid:1").unwrap(),
            false,
        )
        .await
        .unwrap_err();
        assert!(none.to_string().contains("no-such-host.invalid"), "{none}");
    }

    #[test]
    fn two_random_picks_are_distinct_and_cover_the_list() {
        let items: Vec<usize> = (0..5).collect();
        let mut seen = HashSet::new();
        for _ in 0..500 {
            let two = two_of(&items);
            assert_eq!(two.len(), 2);
            assert_ne!(two[0], two[1]);
            seen.extend(two);
        }
        assert_eq!(seen.len(), 5);
        assert_eq!(two_of(&[1]), vec![1]);
    }
}
