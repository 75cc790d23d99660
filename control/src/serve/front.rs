//! The front door's sandbox API: `corral.v1.Worker` on `corral serve`,
//! for callers with keys (`--tenants DIR`), over the service's fleet.
//!
//! Every call is checked against the caller's key (its scopes), then
//! passed whole to the worker that has the sandbox (a new one is placed
//! as sessions are), with the caller's tenant in [`TENANT_HEADER`]: the
//! worker stamps what it makes for a tenant with it and answers for that
//! tenant's sandboxes alone, so another tenant's id is NOT_FOUND exactly
//! as one that does not exist, whichever replica asks. Streams (output,
//! downloads, uploads) pass through as they come, never whole. What this
//! keeps is a hint (which worker had an id), never an owner: a replica
//! without it asks the workers.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corral_harness::audit::AuditLog;
use corral_harness::client::RawClient;
use corral_harness::fleet::Fleet;
use corral_harness::placement::Attempt;
use corral_harness::tenants::{Keys, Principal, Quota, Scope};
use corral_proto::sandbox::{TENANT_HEADER, TENANT_LABEL};
use corral_proto::{Reason, SandboxId, pb};
use futures_util::{Stream, StreamExt};

pub use super::peers::Peers;
use super::peers::from_replica;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status};

/// Sandbox ids whose worker is remembered, at most (then forgotten, and
/// asked again).
const ROUTES: usize = 100_000;

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SandboxEvent, Status>> + Send>>;
type RunStream = Pin<Box<dyn Stream<Item = Result<pb::RunOperationResponse, Status>> + Send>>;
type DownloadStream = Pin<Box<dyn Stream<Item = Result<pb::DownloadResponse, Status>> + Send>>;
type BuildStream = Pin<Box<dyn Stream<Item = Result<pb::BuildImageEvent, Status>> + Send>>;

pub struct FrontDoor {
    fleet: Fleet,
    /// Which worker had a sandbox when last asked.
    routes: Mutex<HashMap<SandboxId, String>>,
    audit: Option<AuditLog>,
    /// The tenants' keys and quotas (None: one user, no quotas).
    keys: Option<Keys>,
    /// Each tenant's creates through this replica.
    uses: Mutex<HashMap<String, Arc<TenantUse>>>,
    /// The other replicas, when there are several.
    peers: Option<Peers>,
    /// Images built through this replica, and the worker that has each: a
    /// sandbox of one is made there (no other worker has it).
    built: Arc<Mutex<HashMap<String, String>>>,
    /// Its own port listener's URL (`--ports-listen`), which the URLs of
    /// exposed ports name instead of the workers'.
    ports_url: Option<String>,
    /// Each worker's port listener, as it last said (asked again after a
    /// minute).
    worker_ports: Mutex<HashMap<String, (String, Instant)>>,
}

/// A tenant's creates through this replica: one quota check at a time, the
/// sandboxes under way (their ids, and what each will take) and when its
/// last ones were asked for.
#[derive(Default)]
struct TenantUse {
    check: tokio::sync::Mutex<()>,
    state: Mutex<UseState>,
}

#[derive(Default)]
struct UseState {
    making: HashMap<SandboxId, Takes>,
    asked: VecDeque<Instant>,
}

/// What one sandbox takes of its tenant's quotas: its limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Takes {
    memory_bytes: u64,
    cpu_millis: u64,
    pids: u64,
}

impl Takes {
    /// A sandbox as its worker lists it: the limits it runs with.
    fn of(s: &pb::Sandbox) -> Self {
        let spec = s.spec.as_ref();
        let or_spec = |have: u64, asked: Option<u64>| {
            if have > 0 { have } else { asked.unwrap_or(0) }
        };
        Self {
            memory_bytes: or_spec(s.memory_bytes, spec.map(|p| p.memory_bytes)),
            cpu_millis: or_spec(
                u64::from(s.cpu_millis),
                spec.map(|p| u64::from(p.cpu_millis)),
            ),
            pids: or_spec(
                u64::from(s.pids_limit),
                spec.map(|p| u64::from(p.pids_limit)),
            ),
        }
    }
}

/// Sandboxes counted against their tenant's quotas while they are made.
pub(super) struct Reservation {
    tenant: Arc<TenantUse>,
    ids: Vec<SandboxId>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.tenant.state.lock().unwrap_or_else(|p| p.into_inner());
        for id in &self.ids {
            state.making.remove(id);
        }
    }
}

/// The window of `creates_per_minute`.
const MINUTE: Duration = Duration::from_secs(60);

fn status(code: Code, reason: Reason, message: impl Into<String>) -> Status {
    corral_proto::reason::status(code, reason, None, message)
}

/// An id no worker has: the very answer a worker gives (the same for an id
/// that is another tenant's).
fn unknown(id: &SandboxId) -> Status {
    status(
        Code::NotFound,
        Reason::SandboxNotFound,
        format!("unknown sandbox {id}"),
    )
}

fn sandbox_id(s: String) -> Result<SandboxId, Status> {
    SandboxId::new(s).map_err(|e| {
        status(
            Code::InvalidArgument,
            Reason::InvalidArgument,
            e.to_string(),
        )
    })
}

/// The caller, as the key check left it on the request.
pub(super) fn caller<T>(req: &Request<T>) -> Result<Principal, Status> {
    req.extensions().get::<Principal>().cloned().ok_or_else(|| {
        status(
            Code::Unauthenticated,
            Reason::Unauthenticated,
            "no key was checked for this call",
        )
    })
}

/// Whether `who` may name a new `what` (sandbox, session) `id` itself. A
/// tenant's caller names ids of its own namespace (`TENANT.…`: tenants'
/// names have no dot) or random ones (the shapes the front door, the
/// workers and the sessions make): an id another tenant could hold is
/// refused alike, taken or not, so a create tells nothing of another's.
pub(super) fn may_name(who: &Principal, id: &str, what: &str) -> Result<(), Status> {
    let Some(tenant) = tenant_of(who) else {
        return Ok(());
    };
    let own = id
        .strip_prefix(tenant)
        .is_some_and(|rest| rest.starts_with('.') && rest.len() > 1);
    if own || is_uuid(id) || is_session_id(id) {
        return Ok(());
    }
    Err(status(
        Code::InvalidArgument,
        Reason::InvalidArgument,
        format!(
            "a {what} id a tenant names starts with its tenant's name and a dot (`{tenant}.NAME`), so that it can never be another tenant's; {:?} is not (leave it out to have one made)",
            corral_harness::tenants::shown(id)
        ),
    ))
}

/// A UUID as ids are made: 8-4-4-4-12 hex digits (the workers', the
/// front door's), or 32 in a row (the Python SDK's).
fn is_uuid(id: &str) -> bool {
    let dashed = id.len() == 36
        && id.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    dashed || (id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()))
}

/// A session id as the sessions make them (`s-` and 12 hex digits).
fn is_session_id(id: &str) -> bool {
    id.strip_prefix("s-")
        .is_some_and(|h| h.len() == 12 && h.chars().all(|c| c.is_ascii_hexdigit()))
}

/// The caller's key must allow `scope`.
pub(super) fn need(who: &Principal, scope: Scope, call: &str) -> Result<(), Status> {
    if who.allows(scope) {
        return Ok(());
    }
    let has: Vec<&str> = who.scopes.iter().map(|s| s.as_str()).collect();
    Err(status(
        Code::PermissionDenied,
        Reason::PermissionDenied,
        format!(
            "{call} needs a key with scope `{scope}`; this key ({}) has {}",
            who.key_id,
            has.join(", ")
        ),
    ))
}

/// A worker's answer that it has no such sandbox, made the front door's
/// own: the very status an id no worker has gets, metadata and all (a
/// worker's headers would tell the two apart).
fn as_unknown(s: Status, id: &SandboxId) -> Status {
    if is_unknown_sandbox(&s) {
        unknown(id)
    } else {
        s
    }
}

