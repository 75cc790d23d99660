//! Warm pools: sandboxes of a template, made and started ahead of time
//! (hardened, their supervisor up and answering), each handed out once to a
//! create that matches the template. What is per sandbox is applied at the
//! claim: its id, record and lifetimes (the worker's), its labels, and its
//! environment (given to each of its commands by the worker). A member is
//! used once: nothing of an earlier tenant can be in it.
//!
//! The pool state is the worker's (one lock, short sections); the members'
//! containers carry the worker's labels but no record, so a worker that
//! starts again removes them (they are made again), and its sweep leaves
//! alone the ones its pools hold.

use std::collections::VecDeque;
use std::str::FromStr;
use std::time::Duration;

use corral_proto::{NetworkMode, SandboxId, SandboxSpec};

use tokio::time::Instant;

use crate::docker::Defaults;
use crate::sandbox::Sandbox;

/// One `--pool IMAGE=N[,max=M][,memory=SIZE][,cpus=N][,pids=N][,runtime=NAME]`,
/// or `--pool template:NAME=N[,...]`: members of the operator's template
/// NAME (see [`crate::templates`]), each started and ready. With `max`,
/// N is a floor and the pool follows demand up to M (see [`Demand`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// The image (empty for a template's pool: the template's, when a
    /// member is made).
    pub image: String,
    /// The worker's template its members are of.
    pub template: Option<String>,
    /// Members kept (with `max`: at least).
    pub size: u32,
    /// Most members kept when demand asks for more than `size`.
    pub max: Option<u32>,
    pub memory_bytes: Option<u64>,
    pub cpu_millis: Option<u32>,
    pub pids_limit: Option<u32>,
    pub runtime: Option<String>,
}

/// Most members one template may keep.
pub const MAX_POOL_SIZE: u32 = 1024;

impl FromStr for Template {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: String| {
            format!(
                "--pool {s:?}: {why} (IMAGE=N or template:NAME=N, then [,max=M][,memory=SIZE][,cpus=N][,pids=N][,runtime=NAME])"
            )
        };
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or("");
        let (image, size) = head.rsplit_once('=').ok_or_else(|| bad("no size".into()))?;
        if image.is_empty() {
            return Err(bad("no image".into()));
        }
        let size: u32 = size
            .parse()
            .map_err(|_| bad(format!("{size:?} is not a number of sandboxes")))?;
        if size == 0 || size > MAX_POOL_SIZE {
            return Err(bad(format!("a size of 1-{MAX_POOL_SIZE}")));
        }
        let (image, template) = match image.strip_prefix("template:") {
            Some(name) => {
                corral_proto::template::check_name(name).map_err(|e| bad(e.to_string()))?;
                (String::new(), Some(name.to_string()))
            }
            None => (image.to_string(), None),
        };
        let mut t = Template {
            image,
            template,
            size,
            max: None,
            memory_bytes: None,
            cpu_millis: None,
            pids_limit: None,
            runtime: None,
        };
        for p in parts {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| bad(format!("{p:?} is not KEY=VALUE")))?;
            match k {
                "max" => {
                    t.max = Some(
                        v.parse()
                            .ok()
                            .filter(|m| (size..=MAX_POOL_SIZE).contains(m))
                            .ok_or_else(|| {
                                bad(format!(
                                    "max {v:?} (from the size, {size}, to {MAX_POOL_SIZE})"
                                ))
                            })?,
                    )
                }
                "memory" => t.memory_bytes = Some(corral_proto::units::parse_size(v).map_err(bad)?),
                "cpus" => {
                    let c: f64 = v
                        .parse()
                        .ok()
                        .filter(|c: &f64| c.is_finite() && *c > 0.0)
                        .ok_or_else(|| bad(format!("cpus {v:?}")))?;
                    t.cpu_millis = Some((c * 1000.0).round() as u32);
                }
                "pids" => {
                    t.pids_limit = Some(
                        v.parse()
                            .ok()
                            .filter(|n| *n >= 8)
                            .ok_or_else(|| bad(format!("pids {v:?} (at least 8)")))?,
                    )
                }
                "runtime" if !v.is_empty() => t.runtime = Some(v.to_string()),
                other => return Err(bad(format!("unknown key {other:?}"))),
            }
        }
        Ok(t)
    }
}

