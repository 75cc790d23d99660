//! One sandbox: an actor that owns the link to its supervisor ([`actor`]),
//! the state its watchers read (here), and the watchers ([`watchers`]).
//!
//! The actor is the only writer of the sandbox's journal and operation table.
//! It attaches to the container's stdio, says `Attach` with the last sequence
//! number it holds, and mirrors every event init sends into its own journal.
//! When the attach stream breaks it looks at the container: still running
//! means re-attach and resume from the cursor; gone means the sandbox is
//! lost, and every running operation ends as `sandbox_lost`.
//!
//! Flow control: the actor grants init output credit so that the output not
//! yet taken by the slowest live watcher, plus the credit init still holds,
//! stays under [`WINDOW_BYTES`]. A slow watcher therefore slows the commands
//! down instead of losing their output; with no watcher, nothing waits. A
//! watcher that takes nothing while it holds the window back for
//! [`Limits::watch_stall`] is dropped (its stream ends; a client resumes
//! from its cursor), so no client can hold a sandbox's commands for long.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bollard::container::LogOutput;
use bytes::Bytes;
use corral_init::journal::Journal;
use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest, MAX_WELCOME_BYTES, OperationRecord, Welcome};
use corral_proto::limits::MAX_FINISHED_BYTES;
use corral_proto::{
    Event, EventKind, OperationId, OperationResult, OperationSpec, Outcome, ProtocolError,
    SandboxId, SandboxInfo, SandboxSpec, SandboxState, TerminalSize, pb,
};
use futures_util::{Stream, StreamExt};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::error::{Result, WorkerError};
use crate::runtime::Runtime;

mod actor;
mod input;
mod watchers;

use actor::{Actor, short};
pub use watchers::Watch;
use watchers::{run_watcher, violation};

/// Output bytes that may be in flight or unread by the slowest watcher.
pub const WINDOW_BYTES: u64 = 4 << 20;
/// Operations remembered per sandbox (running ones are never dropped).
const MAX_OPERATIONS: usize = 4096;
/// Input of one operation sent to init and not yet written on by it (init
/// holds up to twice this).
pub const INPUT_WINDOW_BYTES: u64 = 2 << 20;
/// How far past what init has an input call may come and wait for those
/// before it (a client with several calls in flight, which may arrive in
/// any order); further is refused at once (`input_gap`).
pub const INPUT_AHEAD_BYTES: u64 = 8 << 20;
/// How long such a call waits for those before it before it is refused
/// as a gap.
pub const GAP_PATIENCE: Duration = Duration::from_secs(10);
/// How often waiting calls are looked at again.
const GAP_CHECK: Duration = Duration::from_millis(250);
/// Input calls of one operation waiting their turn.
const MAX_QUEUED_INPUTS: usize = 64;

/// What one sandbox allows its watchers.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A watcher that holds the window back without taking anything for
    /// this long is dropped.
    pub watch_stall: Duration,
    /// Most watchers of one sandbox at once.
    pub max_watchers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            watch_stall: Duration::from_secs(10),
            max_watchers: 64,
        }
    }
}

/// What every sandbox actor of a worker shares: the engine, the task
/// tracker and shutdown of the worker, the limits.
pub struct Env<'a> {
    pub runtime: &'a Arc<dyn Runtime>,
    pub tracker: &'a tokio_util::task::TaskTracker,
    pub shutdown: &'a CancellationToken,
    pub limits: Limits,
    pub metrics: &'a Arc<crate::metrics::WorkerMetrics>,
    /// How sandboxes' egress proxies connect and what bounds them.
    pub egress: &'a Arc<crate::proxy::Settings>,
    /// Operations' spans, when exported.
    pub traces: Option<&'a Arc<crate::telemetry::OpTraces>>,
    /// The worker's state directory (where sandboxes' exposed ports are
    /// kept).
    pub state_root: &'a std::path::Path,
}

/// One watcher, as the actor sees it.
struct WatcherEntry {
    /// The last seq it handed to its client.
    cursor: u64,
    /// Since when it has been holding the window back without progress.
    behind_since: Option<tokio::time::Instant>,
    /// Cancelled when it is dropped for holding the sandbox back.
    kick: CancellationToken,
}