/// What a key that only reads is shown of a sandbox: its environment's
/// names, never their values (an auditor reads logs, not secrets).
fn redact_sandbox(who: &Principal, s: &mut pb::Sandbox) {
    if who.allows(Scope::Run) {
        return;
    }
    if let Some(spec) = &mut s.spec {
        for v in spec.env.values_mut() {
            *v = HIDDEN.into();
        }
    }
}

/// [`redact_sandbox`] for an operation's command.
fn redact_operation(who: &Principal, o: &mut pb::Operation) {
    if who.allows(Scope::Run) {
        return;
    }
    if let Some(pb::operation_spec::Kind::Shell(shell)) =
        o.spec.as_mut().and_then(|spec| spec.kind.as_mut())
    {
        for v in shell.env.values_mut() {
            *v = HIDDEN.into();
        }
    }
}

/// What a redacted value reads.
const HIDDEN: &str = "(hidden)";

fn is_unknown_sandbox(s: &Status) -> bool {
    s.code() == Code::NotFound && corral_proto::reason::of(s) == Some(Reason::SandboxNotFound)
}

/// The weight of worker `url` for `tenant`'s volume `name`: the heaviest
/// takes it (the same on every replica, and few names move when a worker
/// comes or goes).
fn rendezvous(url: &str, tenant: &str, name: &str) -> u64 {
    // FNV-1a: stable across builds and replicas.
    [url, "\0", tenant, "\0", name]
        .iter()
        .flat_map(|s| s.bytes())
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

fn fleet_status(e: corral_harness::fleet::FleetError) -> Status {
    status(Code::Unavailable, Reason::NoWorker, e.to_string())
}

/// A placement's failure: a worker's refusal as it gave it, or no worker.
#[derive(Debug)]
struct Placing(Status);

impl std::fmt::Display for Placing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.message())
    }
}

impl From<corral_harness::fleet::FleetError> for Placing {
    fn from(e: corral_harness::fleet::FleetError) -> Self {
        Placing(fleet_status(e))
    }
}

/// How long a worker's port listener, as it said, is taken without asking
/// again.
const WORKER_PORTS_FOR: Duration = Duration::from_secs(60);

