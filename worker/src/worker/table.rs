//! The worker's sandboxes by id: one lock over one map of slots, each
//! sandbox in one state of its life ([`State`]), with at most one change
//! under way ([`Change`]). A sandbox in transition is never unknown: a
//! lookup of one being made or restored answers [`Lookup::Busy`], which a
//! caller waits on (or passes on as a typed `busy`), never NOT_FOUND.
//!
//! A change is held by a [`Ticket`]; its end (commit, release, or the
//! ticket dropped because the future holding it was canceled) wakes the
//! callers waiting on it. A ticket dropped without a word ends its change
//! as a release would: the table notices the closed channel at the next
//! look, so no slot stays busy, or counted, for a task that is gone.
//!
//! The table is generic over what a running slot holds (the worker's
//! `Sandbox`, a plain value in the tests) so that each transition is
//! tested on its own, without an engine.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use corral_proto::{SandboxId, SandboxInfo};
use tokio::sync::watch;

/// What a running slot holds.
pub(crate) trait Occupant: Clone {
    /// Whether it holds a slot of capacity (a lost sandbox does not).
    fn holds_slot(&self) -> bool;
    /// The tenant it was made for.
    fn owner(&self) -> Option<String>;
}

/// A change of one sandbox's life under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Being made: created, claimed from a pool, or a fork's child.
    Making,
    /// Being started from its checkpoint.
    Restoring,
    /// Being checkpointed.
    Checkpointing,
    /// Frozen for a fork's copy.
    Forking,
    /// Getting a new egress policy.
    Egress,
    /// Being removed.
    Removing,
}

impl Change {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Change::Making => "being made",
            Change::Restoring => "being restored",
            Change::Checkpointing => "being checkpointed",
            Change::Forking => "being forked",
            Change::Egress => "getting a new egress policy",
            Change::Removing => "being removed",
        }
    }
}

/// Where a sandbox is in its life.
#[derive(Clone)]
pub(crate) enum State<S> {
    /// Not there yet (a [`Change::Making`] is under way): holds a slot.
    Making,
    /// Running (or lost, as its occupant says).
    Running(S),
    /// Saved on the engine, its container stopped: holds no slot.
    Checkpointed(Box<SandboxInfo>),
    /// Being started from its checkpoint (a [`Change::Restoring`] is under
    /// way): holds a slot.
    Restoring(Box<SandboxInfo>),
    /// Removed, its container going (a [`Change::Removing`] is under way):
    /// looked up as removed, while a new sandbox of its id waits.
    Removing,
}

struct Entry<S> {
    state: State<S>,
    change: Option<Busy>,
}

impl<S> Entry<S> {
    /// The change under way, if its holder is still there.
    fn busy(&self) -> Option<&Busy> {
        self.change.as_ref().filter(|b| !b.ended())
    }
}

/// A change under way, to wait on.
#[derive(Clone)]
pub(crate) struct Busy {
    pub(crate) change: Change,
    done: watch::Receiver<()>,
}

impl Busy {
    fn ended(&self) -> bool {
        self.done.has_changed().is_err()
    }

    /// Returns when the change has ended (committed, released, or its
    /// holder gone).
    pub(crate) async fn ended_now(mut self) {
        // Nothing is ever sent: this returns when the sender is dropped.
        while self.done.changed().await.is_ok() {}
    }
}

/// The hold on one sandbox's change: given back to the table by
/// [`Table::commit_running`], [`Table::commit_checkpointed`],
/// [`Table::release`] or [`Table::remove`], or dropped (a release).
#[must_use = "a ticket dropped ends its change at once"]
pub(crate) struct Ticket {
    id: SandboxId,
    _done: watch::Sender<()>,
}

impl Ticket {
    fn new(id: &SandboxId, change: Change) -> (Self, Busy) {
        let (tx, rx) = watch::channel(());
        (
            Self {
                id: id.clone(),
                _done: tx,
            },
            Busy { change, done: rx },
        )
    }

    pub(crate) fn id(&self) -> &SandboxId {
        &self.id
    }
}