impl std::fmt::Display for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.template {
            Some(name) => write!(f, "template:{name}={}", self.size)?,
            None => write!(f, "{}={}", self.image, self.size)?,
        }
        if let Some(m) = self.max {
            write!(f, ",max={m}")?;
        }
        if let Some(m) = self.memory_bytes {
            write!(f, ",memory={m}")?;
        }
        if let Some(c) = self.cpu_millis {
            write!(f, ",cpus={}", f64::from(c) / 1000.0)?;
        }
        if let Some(p) = self.pids_limit {
            write!(f, ",pids={p}")?;
        }
        if let Some(r) = &self.runtime {
            write!(f, ",runtime={r}")?;
        }
        Ok(())
    }
}

impl Template {
    /// The spec its members are made with.
    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec {
            // A template's: its image, when a member is made.
            image: self.template.is_none().then(|| self.image.clone()),
            template: self.template.clone(),
            memory_bytes: self.memory_bytes,
            cpu_millis: self.cpu_millis,
            pids_limit: self.pids_limit,
            runtime: self.runtime.clone(),
            ..SandboxSpec::default()
        }
    }

    /// Whether a member can be what `spec` asks for: the same image,
    /// limits and runtime (each as the worker resolves it), and nothing
    /// that is fixed when a container is made (root, a writable root,
    /// capabilities, a network, other tmpfs sizes). Egress is not: every
    /// member has its proxy's directory mounted, served once claimed.
    /// A template's pool matches a create of that template (its member's
    /// image and start are checked at the claim: [`Member::started`]).
    pub fn matches(&self, spec: &SandboxSpec, d: &Defaults) -> bool {
        let plain = spec.network == NetworkMode::None
            && !spec.run_as_root
            && !spec.writable_rootfs
            && spec.add_capabilities.is_empty()
            && spec.volumes.is_empty()
            && !spec.memory_includes_files
            && spec.workspace_bytes.unwrap_or(d.workspace_bytes) == d.workspace_bytes
            && spec.tmp_bytes.unwrap_or(d.tmp_bytes) == d.tmp_bytes;
        let what = match &self.template {
            Some(name) => spec.template.as_deref() == Some(name.as_str()),
            None => spec.image.as_deref().unwrap_or(&d.image) == self.image,
        };
        plain
            && what
            && spec.memory_bytes.unwrap_or(d.memory_bytes)
                == self.memory_bytes.unwrap_or(d.memory_bytes)
            && spec.cpu_millis.unwrap_or(d.cpu_millis) == self.cpu_millis.unwrap_or(d.cpu_millis)
            && spec.pids_limit.unwrap_or(d.pids_limit) == self.pids_limit.unwrap_or(d.pids_limit)
            && spec.runtime.as_ref().or(d.runtime.as_ref())
                == self.runtime.as_ref().or(d.runtime.as_ref())
    }
}

/// Demand is the most members asked for within this long...
pub const BURST_WINDOW: Duration = Duration::from_secs(10);
/// ...over this long: a pool that saw a burst keeps room for another as
/// large for five minutes, then goes back to its floor.
pub const DEMAND_MEMORY: Duration = Duration::from_secs(300);
/// Asks remembered at most (the newest).
const MAX_ASKS: usize = 4 * MAX_POOL_SIZE as usize;

/// When a pool's members were asked for (a create that took one, or that
/// matched and found none ready), over the last [`DEMAND_MEMORY`].
#[derive(Debug, Default)]
pub struct Demand {
    asks: VecDeque<Instant>,
}

impl Demand {
    pub fn ask(&mut self, now: Instant) {
        self.forget(now);
        if self.asks.len() == MAX_ASKS {
            self.asks.pop_front();
        }
        self.asks.push_back(now);
    }

    fn forget(&mut self, now: Instant) {
        while self
            .asks
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > DEMAND_MEMORY)
        {
            self.asks.pop_front();
        }
    }

    /// The most asks within any [`BURST_WINDOW`] of the remembered ones.
    pub fn peak(&mut self, now: Instant) -> usize {
        self.forget(now);
        let mut best = 0;
        let mut from = 0;
        for (to, t) in self.asks.iter().enumerate() {
            while t.saturating_duration_since(self.asks[from]) > BURST_WINDOW {
                from += 1;
            }
            best = best.max(to + 1 - from);
        }
        best
    }
}