/// A worker's port listener URL as the front door reaches it: one that
/// names an address of every interface (`0.0.0.0`, `[::]`) takes the host
/// the front door reaches the worker's API at.
pub(crate) fn reachable(ports_url: &str, worker_url: &str) -> String {
    let host_of = |u: &str| {
        let rest = u.split_once("://").map_or(u, |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or_default();
        match authority.rsplit_once(':') {
            Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => {
                (h.to_string(), Some(p.to_string()))
            }
            _ => (authority.to_string(), None),
        }
    };
    let (host, port) = host_of(ports_url);
    if !matches!(host.as_str(), "0.0.0.0" | "[::]") {
        return ports_url.trim_end_matches('/').to_string();
    }
    let (worker_host, _) = host_of(worker_url);
    let scheme = ports_url.split_once("://").map_or("http", |(s, _)| s);
    match port {
        Some(p) => format!("{scheme}://{worker_host}:{p}"),
        None => format!("{scheme}://{worker_host}"),
    }
}

/// The tenant a caller acts for: None for an admin (every tenant's).
pub(super) fn tenant_of(who: &Principal) -> Option<&str> {
    (!who.allows(Scope::Admin)).then_some(who.tenant.as_str())
}

impl FrontDoor {
    pub fn new(
        fleet: Fleet,
        audit: Option<AuditLog>,
        keys: Option<Keys>,
        peers: Option<Peers>,
    ) -> Self {
        Self {
            fleet,
            routes: Mutex::new(HashMap::new()),
            audit,
            keys,
            uses: Mutex::new(HashMap::new()),
            peers,
            built: Arc::new(Mutex::new(HashMap::new())),
            ports_url: None,
            worker_ports: Mutex::new(HashMap::new()),
        }
    }

    /// Exposed ports are reached through this front door's port listener
    /// at `url` (see [`super::ports`]).
    pub fn with_ports_url(mut self, url: String) -> Self {
        self.ports_url = Some(url.trim_end_matches('/').to_string());
        self
    }

    /// An exposure as the front door's clients reach it: through its own
    /// port listener, when it has one.
    fn through_front(&self, mut e: pb::PortExposure) -> pb::PortExposure {
        if let Some(base) = &self.ports_url {
            e.url = format!("{base}/p/{}/{}/", e.sandbox_id, e.port);
        }
        e
    }

    /// Where requests to sandbox `id`'s exposed ports go: its worker's port
    /// listener. `who`: the caller a key (or the service's token) named,
    /// whose sandbox it must be (another's is `NOT_FOUND`, as for every
    /// call); `None`: a caller with no key of this front door's (the
    /// worker then checks a signed token, or the port is public).
    pub(super) async fn ports_of(
        &self,
        who: Option<&Principal>,
        id: &SandboxId,
    ) -> Result<String, Status> {
        // The sandbox, as this caller may see it (and where it is).
        self.on_sandbox(id, |mut c| {
            let get = pb::GetSandboxRequest { id: id.to_string() };
            let get = match who {
                Some(w) => FrontDoor::outgoing(w, get),
                None => Request::new(get),
            };
            async move { c.get_sandbox(get).await }
        })
        .await?;
        let worker = self.routes().get(id).cloned().unwrap_or_default();
        let known = self
            .worker_ports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&worker)
            .filter(|(_, at)| at.elapsed() < WORKER_PORTS_FOR)
            .map(|(base, _)| base.clone());
        if let Some(base) = known {
            return Ok(base);
        }
        let mut c = self
            .fleet
            .connect(Some(&worker))
            .await
            .map_err(fleet_status)?
            .raw();
        let info = c
            .get_worker_info(pb::GetWorkerInfoRequest {})
            .await?
            .into_inner();
        if info.ports_url.is_empty() {
            return Err(status(
                Code::FailedPrecondition,
                Reason::NotApplicable,
                format!(
                    "the worker of sandbox {id} has no port listener (corral-worker --ports-listen)"
                ),
            ));
        }
        let base = reachable(&info.ports_url, &worker);
        self.worker_ports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(worker, (base.clone(), Instant::now()));
        Ok(base)
    }

    /// The replicas, when there are several.
    pub(super) fn peers(&self) -> Option<&Peers> {
        self.peers.as_ref()
    }

    /// Whether `req` was passed on by another replica.
    pub(super) fn passed<T>(&self, req: &Request<T>) -> bool {
        self.peers.as_ref().is_some_and(|p| p.passed(req))
    }

    /// `msg` as passed to another replica, with the caller's `key`.
    pub(super) fn to_replica<T>(
        &self,
        msg: T,
        key: MetadataValue<tonic::metadata::Ascii>,
    ) -> Request<T> {
        match &self.peers {
            Some(p) => p.forwarded(msg, key),
            None => {
                let mut req = Request::new(msg);
                req.metadata_mut().insert("authorization", key);
                req
            }
        }
    }

    /// A channel to replica `url` (the workers' TLS settings, never their
    /// token: a call passed on carries its caller's key).
    pub(super) async fn peer_channel(
        &self,
        url: &str,
    ) -> Result<tonic::transport::Channel, Status> {
        let peers = self.peers.as_ref().ok_or_else(|| {
            status(
                Code::Internal,
                Reason::Internal,
                "this front door has no --peers",
            )
        })?;
        peers.channel(&self.fleet, url).await
    }

    /// A client of the tenant's home replica `home`, to which this one
    /// passes the tenant's creates and forks with the caller's own key
    /// ([`forwarded`]): that replica checks the key and the quota, and
    /// audits the call.
    async fn home_replica(
        &self,
        home: &str,
    ) -> Result<pb::worker_client::WorkerClient<tonic::transport::Channel>, Status> {
        Ok(
            pb::worker_client::WorkerClient::new(self.peer_channel(home).await?)
                .max_decoding_message_size(corral_proto::limits::MAX_GRPC_MESSAGE_BYTES),
        )
    }

    /// Where a call that makes sandboxes for `who`'s tenant is checked: None
    /// here, or the home replica to pass it to (with the caller's key);
    /// a call passed on already that is not at home is refused.
    fn elsewhere(
        &self,
        who: &Principal,
        quota: Option<&Quota>,
        forwarded: bool,
    ) -> Result<Option<String>, Status> {
        if quota.is_none() {
            return Ok(None);
        }
        self.home_of(who, forwarded)
    }

    /// Where `who`'s tenant's quotas are checked and its sessions live:
    /// None here (also for one replica, and for a caller of every tenant),
    /// or the home replica; a call passed on already that is not at home
    /// is refused.
    pub(super) fn home_of(
        &self,
        who: &Principal,
        forwarded: bool,
    ) -> Result<Option<String>, Status> {
        let (Some(peers), Some(tenant)) = (&self.peers, tenant_of(who)) else {
            return Ok(None);
        };
        let home = peers.home(tenant);
        if home == peers.own() {
            return Ok(None);
        }
        if forwarded {
            return Err(status(
                Code::Unavailable,
                Reason::NoWorker,
                format!(
                    "this replica ({}) is not tenant {tenant}'s home ({home}): the replicas' --peers differ",
                    peers.own()
                ),
            ));
        }
        Ok(Some(home.to_string()))
    }

    /// The caller's tenant's quota on the sandboxes it makes (None: it has
    /// none, or the caller is an admin).
    fn quota_of(&self, who: &Principal) -> Option<Quota> {
        match (&self.keys, tenant_of(who)) {
            (Some(keys), Some(tenant)) => keys
                .current()
                .quota(tenant)
                .filter(|q| q.limits_sandboxes())
                .cloned(),
            _ => None,
        }
    }

    /// Every sandbox the caller may see, on every worker.
    async fn list_all(&self, who: &Principal) -> Result<Vec<pb::Sandbox>, Status> {
        let urls = self.fleet.urls().await.map_err(fleet_status)?;
        let asked = urls.iter().map(|url| async move {
            let client = self.fleet.connect(Some(url)).await.map_err(fleet_status)?;
            let listed = client
                .raw()
                .list_sandboxes(FrontDoor::outgoing(who, pb::ListSandboxesRequest {}))
                .await
                .map_err(|s| {
                    status(
                        Code::Unavailable,
                        Reason::NoWorker,
                        format!("worker {url} did not list its sandboxes: {}", s.message()),
                    )
                })?;
            Ok::<_, Status>((url.clone(), listed.into_inner().sandboxes))
        });
        let mut all = Vec::new();
        for answer in futures_util::future::join_all(asked).await {
            let (url, sandboxes) = answer?;
            for s in &sandboxes {
                if let Ok(id) = SandboxId::new(s.id.clone()) {
                    self.remember(&id, &url);
                }
            }
            all.extend(sandboxes);
        }
        all.sort_by(|a, b| (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id)));
        Ok(all)
    }

    /// Counts new sandboxes `ids`, each taking `each`, against their
    /// tenant's quota, or refuses them all (`quota_exceeded`, naming the
    /// first quota they would pass). One check at a time per tenant: the
    /// sandboxes it has (every worker asked) and those under way here are
    /// counted together, so concurrent creates and forks through this
    /// replica never pass a quota.
    async fn reserve(
        &self,
        who: &Principal,
        quota: &Quota,
        ids: &[SandboxId],
        each: Takes,
    ) -> Result<Option<Reservation>, Status> {
        let tenant = {
            let mut uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
            uses.entry(who.tenant.clone()).or_default().clone()
        };
        let _one = tenant.check.lock().await;
        // The creates under way are taken before the workers are asked: one
        // that ends meanwhile is then in this set, or (ended before) in the
        // workers' lists; taken after, it could be in neither.
        let making: Vec<(SandboxId, Takes)> = {
            let state = tenant.state.lock().unwrap_or_else(|p| p.into_inner());
            state.making.iter().map(|(i, t)| (i.clone(), *t)).collect()
        };
        let holds = quota.sandboxes.is_some()
            || quota.memory_bytes.is_some()
            || quota.cpu_millis.is_some()
            || quota.pids.is_some();
        let listed = if holds {
            Some(self.list_all(who).await?)
        } else {
            None
        };
        let mut state = tenant.state.lock().unwrap_or_else(|p| p.into_inner());
        // A create of an id it has is answered by the worker (the same
        // sandbox again, or a conflict): it makes nothing.
        if let Some(listed) = &listed
            && ids.len() == 1
            && listed.iter().any(|s| s.id == ids[0].as_str())
        {
            return Ok(None);
        }
        let now = Instant::now();
        while state
            .asked
            .front()
            .is_some_and(|t| now.duration_since(*t) >= MINUTE)
        {
            state.asked.pop_front();
        }
        let n = ids.len() as u64;
        let refuse = |name: &str, limit: u64, used: u64, what: String| {
            Err(corral_proto::reason::quota_status(name, limit, used, what))
        };
        if let Some(limit) = quota.creates_per_minute {
            let used = state.asked.len() as u64;
            if used + n > limit {
                return refuse(
                    "creates_per_minute",
                    limit,
                    used,
                    format!(
                        "tenant {} asked for {used} sandboxes in the last minute, its quota creates_per_minute={limit}: ask again later",
                        who.tenant
                    ),
                );
            }
        }
        if let Some(listed) = &listed {
            let mut held: HashMap<&str, Takes> = listed
                .iter()
                .map(|s| (s.id.as_str(), Takes::of(s)))
                .collect();
            held.extend(making.iter().map(|(i, t)| (i.as_str(), *t)));
            let tenant = &who.tenant;
            let used = held.len() as u64;
            if let Some(limit) = quota.sandboxes
                && used + n > limit
            {
                return refuse(
                    "sandboxes",
                    limit,
                    used,
                    format!(
                        "tenant {tenant} has {used} sandboxes, its quota sandboxes={limit}: remove one first"
                    ),
                );
            }
            let sum = |f: fn(&Takes) -> u64| held.values().map(f).fold(0u64, u64::saturating_add);
            let checks: [(&str, Option<u64>, u64, u64, &str); 3] = [
                (
                    "memory",
                    quota.memory_bytes,
                    sum(|t| t.memory_bytes),
                    each.memory_bytes,
                    "bytes of memory",
                ),
                (
                    "cpus",
                    quota.cpu_millis,
                    sum(|t| t.cpu_millis),
                    each.cpu_millis,
                    "thousandths of a CPU",
                ),
                ("pids", quota.pids, sum(|t| t.pids), each.pids, "processes"),
            ];
            for (name, limit, used, one, unit) in checks {
                if let Some(limit) = limit
                    && used.saturating_add(one.saturating_mul(n)) > limit
                {
                    return refuse(
                        name,
                        limit,
                        used,
                        format!(
                            "tenant {tenant}'s sandboxes hold {used} {unit} and {n} more would take {}, its quota {name} is {limit}: remove one or ask for less",
                            one.saturating_mul(n)
                        ),
                    );
                }
            }
        }
        for id in ids {
            state.making.insert(id.clone(), each);
            state.asked.push_back(now);
        }
        drop(state);
        Ok(Some(Reservation {
            tenant: tenant.clone(),
            ids: ids.to_vec(),
        }))
    }

    /// Counts the sandbox a new session of `who`'s tenant will make (the
    /// workers' defaults: a session names no limits) against its quotas
    /// while the session starts, or refuses it (`quota_exceeded`). Checked
    /// where the session lives: the tenant's home, as its creates are.
    pub(super) async fn reserve_for_session(
        &self,
        who: &Principal,
    ) -> Result<Option<Reservation>, Status> {
        let Some(quota) = self.quota_of(who) else {
            return Ok(None);
        };
        let takes = self.takes_new(&pb::SandboxSpec::default(), &quota).await?;
        self.reserve(who, &quota, &[SandboxId::random()], takes)
            .await
    }

    /// What a new sandbox of `spec` will take: what it asks for, else the
    /// largest default among the workers (it may be placed on any; one
    /// that does not say counts its ceiling), so that a quota is never
    /// passed.
    async fn takes_new(&self, spec: &pb::SandboxSpec, quota: &Quota) -> Result<Takes, Status> {
        let mut takes = Takes {
            memory_bytes: spec.memory_bytes,
            cpu_millis: u64::from(spec.cpu_millis),
            pids: u64::from(spec.pids_limit),
        };
        let need = (quota.memory_bytes.is_some() && takes.memory_bytes == 0)
            || (quota.cpu_millis.is_some() && takes.cpu_millis == 0)
            || (quota.pids.is_some() && takes.pids == 0);
        if !need {
            return Ok(takes);
        }
        let urls = self.fleet.urls().await.map_err(fleet_status)?;
        let asked = urls.iter().map(|url| async move {
            let client = self.fleet.connect(Some(url)).await.map_err(fleet_status)?;
            client.worker_info().await.map_err(|e| {
                status(
                    Code::Unavailable,
                    Reason::NoWorker,
                    format!("worker {url} did not say its defaults: {e}"),
                )
            })
        });
        let mut defaults = Takes::default();
        for info in futures_util::future::join_all(asked).await {
            let info = info?;
            let d = info.default_limits;
            let c = &info.policy.ceilings;
            let either = |d: u64, c: u64| if d > 0 { d } else { c };
            defaults.memory_bytes = defaults
                .memory_bytes
                .max(either(d.memory_bytes, c.memory_bytes));
            defaults.cpu_millis = defaults
                .cpu_millis
                .max(either(u64::from(d.cpu_millis), u64::from(c.cpu_millis)));
            defaults.pids = defaults
                .pids
                .max(either(u64::from(d.pids_limit), u64::from(c.pids)));
        }
        for (mine, default) in [
            (&mut takes.memory_bytes, defaults.memory_bytes),
            (&mut takes.cpu_millis, defaults.cpu_millis),
            (&mut takes.pids, defaults.pids),
        ] {
            if *mine == 0 {
                *mine = default;
            }
        }
        Ok(takes)
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, String>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remember(&self, id: &SandboxId, url: &str) {
        let mut routes = self.routes();
        if routes.len() >= ROUTES {
            routes.clear();
        }
        routes.insert(id.clone(), url.to_string());
    }

    fn forget(&self, id: &SandboxId) {
        self.routes().remove(id);
    }

    /// The worker that has a sandbox of `id`, whoever's it is (None: no
    /// worker has one): each worker is asked, as its operator.
    async fn holder(&self, id: &SandboxId) -> Result<Option<(String, RawClient)>, Status> {
        let urls = self.fleet.urls().await.map_err(fleet_status)?;
        let asked = urls.iter().map(|url| async move {
            let client = self.fleet.connect(Some(url)).await.map_err(fleet_status)?;
            let mut raw = client.raw();
            match raw
                .get_sandbox(pb::GetSandboxRequest { id: id.to_string() })
                .await
            {
                Ok(_) => Ok(Some((url.clone(), raw))),
                Err(s) if s.code() == Code::NotFound => Ok(None),
                Err(s) => Err(status(
                    Code::Unavailable,
                    Reason::NoWorker,
                    format!(
                        "worker {url} did not say whether it has {id}: {}",
                        s.message()
                    ),
                )),
            }
        });
        let mut found = None;
        for answer in futures_util::future::join_all(asked).await {
            if let Some(held) = answer? {
                found.get_or_insert(held);
            }
        }
        if let Some((url, _)) = &found {
            self.remember(id, url);
        }
        Ok(found)
    }

    /// Refuses a new sandbox's `id` that a worker already has.
    async fn taken(&self, id: &SandboxId) -> Result<(), Status> {
        match self.holder(id).await? {
            Some(_) => Err(status(
                Code::AlreadyExists,
                Reason::Conflict,
                format!("sandbox {id} already exists"),
            )),
            None => Ok(()),
        }
    }

    /// A request to a worker, made for the caller's tenant (an admin's
    /// for every tenant).
    fn outgoing<T>(who: &Principal, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if let Some(tenant) = tenant_of(who)
            && let Ok(v) = MetadataValue::try_from(tenant)
        {
            req.metadata_mut().insert(TENANT_HEADER, v);
        }
        req
    }

    /// A client of the worker that has (or last had) `id`.
    async fn worker_of(&self, id: &SandboxId) -> Result<(RawClient, bool), Status> {
        let known = self.routes().get(id).cloned();
        if let Some(url) = known {
            let client = self.fleet.connect(Some(&url)).await.map_err(fleet_status)?;
            return Ok((client.raw(), true));
        }
        let client = match self.fleet.find(id).await {
            Ok(c) => c,
            Err(corral_harness::fleet::FleetError::Invalid(_)) => return Err(unknown(id)),
            Err(e) => return Err(fleet_status(e)),
        };
        self.remember(id, client.url());
        Ok((client.raw(), false))
    }

    /// `call` on the worker that has `id`: where the worker remembered
    /// says it has no such sandbox, the workers are asked again once.
    async fn on_sandbox<T, F, Fut>(&self, id: &SandboxId, mut call: F) -> Result<T, Status>
    where
        F: FnMut(RawClient) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let (client, remembered) = self.worker_of(id).await?;
        let r = match call(client).await {
            Err(s) if remembered && is_unknown_sandbox(&s) => {
                self.forget(id);
                let (client, _) = self.worker_of(id).await?;
                call(client).await.map(Response::into_inner)
            }
            r => r.map(Response::into_inner),
        };
        r.map_err(|s| as_unknown(s, id))
    }

    /// What each worker answers `ask` (a worker that does not answer, or
    /// fails, is left out), with its address.
    async fn ask_each<T, F, Fut>(&self, ask: F) -> Result<Vec<(String, T)>, Status>
    where
        F: Fn(RawClient) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let urls = self.fleet.urls().await.map_err(fleet_status)?;
        let ask = &ask;
        let asked = urls.into_iter().map(|url| async move {
            let client = self.fleet.connect(Some(&url)).await.ok()?;
            let answer = ask(client.raw()).await.ok()?.into_inner();
            Some((url, answer))
        });
        Ok(futures_util::future::join_all(asked)
            .await
            .into_iter()
            .flatten()
            .collect())
    }

    /// Each worker's templates, as the caller sees them (a worker that
    /// does not answer is left out).
    async fn templates_of(
        &self,
        who: &Principal,
    ) -> Result<Vec<(String, Vec<pb::Template>)>, Status> {
        let each = self
            .ask_each(|mut c| async move {
                c.list_templates(FrontDoor::outgoing(who, pb::ListTemplatesRequest {}))
                    .await
            })
            .await?;
        Ok(each.into_iter().map(|(u, r)| (u, r.templates)).collect())
    }

    /// The workers that have the caller's template `name` as it was built
    /// last (one rebuilt elsewhere is older on the others).
    async fn having_template(&self, who: &Principal, name: &str) -> Result<Vec<String>, Status> {
        let found: Vec<(String, i64, String)> = self
            .templates_of(who)
            .await?
            .into_iter()
            .filter_map(|(url, list)| {
                let t = list.into_iter().find(|t| t.name == name)?;
                Some((url, t.created_at_unix_ms, t.image))
            })
            .collect();
        let newest = found.iter().max_by_key(|f| f.1).map(|f| f.2.clone());
        let urls: Vec<String> = found
            .into_iter()
            .filter(|f| Some(&f.2) == newest.as_ref())
            .map(|f| f.0)
            .collect();
        if urls.is_empty() {
            // None has it yet: every worker may take it from the fleet's
            // registry (one without says `no_such_template`).
            return self.fleet.urls().await.map_err(fleet_status);
        }
        Ok(urls)
    }

    /// Each worker's volumes, as the caller sees them (a worker that does
    /// not answer is left out).
    async fn volumes_of(&self, who: &Principal) -> Result<Vec<(String, Vec<pb::Volume>)>, Status> {
        let each = self
            .ask_each(|mut c| async move {
                c.list_volumes(FrontDoor::outgoing(who, pb::ListVolumesRequest {}))
                    .await
            })
            .await?;
        Ok(each.into_iter().map(|(u, r)| (u, r.volumes)).collect())
    }

    /// Of `urls`, those where every volume `mounts` names lives (a volume
    /// lives on one worker: those of one sandbox must be on one).
    async fn having_volumes(
        &self,
        who: &Principal,
        mounts: &[corral_proto::volume::VolumeMount],
        urls: Vec<String>,
    ) -> Result<Vec<String>, Status> {
        if mounts.is_empty() {
            return Ok(urls);
        }
        let all = self.volumes_of(who).await?;
        let mut on: Vec<String> = urls;
        for m in mounts {
            let here: Vec<&String> = all
                .iter()
                .filter(|(_, list)| list.iter().any(|v| v.name == m.name))
                .map(|(url, _)| url)
                .collect();
            if here.is_empty() {
                return Err(status(
                    Code::FailedPrecondition,
                    Reason::NoSuchVolume,
                    format!(
                        "no worker of this front door has volume {:?} (make it with `corral volume create`)",
                        m.name
                    ),
                ));
            }
            on.retain(|u| here.contains(&u));
            if on.is_empty() {
                return Err(status(
                    Code::FailedPrecondition,
                    Reason::NoSuchVolume,
                    format!(
                        "volume {:?} is on another worker than the rest of what this sandbox names (its volumes, its template): one sandbox's volumes live on one worker (corral volume ls shows where)",
                        m.name
                    ),
                ));
            }
        }
        Ok(on)
    }

    /// Writes `call`'s line in the audit log (see [`super::audited`]).
    async fn audited<T>(
        &self,
        who: &Principal,
        call: &str,
        sandbox: Option<&str>,
        r: Result<T, Status>,
    ) -> Result<T, Status> {
        let about = super::About::Sandbox(sandbox.unwrap_or_default());
        super::audited(self.audit.as_ref(), who, call, about, r).await
    }
}