/// The operations of a sandbox as the worker knows them: every running
/// one, and finished ones up to [`MAX_OPERATIONS`] and
/// [`MAX_FINISHED_BYTES`] (the oldest forgotten first), as the supervisor
/// remembers them. A finished write keeps no data.
#[derive(Default)]
struct OpTable {
    ops: HashMap<OperationId, OperationRecord>,
    finished: VecDeque<(OperationId, usize)>,
    finished_bytes: usize,
}

impl OpTable {
    fn running(&self) -> usize {
        self.ops.len() - self.finished.len()
    }

    fn finish(&mut self, id: &OperationId, result: OperationResult) {
        let Some(rec) = self.ops.get_mut(id) else {
            return;
        };
        if rec.result.is_some() {
            return;
        }
        rec.result = Some(result);
        rec.spec = rec.spec.without_data();
        let weight = rec.weight();
        self.finished.push_back((id.clone(), weight));
        self.finished_bytes += weight;
        while self.ops.len() > MAX_OPERATIONS
            || (self.finished_bytes > MAX_FINISHED_BYTES && self.finished.len() > 1)
        {
            let Some((old, w)) = self.finished.pop_front() else {
                break;
            };
            self.finished_bytes -= w;
            self.ops.remove(&old);
        }
    }

    /// Takes init's view of an operation (init is the authority).
    fn merge(&mut self, rec: OperationRecord) {
        let result = rec.result.clone();
        let first_seq = rec.first_seq;
        let id = rec.id.clone();
        let entry = self.ops.entry(id.clone()).or_insert(OperationRecord {
            result: None,
            ..rec
        });
        if entry.first_seq == 0 {
            entry.first_seq = first_seq;
        }
        if let Some(r) = result {
            self.finish(&id, r);
        }
    }
}

/// State shared between the actor (the only writer) and readers: the gRPC
/// handlers and the watchers. Every lock is held for a short, non-async
/// section only.
pub struct Shared {
    journal: Mutex<Journal>,
    ops: Mutex<OpTable>,
    state: watch::Sender<SandboxState>,
    last_seq: watch::Sender<u64>,
    watchers: Mutex<HashMap<u64, WatcherEntry>>,
    limits: Limits,
    next_watcher: std::sync::atomic::AtomicU64,
    /// Wakes the actor when a watcher made progress.
    progress: Notify,
    /// Cancelled when the sandbox is destroyed or the worker stops.
    closed: CancellationToken,
    /// When a client last named this sandbox in a call (or watched it).
    touched: Mutex<tokio::time::Instant>,
    /// The egress policy its proxy follows (`None`: it has no proxy).
    egress: Option<watch::Sender<Arc<Vec<corral_proto::egress::Rule>>>>,
    /// Its exposed ports and its way in.
    ports: crate::ports::SandboxPorts,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves consistent data
    // (each section is a single update), so poisoning is not fatal.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Output bytes the slowest live watcher has not yet taken.
    fn backlog(&self) -> u64 {
        let slowest = lock(&self.watchers).values().map(|w| w.cursor).min();
        match slowest {
            Some(seq) => lock(&self.journal).output_bytes_after(seq),
            None => 0,
        }
    }

    /// Drops the watchers that have held the window back, taking nothing,
    /// for longer than the limit. Returns whether one is still behind (the
    /// actor looks again soon).
    fn drop_stalled(&self, was_behind: bool, backlog: u64) -> bool {
        // Nobody can be holding the window back while the slowest watcher
        // is within half of it: the common case costs nothing more.
        if !was_behind && backlog < WINDOW_BYTES / 2 {
            return false;
        }
        let now = tokio::time::Instant::now();
        let journal = lock(&self.journal);
        let mut watchers = lock(&self.watchers);
        let mut behind = false;
        watchers.retain(|id, w| {
            if journal.output_bytes_after(w.cursor) < WINDOW_BYTES / 2 {
                w.behind_since = None;
                return true;
            }
            let since = *w.behind_since.get_or_insert(now);
            if now.duration_since(since) < self.limits.watch_stall {
                behind = true;
                return true;
            }
            warn!(
                watcher = id,
                cursor = w.cursor,
                "a watcher took nothing for {:?} while holding the sandbox back; dropped",
                self.limits.watch_stall
            );
            w.kick.cancel();
            false
        });
        behind
    }
}

