//! Creates: a sandbox made cold, or claimed from a warm pool; the
//! placement of a new slot; and the guard that undoes a create that fails.

use corral_proto::{SandboxId, SandboxInfo, SandboxSpec};
use tracing::{info, warn};

use super::table::{Lookup, Refused, Ticket};
use super::{BUSY_WAIT, Made, READY_TIMEOUT, Worker, lock, wait};
use crate::docker;
use crate::error::{Result, WorkerError};
use crate::sandbox::Sandbox;
use crate::state::StateDir;

impl Worker {
    /// Creates a sandbox, or returns the existing one with this id and spec.
    pub async fn create_sandbox(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
    ) -> Result<SandboxInfo> {
        self.create_sandbox_traced(id, spec, None).await
    }

    /// [`Self::create_sandbox`] under the W3C trace context
    /// `traceparent`: with `--otlp-endpoint`, a span of the create (made,
    /// claimed from a pool, or there already) is made there.
    pub async fn create_sandbox_traced(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
        traceparent: Option<String>,
    ) -> Result<SandboxInfo> {
        let started = std::time::Instant::now();
        let began = std::time::SystemTime::now();
        let made = self.create_from_template(id, spec).await;
        if let (Some(t), Some(parent)) = (&self.inner.traces, &traceparent) {
            let how = match &made {
                Ok((_, Made::Created)) => "created",
                Ok((_, Made::Claimed)) => "claimed",
                Ok((_, Made::Existing)) => "existing",
                Err(_) => "failed",
            };
            let sandbox = made.as_ref().ok().map(|(info, _)| info.id.to_string());
            t.sandbox_span(parent, "create", began, how, sandbox.as_deref());
        }
        let m = &self.inner.metrics;
        match &made {
            Ok((_, Made::Created | Made::Claimed)) => {
                m.sandbox_create("created");
                m.sandbox_create_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
            Ok((_, Made::Existing)) => {}
            Err(WorkerError::AtCapacity(_)) => m.sandbox_create("at_capacity"),
            Err(WorkerError::Draining) => m.sandbox_create("draining"),
            Err(
                WorkerError::Invalid(_) | WorkerError::Denied { .. } | WorkerError::Conflict { .. },
            ) => m.sandbox_create("refused"),
            Err(_) => m.sandbox_create("failed"),
        }
        made.map(|(info, _)| info)
    }

    /// [`Self::create_sandbox_inner`] of a spec that may name a template:
    /// its image, and a new sandbox started as it says and ready before it
    /// is answered (one that is not is removed).
    async fn create_from_template(
        &self,
        id: Option<SandboxId>,
        mut spec: SandboxSpec,
    ) -> Result<(SandboxInfo, Made)> {
        spec.validate()?;
        let template = self.resolve_template(&mut spec).await?;
        self.create_sandbox_inner(id, spec, None, template.as_ref())
            .await
    }

    /// A new sandbox of `template` started as it says and ready, before it
    /// is committed (its id stays busy meanwhile, and a create given up on
    /// removes it); an error says why not, and the caller undoes it.
    async fn ready_for(
        &self,
        sandbox: &Sandbox,
        template: Option<&crate::templates::Template>,
    ) -> Result<()> {
        let Some(t) = template.filter(|t| !t.start.is_empty() || t.seeded) else {
            return Ok(());
        };
        let mut closing = CloseOnDrop(Some(sandbox.clone()));
        let r = self.start_template(sandbox, t).await;
        closing.0 = None;
        if r.is_err() {
            // Why goes to the client: what the tenant's command said stays
            // out of the worker's log.
            warn!(sandbox = %sandbox.id, template = %t.name, "a template's sandbox was not ready; removed");
        }
        r
    }

    /// [`Self::create_sandbox`], and whether a new one was made;
    /// `forking_from` is the parent of a fork's child (kept in its record
    /// until the fork is done).
    pub(super) async fn create_sandbox_inner(
        &self,
        id: Option<SandboxId>,
        spec: SandboxSpec,
        forking_from: Option<&SandboxId>,
        template: Option<&crate::templates::Template>,
    ) -> Result<(SandboxInfo, Made)> {
        spec.validate()?;
        // A template's image is the worker's own choice (its build, or the
        // registry's under the template's name): the rest of the spec is
        // checked as for any image.
        let own_image = template.is_some_and(|t| spec.image.as_ref() == Some(&t.image));
        let checked = if own_image {
            std::borrow::Cow::Owned(SandboxSpec {
                image: None,
                ..spec.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(&spec)
        };
        crate::policy::check(
            &self.inner.policy,
            &checked,
            &self.inner.default_image,
            self.inner.default_runtime.as_deref(),
        )?;
        if self.inner.shutdown.is_cancelled() {
            return Err(WorkerError::ShuttingDown);
        }
        let id = id.unwrap_or_else(SandboxId::random);
        // What a template's pool member must have been started as.
        let started = template.map(|t| (t.image.clone(), t.start.clone()));
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        let (ticket, placed) = loop {
            // A sandbox of this id (a checkpointed one too) answers the
            // same create again, and refuses another.
            let there = match self.inner.table.lookup(&id) {
                Lookup::Running(sb) => Some(self.info_of(&sb)),
                Lookup::Checkpointed(info) => Some(*info),
                Lookup::Busy(b) => {
                    wait(&id, b, deadline).await?;
                    continue;
                }
                Lookup::Removed { .. } | Lookup::Unknown => None,
            };
            if let Some(info) = there {
                return if info.spec == spec {
                    Ok((info, Made::Existing))
                } else {
                    Err(WorkerError::Conflict {
                        what: "sandbox",
                        id: id.to_string(),
                    })
                };
            }
            if self.inner.drain.borrow().is_some() {
                return Err(WorkerError::Draining);
            }
            let mut placed = Placed::default();
            match self.inner.table.begin_making(&id, |held| {
                self.place(held, Some(&spec), started.as_ref(), &mut placed)
            }) {
                Ok(ticket) => break (ticket, placed),
                // Another create of the id got there first: answered as it
                // ends.
                Err(Refused::Found(Lookup::Busy(b))) => {
                    self.let_go(placed).await;
                    wait(&id, b, deadline).await?;
                }
                Err(Refused::Found(_)) => self.let_go(placed).await,
                Err(Refused::Full(e)) => {
                    self.let_go(placed).await;
                    return Err(e);
                }
            }
        };
        let mut guard = SlotGuard::new(self, ticket);
        let Placed {
            member, evicted, ..
        } = placed;
        self.let_go(Placed {
            evicted,
            ..Placed::default()
        })
        .await;
        // A warm member of a pool whose template this matches (a
        // template's member is started and ready already).
        let was_started = member.as_ref().is_some_and(|m| m.started.is_some());
        if let Some(member) = member
            && let Some(sandbox) = self.claim(&mut guard, member, &spec, forking_from).await?
        {
            let template = template.filter(|_| !was_started);
            if let Err(e) = self.ready_for(&sandbox, template).await {
                sandbox.close();
                guard.abandon().await;
                return Err(e);
            }
            let info = self.info_of(&sandbox);
            guard.commit(sandbox);
            return Ok((info, Made::Claimed));
        }
        // Its volumes: held (one writer at a time) while it has its slot,
        // and mounted on the host before its container binds them.
        let volumes =
            self.inner
                .volumes
                .hold(super::tenant_of(&spec).as_deref(), &id, &spec.volumes)?;
        guard.volumes = !volumes.is_empty();
        if let Err(e) = self.inner.volumes.mount(&volumes).await {
            guard.abandon().await;
            return Err(e.into());
        }
        let binds: Vec<crate::runtime::Bind> = volumes
            .iter()
            .map(|r| crate::runtime::Bind {
                source: r.host_path.clone(),
                target: r.mount.path.clone(),
                // A reader's source is the volume's read-only view: bound
                // as it is, it stays ro,nosuid,nodev (the engine's own
                // read-only bind would lose the other two).
                read_only: false,
            })
            .collect();
        let mut record = StateDir::new_record(&id, &spec);
        record.created_at_unix_ms = self.inner.clock.now_ms();
        record.forking_from = forking_from.map(ToString::to_string);
        self.inner.state.save(&record)?;
        guard.record = true;
        // Every sandbox has its socket directory mounted (the way in binds
        // its socket there when a port is exposed); the egress proxy's
        // socket is there before the container mounts it.
        let dir = self.egress_dir(&id);
        guard.egress_dir = Some(dir.clone());
        crate::proxy::make_dir(&dir).map_err(|e| WorkerError::state(&dir, e))?;
        let egress = self.egress_socket(&id, &spec)?;
        // Named before it exists: a create canceled while the engine makes
        // it removes it by that name.
        guard.container = Some(docker::container_name(self.id(), &id));
        guard.unsure = true;
        let made = self
            .inner
            .runtime
            .create(&id, &spec, Some(&dir), &binds)
            .await;
        // The engine answered: nothing more of it to wait for.
        guard.unsure = false;
        let container = match made {
            Ok(c) => c,
            // What it made of it (if anything, by name) goes before the
            // create answers.
            Err(e) => {
                guard.abandon().await;
                return Err(e);
            }
        };
        guard.container = Some(container.clone());
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec,
            container.clone(),
            record.created_at_unix_ms,
            egress,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            sandbox.close();
            guard.abandon().await;
            return Err(e);
        }
        info!(sandbox = %id, container = %container, "sandbox ready");
        // What it writes to is its user's before its first command.
        if volumes.iter().any(|r| !r.mount.read_only) {
            let given = match self.inner.runtime.process(&container).await {
                Ok(p) => self
                    .inner
                    .volumes
                    .give_to(&volumes, p.uid)
                    .await
                    .map_err(Into::into),
                Err(e) => Err(e),
            };
            if let Err(e) = given {
                sandbox.close();
                guard.abandon().await;
                return Err(e);
            }
        }
        if let Err(e) = self.ready_for(&sandbox, template).await {
            sandbox.close();
            guard.abandon().await;
            return Err(e);
        }
        let info = self.info_of(&sandbox);
        guard.commit(sandbox);
        Ok((info, Made::Created))
    }

    /// Whether a sandbox may take a slot when `held` are taken (called
    /// under the table's lock; takes the pools'). For a create of `spec`,
    /// a ready member of a pool whose template it matches is taken (its
    /// slot becomes the sandbox's); else, when the worker is full, a pool
    /// member gives up its slot; else `at_capacity`. What it took is in
    /// `placed`, to be dealt with once the locks are let go.
    pub(super) fn place(
        &self,
        held: usize,
        spec: Option<&SandboxSpec>,
        started: Option<&(String, corral_proto::template::TemplateStart)>,
        placed: &mut Placed,
    ) -> Result<()> {
        let mut pools = lock(&self.inner.pools);
        if let Some(pool) = spec.and_then(|spec| {
            pools
                .iter_mut()
                .find(|p| p.template.matches(spec, &self.inner.defaults))
        }) {
            while let Some(m) = pool.ready.pop_front() {
                if m.sandbox.is_lost() {
                    placed.dead.push(m);
                } else if m.started.is_some() && m.started.as_ref() != started {
                    // Started as another template than this create's
                    // (another tenant's of the name, another build).
                    pool.ready.push_front(m);
                    break;
                } else {
                    placed.member = Some(m);
                    break;
                }
            }
            match &placed.member {
                Some(_) => pool.claims += 1,
                None => pool.misses += 1,
            }
            pool.demand.ask(tokio::time::Instant::now());
            self.inner
                .metrics
                .pool_claimed(&pool.template.to_string(), placed.member.is_some());
            placed.woke = true;
            if placed.member.is_some() {
                return Ok(());
            }
        }
        // Members still being made do not count here: one that is done
        // when the worker has no room for it is removed.
        let members: usize = pools.iter().map(|p| p.ready.len()).sum();
        if held + members >= self.inner.max_sandboxes as usize {
            placed.evicted = pools.iter_mut().find_map(|p| p.ready.pop_front());
            if placed.evicted.is_none() {
                return Err(WorkerError::AtCapacity(self.inner.max_sandboxes));
            }
        }
        Ok(())
    }

    /// Lets go of what a placement took and does not use: members found
    /// dead or evicted are removed, a claimed one is given back to its
    /// pool's filler (which removes it: it was taken ready).
    pub(super) async fn let_go(&self, placed: Placed) {
        if placed.woke {
            self.inner.pool_wake.notify_one();
        }
        if let Some(m) = &placed.evicted {
            info!(member = %m.id, "a pool member gives its slot");
        }
        for m in placed
            .dead
            .into_iter()
            .chain(placed.evicted)
            .chain(placed.member)
        {
            self.discard_member(m).await;
        }
    }

    /// Pool member `member` made into the sandbox `guard` makes, with
    /// `spec` (`None`: it did not answer and is gone; the sandbox is made
    /// cold). Its container, started and answering, gets the sandbox's
    /// record and a new actor; its commands get the spec's environment
    /// from the worker.
    pub(super) async fn claim(
        &self,
        guard: &mut SlotGuard,
        member: crate::pool::Member,
        spec: &SandboxSpec,
        forking_from: Option<&SandboxId>,
    ) -> Result<Option<Sandbox>> {
        let id = guard.id().clone();
        let container = member.sandbox.container_id.clone();
        member.sandbox.close();
        guard.container = Some(container.clone());
        guard.member_dir = Some(self.egress_dir(&member.id));
        let mut record = StateDir::new_record(&id, spec);
        record.created_at_unix_ms = self.inner.clock.now_ms();
        record.container_id = Some(container.clone());
        record.forking_from = forking_from.map(ToString::to_string);
        self.inner.state.save(&record)?;
        guard.record = true;
        // The member's socket directory, mounted when it was made, is the
        // sandbox's under its id too (a link: the container's mount names
        // the member's, which must stay for the engine to start it again
        // from a checkpoint), and its proxy's socket is bound there if the
        // spec has egress; the sandbox's actor then has the supervisor
        // serve it.
        let dir = self.egress_dir(&id);
        crate::proxy::remove(&dir);
        guard.egress_dir = Some(dir.clone());
        crate::proxy::link_dir(&dir, &member.id).map_err(|e| WorkerError::state(&dir, e))?;
        let egress = self.egress_socket(&id, spec)?;
        let sandbox = Sandbox::spawn(
            id.clone(),
            spec.clone(),
            container.clone(),
            record.created_at_unix_ms,
            egress,
            &self.env(),
        );
        if let Err(e) = sandbox.wait_ready(READY_TIMEOUT).await {
            warn!(sandbox = %id, member = %member.id, error = %e, "a claimed member did not answer; made cold instead");
            sandbox.close();
            guard.undo().await;
            return Ok(None);
        }
        info!(sandbox = %id, member = %member.id, container = %container, "sandbox ready, from a pool");
        Ok(Some(sandbox))
    }
}

/// Closes a sandbox being made when the create that makes it is given up
/// on (its future dropped), so its actor ends with it; the create's
/// [`SlotGuard`] removes the rest. Forgotten once the create goes on.
struct CloseOnDrop(Option<Sandbox>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            s.close();
        }
    }
}