/// A unary call on a named sandbox: checked, passed to its worker,
/// audited when `audit` says so.
macro_rules! on_sandbox {
    ($self:ident, $req:ident, $scope:expr, $call:literal, $audit:expr, $field:ident, $method:ident) => {{
        let who = caller(&$req)?;
        let msg = $req.into_inner();
        let id_text = msg.$field.clone();
        let r = async {
            need(&who, $scope, $call)?;
            let id = sandbox_id(msg.$field.clone())?;
            let r = $self
                .on_sandbox(&id, |mut c| {
                    let req = FrontDoor::outgoing(&who, msg.clone());
                    async move { c.$method(req).await }
                })
                .await;
            r
        }
        .await;
        let r = if $audit {
            $self.audited(&who, $call, Some(&id_text), r).await
        } else {
            r
        };
        r.map(Response::new)
    }};
}

#[tonic::async_trait]
impl pb::worker_server::Worker for FrontDoor {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let who = caller(&req)?;
        let key = req.metadata().get("authorization").cloned();
        let passed = self.passed(&req);
        let mut msg = req.into_inner();
        // A tenant's quota counts the create while it is made: its id is
        // chosen here when the client gives none.
        let quota = self.quota_of(&who);
        // An id the client (or a replica passing a create on) chose may be
        // taken on some worker; one made here is new.
        let chosen = !msg.id.is_empty();
        if quota.is_some() && !chosen {
            msg.id = SandboxId::random().to_string();
        }
        // A tenant with a quota has its creates checked by its home replica.
        if let Some(home) = self.elsewhere(&who, quota.as_ref(), passed)?
            && let Some(key) = key
        {
            return self
                .home_replica(&home)
                .await?
                .create_sandbox(self.to_replica(msg, key))
                .await
                .map_err(|e| from_replica(&home, e));
        }
        let msg = msg;
        let r = async {
            need(&who, Scope::Run, "CreateSandbox")?;
            if !msg.id.is_empty() {
                may_name(&who, &msg.id, "sandbox")?;
            }
            let takes = match &quota {
                Some(quota) => Some(
                    self.takes_new(&msg.spec.clone().unwrap_or_default(), quota)
                        .await?,
                ),
                None => None,
            };
            let reserve = || async {
                match (&quota, takes) {
                    (Some(quota), Some(takes)) => {
                        let id = sandbox_id(msg.id.clone())?;
                        self.reserve(&who, quota, &[id], takes).await
                    }
                    _ => Ok(None),
                }
            };
            // None with a quota: a sandbox of that id was listed.
            let mut reserved = reserve().await?;
            let mut spec = corral_proto::SandboxSpec::try_from(
                msg.spec.clone().unwrap_or_default(),
            )
            .map_err(|e| {
                status(
                    Code::InvalidArgument,
                    Reason::InvalidArgument,
                    e.to_string(),
                )
            })?;
            // Placement asks the workers about the caller's templates (its
            // tenant's, never one a client names in a label).
            match tenant_of(&who) {
                Some(t) => {
                    spec.labels.insert(TENANT_LABEL.to_string(), t.to_string());
                }
                None => {
                    spec.labels.remove(TENANT_LABEL);
                }
            }
            // Ids are one namespace over the fleet: a worker that has the
            // id answers the create (the same sandbox again, or a conflict).
            if chosen && let Some((_, mut raw)) = self.holder(&sandbox_id(msg.id.clone())?).await? {
                return raw
                    .create_sandbox(FrontDoor::outgoing(&who, msg.clone()))
                    .await
                    .map(Response::into_inner);
            }
            // Listed at the check, gone since: counted now, or refused.
            if quota.is_some() && reserved.is_none() {
                reserved = reserve().await?;
                if reserved.is_none() {
                    return Err(status(
                        Code::Aborted,
                        Reason::Conflict,
                        format!(
                            "sandbox {} came and went while it was asked for: ask again",
                            msg.id
                        ),
                    ));
                }
            }
            let _reserved = reserved;
            // An image built through this replica is on the worker that
            // built it alone.
            let image = spec.image.clone().unwrap_or_default();
            let built_on = self
                .built
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&image)
                .cloned();
            let urls = match (&spec.template, built_on) {
                // A template is on the workers that built it.
                (Some(t), _) => self.having_template(&who, t).await?,
                (None, Some(url)) => vec![url],
                (None, None) => self.fleet.urls().await.map_err(fleet_status)?,
            };
            // Volumes live where they were made.
            let urls = self.having_volumes(&who, &spec.volumes, urls).await?;
            let made: Result<(pb::Sandbox, String), Placing> = self
                .fleet
                .place(&urls, &spec, |url, client| {
                    let req = FrontDoor::outgoing(&who, msg.clone());
                    async move {
                        let mut raw = client.raw();
                        match raw.create_sandbox(req).await {
                            Ok(r) => Ok((r.into_inner(), url)),
                            Err(s)
                                if matches!(
                                    corral_proto::reason::of(&s),
                                    Some(Reason::AtCapacity | Reason::Draining)
                                ) =>
                            {
                                Err(Attempt::Refused(s.message().to_string()))
                            }
                            Err(s) => Err(Attempt::Failed(Placing(s))),
                        }
                    }
                })
                .await;
            let (sandbox, url) = made.map_err(|p| p.0)?;
            if let Ok(id) = SandboxId::new(sandbox.id.clone()) {
                self.remember(&id, &url);
            }
            Ok(sandbox)
        }
        .await;
        let id = r.as_ref().map_or(msg.id.clone(), |s| s.id.clone());
        self.audited(&who, "CreateSandbox", Some(&id), r)
            .await
            .map(Response::new)
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let shown = caller(&req)?;
        on_sandbox!(self, req, Scope::Read, "GetSandbox", false, id, get_sandbox).map(|mut r| {
            redact_sandbox(&shown, r.get_mut());
            r
        })
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let who = caller(&req)?;
        need(&who, Scope::Read, "ListSandboxes")?;
        let mut sandboxes = self.list_all(&who).await?;
        for s in &mut sandboxes {
            redact_sandbox(&who, s);
        }
        Ok(Response::new(pb::ListSandboxesResponse { sandboxes }))
    }

    async fn destroy_sandbox(
        &self,
        req: Request<pb::DestroySandboxRequest>,
    ) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "DestroySandbox",
            true,
            id,
            destroy_sandbox
        )
    }

    async fn submit_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "SubmitOperation",
            true,
            sandbox_id,
            submit_operation
        )
    }

    type RunOperationStream = RunStream;

    async fn run_operation(
        &self,
        req: Request<pb::SubmitOperationRequest>,
    ) -> Result<Response<RunStream>, Status> {
        let events = on_sandbox!(
            self,
            req,
            Scope::Run,
            "RunOperation",
            true,
            sandbox_id,
            run_operation
        )?;
        Ok(Response::new(Box::pin(events.into_inner())))
    }

    async fn get_operation(
        &self,
        req: Request<pb::GetOperationRequest>,
    ) -> Result<Response<pb::Operation>, Status> {
        let shown = caller(&req)?;
        on_sandbox!(
            self,
            req,
            Scope::Read,
            "GetOperation",
            false,
            sandbox_id,
            get_operation
        )
        .map(|mut r| {
            redact_operation(&shown, r.get_mut());
            r
        })
    }

    async fn upload(
        &self,
        req: Request<tonic::Streaming<pb::UploadRequest>>,
    ) -> Result<Response<pb::Operation>, Status> {
        let who = caller(&req)?;
        let mut incoming = req.into_inner();
        let first = incoming.message().await?.ok_or_else(|| {
            status(
                Code::InvalidArgument,
                Reason::InvalidArgument,
                "an upload needs a first message",
            )
        })?;
        let id_text = first.sandbox_id.clone();
        let r = async {
            need(&who, Scope::Run, "Upload")?;
            let id = sandbox_id(first.sandbox_id.clone())?;
            let (mut client, _) = self.worker_of(&id).await?;
            let id_for_errors = id.clone();
            // A client's failure mid-stream ends what goes on without its
            // eof: the worker cancels the upload.
            let rest = incoming
                .take_while(|m| std::future::ready(m.is_ok()))
                .filter_map(|m| std::future::ready(m.ok()));
            let out = futures_util::stream::once(async move { first }).chain(rest);
            client
                .upload(FrontDoor::outgoing(&who, out))
                .await
                .map(Response::into_inner)
                .map_err(|s| as_unknown(s, &id_for_errors))
        }
        .await;
        self.audited(&who, "Upload", Some(&id_text), r)
            .await
            .map(Response::new)
    }

    type DownloadStream = DownloadStream;

    async fn download(
        &self,
        req: Request<pb::DownloadRequest>,
    ) -> Result<Response<DownloadStream>, Status> {
        let r: Result<tonic::Streaming<pb::DownloadResponse>, Status> = {
            let who = caller(&req)?;
            let msg = req.into_inner();
            let id_text = msg.sandbox_id.clone();
            let r = async {
                need(&who, Scope::Run, "Download")?;
                let id = sandbox_id(msg.sandbox_id.clone())?;
                self.on_sandbox(&id, |mut c| {
                    let req = FrontDoor::outgoing(&who, msg.clone());
                    async move { c.download(req).await }
                })
                .await
            }
            .await;
            self.audited(&who, "Download", Some(&id_text), r).await
        };
        Ok(Response::new(Box::pin(r?)))
    }

    async fn list_operations(
        &self,
        req: Request<pb::ListOperationsRequest>,
    ) -> Result<Response<pb::ListOperationsResponse>, Status> {
        let shown = caller(&req)?;
        on_sandbox!(
            self,
            req,
            Scope::Read,
            "ListOperations",
            false,
            sandbox_id,
            list_operations
        )
        .map(|mut r| {
            for o in &mut r.get_mut().operations {
                redact_operation(&shown, o);
            }
            r
        })
    }

    async fn cancel_operation(
        &self,
        req: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::CancelOperationResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "CancelOperation",
            true,
            sandbox_id,
            cancel_operation
        )
    }

    async fn signal_operation(
        &self,
        req: Request<pb::SignalOperationRequest>,
    ) -> Result<Response<pb::SignalOperationResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "SignalOperation",
            true,
            sandbox_id,
            signal_operation
        )
    }

    type WatchSandboxStream = EventStream;

    async fn watch_sandbox(
        &self,
        req: Request<pb::WatchSandboxRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let who = caller(&req)?;
        let msg = req.into_inner();
        need(&who, Scope::Read, "WatchSandbox")?;
        let id = sandbox_id(msg.sandbox_id.clone())?;
        let events = self
            .on_sandbox(&id, |mut c| {
                let req = FrontDoor::outgoing(&who, msg.clone());
                async move { c.watch_sandbox(req).await }
            })
            .await?;
        Ok(Response::new(Box::pin(events)))
    }

    async fn get_worker_info(
        &self,
        req: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        let who = caller(&req)?;
        need(&who, Scope::Read, "GetWorkerInfo")?;
        let urls = self.fleet.urls().await.map_err(fleet_status)?;
        let mut why = Vec::new();
        for url in &urls {
            let asked = async {
                let client = self.fleet.connect(Some(url)).await.map_err(fleet_status)?;
                client
                    .raw()
                    .get_worker_info(FrontDoor::outgoing(&who, pb::GetWorkerInfoRequest {}))
                    .await
            };
            match asked.await {
                Ok(mut info) => {
                    // A tenant is shown the worker, not the others' work on it.
                    if tenant_of(&who).is_some() {
                        let info = info.get_mut();
                        info.sandboxes = 0;
                        info.running_operations = 0;
                        for pool in &mut info.pools {
                            pool.ready = 0;
                            pool.claims = 0;
                            pool.misses = 0;
                            pool.last_refill_ms = 0;
                            // A pool that follows demand would tell of
                            // others' creates by its size.
                            if pool.max_size > 0 {
                                pool.size = 0;
                            }
                        }
                    }
                    return Ok(info);
                }
                Err(s) => why.push(format!("{url}: {}", s.message())),
            }
        }
        Err(status(
            Code::Unavailable,
            Reason::NoWorker,
            format!("no worker answered: {}", why.join("; ")),
        ))
    }

    async fn get_sandbox_stats(
        &self,
        req: Request<pb::GetSandboxStatsRequest>,
    ) -> Result<Response<pb::SandboxStats>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Read,
            "GetSandboxStats",
            false,
            sandbox_id,
            get_sandbox_stats
        )
    }

    async fn write_input(
        &self,
        req: Request<pb::WriteInputRequest>,
    ) -> Result<Response<pb::WriteInputResponse>, Status> {
        // Not audited: one line per piece of a command's input would
        // drown the log (the operation it goes to is).
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "WriteInput",
            false,
            sandbox_id,
            write_input
        )
    }

    async fn resize_terminal(
        &self,
        req: Request<pb::ResizeTerminalRequest>,
    ) -> Result<Response<pb::ResizeTerminalResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "ResizeTerminal",
            false,
            sandbox_id,
            resize_terminal
        )
    }

    async fn reset_sandbox(
        &self,
        req: Request<pb::ResetSandboxRequest>,
    ) -> Result<Response<pb::ResetSandboxResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "ResetSandbox",
            true,
            id,
            reset_sandbox
        )
    }

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        let _ = caller(&req)?;
        Err(status(
            Code::PermissionDenied,
            Reason::PermissionDenied,
            "a worker is drained at the worker itself (corral worker drain --worker URL), not through the front door",
        ))
    }

    async fn set_sandbox_egress(
        &self,
        req: Request<pb::SetSandboxEgressRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "SetSandboxEgress",
            true,
            id,
            set_sandbox_egress
        )
    }

    async fn fork_sandbox(
        &self,
        req: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<pb::ForkSandboxResponse>, Status> {
        let who = caller(&req)?;
        let key = req.metadata().get("authorization").cloned();
        let passed = self.passed(&req);
        let mut msg = req.into_inner();
        // A fork's children count against the tenant's quotas as creates
        // do: checked by its home replica, their ids chosen here.
        let quota = self.quota_of(&who);
        if quota.is_some() && msg.child_ids.is_empty() {
            let n = usize::try_from(msg.count).unwrap_or(usize::MAX);
            if (1..=corral_proto::limits::MAX_FORK_CHILDREN).contains(&n) {
                msg.child_ids = (0..n).map(|_| SandboxId::random().to_string()).collect();
                msg.count = 0;
            }
        }
        if let Some(home) = self.elsewhere(&who, quota.as_ref(), passed)?
            && let Some(key) = key
        {
            return self
                .home_replica(&home)
                .await?
                .fork_sandbox(self.to_replica(msg, key))
                .await
                .map_err(|e| from_replica(&home, e));
        }
        let msg = msg;
        let id_text = msg.id.clone();
        let r = async {
            need(&who, Scope::Run, "ForkSandbox")?;
            for child in &msg.child_ids {
                may_name(&who, child, "sandbox")?;
            }
            let id = sandbox_id(msg.id.clone())?;
            let (client, _) = self.worker_of(&id).await?;
            // Ids are one namespace over the fleet: a child's id another
            // worker has is refused here, as its own worker would refuse it.
            let mut children = Vec::with_capacity(msg.child_ids.len());
            for child in &msg.child_ids {
                let child = sandbox_id(child.clone())?;
                self.taken(&child).await?;
                children.push(child);
            }
            let mut c = client;
            // Each child takes what its parent has.
            let _reserved = match &quota {
                Some(quota) if !children.is_empty() => {
                    let parent = c
                        .get_sandbox(FrontDoor::outgoing(
                            &who,
                            pb::GetSandboxRequest { id: id.to_string() },
                        ))
                        .await
                        .map_err(|s| as_unknown(s, &id))?
                        .into_inner();
                    self.reserve(&who, quota, &children, Takes::of(&parent))
                        .await?
                }
                _ => None,
            };
            let forked = c
                .fork_sandbox(FrontDoor::outgoing(&who, msg.clone()))
                .await
                .map(Response::into_inner)
                .map_err(|s| as_unknown(s, &id))?;
            let url = self.routes().get(&id).cloned();
            if let Some(url) = url {
                for child in &forked.children {
                    if let Ok(cid) = SandboxId::new(child.id.clone()) {
                        self.remember(&cid, &url);
                    }
                }
            }
            Ok(forked)
        }
        .await;
        self.audited(&who, "ForkSandbox", Some(&id_text), r)
            .await
            .map(Response::new)
    }

    async fn checkpoint_sandbox(
        &self,
        req: Request<pb::CheckpointSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "CheckpointSandbox",
            true,
            id,
            checkpoint_sandbox
        )
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::Template>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "SnapshotSandbox",
            true,
            id,
            snapshot_sandbox
        )
    }

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::PortExposure>, Status> {
        let r: Result<Response<pb::PortExposure>, Status> = on_sandbox!(
            self,
            req,
            Scope::Run,
            "ExposePort",
            true,
            sandbox_id,
            expose_port
        );
        r.map(|e| Response::new(self.through_front(e.into_inner())))
    }

    async fn revoke_access(
        &self,
        req: Request<pb::RevokeAccessRequest>,
    ) -> Result<Response<pb::RevokeAccessResponse>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "RevokeAccess",
            true,
            sandbox_id,
            revoke_access
        )
    }

    async fn list_exposures(
        &self,
        req: Request<pb::ListExposuresRequest>,
    ) -> Result<Response<pb::ListExposuresResponse>, Status> {
        let r: Result<Response<pb::ListExposuresResponse>, Status> = on_sandbox!(
            self,
            req,
            Scope::Read,
            "ListExposures",
            false,
            sandbox_id,
            list_exposures
        );
        r.map(|l| {
            let mut l = l.into_inner();
            l.exposures = l
                .exposures
                .into_iter()
                .map(|e| self.through_front(e))
                .collect();
            Response::new(l)
        })
    }

    async fn restore_sandbox(
        &self,
        req: Request<pb::RestoreSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        on_sandbox!(
            self,
            req,
            Scope::Run,
            "RestoreSandbox",
            true,
            id,
            restore_sandbox
        )
    }

    type BuildImageStream = BuildStream;

    async fn list_templates(
        &self,
        req: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        let who = caller(&req)?;
        need(&who, Scope::Read, "ListTemplates")?;
        // Every worker's, one of each name: the newest.
        let mut by_name: std::collections::BTreeMap<String, pb::Template> = Default::default();
        for (_, list) in self.templates_of(&who).await? {
            for t in list {
                match by_name.get(&t.name) {
                    Some(had) if had.created_at_unix_ms >= t.created_at_unix_ms => {}
                    _ => {
                        by_name.insert(t.name.clone(), t);
                    }
                }
            }
        }
        Ok(Response::new(pb::ListTemplatesResponse {
            templates: by_name.into_values().collect(),
        }))
    }

    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::Volume>, Status> {
        let who = caller(&req)?;
        let msg = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "CreateVolume")?;
            corral_proto::volume::check_name(&msg.name).map_err(|e| {
                status(
                    Code::InvalidArgument,
                    Reason::InvalidArgument,
                    e.to_string(),
                )
            })?;
            // Where it is already (the same again, or a conflict); else
            // the worker its name and tenant hash to, so that two creates
            // of one name through any replica meet on one worker. Every
            // worker must answer: one that does not may have it.
            let urls = self.fleet.urls().await.map_err(fleet_status)?;
            let listed = self.volumes_of(&who).await?;
            let silent: Vec<&String> = urls
                .iter()
                .filter(|u| !listed.iter().any(|(l, _)| l == *u))
                .collect();
            if !silent.is_empty() {
                return Err(status(
                    Code::Unavailable,
                    Reason::NoWorker,
                    format!(
                        "a volume is made once every worker has said whether it has one of that name; no answer from: {}",
                        silent
                            .iter()
                            .map(|u| u.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            let there = listed
                .into_iter()
                .find(|(_, list)| list.iter().any(|v| v.name == msg.name))
                .map(|(url, _)| url);
            let url = match there {
                Some(url) => url,
                None => {
                    let tenant = who.tenant.clone();
                    urls.into_iter()
                        .max_by_key(|u| rendezvous(u, &tenant, &msg.name))
                        .ok_or_else(|| {
                            status(Code::Unavailable, Reason::NoWorker, "no worker is known")
                        })?
                }
            };
            let client = self.fleet.connect(Some(&url)).await.map_err(fleet_status)?;
            client
                .raw()
                .create_volume(FrontDoor::outgoing(&who, msg.clone()))
                .await
                .map(Response::into_inner)
        }
        .await;
        self.audited(&who, "CreateVolume", None, r)
            .await
            .map(Response::new)
    }

    async fn list_volumes(
        &self,
        req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let who = caller(&req)?;
        need(&who, Scope::Read, "ListVolumes")?;
        let mut volumes: Vec<pb::Volume> = self
            .volumes_of(&who)
            .await?
            .into_iter()
            .flat_map(|(_, list)| list)
            .collect();
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListVolumesResponse { volumes }))
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let who = caller(&req)?;
        let msg = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "DeleteVolume")?;
            let mut existed = false;
            for (url, list) in self.volumes_of(&who).await? {
                if !list.iter().any(|v| v.name == msg.name) {
                    continue;
                }
                let client = self.fleet.connect(Some(&url)).await.map_err(fleet_status)?;
                existed |= client
                    .raw()
                    .delete_volume(FrontDoor::outgoing(&who, msg.clone()))
                    .await?
                    .into_inner()
                    .existed;
            }
            Ok(pb::DeleteVolumeResponse { existed })
        }
        .await;
        self.audited(&who, "DeleteVolume", None, r)
            .await
            .map(Response::new)
    }

    async fn delete_template(
        &self,
        req: Request<pb::DeleteTemplateRequest>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        let who = caller(&req)?;
        let msg = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "DeleteTemplate")?;
            // On every worker that answers; one that does not is named,
            // after the others have forgotten it.
            let urls = self.fleet.urls().await.map_err(fleet_status)?;
            let (mut existed, mut missed) = (false, Vec::new());
            for url in &urls {
                let asked = async {
                    let client = self.fleet.connect(Some(url)).await.map_err(fleet_status)?;
                    client
                        .raw()
                        .delete_template(FrontDoor::outgoing(&who, msg.clone()))
                        .await
                        .map(|r| r.into_inner().existed)
                };
                match asked.await {
                    Ok(e) => existed |= e,
                    // Refused (a bad name, a template in use there): said.
                    Err(s)
                        if matches!(s.code(), Code::InvalidArgument | Code::FailedPrecondition) =>
                    {
                        return Err(s);
                    }
                    Err(s) => missed.push(format!("{url}: {}", s.message())),
                }
            }
            if !missed.is_empty() {
                return Err(corral_proto::reason::status(
                    Code::Unavailable,
                    Reason::NoWorker,
                    None,
                    format!(
                        "the template was forgotten where workers answered; ask again for: {}",
                        missed.join("; ")
                    ),
                ));
            }
            Ok(pb::DeleteTemplateResponse { existed })
        }
        .await;
        self.audited(&who, "DeleteTemplate", None, r)
            .await
            .map(Response::new)
    }

    async fn build_image(
        &self,
        req: Request<tonic::Streaming<pb::BuildImageRequest>>,
    ) -> Result<Response<BuildStream>, Status> {
        let who = caller(&req)?;
        let r = async {
            need(&who, Scope::Run, "BuildImage")?;
            // The build goes whole to one worker that builds (its request
            // stream can be sent once): the least full of them.
            let urls = self.fleet.urls().await.map_err(fleet_status)?;
            let asked = urls.iter().map(|url| async move {
                let client = self.fleet.connect(Some(url)).await.ok()?;
                let info = client.worker_info().await.ok()?;
                (info.policy.allow_build && !info.draining).then(|| {
                    let load = f64::from(info.sandboxes) / f64::from(info.max_sandboxes.max(1));
                    (load, url.clone(), client)
                })
            });
            let able = futures_util::future::join_all(asked).await;
            let Some((_, url, client)) = able
                .into_iter()
                .flatten()
                .min_by(|a, b| a.0.total_cmp(&b.0))
            else {
                return Err(corral_proto::reason::status(
                    Code::PermissionDenied,
                    Reason::PolicyDenied,
                    Some("--allow-build"),
                    "none of the front door's workers builds images (corral-worker --allow-build)"
                        .to_string(),
                ));
            };
            let incoming = req
                .into_inner()
                .take_while(|m| std::future::ready(m.is_ok()));
            let requests = incoming.filter_map(|m| std::future::ready(m.ok()));
            let events = client
                .raw()
                .build_image(FrontDoor::outgoing(&who, requests))
                .await
                .map(Response::into_inner)?;
            Ok((url, events))
        }
        .await;
        let (url, events) = self.audited(&who, "BuildImage", None, r).await?;
        // What it built is remembered with its worker, for the creates
        // that name it.
        let built = self.built.clone();
        let stream = events.inspect(move |ev| {
            if let Ok(pb::BuildImageEvent {
                kind: Some(pb::build_image_event::Kind::Done(done)),
            }) = ev
                && done.failure.is_none()
                && !done.image.is_empty()
            {
                let mut built = built.lock().unwrap_or_else(|p| p.into_inner());
                if built.len() >= ROUTES {
                    built.clear();
                }
                built.insert(done.image.clone(), url.clone());
            }
        });
        Ok(Response::new(Box::pin(stream) as BuildStream))
    }
}