enum Command {
    Submit {
        id: OperationId,
        spec: OperationSpec,
        /// The W3C trace context it was submitted with.
        traceparent: Option<String>,
        reply: oneshot::Sender<Result<OperationRecord>>,
    },
    Cancel {
        id: OperationId,
        reply: oneshot::Sender<bool>,
    },
    Signal {
        id: OperationId,
        signal: i32,
        reply: oneshot::Sender<Result<bool>>,
    },
    Input(PendingInput),
    Resize {
        id: OperationId,
        size: TerminalSize,
        reply: oneshot::Sender<Result<()>>,
    },
    Reset {
        reply: oneshot::Sender<Result<u32>>,
    },
    /// Have the supervisor start the way in's relay.
    StartIngress {
        secret: Vec<u8>,
        reply: oneshot::Sender<Result<()>>,
    },
}

/// Where an operation's input stands after a WriteInput.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputReply {
    /// The input's end (the next offset).
    pub input_bytes: u64,
    /// No more input is taken.
    pub closed: bool,
}

/// One WriteInput, waiting for its turn or for init to take it.
struct PendingInput {
    id: OperationId,
    offset: u64,
    data: Bytes,
    eof: bool,
    reply: oneshot::Sender<Result<InputReply>>,
    /// When it came (a call past the input waits [`GAP_PATIENCE`] at
    /// most for those before it).
    since: tokio::time::Instant,
}

/// The actor's view of one operation's input.
#[derive(Default)]
struct InputLink {
    /// Bytes init has taken, and written on.
    received: u64,
    consumed: u64,
    /// Bytes sent to init (taken or not yet): at least `received`.
    sent: u64,
    closed: bool,
    /// Sent to init, in order, each answered when an ack covers its end.
    in_flight: VecDeque<(u64, PendingInput)>,
    /// Calls not yet sent, by offset.
    queue: VecDeque<PendingInput>,
}

impl InputLink {
    fn reply(&self) -> InputReply {
        InputReply {
            input_bytes: self.received,
            closed: self.closed,
        }
    }

    /// Every call waiting on this input, those in flight first.
    fn take_waiting(&mut self) -> Vec<PendingInput> {
        let in_flight: Vec<PendingInput> = self.in_flight.drain(..).map(|(_, p)| p).collect();
        in_flight.into_iter().chain(self.queue.drain(..)).collect()
    }

    /// What was sent and not taken goes back to the queue, to be sent
    /// again from what init has (it places input by offset, so nothing is
    /// taken twice).
    fn unsend(&mut self) {
        while let Some((_, p)) = self.in_flight.pop_front() {
            self.enqueue(p);
        }
        self.sent = self.received;
    }

    /// Queues `p` by its offset (after those of the same offset).
    fn enqueue(&mut self, p: PendingInput) {
        let at = self.queue.partition_point(|q| q.offset <= p.offset);
        self.queue.insert(at, p);
    }

    /// Answers every waiting call: the input is closed.
    fn close_all(&mut self) {
        self.closed = true;
        let reply = self.reply();
        for p in self.take_waiting() {
            let _ = p.reply.send(Ok(reply));
        }
    }

    fn fail_all(&mut self, err: impl Fn() -> WorkerError) {
        for p in self.take_waiting() {
            let _ = p.reply.send(Err(err()));
        }
    }
}

/// A handle to a sandbox: cheap to clone, safe to use from any task.
#[derive(Clone)]
pub struct Sandbox {
    pub id: SandboxId,
    pub spec: SandboxSpec,
    pub container_id: String,
    pub created_at_unix_ms: i64,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Command>,
}

type Output = Pin<Box<dyn Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>;
type Input = Pin<Box<dyn AsyncWrite + Send>>;