/// What a lookup finds.
pub(crate) enum Lookup<S> {
    Running(S),
    Checkpointed(Box<SandboxInfo>),
    /// Being made or restored: wait for it, then look again.
    Busy(Busy),
    /// Removed lately, and why.
    Removed {
        why: &'static str,
    },
    Unknown,
}

/// Why a change could not begin.
pub(crate) enum Refused<S, E> {
    /// The id is taken (a create of it answers with what is there), or
    /// not there to change.
    Found(Lookup<S>),
    /// The capacity check refused.
    Full(E),
}

/// The reasons of the last [`Removed::KEPT`] removals.
#[derive(Default)]
struct Removed {
    why: HashMap<SandboxId, (&'static str, Option<String>)>,
    order: VecDeque<SandboxId>,
}

impl Removed {
    const KEPT: usize = 4096;

    fn note(&mut self, id: SandboxId, why: &'static str, owner: Option<String>) {
        if self.why.insert(id.clone(), (why, owner)).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > Self::KEPT {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }
}

/// The slots, as one lock holds them.
pub(crate) struct Map<S> {
    slots: HashMap<SandboxId, Entry<S>>,
    removed: Removed,
}

impl<S: Occupant> Map<S> {
    /// Slots of capacity taken: sandboxes being made or restored, and
    /// running ones that are not lost.
    pub(crate) fn held(&self) -> usize {
        self.slots
            .values()
            .filter(|e| match &e.state {
                State::Making | State::Restoring(_) => e.busy().is_some(),
                State::Running(s) => s.holds_slot(),
                State::Checkpointed(_) | State::Removing => false,
            })
            .count()
    }

    /// The running sandboxes (lost ones among them).
    pub(crate) fn running(&self) -> impl Iterator<Item = (&SandboxId, &S)> {
        self.slots.iter().filter_map(|(id, e)| match &e.state {
            State::Running(s) => Some((id, s)),
            _ => None,
        })
    }

    /// The checkpointed sandboxes, and those being restored (until they
    /// run, they are as they were saved).
    pub(crate) fn checkpointed(&self) -> impl Iterator<Item = (&SandboxId, &SandboxInfo)> {
        self.slots.iter().filter_map(|(id, e)| match &e.state {
            State::Checkpointed(info) | State::Restoring(info) => Some((id, &**info)),
            _ => None,
        })
    }

    /// Every id with a slot.
    pub(crate) fn ids(&self) -> Vec<SandboxId> {
        self.slots.keys().cloned().collect()
    }

    fn lookup(&mut self, id: &SandboxId) -> Lookup<S> {
        self.tidy(id);
        let removed = || match self.removed.why.get(id) {
            Some((why, _)) => Lookup::Removed { why },
            None => Lookup::Unknown,
        };
        match self.slots.get(id) {
            Some(e) => match (&e.state, e.busy()) {
                (State::Making | State::Restoring(_), Some(b)) => Lookup::Busy(b.clone()),
                (State::Running(s), _) => Lookup::Running(s.clone()),
                (State::Checkpointed(info), _) => Lookup::Checkpointed(info.clone()),
                (State::Removing, _) => removed(),
                // Tidied above.
                (State::Making | State::Restoring(_), None) => Lookup::Unknown,
            },
            None => removed(),
        }
    }

    /// Ends a change whose holder is gone: a sandbox never made is no
    /// slot; one whose restore was given up is checkpointed still.
    fn tidy(&mut self, id: &SandboxId) {
        let Some(e) = self.slots.get_mut(id) else {
            return;
        };
        if e.change.as_ref().is_none_or(|b| !b.ended()) {
            return;
        }
        e.change = None;
        match &e.state {
            State::Making | State::Removing => {
                self.slots.remove(id);
            }
            State::Restoring(info) => e.state = State::Checkpointed(info.clone()),
            State::Running(_) | State::Checkpointed(_) => {}
        }
    }
}

/// The worker's sandboxes by id.
pub(crate) struct Table<S> {
    map: Mutex<Map<S>>,
}

impl<S: Occupant> Default for Table<S> {
    fn default() -> Self {
        Self {
            map: Mutex::new(Map {
                slots: HashMap::new(),
                removed: Removed::default(),
            }),
        }
    }
}

impl<S: Occupant> Table<S> {
    /// The slots, for a look at many at once (the lock is held: keep it
    /// short, never across an await). Taken before the pools' lock when
    /// both are.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Map<S>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lookup(&self, id: &SandboxId) -> Lookup<S> {
        self.lock().lookup(id)
    }