/// The key check of a front door: the caller's bearer key, against the
/// tenants' keys as they are now; the caller it names goes with the
/// request.
#[derive(Clone)]
pub struct KeyAuth {
    keys: corral_harness::tenants::Keys,
}

impl KeyAuth {
    pub fn new(keys: corral_harness::tenants::Keys) -> Self {
        Self { keys }
    }

    #[allow(clippy::result_large_err)]
    pub fn check(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.strip_prefix("Bearer ").unwrap_or(v))
            .unwrap_or("");
        match self
            .keys
            .current()
            .authenticate(given, corral_harness::tenants::now_ms())
        {
            Ok(who) => {
                corral_worker::server::mark_authenticated(&req);
                req.extensions_mut().insert(who);
                Ok(req)
            }
            Err(e) => Err(status(
                Code::Unauthenticated,
                Reason::Unauthenticated,
                format!("{e} (a key of this front door: `corral admin key create`)"),
            )),
        }
    }
}

/// Who may call the service: the holder of its one token (every
/// tenant's, as an admin key), or the tenants' keys.
#[derive(Clone)]
pub enum Gate {
    Token(Arc<corral_worker::server::TokenAuth>),
    Keys(KeyAuth),
}

impl Gate {
    pub fn token(token: String) -> Self {
        Gate::Token(Arc::new(corral_worker::server::TokenAuth::new(Some(token))))
    }

