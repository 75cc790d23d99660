//! The operation manager: one actor per sandbox.
//!
//! `add` is idempotent by id and runs an operation at most once: the worker
//! refuses to run an id twice, even across restarts of this process, so a
//! resumed session that adds an operation again re-attaches to it (or gets
//! its result) instead of running it again. `cancel` is idempotent and a
//! no-op for unknown or finished operations. Every change is published as a
//! full snapshot on the updates channel; output of a running operation is
//! published at most every [`PROGRESS_INTERVAL`].

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use corral_proto::init::OperationRecord;
use corral_proto::{EventKind, OperationId, SandboxId};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::operation::{OpStatus, Operation};
use crate::client::WorkerClient;
use crate::follow::{self, FollowError, Follower};
use crate::worker_api::{ApiError, WorkerApi};

/// Least time between two progress snapshots of one operation.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);
/// Updates waiting for the consumer; past it the manager waits too.
const UPDATES_CAPACITY: usize = 1024;
/// Egress decisions kept for a listener that is behind.
const EGRESS_CAPACITY: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManagerError {
    #[error("the operation manager has stopped")]
    Stopped,
}

/// Runs operations and reports on them. See the module docs.
pub trait OperationManager: Send + Sync {
    /// Starts `op` (its status is ignored: it starts `ready`). At most once
    /// per id: later adds of a known id are ignored.
    fn add(&self, op: Operation) -> impl Future<Output = Result<(), ManagerError>> + Send;
    /// Asks a running operation to stop. Unknown or finished: nothing happens.
    fn cancel(
        &self,
        id: &OperationId,
        reason: &str,
    ) -> impl Future<Output = Result<(), ManagerError>> + Send;
}

enum Command {
    Add(Box<Operation>, oneshot::Sender<()>),
    Cancel(OperationId, String, oneshot::Sender<()>),
}

/// A manager over any [`WorkerApi`]; see [`LocalManager`] and [`RemoteManager`].
pub struct Manager<W: WorkerApi> {
    tx: mpsc::Sender<Command>,
    lost: tokio::sync::watch::Receiver<Option<String>>,
    egress: tokio::sync::broadcast::Sender<corral_proto::event::Egress>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _worker: std::marker::PhantomData<fn() -> W>,
}

/// Runs operations through the worker library in this process.
#[cfg(feature = "local")]
pub type LocalManager = Manager<corral_worker::Worker>;
/// Runs operations on a worker over gRPC, following its events from a
/// cursor across lost connections and worker restarts.
pub type RemoteManager = Manager<WorkerClient>;

impl<W: WorkerApi> Manager<W> {
    /// Starts the manager of one sandbox. Snapshots arrive on the returned
    /// channel, which the caller must keep draining.
    pub fn start(worker: W, sandbox: SandboxId) -> (Self, mpsc::Receiver<Operation>) {
        Self::start_with(worker, sandbox, follow::DEFAULT_PATIENCE)
    }

    /// [`Self::start`], taking the sandbox for lost once its worker has
    /// been unreachable for `patience`.
    pub fn start_with(
        worker: W,
        sandbox: SandboxId,
        patience: Duration,
    ) -> (Self, mpsc::Receiver<Operation>) {
        Self::start_traced(worker, sandbox, patience, None)
    }

    /// [`Self::start_with`], each operation submitted with the trace
    /// context `contexts` has for it (see [`crate::telemetry`]).
    pub fn start_traced(
        worker: W,
        sandbox: SandboxId,
        patience: Duration,
        contexts: Option<crate::telemetry::TraceContexts>,
    ) -> (Self, mpsc::Receiver<Operation>) {
        let (tx, rx) = mpsc::channel(64);
        let (lost_tx, lost) = tokio::sync::watch::channel(None);
        // The newest decisions, for whoever listens (a slow listener
        // misses the oldest; the worker's metrics count them all).
        let (egress, _) = tokio::sync::broadcast::channel(EGRESS_CAPACITY);
        let (updates, updates_rx) = mpsc::channel(UPDATES_CAPACITY);
        let stop = CancellationToken::new();
        let actor = Actor {
            worker,
            sandbox: sandbox.clone(),
            rx,
            updates,
            stop: stop.clone(),
            seen: HashSet::new(),
            ops: HashMap::new(),
            dirty: HashMap::new(),
            follower: None,
            patience,
            lost: lost_tx,
            egress: egress.clone(),
            submits: tokio::task::JoinSet::new(),
            cancel_after_submit: HashSet::new(),
            cancels: tokio::task::JoinSet::new(),
            contexts,
        };
        let task = tokio::spawn(
            actor
                .run()
                .instrument(info_span!("operations", sandbox = %sandbox)),
        );
        (
            Self {
                tx,
                lost,
                egress,
                stop,
                task,
                _worker: std::marker::PhantomData,
            },
            updates_rx,
        )
    }