/// What a placement took from the pools (see [`Worker::place`]).
#[derive(Default)]
pub(super) struct Placed {
    /// A ready member to claim.
    member: Option<crate::pool::Member>,
    /// A member that gave its slot up.
    evicted: Option<crate::pool::Member>,
    /// Members found lost.
    dead: Vec<crate::pool::Member>,
    /// A pool was asked: its filler looks again.
    woke: bool,
}

/// A sandbox being made, and what it has so far: its state record, its
/// egress socket directory, its container. [`SlotGuard::commit`] makes it
/// a running sandbox; a guard dropped without that undoes all of it once
/// (a canceled create too: the worker's own task then removes the
/// container, and the id stays held until it has).
pub(super) struct SlotGuard {
    worker: Worker,
    ticket: Option<Ticket>,
    id: SandboxId,
    /// Its record is written.
    pub(super) record: bool,
    /// Its socket directory (made, or to be made).
    pub(super) egress_dir: Option<std::path::PathBuf>,
    /// The pool member's socket directory its container mounts.
    pub(super) member_dir: Option<std::path::PathBuf>,
    /// Its container (its id, or its name while the engine makes it).
    pub(super) container: Option<String>,
    /// The container was asked for and not yet answered: the engine may
    /// still make it after a first removal finds none.
    pub(super) unsure: bool,
    /// It holds volumes (let go once its container is gone).
    pub(super) volumes: bool,
}