    pub fn keys(keys: corral_harness::tenants::Keys) -> Self {
        Gate::Keys(KeyAuth::new(keys))
    }

    /// Checks the caller, and leaves who it is on the request.
    #[allow(clippy::result_large_err)]
    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        match self {
            Gate::Token(auth) => {
                let mut req = auth.check(req)?;
                req.extensions_mut().insert(Principal {
                    tenant: "-".into(),
                    key_id: "service-token".into(),
                    scopes: [Scope::Admin].into(),
                });
                Ok(req)
            }
            Gate::Keys(auth) => auth.check(req),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> Principal {
        Principal {
            tenant: name.into(),
            key_id: "k".into(),
            scopes: [Scope::Run].into(),
        }
    }

    #[test]
    fn a_workers_listener_on_every_interface_is_reached_at_the_workers_host() {
        assert_eq!(
            reachable("http://0.0.0.0:7080", "https://10.1.2.3:7070"),
            "http://10.1.2.3:7080"
        );
        assert_eq!(
            reachable("http://[::]:7080", "http://w1.example:7070"),
            "http://w1.example:7080"
        );
        assert_eq!(
            reachable("http://10.9.9.9:7080/", "http://10.1.2.3:7070"),
            "http://10.9.9.9:7080"
        );
    }

    #[test]
    fn a_tenant_names_ids_of_its_own_namespace_or_random_ones_only() {
        let acme = tenant("acme");
        for ok in [
            "acme.build-1",
            "acme.x",
            "0f8e2b9c-1d2a-4c3b-9e8f-7a6b5c4d3e2f",
            "0f8e2b9c1d2a4c3b9e8f7a6b5c4d3e2f",
            "s-0123456789ab",
        ] {
            assert!(may_name(&acme, ok, "sandbox").is_ok(), "{ok}");
        }
        for no in [
            "build-1",
            "acme",
            "acme.",
            "acme-b.x",
            "acmex.y",
            "bolt.x",
            "s-0123",
            "0f8e2b9c1d2a4c3b9e8f7a6b5c4d3e2",
            "0f8e2b9c-1d2a-4c3b-9e8f-7a6b5c4d3e2g",
        ] {
            let e = may_name(&acme, no, "sandbox").unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{no}");
        }
        // A caller of every tenant's names what it likes.
        let admin = Principal {
            tenant: "-".into(),
            key_id: "k".into(),
            scopes: [Scope::Admin].into(),
        };
        assert!(may_name(&admin, "build-1", "sandbox").is_ok());
    }
}