    /// Sandbox `id` as it was saved, while it is being restored.
    pub(crate) fn restoring(&self, id: &SandboxId) -> Option<SandboxInfo> {
        match self.lock().slots.get(id).map(|e| &e.state) {
            Some(State::Restoring(info)) => Some((**info).clone()),
            _ => None,
        }
    }

    /// Whose sandbox `id` is, if it is here or was removed lately
    /// (`Some(None)`: made for no tenant).
    pub(crate) fn owner(&self, id: &SandboxId) -> Option<Option<String>> {
        let map = self.lock();
        match map.slots.get(id).map(|e| &e.state) {
            Some(State::Running(s)) => Some(s.owner()),
            Some(State::Checkpointed(info) | State::Restoring(info)) => Some(
                info.spec
                    .labels
                    .get(corral_proto::sandbox::TENANT_LABEL)
                    .cloned(),
            ),
            // Not made yet: nobody's to answer for.
            Some(State::Making) => None,
            Some(State::Removing) | None => map.removed.why.get(id).map(|(_, owner)| owner.clone()),
        }
    }

    /// Begins making sandbox `id` if the id is free and `room` (given the
    /// slots taken now, under the table's lock) allows one more.
    pub(crate) fn begin_making<E>(
        &self,
        id: &SandboxId,
        room: impl FnOnce(usize) -> Result<(), E>,
    ) -> Result<Ticket, Refused<S, E>> {
        let mut map = self.lock();
        match map.lookup(id) {
            Lookup::Unknown | Lookup::Removed { .. } => {}
            found => return Err(Refused::Found(found)),
        }
        // Its container still going: made once it is gone.
        if let Some(b) = map.slots.get(id).and_then(Entry::busy) {
            return Err(Refused::Found(Lookup::Busy(b.clone())));
        }
        room(map.held()).map_err(Refused::Full)?;
        let (ticket, busy) = Ticket::new(id, Change::Making);
        map.slots.insert(
            id.clone(),
            Entry {
                state: State::Making,
                change: Some(busy),
            },
        );
        Ok(ticket)
    }

    /// Begins `change` on sandbox `id`, running or checkpointed, if no
    /// other change is under way (else what to wait on, in
    /// [`Lookup::Busy`]).
    pub(crate) fn hold(&self, id: &SandboxId, change: Change) -> Result<Ticket, Lookup<S>> {
        let mut map = self.lock();
        map.tidy(id);
        let Some(e) = map.slots.get_mut(id) else {
            return Err(map.lookup(id));
        };
        if let Some(b) = e.busy() {
            return Err(Lookup::Busy(b.clone()));
        }
        if matches!(e.state, State::Removing) {
            return Err(map.lookup(id));
        }
        let (ticket, busy) = Ticket::new(id, change);
        e.change = Some(busy);
        Ok(ticket)
    }

    /// A checkpointed sandbox held by `ticket` becomes one being restored,
    /// if `room` allows one more slot.
    pub(crate) fn begin_restoring<E>(
        &self,
        ticket: &Ticket,
        room: impl FnOnce(usize) -> Result<(), E>,
    ) -> Result<Box<SandboxInfo>, Refused<S, E>> {
        let mut map = self.lock();
        let held = map.held();
        let Some(e) = map.slots.get_mut(&ticket.id) else {
            return Err(Refused::Found(Lookup::Unknown));
        };
        let State::Checkpointed(info) = &e.state else {
            let found = map.lookup(&ticket.id);
            return Err(Refused::Found(found));
        };
        let info = info.clone();
        room(held).map_err(Refused::Full)?;
        e.state = State::Restoring(info.clone());
        if let Some(b) = &mut e.change {
            b.change = Change::Restoring;
        }
        Ok(info)
    }

    /// The change of `ticket` ends with its sandbox running as `s`.
    pub(crate) fn commit_running(&self, ticket: Ticket, s: S) {
        self.settle(ticket, State::Running(s));
    }