    /// Why the sandbox is lost, once it is (its worker unreachable past the
    /// patience, or the worker says so); `None` until then.
    pub fn lost(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.lost.clone()
    }

    /// The sandbox's egress decisions from now on.
    pub fn egress(&self) -> tokio::sync::broadcast::Receiver<corral_proto::event::Egress> {
        self.egress.subscribe()
    }

    /// Stops the actor (operations keep running on the worker): at once when it is idle, and within
    /// [`SHUTDOWN_PATIENCE`] when a call to the worker hangs (everything it
    /// did is durable on the worker; a new manager takes over from there).
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if tokio::time::timeout(SHUTDOWN_PATIENCE, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!(
                "the operation manager did not stop within {SHUTDOWN_PATIENCE:?}; aborted"
            );
            self.task.abort();
        }
    }
}

/// How long [`Manager::shutdown`] waits for a call in flight.
pub const SHUTDOWN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

impl<W: WorkerApi> OperationManager for Manager<W> {
    async fn add(&self, op: Operation) -> Result<(), ManagerError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send(Command::Add(Box::new(op), reply))
            .await
            .map_err(|_| ManagerError::Stopped)?;
        done.await.map_err(|_| ManagerError::Stopped)
    }

    async fn cancel(&self, id: &OperationId, reason: &str) -> Result<(), ManagerError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send(Command::Cancel(id.clone(), reason.to_string(), reply))
            .await
            .map_err(|_| ManagerError::Stopped)?;
        done.await.map_err(|_| ManagerError::Stopped)
    }
}

struct Actor<W: WorkerApi> {
    worker: W,
    sandbox: SandboxId,
    rx: mpsc::Receiver<Command>,
    updates: mpsc::Sender<Operation>,
    stop: CancellationToken,
    /// Every id ever added: the at-most-once guard.
    seen: HashSet<OperationId>,
    /// Operations not yet terminal.
    ops: HashMap<OperationId, Operation>,
    /// Operations with unpublished progress, and when they were last published.
    dirty: HashMap<OperationId, Instant>,
    /// The sandbox's events (`None` until first reached).
    follower: Option<Follower<W>>,
    /// How long the worker may stay unreachable.
    patience: Duration,
    /// Set once the sandbox is lost.
    lost: tokio::sync::watch::Sender<Option<String>>,
    /// Submits under way (retried while the worker does not answer): the
    /// loop goes on meanwhile, taking events, adds and cancels.
    submits: tokio::task::JoinSet<(OperationId, Result<OperationRecord, CallError>)>,
    /// Operations asked to stop while their submit was under way.
    cancel_after_submit: HashSet<OperationId>,
    /// Cancels under way on the worker (retried while it does not
    /// answer): the loop goes on meanwhile.
    cancels: tokio::task::JoinSet<()>,
    /// Where each operation's trace context is (none: not traced).
    contexts: Option<crate::telemetry::TraceContexts>,
    egress: tokio::sync::broadcast::Sender<corral_proto::event::Egress>,
}

enum Wake {
    Command(Option<Command>),
    Submitted(OperationId, Box<Result<OperationRecord, CallError>>),
    Event(Result<corral_proto::Event, FollowError>),
    Tick,
    Stop,
}

/// Runs a worker call, retrying transient failures for up to
/// `patience`, unless the manager is stopped first.
async fn call<W, T, F, Fut>(
    worker: &W,
    patience: Duration,
    stop: &CancellationToken,
    f: F,
) -> Result<T, CallError>
where
    W: WorkerApi,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    tokio::select! {
        r = follow::retry(worker, patience, f) => r.map_err(CallError::Worker),
        () = stop.cancelled() => Err(CallError::Stopped),
    }
}

/// Why a worker call of the manager failed.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error(transparent)]
    Worker(FollowError),
    #[error("the operation manager stopped")]
    Stopped,
}

async fn next_event<W: WorkerApi>(
    follower: &mut Option<Follower<W>>,
) -> Result<corral_proto::Event, FollowError> {
    match follower {
        Some(f) => f.next().await,
        None => std::future::pending().await,
    }
}