/// A started, ready member, and the actor that watches it (so one that
/// dies is seen and replaced).
pub struct Member {
    pub id: SandboxId,
    pub sandbox: Sandbox,
    /// A template's member: the image and start it was started with (its
    /// start command runs, its probe held).
    pub started: Option<(String, corral_proto::template::TemplateStart)>,
}

/// One template's members and counts.
pub struct Pool {
    pub template: Template,
    pub ready: VecDeque<Member>,
    /// Ids of members being made (their containers exist or are about to).
    pub filling: Vec<SandboxId>,
    pub claims: u64,
    pub misses: u64,
    /// How long the last member took to make, start and answer.
    pub last_refill: Option<Duration>,
    pub demand: Demand,
}

impl Pool {
    pub fn new(template: Template) -> Self {
        Self {
            template,
            ready: VecDeque::new(),
            filling: Vec::new(),
            claims: 0,
            misses: 0,
            last_refill: None,
            demand: Demand::default(),
        }
    }

    /// Members it keeps now: its size, or with a `max`, the largest burst
    /// of asks of late between the two.
    pub fn target(&mut self, now: Instant) -> usize {
        let size = self.template.size as usize;
        match self.template.max {
            None => size,
            Some(max) => self.demand.peak(now).clamp(size, max as usize),
        }
    }

    /// Members held (ready and being made): each takes a slot.
    pub fn held(&self) -> usize {
        self.ready.len() + self.filling.len()
    }

    /// Whether `id` is one of this pool's members.
    pub fn holds(&self, id: &str) -> bool {
        self.ready.iter().any(|m| m.id.as_str() == id)
            || self.filling.iter().any(|f| f.as_str() == id)
    }
}

/// A member's id: the pool's prefix, then a random part.
pub fn member_id() -> SandboxId {
    let raw = SandboxId::random();
    SandboxId::new(format!("pool-{raw}")).unwrap_or(raw)
}