    /// The change of `ticket` ends with its sandbox checkpointed as `info`.
    pub(crate) fn commit_checkpointed(&self, ticket: Ticket, info: Box<SandboxInfo>) {
        self.settle(ticket, State::Checkpointed(info));
    }

    /// A sandbox whose state changes while the change goes on (a
    /// checkpoint sets it apart before its container stops): still held.
    pub(crate) fn set_state(&self, ticket: &Ticket, state: State<S>) {
        if let Some(e) = self.lock().slots.get_mut(&ticket.id) {
            e.state = state;
        }
    }

    fn settle(&self, ticket: Ticket, state: State<S>) {
        let mut map = self.lock();
        map.slots.insert(
            ticket.id.clone(),
            Entry {
                state,
                change: None,
            },
        );
        drop(map);
        drop(ticket);
    }

    /// The change of `ticket` ends with nothing changed: a sandbox being
    /// made is no slot, one being restored is checkpointed still.
    pub(crate) fn release(&self, ticket: Ticket) {
        let mut map = self.lock();
        if let Some(e) = map.slots.get_mut(&ticket.id) {
            e.change = None;
            match &e.state {
                State::Making | State::Removing => {
                    map.slots.remove(&ticket.id);
                }
                State::Restoring(info) => e.state = State::Checkpointed(info.clone()),
                State::Running(_) | State::Checkpointed(_) => {}
            }
        }
        drop(map);
        drop(ticket);
    }

    /// The sandbox of `ticket` is removed: from now on lookups answer
    /// [`Lookup::Removed`] with `why`, and a new sandbox of its id waits
    /// until [`Table::release`] of the ticket (its container gone). What
    /// it was, to be let go of.
    pub(crate) fn remove(&self, ticket: &Ticket, why: &'static str) -> Option<State<S>> {
        let mut map = self.lock();
        let e = map.slots.get_mut(&ticket.id)?;
        let was = std::mem::replace(&mut e.state, State::Removing);
        let owner = match &was {
            State::Running(s) => s.owner(),
            State::Checkpointed(info) | State::Restoring(info) => info
                .spec
                .labels
                .get(corral_proto::sandbox::TENANT_LABEL)
                .cloned(),
            State::Making | State::Removing => None,
        };
        map.removed.note(ticket.id.clone(), why, owner);
        Some(was)
    }