impl<W: WorkerApi> Actor<W> {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(PROGRESS_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.follower.is_none() && !self.connect().await {
                break;
            }
            let wake = tokio::select! {
                () = self.stop.cancelled() => Wake::Stop,
                cmd = self.rx.recv() => Wake::Command(cmd),
                Some(Ok((id, r))) = self.submits.join_next(), if !self.submits.is_empty() => Wake::Submitted(id, Box::new(r)),
                Some(_) = self.cancels.join_next(), if !self.cancels.is_empty() => continue,
                ev = next_event(&mut self.follower) => Wake::Event(ev),
                _ = tick.tick(), if !self.dirty.is_empty() => Wake::Tick,
            };
            match wake {
                Wake::Stop | Wake::Command(None) => break,
                Wake::Command(Some(Command::Add(op, reply))) => {
                    self.add(*op).await;
                    let _ = reply.send(());
                }
                Wake::Command(Some(Command::Cancel(id, reason, reply))) => {
                    self.cancel(&id, &reason).await;
                    let _ = reply.send(());
                }
                Wake::Submitted(id, r) => self.submitted(id, *r).await,
                Wake::Event(Ok(event)) => self.on_event(event).await,
                Wake::Event(Err(e)) => {
                    warn!(error = %e, "cannot follow the sandbox");
                    if !self.give_up(&e).await {
                        break;
                    }
                }
                Wake::Tick => self.flush_progress().await,
            }
        }
        debug!("operation manager stopped");
    }

    /// Starts following the sandbox's events from its current seq.
    async fn connect(&mut self) -> bool {
        let opened = tokio::select! {
            f = Follower::from_now(self.worker.clone(), self.sandbox.clone(), None, self.patience) => f,
            () = self.stop.cancelled() => return false,
        };
        match opened {
            Ok(f) => {
                self.follower = Some(f);
                true
            }
            Err(e) => {
                warn!(error = %e, "cannot reach the sandbox");
                self.give_up(&e).await
            }
        }
    }

    /// The sandbox cannot be followed: every running operation fails. It
    /// is reported lost when its worker stayed unreachable past the
    /// deadline or no longer has it; other refusals (too many watchers,
    /// say) are tried again. The manager stays up (it tries again, and
    /// answers adds) unless stopped.
    async fn give_up(&mut self, e: &FollowError) -> bool {
        match e {
            FollowError::GaveUp { .. } => self.fail_all(&e.to_string(), true).await,
            FollowError::Refused(ApiError::NotFound(why)) => {
                let reason = format!(
                    "sandbox lost: {} no longer has it ({why})",
                    self.worker.name()
                );
                self.fail_all(&reason, true).await;
            }
            FollowError::Refused(_) => {
                self.fail_all(&format!("sandbox unreachable: {e}"), false)
                    .await;
            }
        }
        if self.stop.is_cancelled() {
            return false;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => true,
            () = self.stop.cancelled() => false,
        }
    }

    /// Every running operation fails with `reason`; with `lost`, the
    /// sandbox is reported lost (once).
    async fn fail_all(&mut self, reason: &str, lost: bool) {
        let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
        for id in ids {
            if let Some(mut op) = self.ops.remove(&id) {
                if lost {
                    op.fail_lost(reason);
                } else {
                    op.fail(reason);
                }
                self.publish(op).await;
            }
        }
        if lost && self.lost.borrow().is_none() {
            self.lost.send_replace(Some(reason.to_string()));
        }
    }

    async fn publish(&mut self, op: Operation) {
        self.dirty.remove(&op.id);
        let _ = self.updates.send(op).await;
    }

    /// Takes `op` (published `ready`) and submits it as a task of its own,
    /// retried while the worker does not answer: the loop goes on. Its
    /// events are taken from now on, so none is missed however the submit's
    /// answer and the events interleave.
    async fn add(&mut self, mut op: Operation) {
        if !self.seen.insert(op.id.clone()) {
            debug!(operation = %op.id, "already added; ignored");
            return;
        }
        op.status = OpStatus::Ready;
        self.ops.insert(op.id.clone(), op.clone());
        self.publish(op.clone()).await;
        let (worker, sandbox, stop, patience) = (
            self.worker.clone(),
            self.sandbox.clone(),
            self.stop.clone(),
            self.patience,
        );
        let traceparent = self.contexts.as_ref().and_then(|c| c.get(&op.id));
        self.submits.spawn(async move {
            let submitted = call(&worker, patience, &stop, || {
                worker.submit_traced(&sandbox, &op.id, &op.spec, traceparent.as_deref())
            })
            .await;
            (op.id, submitted)
        });
    }

    /// A submit's answer: the operation runs (unless its events ended it
    /// first), was over already (a resumed session), or could not start.
    async fn submitted(&mut self, id: OperationId, r: Result<OperationRecord, CallError>) {
        let canceled = self.cancel_after_submit.remove(&id);
        let Some(mut op) = self.ops.remove(&id) else {
            // Ended meanwhile: by its events, or its sandbox's loss.
            return;
        };
        match r {
            Ok(record) => {
                if let Some(result) = record.result {
                    // Known to the worker and already over.
                    op.finish(result);
                    self.publish(op).await;
                    return;
                }
                if op.status == OpStatus::Ready {
                    op.status = OpStatus::Awaiting;
                    self.publish(op.clone()).await;
                }
                self.ops.insert(id.clone(), op);
                if canceled {
                    self.cancel_on_worker(&id).await;
                }
            }
            Err(e) => {
                op.fail(e.to_string());
                self.publish(op).await;
                // Its worker stayed unreachable past the deadline.
                if matches!(e, CallError::Worker(FollowError::GaveUp { .. })) {
                    self.fail_all(&e.to_string(), true).await;
                }
            }
        }
    }

    async fn cancel(&mut self, id: &OperationId, reason: &str) {
        let Some(op) = self.ops.get_mut(id) else {
            return;
        };
        if op.status == OpStatus::Canceling {
            return;
        }
        debug!(operation = %id, reason, "canceling");
        let submitting = op.status == OpStatus::Ready;
        op.status = OpStatus::Canceling;
        let snapshot = op.clone();
        self.publish(snapshot).await;
        if submitting {
            // Asked of the worker once it has the operation.
            self.cancel_after_submit.insert(id.clone());
            return;
        }
        self.cancel_on_worker(id).await;
    }

    /// Asks the worker to stop `id`, as a task of its own (retried while
    /// the worker does not answer); the operation's end comes as an event.
    async fn cancel_on_worker(&mut self, id: &OperationId) {
        let (worker, sandbox, stop, patience, id) = (
            self.worker.clone(),
            self.sandbox.clone(),
            self.stop.clone(),
            self.patience,
            id.clone(),
        );
        self.cancels.spawn(async move {
            if let Err(e) = call(&worker, patience, &stop, || worker.cancel(&sandbox, &id)).await {
                warn!(operation = %id, error = %e, "cancel failed");
            }
        });
    }

    async fn on_event(&mut self, event: corral_proto::Event) {
        match event.kind {
            EventKind::Gap { .. } => self.refresh_all().await,
            EventKind::SandboxLost { reason } => {
                self.fail_all(&format!("sandbox lost: {reason}"), true)
                    .await;
            }
            EventKind::Egress(e) => {
                let _ = self.egress.send(e);
            }
            // The way in is not an operation's: nothing of it to record.
            EventKind::Port(_) => {}
            kind => {
                let Some(id) = event.operation_id else { return };
                let Some(op) = self.ops.get_mut(&id) else {
                    return;
                };
                match kind {
                    EventKind::Output { stream, data } => {
                        op.progress.push(stream, &data);
                        self.dirty.entry(id).or_insert_with(Instant::now);
                    }
                    EventKind::Finished(result) => {
                        if let Some(mut op) = self.ops.remove(&id) {
                            op.finish(*result);
                            self.publish(op).await;
                        }
                    }
                    EventKind::Started { .. }
                    | EventKind::Gap { .. }
                    | EventKind::SandboxLost { .. }
                    | EventKind::Egress(_)
                    | EventKind::Port(_) => {}
                }
            }
        }
    }

    /// Fetches the state of every running operation (after a gap).
    async fn refresh_all(&mut self) {
        let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
        for id in ids {
            let (worker, sandbox) = (&self.worker, &self.sandbox);
            let fetched = call(worker, self.patience, &self.stop, || {
                worker.operation(sandbox, &id)
            })
            .await;
            if let Ok(record) = fetched
                && let Some(result) = record.result
                && let Some(mut op) = self.ops.remove(&id)
            {
                op.finish(result);
                self.publish(op).await;
            }
        }
    }

    /// Publishes output-so-far that has waited long enough.
    async fn flush_progress(&mut self) {
        let now = Instant::now();
        let due: Vec<OperationId> = self
            .dirty
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= PROGRESS_INTERVAL / 2)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            if let Some(op) = self.ops.get(&id).cloned() {
                self.publish(op).await;
            } else {
                self.dirty.remove(&id);
            }
        }
    }
}