impl From<&mut Pool> for corral_proto::PoolInfo {
    fn from(p: &mut Pool) -> Self {
        Self {
            size: p.target(Instant::now()) as u32,
            max_size: p.template.max.unwrap_or(0),
            template: p.template.to_string(),
            image: p.template.image.clone(),
            ready: p.ready.len() as u32,
            claims: p.claims,
            misses: p.misses,
            last_refill_ms: p.last_refill.map_or(0, |d| d.as_millis() as u64),
            memory_bytes: p.template.memory_bytes,
            cpu_millis: p.template.cpu_millis,
            pids_limit: p.template.pids_limit,
            runtime: p.template.runtime.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse_print_and_refuse_what_they_cannot_be() {
        let t: Template = "corral-debian:latest=4,memory=512m,cpus=0.5,pids=64,runtime=runsc"
            .parse()
            .unwrap();
        assert_eq!(t.image, "corral-debian:latest");
        assert_eq!(t.size, 4);
        assert_eq!(t.memory_bytes, Some(512 << 20));
        assert_eq!(t.cpu_millis, Some(500));
        assert_eq!(t.pids_limit, Some(64));
        assert_eq!(t.runtime.as_deref(), Some("runsc"));
        assert_eq!(
            t.to_string(),
            "corral-debian:latest=4,memory=536870912,cpus=0.5,pids=64,runtime=runsc"
        );
        let web: Template = "template:web=3,memory=1g".parse().unwrap();
        assert_eq!(
            (web.template.as_deref(), web.image.as_str()),
            (Some("web"), "")
        );
        assert_eq!(web.to_string(), "template:web=3,memory=1073741824");
        assert!("template:Bad=1".parse::<Template>().is_err());
        let grows: Template = "corral-sandbox:latest=2,max=100".parse().unwrap();
        assert_eq!((grows.size, grows.max), (2, Some(100)));
        assert_eq!(grows.to_string(), "corral-sandbox:latest=2,max=100");
        let plain: Template = "corral-sandbox:latest=2".parse().unwrap();
        assert_eq!(plain.spec().image.as_deref(), Some("corral-sandbox:latest"));
        for bad in [
            "x",
            "=3",
            "x=0",
            "x=99999",
            "x=two",
            "x=1,memory=lots",
            "x=1,cpus=-1",
            "x=1,pids=2",
            "x=1,gpu=1",
            "x=1,memory",
            "x=2,max=1",
            "x=2,max=2000",
            "x=2,max=lots",
        ] {
            let e = bad.parse::<Template>().expect_err(bad);
            assert!(e.contains("--pool"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_template_matches_what_its_members_can_be_and_nothing_else() {
        let d = Defaults::default();
        // Not the default image: a create that names none differs.
        let t: Template = "corral-sandbox:latest=1,memory=512m".parse().unwrap();
        let asks = |f: &dyn Fn(&mut SandboxSpec)| {
            let mut s = SandboxSpec {
                image: Some("corral-sandbox:latest".into()),
                memory_bytes: Some(512 << 20),
                ..SandboxSpec::default()
            };
            f(&mut s);
            t.matches(&s, &d)
        };
        assert!(asks(&|_| {}));
        // What a claim gives per sandbox does not matter.
        assert!(asks(&|s| {
            s.env.insert("A".into(), "1".into());
            s.labels.insert("team".into(), "x".into());
            s.ttl_ms = Some(1000);
            s.idle_timeout_ms = Some(1000);
        }));
        // The defaults, said or not, are the same.
        assert!(asks(&|s| s.cpu_millis = Some(d.cpu_millis)));
        assert!(asks(&|s| s.workspace_bytes = Some(d.workspace_bytes)));
        assert!(asks(&|s| s.egress =
            corral_proto::egress::parse_rules(&["pypi.org"], false)
                .unwrap()));
        // What is fixed when a container is made does.
        for differs in [
            &(|s: &mut SandboxSpec| s.image = Some("other:latest".into()))
                as &dyn Fn(&mut SandboxSpec),
            &|s| s.image = None,
            &|s| s.memory_bytes = None,
            &|s| s.cpu_millis = Some(2000),
            &|s| s.pids_limit = Some(64),
            &|s| s.runtime = Some("runsc".into()),
            &|s| s.run_as_root = true,
            &|s| s.writable_rootfs = true,
            &|s| s.add_capabilities = vec!["CAP_CHOWN".into()],
            &|s| s.network = NetworkMode::Bridge,
            &|s| s.workspace_bytes = Some(2 << 30),
            &|s| s.tmp_bytes = Some(1 << 20),
            &|s| s.memory_includes_files = true,
        ] {
            assert!(!asks(differs));
        }
    }

    #[test]
    fn a_pool_follows_its_largest_recent_burst_between_its_floor_and_its_ceiling() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_millis(s);
        let mut fixed = Pool::new("corral-sandbox:latest=3".parse().unwrap());
        let mut elastic = Pool::new("corral-sandbox:latest=2,max=50".parse().unwrap());
        assert_eq!((fixed.target(t0), elastic.target(t0)), (3, 2));
        // 30 asks in 3 s, then a trickle of one every 20 s.
        for i in 0..30 {
            fixed.demand.ask(at(i * 100));
            elastic.demand.ask(at(i * 100));
        }
        assert_eq!(
            (fixed.target(at(3_000)), elastic.target(at(3_000))),
            (3, 30)
        );
        for i in 1..=10 {
            elastic.demand.ask(at(3_000 + i * 20_000));
        }
        // The burst is remembered for five minutes, then the floor.
        assert_eq!(elastic.target(at(200_000)), 30);
        assert_eq!(elastic.target(at(3_000 + 300_001)), 2);
        // Never past the ceiling.
        for i in 0..80 {
            elastic.demand.ask(at(400_000 + i));
        }
        assert_eq!(elastic.target(at(400_100)), 50);
        // A burst split by a window's edge counts whole: 10 asks at 9.9 s
        // and 10 at 10.1 s are 20 within 10 s.
        let mut edge = Pool::new("x=1,max=100".parse().unwrap());
        for i in 0..10 {
            edge.demand.ask(at(9_900 + i));
            edge.demand.ask(at(10_100 + i));
        }
        assert_eq!(edge.target(at(10_200)), 20);
        // Asks a window apart are never one burst.
        let mut slow = Pool::new("x=1,max=100".parse().unwrap());
        for i in 0..20 {
            slow.demand.ask(at(i * 10_001));
        }
        assert_eq!(slow.target(at(20 * 10_001)), 1);
    }
}
