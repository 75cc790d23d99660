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
use std::sync::Arc;
use std::time::Duration;

use corral_proto::init::OperationRecord;
use corral_proto::{EventKind, OperationId, SandboxId};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::backend::{Backend, BackendError, EventStream, LocalBackend, RemoteBackend};
use super::operation::{OpStatus, Operation};

/// Least time between two progress snapshots of one operation.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);
/// How long a transient failure is retried before the operation fails.
const PATIENCE: Duration = Duration::from_secs(120);
/// Updates waiting for the consumer; past it the manager waits too.
const UPDATES_CAPACITY: usize = 1024;

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

/// A manager over any [`Backend`]; see [`LocalManager`] and [`RemoteManager`].
pub struct Manager<B: Backend> {
    tx: mpsc::Sender<Command>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _backend: std::marker::PhantomData<fn() -> B>,
}

/// Runs operations through the worker library in this process.
pub type LocalManager = Manager<LocalBackend>;
/// Runs operations on a worker over gRPC, reconnecting and resuming from its
/// cursor when the connection or the worker goes away.
pub type RemoteManager = Manager<RemoteBackend>;

impl<B: Backend> Manager<B> {
    /// Starts the manager of one sandbox. Snapshots arrive on the returned
    /// channel, which the caller must keep draining.
    pub fn start(backend: B, sandbox: SandboxId) -> (Self, mpsc::Receiver<Operation>) {
        let (tx, rx) = mpsc::channel(64);
        let (updates, updates_rx) = mpsc::channel(UPDATES_CAPACITY);
        let stop = CancellationToken::new();
        let actor = Actor {
            backend: Arc::new(backend),
            sandbox: sandbox.clone(),
            rx,
            updates,
            stop: stop.clone(),
            seen: HashSet::new(),
            ops: HashMap::new(),
            dirty: HashMap::new(),
            cursor: None,
            stream: None,
        };
        let task = tokio::spawn(
            actor
                .run()
                .instrument(info_span!("operations", sandbox = %sandbox)),
        );
        (
            Self {
                tx,
                stop,
                task,
                _backend: std::marker::PhantomData,
            },
            updates_rx,
        )
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

impl<B: Backend> OperationManager for Manager<B> {
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

struct Actor<B: Backend> {
    backend: Arc<B>,
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
    /// Seq of the last sandbox event handled (`None` before the first watch).
    cursor: Option<u64>,
    stream: Option<EventStream>,
}

enum Wake {
    Command(Option<Command>),
    Event(Option<Result<corral_proto::Event, BackendError>>),
    Tick,
    Stop,
}

/// Retries `f` on transient errors with backoff, for up to [`PATIENCE`].
async fn retry<T, F, Fut>(stop: &CancellationToken, mut f: F) -> Result<T, BackendError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, BackendError>>,
{
    let deadline = Instant::now() + PATIENCE;
    let mut delay = Duration::from_millis(50);
    loop {
        match f().await {
            Err(BackendError::Transient(e))
                if Instant::now() < deadline && !stop.is_cancelled() =>
            {
                debug!(error = %e, "transient failure; retrying");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stop.cancelled() => return Err(BackendError::Transient(e)),
                }
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

async fn next_event(
    stream: &mut Option<EventStream>,
) -> Option<Result<corral_proto::Event, BackendError>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

impl<B: Backend> Actor<B> {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(PROGRESS_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.stream.is_none() && !self.connect().await {
                break;
            }
            let wake = tokio::select! {
                () = self.stop.cancelled() => Wake::Stop,
                cmd = self.rx.recv() => Wake::Command(cmd),
                ev = next_event(&mut self.stream) => Wake::Event(ev),
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
                Wake::Event(Some(Ok(event))) => self.on_event(event).await,
                Wake::Event(Some(Err(e))) => {
                    debug!(error = %e, "event stream failed; resuming from the cursor");
                    self.stream = None;
                }
                Wake::Event(None) => {
                    debug!("event stream ended; resuming from the cursor");
                    self.stream = None;
                }
                Wake::Tick => self.flush_progress().await,
            }
        }
        debug!("operation manager stopped");
    }

    /// (Re)opens the sandbox's event stream from the cursor. After a gap in
    /// the connection, results that went by are fetched directly.
    async fn connect(&mut self) -> bool {
        let (backend, sandbox, stop) = (
            self.backend.clone(),
            self.sandbox.clone(),
            self.stop.clone(),
        );
        let cursor = match self.cursor {
            Some(c) => c,
            None => match retry(&stop, || backend.last_seq(&sandbox)).await {
                Ok(c) => c,
                Err(e) => {
                    warn!(error = %e, "cannot reach the sandbox");
                    return self.give_up(&e.to_string()).await;
                }
            },
        };
        match retry(&stop, || backend.watch(&sandbox, cursor)).await {
            Ok(s) => {
                self.cursor = Some(cursor);
                self.stream = Some(s);
                true
            }
            Err(e) => {
                warn!(error = %e, "cannot watch the sandbox");
                self.give_up(&e.to_string()).await
            }
        }
    }

    /// The sandbox cannot be reached: every running operation fails. The
    /// manager stays up (answering adds with failures) unless stopped.
    async fn give_up(&mut self, reason: &str) -> bool {
        let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
        for id in ids {
            if let Some(mut op) = self.ops.remove(&id) {
                op.fail(format!("sandbox unreachable: {reason}"));
                self.publish(op).await;
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

    async fn publish(&mut self, op: Operation) {
        self.dirty.remove(&op.id);
        let _ = self.updates.send(op).await;
    }

    async fn add(&mut self, mut op: Operation) {
        if !self.seen.insert(op.id.clone()) {
            debug!(operation = %op.id, "already added; ignored");
            return;
        }
        op.status = OpStatus::Ready;
        self.publish(op.clone()).await;
        let (backend, sandbox, stop) = (
            self.backend.clone(),
            self.sandbox.clone(),
            self.stop.clone(),
        );
        let submitted = retry(&stop, || backend.submit(&sandbox, &op.id, &op.spec)).await;
        match submitted {
            Ok(record) => self.track(op, record).await,
            Err(e) => {
                op.fail(e.to_string());
                self.publish(op).await;
            }
        }
    }

    async fn track(&mut self, mut op: Operation, record: OperationRecord) {
        if let Some(result) = record.result {
            // Known to the worker and already over (a resumed session).
            op.finish(result);
            self.publish(op).await;
            return;
        }
        op.status = OpStatus::Awaiting;
        self.ops.insert(op.id.clone(), op.clone());
        self.publish(op).await;
    }

    async fn cancel(&mut self, id: &OperationId, reason: &str) {
        let Some(op) = self.ops.get_mut(id) else {
            return;
        };
        if op.status == OpStatus::Canceling {
            return;
        }
        debug!(operation = %id, reason, "canceling");
        op.status = OpStatus::Canceling;
        let snapshot = op.clone();
        self.publish(snapshot).await;
        let (backend, sandbox, stop) = (
            self.backend.clone(),
            self.sandbox.clone(),
            self.stop.clone(),
        );
        if let Err(e) = retry(&stop, || backend.cancel(&sandbox, id)).await {
            warn!(operation = %id, error = %e, "cancel failed");
        }
    }

    async fn on_event(&mut self, event: corral_proto::Event) {
        self.cursor = Some(self.cursor.unwrap_or(0).max(event.seq));
        match event.kind {
            EventKind::Gap { .. } => self.refresh_all().await,
            EventKind::SandboxLost { reason } => {
                let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
                for id in ids {
                    if let Some(mut op) = self.ops.remove(&id) {
                        op.fail(format!("sandbox lost: {reason}"));
                        self.publish(op).await;
                    }
                }
            }
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
                    | EventKind::SandboxLost { .. } => {}
                }
            }
        }
    }

    /// Fetches the state of every running operation (after a gap).
    async fn refresh_all(&mut self) {
        let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
        for id in ids {
            let (backend, sandbox, stop) = (
                self.backend.clone(),
                self.sandbox.clone(),
                self.stop.clone(),
            );
            if let Ok(record) = retry(&stop, || backend.operation(&sandbox, &id)).await
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