    /// A sandbox found at start (re-adopted running, or checkpointed),
    /// with no change under way.
    pub(crate) fn adopt(&self, id: SandboxId, state: State<S>) {
        self.lock().slots.insert(
            id,
            Entry {
                state,
                change: None,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A running sandbox in the tests: its name, and whether it is lost.
    #[derive(Clone, Debug, PartialEq)]
    struct Fake(&'static str, bool);

    impl Occupant for Fake {
        fn holds_slot(&self) -> bool {
            !self.1
        }
        fn owner(&self) -> Option<String> {
            Some(format!("owner-of-{}", self.0))
        }
    }

    fn id(s: &str) -> SandboxId {
        SandboxId::new(s.to_string()).unwrap()
    }

    fn info(s: &str) -> Box<SandboxInfo> {
        let mut spec = corral_proto::SandboxSpec::default();
        spec.labels
            .insert(corral_proto::sandbox::TENANT_LABEL.into(), "acme".into());
        Box::new(SandboxInfo {
            id: id(s),
            spec,
            state: corral_proto::SandboxState::Checkpointed,
            container_id: format!("c-{s}"),
            last_seq: 0,
            running_operations: 0,
            created_at_unix_ms: 0,
            last_used_unix_ms: 0,
            worker_id: "w".into(),
            image: "i".into(),
            limits: corral_proto::Limits::default(),
        })
    }

    fn room(max: usize) -> impl FnOnce(usize) -> Result<(), usize> {
        move |held| if held < max { Ok(()) } else { Err(held) }
    }

    fn is_busy(l: &Lookup<Fake>, change: Change) -> bool {
        matches!(l, Lookup::Busy(b) if b.change == change)
    }

    #[test]
    fn a_sandbox_being_made_is_busy_never_unknown_then_runs() {
        let t = Table::<Fake>::default();
        let ticket = t.begin_making(&id("a"), room(4)).ok().unwrap();
        assert!(is_busy(&t.lookup(&id("a")), Change::Making));
        assert_eq!(t.lock().held(), 1);
        // A second create of the id finds it busy, not free.
        assert!(matches!(
            t.begin_making(&id("a"), room(4)),
            Err(Refused::Found(Lookup::Busy(_)))
        ));
        t.commit_running(ticket, Fake("a", false));
        assert!(matches!(
            t.lookup(&id("a")),
            Lookup::Running(Fake("a", false))
        ));
        assert_eq!(t.lock().held(), 1);
    }

    #[test]
    fn a_make_given_up_or_abandoned_leaves_no_slot() {
        let t = Table::<Fake>::default();
        let ticket = t.begin_making(&id("a"), room(4)).ok().unwrap();
        t.release(ticket);
        assert!(matches!(t.lookup(&id("a")), Lookup::Unknown));
        assert_eq!(t.lock().held(), 0);
        // A future canceled mid-create drops its ticket: the same.
        let ticket = t.begin_making(&id("b"), room(4)).ok().unwrap();
        drop(ticket);
        assert_eq!(t.lock().held(), 0);
        assert!(matches!(t.lookup(&id("b")), Lookup::Unknown));
        assert!(t.begin_making(&id("b"), room(4)).is_ok());
    }

    #[test]
    fn capacity_counts_what_is_made_restored_and_running_but_not_lost_or_checkpointed() {
        let t = Table::<Fake>::default();
        t.adopt(id("run"), State::Running(Fake("run", false)));
        t.adopt(id("lost"), State::Running(Fake("lost", true)));
        t.adopt(id("saved"), State::Checkpointed(info("saved")));
        let _making = t.begin_making(&id("new"), room(4)).ok().unwrap();
        assert_eq!(t.lock().held(), 2);
        let hold = t.hold(&id("saved"), Change::Restoring).ok().unwrap();
        assert!(t.begin_restoring(&hold, room(4)).is_ok());
        assert_eq!(t.lock().held(), 3);
        // Full: a new make is refused with the count it saw.
        assert!(matches!(
            t.begin_making(&id("more"), room(3)),
            Err(Refused::Full(3))
        ));
    }

    #[test]
    fn a_checkpoint_sets_it_apart_and_a_failed_one_runs_again() {
        let t = Table::<Fake>::default();
        t.adopt(id("a"), State::Running(Fake("a", false)));
        let ticket = t.hold(&id("a"), Change::Checkpointing).ok().unwrap();
        // Another change waits; reads go on.
        assert!(matches!(
            t.hold(&id("a"), Change::Removing),
            Err(Lookup::Busy(b)) if b.change == Change::Checkpointing
        ));
        t.set_state(&ticket, State::Checkpointed(info("a")));
        assert!(matches!(t.lookup(&id("a")), Lookup::Checkpointed(_)));
        assert_eq!(t.lock().held(), 0);
        // The engine failed: it runs again, as it was.
        t.commit_running(ticket, Fake("a", false));
        assert!(matches!(t.lookup(&id("a")), Lookup::Running(_)));
        let ticket = t.hold(&id("a"), Change::Checkpointing).ok().unwrap();
        t.commit_checkpointed(ticket, info("a"));
        assert!(matches!(t.lookup(&id("a")), Lookup::Checkpointed(_)));
        assert!(t.hold(&id("a"), Change::Removing).is_ok());
    }

    #[test]
    fn a_restore_is_busy_until_it_runs_and_a_failed_one_stays_checkpointed() {
        let t = Table::<Fake>::default();
        t.adopt(id("a"), State::Checkpointed(info("a")));
        let ticket = t.hold(&id("a"), Change::Restoring).ok().unwrap();
        // Full: refused, and it stays checkpointed.
        assert!(matches!(
            t.begin_restoring(&ticket, room(0)),
            Err(Refused::Full(0))
        ));
        assert!(t.begin_restoring(&ticket, room(1)).is_ok());
        assert!(is_busy(&t.lookup(&id("a")), Change::Restoring));
        // Listed as it was saved meanwhile.
        assert_eq!(t.lock().checkpointed().count(), 1);
        t.release(ticket);
        assert!(matches!(t.lookup(&id("a")), Lookup::Checkpointed(_)));
        let ticket = t.hold(&id("a"), Change::Restoring).ok().unwrap();
        assert!(t.begin_restoring(&ticket, room(1)).is_ok());
        drop(ticket);
        assert!(matches!(t.lookup(&id("a")), Lookup::Checkpointed(_)));
        let ticket = t.hold(&id("a"), Change::Restoring).ok().unwrap();
        assert!(t.begin_restoring(&ticket, room(1)).is_ok());
        t.commit_running(ticket, Fake("a", false));
        assert!(matches!(t.lookup(&id("a")), Lookup::Running(_)));
        assert_eq!(t.lock().checkpointed().count(), 0);
    }

    #[test]
    fn a_removed_sandbox_says_why_and_whose_it_was() {
        let t = Table::<Fake>::default();
        t.adopt(id("a"), State::Running(Fake("a", false)));
        t.adopt(id("b"), State::Checkpointed(info("b")));
        let ticket = t.hold(&id("a"), Change::Removing).ok().unwrap();
        assert!(matches!(
            t.remove(&ticket, "a client removed it"),
            Some(State::Running(_))
        ));
        assert!(matches!(
            t.lookup(&id("a")),
            Lookup::Removed {
                why: "a client removed it"
            }
        ));
        assert_eq!(t.owner(&id("a")), Some(Some("owner-of-a".into())));
        // Its container still going: a new one of its id waits, and
        // nothing else may change it.
        assert!(matches!(
            t.begin_making(&id("a"), room(4)),
            Err(Refused::Found(Lookup::Busy(b))) if b.change == Change::Removing
        ));
        assert!(matches!(
            t.hold(&id("a"), Change::Egress),
            Err(Lookup::Busy(_))
        ));
        t.release(ticket);
        let ticket = t.hold(&id("b"), Change::Removing).ok().unwrap();
        t.remove(&ticket, "it lived past its lifetime");
        drop(ticket);
        assert_eq!(t.owner(&id("b")), Some(Some("acme".into())));
        assert_eq!(t.owner(&id("c")), None);
        // Nothing to hold.
        assert!(matches!(
            t.hold(&id("a"), Change::Removing),
            Err(Lookup::Removed { .. })
        ));
        // The id is free again.
        assert!(t.begin_making(&id("a"), room(1)).is_ok());
    }

    #[test]
    fn removals_are_remembered_up_to_a_bound() {
        let t = Table::<Fake>::default();
        for i in 0..(Removed::KEPT + 10) {
            let name = format!("s{i}");
            t.adopt(id(&name), State::Running(Fake("x", false)));
            let ticket = t.hold(&id(&name), Change::Removing).ok().unwrap();
            t.remove(&ticket, "gone");
            t.release(ticket);
        }
        assert!(matches!(t.lookup(&id("s0")), Lookup::Unknown));
        assert!(matches!(
            t.lookup(&id(&format!("s{}", Removed::KEPT + 9))),
            Lookup::Removed { .. }
        ));
        assert_eq!(t.lock().removed.order.len(), Removed::KEPT);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_wake_when_a_change_ends_however_it_ends() {
        let t = std::sync::Arc::new(Table::<Fake>::default());
        let ticket = t.begin_making(&id("a"), room(4)).ok().unwrap();
        let Lookup::Busy(busy) = t.lookup(&id("a")) else {
            panic!("not busy");
        };
        let waiter = tokio::spawn(busy.ended_now());
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiter.is_finished());
        t.commit_running(ticket, Fake("a", false));
        waiter.await.unwrap();

        let ticket = t.hold(&id("a"), Change::Forking).ok().unwrap();
        let Err(Lookup::Busy(busy)) = t.hold(&id("a"), Change::Removing) else {
            panic!("not busy");
        };
        let waiter = tokio::spawn(busy.ended_now());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        // Its holder goes away without a word.
        drop(ticket);
        waiter.await.unwrap();
        assert!(t.hold(&id("a"), Change::Removing).is_ok());
    }
}
