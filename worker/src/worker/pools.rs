//! Warm pools: members made ahead, kept at each pool's size (or, for a
//! pool with a ceiling, at its demand: [`crate::pool::Demand`]) as
//! capacity allows, and removed when they die, give up their slot, are
//! past their pool's demand, or a drain begins.

use std::time::Duration;

use corral_proto::{SandboxId, SandboxSpec};
use tracing::warn;

use super::{READY_TIMEOUT, Worker, lock};
use crate::error::{Result, WorkerError};
use crate::sandbox::Sandbox;

/// Pool members made at once.
const FILL_AT_ONCE: usize = 4;

/// A member to make: its pool's index, its id, its spec, its template.
type NextMember = (
    usize,
    SandboxId,
    SandboxSpec,
    Option<crate::templates::Template>,
);

/// How often a template pool's template is asked of the fleet's registry.
const POOL_TEMPLATES_ASKED: Duration = Duration::from_secs(10);

impl Worker {
    /// Removes a pool member (dead, evicted, or the pools emptied).
    pub(super) async fn discard_member(&self, m: crate::pool::Member) {
        m.sandbox.close();
        if let Err(e) = self
            .inner
            .runtime
            .remove_container(&m.sandbox.container_id)
            .await
        {
            warn!(member = %m.id, error = %e, "could not remove a pool member");
        }
        crate::proxy::remove(&self.egress_dir(&m.id));
    }