impl SlotGuard {
    pub(super) fn new(worker: &Worker, ticket: Ticket) -> Self {
        Self {
            worker: worker.clone(),
            id: ticket.id().clone(),
            ticket: Some(ticket),
            record: false,
            egress_dir: None,
            member_dir: None,
            container: None,
            unsure: false,
            volumes: false,
        }
    }

    pub(super) fn id(&self) -> &SandboxId {
        &self.id
    }

    /// The sandbox runs: it is among the worker's, and what it has is its.
    pub(super) fn commit(mut self, sandbox: Sandbox) {
        self.record = false;
        self.egress_dir = None;
        self.member_dir = None;
        self.container = None;
        self.volumes = false;
        if let Some(ticket) = self.ticket.take() {
            self.worker.inner.table.commit_running(ticket, sandbox);
        }
    }

    /// Undoes what it has so far, keeping the slot (to make it again).
    pub(super) async fn undo(&mut self) {
        let undo = self.take_undo();
        undo.run(&self.worker).await;
    }

    /// Undoes what it has and gives the slot up, before a failed create
    /// answers.
    pub(super) async fn abandon(mut self) {
        self.undo().await;
        if let Some(ticket) = self.ticket.take() {
            self.worker.inner.table.release(ticket);
        }
    }

    fn take_undo(&mut self) -> Undo {
        Undo {
            id: self.id.clone(),
            record: std::mem::take(&mut self.record),
            egress_dir: self.egress_dir.take(),
            member_dir: self.member_dir.take(),
            container: self.container.take(),
            unsure: std::mem::take(&mut self.unsure),
            volumes: std::mem::take(&mut self.volumes),
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let undo = self.take_undo();
        if undo.container.is_none() {
            undo.run_now(&self.worker, true);
            self.worker.inner.table.release(ticket);
            return;
        }
        // A container to remove: the worker's task does it, holding the
        // slot until it is gone (a new sandbox of the id would take its
        // container's name).
        let worker = self.worker.clone();
        self.worker.inner.tracker.spawn(async move {
            undo.run(&worker).await;
            worker.inner.table.release(ticket);
        });
    }
}

/// What a sandbox being made had, to be undone.
struct Undo {
    id: SandboxId,
    record: bool,
    egress_dir: Option<std::path::PathBuf>,
    member_dir: Option<std::path::PathBuf>,
    container: Option<String>,
    unsure: bool,
    volumes: bool,
}

/// How long after a first removal a container the engine was still making
/// is looked for again.
const UNSURE_AGAIN: std::time::Duration = std::time::Duration::from_secs(2);

impl Undo {
    /// The container first: a worker that dies between finds a record
    /// without a container (dropped at its start), never a container
    /// without a record that is not an orphan.
    pub(super) async fn run(self, worker: &Worker) {
        if let Some(c) = &self.container {
            let mut removed = worker.inner.runtime.remove_container(c).await;
            if self.unsure && removed.is_ok() {
                tokio::time::sleep(UNSURE_AGAIN).await;
                removed = worker.inner.runtime.remove_container(c).await;
            }
            if let Err(e) = removed {
                warn!(sandbox = %self.id, container = %c, error = %e, "could not remove a failed create's container (the sweep will)");
                // Its volumes stay held until the sweep removes it.
                self.run_now(worker, false);
                return;
            }
        }
        self.run_now(worker, true);
    }

    pub(super) fn run_now(&self, worker: &Worker, container_gone: bool) {
        if self.volumes && container_gone {
            worker.inner.volumes.release(&self.id);
        }
        if self.record
            && let Err(e) = worker.inner.state.remove(&self.id)
        {
            warn!(sandbox = %self.id, error = %e, "could not remove a failed create's record");
        }
        for dir in self.egress_dir.iter().chain(&self.member_dir) {
            crate::proxy::remove(dir);
        }
    }
}