impl Sandbox {
    /// Starts the actor of a running container. It attaches right away; use
    /// [`wait_ready`](Self::wait_ready) to wait for the supervisor's answer.
    /// `egress`: the bound socket of its proxy, when its spec has egress.
    pub fn spawn(
        id: SandboxId,
        spec: SandboxSpec,
        container_id: String,
        created_at_unix_ms: i64,
        egress: Option<tokio::net::UnixListener>,
        env: &Env<'_>,
    ) -> Self {
        let Env {
            runtime,
            tracker,
            shutdown,
            limits,
            metrics,
            egress: egress_settings,
            traces,
            state_root,
        } = env;
        let policy = egress
            .as_ref()
            .map(|_| watch::Sender::new(Arc::new(spec.egress.clone())));
        let (runtime, limits) = (Arc::clone(runtime), *limits);
        let (port_reports, port_reports_rx) = mpsc::channel(256);
        let shared = Arc::new(Shared {
            limits,
            journal: Mutex::new(Journal::default()),
            ops: Mutex::new(OpTable::default()),
            state: watch::Sender::new(SandboxState::Starting),
            last_seq: watch::Sender::new(0),
            watchers: Mutex::new(HashMap::new()),
            next_watcher: 0.into(),
            progress: Notify::new(),
            closed: shutdown.child_token(),
            touched: Mutex::new(tokio::time::Instant::now()),
            egress: policy,
            ports: crate::ports::SandboxPorts::kept_at(crate::state::ports_path(state_root, &id))
                .telling(crate::reports::Reports::new(port_reports)),
        });
        let (tx, rx) = mpsc::channel(256);
        let egress_reports = match (egress, &shared.egress) {
            (Some(listener), Some(policy)) => {
                let (reports, rx) = mpsc::channel(256);
                let span = info_span!("egress", sandbox = %id);
                tracker.spawn(
                    crate::proxy::serve(
                        listener,
                        policy.subscribe(),
                        Arc::clone(egress_settings),
                        crate::proxy::Reports::new(reports),
                        Arc::clone(metrics),
                        (*tracker).clone(),
                        shared.closed.clone(),
                    )
                    .instrument(span),
                );
                Some(rx)
            }
            _ => None,
        };
        let actor = Actor {
            id: id.clone(),
            container: container_id.clone(),
            runtime,
            metrics: Arc::clone(metrics),
            shared: shared.clone(),
            rx,
            output: None,
            input: None,
            decoder: FrameDecoder::new(),
            boot_id: None,
            welcomed: false,
            welcome_pages: None,
            welcome_bytes: 0,
            attaches: 0,
            granted: 0,
            received: 0,
            live_after: 0,
            stderr: Vec::new(),
            stall_check: false,
            gaps_at: None,
            inputs: HashMap::new(),
            resets: VecDeque::new(),
            egress_reports,
            port_reports: Some(port_reports_rx),
            reports_pending: VecDeque::new(),
            traced: traces
                .map(|t| t.open_of(&id).into_iter().map(|op| (op, false)).collect())
                .unwrap_or_default(),
            traces: traces.cloned(),
        };
        let span = info_span!("sandbox", sandbox = %id, container = %short(&container_id));
        tracker.spawn(actor.run().instrument(span));
        Self {
            id,
            spec,
            container_id,
            created_at_unix_ms,
            shared,
            tx,
        }
    }

    pub fn created_at_unix_ms(&self) -> i64 {
        self.created_at_unix_ms
    }

    pub fn info(&self) -> SandboxInfo {
        let mut spec = self.spec.clone();
        if self.shared.egress.is_some() {
            spec.egress = self.egress();
        }
        SandboxInfo {
            id: self.id.clone(),
            spec,
            state: self.shared.state.borrow().clone(),
            container_id: self.container_id.clone(),
            last_seq: *self.shared.last_seq.borrow(),
            running_operations: lock(&self.shared.ops).running() as u32,
            created_at_unix_ms: self.created_at_unix_ms,
            last_used_unix_ms: crate::state::now_unix_ms()
                - i64::try_from(self.idle_for().as_millis()).unwrap_or(i64::MAX),
            worker_id: String::new(),
            image: String::new(),
            limits: corral_proto::Limits::default(),
        }
    }