    /// Keeps every pool at its size, as capacity allows: members that died
    /// are removed, new ones made a few at a time (woken by claims, else
    /// every two seconds), never while draining or stopping. With a
    /// registry, the templates of template pools are asked of it at start
    /// and every [`POOL_TEMPLATES_ASKED`]: a pool fills without waiting for
    /// a create to pull its template, and follows a newer build of it.
    pub(super) async fn fill_pools_forever(&self) {
        let mut asked: Option<tokio::time::Instant> = None;
        loop {
            if self.inner.registry.is_some()
                && asked.is_none_or(|at| at.elapsed() >= POOL_TEMPLATES_ASKED)
            {
                asked = Some(tokio::time::Instant::now());
                self.refresh_pool_templates().await;
            }
            self.fill_pools().await;
            tokio::select! {
                () = self.inner.shutdown.cancelled() => return,
                () = self.inner.pool_wake.notified() => {}
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    /// Takes the registry's build of each template a pool is of (the
    /// operator's: pools are the worker's own).
    async fn refresh_pool_templates(&self) {
        let names: Vec<String> = lock(&self.inner.pools)
            .iter()
            .filter_map(|p| p.template.template.clone())
            .collect();
        for name in names {
            let mut spec = SandboxSpec {
                template: Some(name.clone()),
                ..SandboxSpec::default()
            };
            match self.resolve_template(&mut spec).await {
                Ok(_) | Err(WorkerError::NoSuchTemplate(_)) => {}
                Err(e) => {
                    warn!(template = %name, error = %e, "a pool's template could not be taken from the registry");
                }
            }
        }
    }

    pub(super) async fn fill_pools(&self) {
        let at = tokio::time::Instant::now();
        let (dead, spare): (Vec<crate::pool::Member>, Vec<crate::pool::Member>) = {
            let mut pools = lock(&self.inner.pools);
            let mut dead = Vec::new();
            let mut spare = Vec::new();
            for p in pools.iter_mut() {
                // A template's members of an earlier build of it (or of
                // one since removed) go too.
                let now = p.template.template.as_deref().map(|name| {
                    self.inner
                        .templates
                        .get(None, name)
                        .map(|t| (t.image, t.start))
                });
                let (gone, alive): (Vec<_>, Vec<_>) = p.ready.drain(..).partition(|m| {
                    m.sandbox.is_lost()
                        || now
                            .as_ref()
                            .is_some_and(|now| now.as_ref() != m.started.as_ref())
                });
                p.ready = alive.into();
                dead.extend(gone);
                // Past a burst, a pool that follows demand goes back down
                // (its newest members first).
                let target = p.target(at);
                while p.held() > target
                    && let Some(m) = p.ready.pop_back()
                {
                    spare.push(m);
                }
            }
            (dead, spare)
        };
        for m in dead {
            warn!(member = %m.id, "a pool member died or is of an earlier template; it is replaced");
            self.discard_member(m).await;
        }
        for m in spare {
            tracing::info!(member = %m.id, "a pool member is removed: its pool's demand went down");
            self.discard_member(m).await;
        }
        // Up to FILL_AT_ONCE members made at once (each mostly waits on the
        // engine), the next chosen as one is done; an error or a member
        // with no room left stops the choosing until the next wake.
        let mut making = futures_util::stream::FuturesUnordered::new();
        let mut go_on = true;
        loop {
            while go_on && making.len() < FILL_AT_ONCE {
                if self.inner.shutdown.is_cancelled() || self.inner.drain.borrow().is_some() {
                    go_on = false;
                    break;
                }
                match self.next_member() {
                    Some(next) => making.push(self.fill_one(next)),
                    None => {
                        go_on = false;
                        break;
                    }
                }
            }
            match futures_util::StreamExt::next(&mut making).await {
                Some(more) => go_on &= more,
                None => return,
            }
        }
    }

    /// The next member to make: of the pool that lacks the most, if the
    /// worker has a slot for it (counted in its pool's `filling` from now).
    fn next_member(&self) -> Option<NextMember> {
        let table = self.inner.table.lock();
        let mut pools = lock(&self.inner.pools);
        let held: usize = pools.iter().map(crate::pool::Pool::held).sum();
        if table.held() + held >= self.inner.max_sandboxes as usize {
            return None;
        }
        // A template's pool fills once the template is there.
        let of = |p: &crate::pool::Pool| match &p.template.template {
            Some(name) => self.inner.templates.get(None, name).map(Some),
            None => Some(None),
        };
        let now = tokio::time::Instant::now();
        pools
            .iter_mut()
            .enumerate()
            .filter_map(|(i, p)| {
                let lacks = p.target(now).checked_sub(p.held()).filter(|n| *n > 0)?;
                Some((i, lacks, p))
            })
            .filter_map(|(i, lacks, p)| of(p).map(|t| (i, lacks, p, t)))
            .max_by_key(|(_, lacks, _, _)| *lacks)
            .map(|(i, _, p, t)| {
                let id = crate::pool::member_id();
                p.filling.push(id.clone());
                let mut spec = p.template.spec();
                if let Some(t) = &t {
                    spec.image = Some(t.image.clone());
                    spec.template = Some(t.name.clone());
                }
                (i, id, spec, t)
            })
    }

    /// Makes member `next` and puts it in its pool: whether to go on
    /// choosing more (not after an error, nor when it found no room).
    async fn fill_one(&self, next: NextMember) -> bool {
        let (i, id, spec, template) = next;
        let started = std::time::Instant::now();
        let made = match (self.make_member(&id, spec).await, &template) {
            // A template's member is started as it says, and ready.
            (Ok(sandbox), Some(t)) => match self.start_template(&sandbox, t).await {
                Ok(()) => Ok(sandbox),
                Err(e) => {
                    self.discard_member(crate::pool::Member {
                        id: id.clone(),
                        sandbox,
                        started: None,
                    })
                    .await;
                    Err(e)
                }
            },
            (made, _) => made,
        };
        let stamp = template.map(|t| (t.image, t.start));
        let unwanted = {
            let table = self.inner.table.lock();
            let mut pools = lock(&self.inner.pools);
            pools[i].filling.retain(|f| f != &id);
            let held: usize = pools.iter().map(crate::pool::Pool::held).sum();
            let count = table.held() + held;
            let pool = &mut pools[i];
            match made {
                // Made while creates filled the worker: no room.
                Ok(sandbox) if count >= self.inner.max_sandboxes as usize => {
                    Some(crate::pool::Member {
                        id,
                        sandbox,
                        started: stamp,
                    })
                }
                Ok(sandbox) => {
                    pool.last_refill = Some(started.elapsed());
                    pool.ready.push_back(crate::pool::Member {
                        id,
                        sandbox,
                        started: stamp,
                    });
                    self.inner
                        .metrics
                        .pool_refilled(&pool.template.to_string(), started.elapsed());
                    None
                }
                Err(e) => {
                    warn!(member = %id, error = %e, "could not make a pool member; trying again later");
                    return false;
                }
            }
        };
        if let Some(m) = unwanted {
            self.discard_member(m).await;
            return false;
        }
        true
    }

    pub(super) async fn make_member(&self, id: &SandboxId, spec: SandboxSpec) -> Result<Sandbox> {
        // A socket directory mounted from the start, empty: a claim that
        // asks for egress binds its proxy's socket there.
        let dir = self.egress_dir(id);
        let made = match crate::proxy::make_dir(&dir) {
            Ok(()) => self.inner.runtime.create(id, &spec, Some(&dir), &[]).await,
            Err(e) => Err(WorkerError::state(&dir, e)),
        };
        let container = match made {
            Ok(c) => c,
            Err(e) => {
                crate::proxy::remove(&dir);
                return Err(e);
            }
        };
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec,
            container.clone(),
            self.inner.clock.now_ms(),
            None,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            sandbox.close();
            let _ = self.inner.runtime.remove_container(&container).await;
            crate::proxy::remove(&dir);
            return Err(e);
        }
        Ok(sandbox)
    }

    /// Removes every pool member (a drain, a shutdown that removes all).
    pub(super) async fn empty_pools(&self) {
        let members: Vec<crate::pool::Member> = lock(&self.inner.pools)
            .iter_mut()
            .flat_map(|p| p.ready.drain(..).collect::<Vec<_>>())
            .collect();
        for m in members {
            self.discard_member(m).await;
        }
    }
}