    /// Waits until the supervisor answered (or the sandbox is lost).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.shared.state.subscribe();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                let state = rx.borrow_and_update().clone();
                match state {
                    SandboxState::Ready => return Ok(()),
                    SandboxState::Lost(reason) => {
                        return Err(WorkerError::SandboxLost {
                            id: self.id.to_string(),
                            reason,
                        });
                    }
                    // An actor's sandbox is never in that state (the
                    // worker keeps checkpointed ones apart).
                    SandboxState::Starting | SandboxState::Checkpointed => {}
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() {
                        return Err(WorkerError::ShuttingDown);
                    },
                    // Removed (or the worker stops) before it answered.
                    () = self.shared.closed.cancelled() => {
                        return Err(WorkerError::SandboxLost {
                            id: self.id.to_string(),
                            reason: "it was closed before its supervisor answered".into(),
                        });
                    }
                }
            }
        })
        .await;
        waited.unwrap_or_else(|_| {
            Err(WorkerError::InitUnresponsive {
                id: self.id.to_string(),
                reason: format!("no answer within {timeout:?}"),
            })
        })
    }

    pub async fn submit(
        &self,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<OperationRecord> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                id,
                spec,
                traceparent,
                reply,
            })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    pub async fn cancel(&self, id: OperationId) -> Result<bool> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Cancel { id, reply })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)
    }

    /// Sends a signal to a running shell operation's process group;
    /// whether it was running.
    pub async fn signal(&self, id: OperationId, signal: i32) -> Result<bool> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Signal { id, signal, reply })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    pub fn operation(&self, id: &OperationId) -> Option<OperationRecord> {
        lock(&self.shared.ops).ops.get(id).cloned()
    }

    /// Every operation known here, oldest first (those not started yet
    /// last).
    pub fn operations(&self) -> Vec<OperationRecord> {
        let mut all: Vec<OperationRecord> = lock(&self.shared.ops).ops.values().cloned().collect();
        all.sort_by_key(|o| (o.first_seq == 0, o.first_seq, o.id.to_string()));
        all
    }

    /// Feeds input to an operation; answers once init has taken it.
    pub async fn write_input(
        &self,
        id: OperationId,
        offset: u64,
        data: Bytes,
        eof: bool,
    ) -> Result<InputReply> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Input(PendingInput {
                id,
                offset,
                data,
                eof,
                reply,
                since: tokio::time::Instant::now(),
            }))
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    pub async fn resize(&self, id: OperationId, size: TerminalSize) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Resize { id, size, reply })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Kills every process of the sandbox but its supervisor.
    pub async fn reset(&self) -> Result<u32> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Reset { reply })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// A client named this sandbox: it is not idle.
    pub fn touch(&self) {
        *lock(&self.shared.touched) = tokio::time::Instant::now();
    }

    /// How long no client has named or watched this sandbox.
    pub fn idle_for(&self) -> Duration {
        if self.watchers() > 0 {
            self.touch();
            return Duration::ZERO;
        }
        lock(&self.shared.touched).elapsed()
    }

    /// Replaces the egress policy of a sandbox that has a proxy: new
    /// connections follow it, open ones it no longer allows are closed.
    /// `false`: it has none (it was made without egress).
    pub fn set_egress(&mut self, rules: Vec<corral_proto::egress::Rule>) -> bool {
        let Some(policy) = &self.shared.egress else {
            return false;
        };
        // An emptied policy keeps the proxy, after a restart too.
        self.spec.egress_proxy |= rules.is_empty();
        self.spec.egress.clone_from(&rules);
        policy.send_replace(Arc::new(rules));
        true
    }

    /// Whether it has an egress proxy (made with egress rules; an empty
    /// policy set later still has one, blocking everything).
    pub fn has_egress(&self) -> bool {
        self.shared.egress.is_some()
    }

    /// The egress policy it follows now (its spec's, unless replaced).
    pub fn egress(&self) -> Vec<corral_proto::egress::Rule> {
        self.shared
            .egress
            .as_ref()
            .map(|p| p.borrow().as_ref().clone())
            .unwrap_or_default()
    }

    /// Stops the actor and every watcher of this sandbox.
    pub fn close(&self) {
        self.shared.ports.close();
        self.shared.closed.cancel();
    }

    /// Its exposed ports and its way in.
    pub fn ports(&self) -> &crate::ports::SandboxPorts {
        &self.shared.ports
    }

    /// Cancelled when the sandbox goes (or the worker stops).
    pub fn closed(&self) -> &CancellationToken {
        &self.shared.closed
    }

    /// Has the supervisor start the relay of the way in (nothing if it
    /// runs); the worker's socket is bound first.
    pub async fn start_ingress(&self, secret: Vec<u8>) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::StartIngress { secret, reply })
            .await
            .map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Streams the events after `after_seq` (replay, then live), optionally
    /// only those of one operation (gaps are always sent). The returned
    /// channel is bounded: a reader that does not keep up holds back the
    /// sandbox's output rather than losing it.
    pub fn watch(
        &self,
        after_seq: u64,
        only: Option<OperationId>,
        tracker: &tokio_util::task::TaskTracker,
    ) -> Result<Watch> {
        // Small: what sits here counts as taken, so it widens the window.
        let (tx, rx) = mpsc::channel(4);
        let shared = self.shared.clone();
        let watcher = shared
            .next_watcher
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let kick = CancellationToken::new();
        {
            let mut watchers = lock(&shared.watchers);
            if watchers.len() >= shared.limits.max_watchers {
                return Err(WorkerError::TooManyWatchers(format!(
                    "sandbox {} has {} watchers, its limit",
                    self.id,
                    watchers.len()
                )));
            }
            watchers.insert(
                watcher,
                WatcherEntry {
                    cursor: after_seq,
                    behind_since: None,
                    kick: kick.clone(),
                },
            );
        }
        let span = info_span!("watch", sandbox = %self.id, watcher, after_seq);
        let dropped = kick.clone();
        tracker.spawn(
            async move {
                let reason = tokio::select! {
                    r = run_watcher(&shared, watcher, after_seq, only, &tx) => r,
                    () = kick.cancelled() => "dropped: it held the sandbox back",
                };
                debug!(reason, "watcher ended");
                lock(&shared.watchers).remove(&watcher);
                shared.progress.notify_one();
            }
            .instrument(span),
        );
        Ok(Watch {
            events: rx,
            dropped,
        })
    }

    /// The seq of its last event.
    pub fn last_seq(&self) -> u64 {
        *self.shared.last_seq.borrow()
    }

    /// Watchers of this sandbox now.
    pub fn watchers(&self) -> usize {
        lock(&self.shared.watchers).len()
    }

    /// Whether it is lost (cheap: no info is built).
    pub fn is_lost(&self) -> bool {
        matches!(*self.shared.state.borrow(), SandboxState::Lost(_))
    }

    /// Operations running in it now.
    pub fn running_operations(&self) -> usize {
        lock(&self.shared.ops).running()
    }

    /// Bytes its event journal holds.
    pub fn journal_bytes(&self) -> usize {
        lock(&self.shared.journal).bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(running: &OperationId, done: &OperationId) -> OpTable {
        let mut t = OpTable::default();
        for id in [running, done] {
            t.ops.insert(
                id.clone(),
                OperationRecord {
                    id: id.clone(),
                    spec: OperationSpec::Shell(corral_proto::ShellSpec::new("true")),
                    result: None,
                    first_seq: 0,
                    input_bytes: 0,
                },
            );
        }
        t.finish(
            done,
            OperationResult::with_outcome(Outcome::Exited { code: 0 }),
        );
        t
    }

    fn event(seq: u64, op: Option<&OperationId>, kind: EventKind) -> Event {
        Event {
            seq,
            operation_id: op.cloned(),
            kind,
        }
    }

    #[test]
    fn frames_that_break_the_protocol_are_named() {
        let (running, done) = (OperationId::random(), OperationId::random());
        let t = table(&running, &done);
        let out = || EventKind::Output {
            stream: corral_proto::OutputStream::Stdout,
            data: Bytes::from_static(b"x"),
        };
        assert_eq!(violation(&t, 7, &event(8, Some(&running), out())), None);
        let jump = violation(&t, 7, &event(12, Some(&running), out())).unwrap();
        assert!(jump.contains("event 12 after event 7"), "{jump}");
        let stranger = OperationId::random();
        let forged = violation(&t, 7, &event(8, Some(&stranger), out())).unwrap();
        assert!(forged.contains("never given"), "{forged}");
        let pass = EventKind::Finished(Box::new(OperationResult::with_outcome(Outcome::Exited {
            code: 0,
        })));
        let second = violation(&t, 7, &event(8, Some(&done), pass)).unwrap();
        assert!(second.contains("had finished"), "{second}");
    }
}
