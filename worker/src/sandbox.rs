//! One sandbox: an actor that owns the link to its supervisor, and the state
//! its watchers read.
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

use crate::docker::DockerRuntime;
use crate::error::{Result, WorkerError};

/// Output bytes that may be in flight or unread by the slowest watcher.
pub const WINDOW_BYTES: u64 = 4 << 20;
/// Operations remembered per sandbox (running ones are never dropped).
const MAX_OPERATIONS: usize = 4096;
/// Input of one operation sent to init and not yet written on by it (init
/// holds up to twice this).
pub const INPUT_WINDOW_BYTES: u64 = 2 << 20;
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
    pub runtime: &'a Arc<DockerRuntime>,
    pub tracker: &'a tokio_util::task::TaskTracker,
    pub shutdown: &'a CancellationToken,
    pub limits: Limits,
    pub metrics: &'a Arc<crate::metrics::WorkerMetrics>,
    /// How sandboxes' egress proxies connect and what bounds them.
    pub egress: &'a Arc<crate::proxy::Settings>,
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
    touched: Mutex<std::time::Instant>,
    /// The egress policy its proxy follows (`None`: it has no proxy).
    egress: Option<watch::Sender<Arc<Vec<corral_proto::egress::Rule>>>>,
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
}

/// The actor's view of one operation's input.
#[derive(Default)]
struct InputLink {
    /// Bytes init has taken, and written on.
    received: u64,
    consumed: u64,
    closed: bool,
    /// Sent to init, answered when its ack covers `end`.
    in_flight: Option<(u64, PendingInput)>,
    queue: VecDeque<PendingInput>,
}

impl InputLink {
    fn reply(&self) -> InputReply {
        InputReply {
            input_bytes: self.received,
            closed: self.closed,
        }
    }

    /// Every call waiting on this input, the one in flight first.
    fn take_waiting(&mut self) -> Vec<PendingInput> {
        let in_flight = self.in_flight.take().map(|(_, p)| p);
        in_flight.into_iter().chain(self.queue.drain(..)).collect()
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
        } = env;
        let policy = egress
            .as_ref()
            .map(|_| watch::Sender::new(Arc::new(spec.egress.clone())));
        let (runtime, limits) = (Arc::clone(runtime), *limits);
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
            touched: Mutex::new(std::time::Instant::now()),
            egress: policy,
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
                        reports,
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
            inputs: HashMap::new(),
            resets: VecDeque::new(),
            egress_reports,
            egress_pending: VecDeque::new(),
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
                if rx.changed().await.is_err() {
                    return Err(WorkerError::ShuttingDown);
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

    pub async fn submit(&self, id: OperationId, spec: OperationSpec) -> Result<OperationRecord> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Submit { id, spec, reply })
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
        *lock(&self.shared.touched) = std::time::Instant::now();
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
        self.shared.closed.cancel();
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

/// One watcher's events. When they end, [`Watch::was_dropped`] tells a
/// watcher the worker dropped (it held the sandbox back) from one whose
/// sandbox or client went away.
pub struct Watch {
    pub events: mpsc::Receiver<Event>,
    dropped: CancellationToken,
}

impl Watch {
    pub fn was_dropped(&self) -> bool {
        self.dropped.is_cancelled()
    }
}

async fn run_watcher(
    shared: &Shared,
    watcher: u64,
    mut cursor: u64,
    only: Option<OperationId>,
    tx: &mpsc::Sender<Event>,
) -> &'static str {
    let mut seq_rx = shared.last_seq.subscribe();
    loop {
        let batch = lock(&shared.journal).read_after(cursor, 256);
        if batch.is_empty() {
            tokio::select! {
                changed = seq_rx.changed() => if changed.is_err() { return "sandbox gone" },
                () = tx.closed() => return "client left",
                () = shared.closed.cancelled() => return "sandbox closed",
            }
            continue;
        }
        for event in batch {
            cursor = event.seq;
            let wanted = match (&only, &event.operation_id) {
                (None, _) => true,
                (Some(want), Some(got)) => want == got,
                (Some(_), None) => matches!(
                    event.kind,
                    EventKind::Gap { .. } | EventKind::SandboxLost { .. }
                ),
            };
            if wanted {
                tokio::select! {
                    sent = tx.send(event) => if sent.is_err() { return "client left" },
                    () = shared.closed.cancelled() => return "sandbox closed",
                }
            }
        }
        if let Some(w) = lock(&shared.watchers).get_mut(&watcher) {
            w.cursor = cursor;
        }
        shared.progress.notify_one();
    }
}

/// What is wrong with a live event from the supervisor, if anything. The
/// supervisor runs in the sandbox, so its frames are checked like any other
/// input: live events come one seq after another, for operations the worker
/// handed it, and an operation finishes once.
fn violation(ops: &OpTable, last_seq: u64, event: &Event) -> Option<String> {
    if event.seq != last_seq + 1 {
        return Some(format!("event {} after event {last_seq}", event.seq));
    }
    if matches!(event.kind, EventKind::Egress(_)) && event.operation_id.is_some() {
        return Some("an egress event of an operation".into());
    }
    let id = event.operation_id.as_ref()?;
    let Some(op) = ops.ops.get(id) else {
        return Some(format!(
            "an event for operation {id}, which it was never given"
        ));
    };
    if op.result.is_some() && !matches!(event.kind, EventKind::Gap { .. }) {
        return Some(format!("an event for operation {id}, which had finished"));
    }
    None
}

fn short(container: &str) -> &str {
    &container[..container.len().min(12)]
}

struct Actor {
    id: SandboxId,
    container: String,
    runtime: Arc<DockerRuntime>,
    metrics: Arc<crate::metrics::WorkerMetrics>,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Command>,
    output: Option<Output>,
    input: Option<Input>,
    decoder: FrameDecoder,
    boot_id: Option<String>,
    welcomed: bool,
    /// Pages of a Welcome still coming, and their encoded size.
    welcome_pages: Option<Welcome>,
    welcome_bytes: usize,
    /// Attaches made so far: the current one's number, which its Welcome
    /// echoes.
    attaches: u64,
    /// Credit granted to init since the last attach, and output received.
    granted: u64,
    received: u64,
    /// Events up to this seq are replays, which take no credit.
    live_after: u64,
    /// Partial line of init's own log (its stderr).
    stderr: Vec<u8>,
    /// A watcher is holding the window back: look again in a while.
    stall_check: bool,
    /// Input of operations that take it.
    inputs: HashMap<OperationId, InputLink>,
    /// Resets sent to init, answered in order.
    resets: VecDeque<oneshot::Sender<Result<u32>>>,
    /// Decisions of the sandbox's egress proxy, for init to journal.
    egress_reports: Option<mpsc::Receiver<corral_proto::event::Egress>>,
    /// Those not yet sent (no link to init just now), oldest first.
    egress_pending: VecDeque<corral_proto::event::Egress>,
}

/// Most egress decisions kept while init cannot be told; past it the
/// oldest go (the metrics count them all).
const MAX_EGRESS_PENDING: usize = 1024;

async fn next_report(
    rx: &mut Option<mpsc::Receiver<corral_proto::event::Egress>>,
) -> Option<corral_proto::event::Egress> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

enum Wake {
    Command(Option<Command>),
    Egress(Option<corral_proto::event::Egress>),
    Output(Option<Result<LogOutput, bollard::errors::Error>>),
    Progress,
    Closed,
}

impl Actor {
    async fn run(mut self) {
        while !self.shared.closed.is_cancelled() {
            if self.output.is_none() && !self.is_lost() {
                self.connect().await;
            }
            let wake = tokio::select! {
                () = self.shared.closed.cancelled() => Wake::Closed,
                cmd = self.rx.recv() => Wake::Command(cmd),
                item = next_output(&mut self.output) => Wake::Output(item),
                () = self.shared.progress.notified() => Wake::Progress,
                e = next_report(&mut self.egress_reports) => Wake::Egress(e),
                () = tokio::time::sleep(Duration::from_millis(250)), if self.stall_check => Wake::Progress,
            };
            match wake {
                Wake::Closed | Wake::Command(None) => break,
                Wake::Command(Some(cmd)) => self.handle(cmd).await,
                Wake::Output(Some(Ok(LogOutput::StdOut { message }))) => {
                    self.on_frames(&message).await;
                }
                Wake::Output(Some(Ok(LogOutput::StdErr { message }))) => self.on_init_log(&message),
                Wake::Output(Some(Ok(_))) => {}
                Wake::Output(Some(Err(e))) => {
                    debug!(error = %e, "attach stream failed");
                    self.detach();
                }
                Wake::Output(None) => {
                    debug!("attach stream ended");
                    self.detach();
                }
                Wake::Progress => self.grant().await,
                Wake::Egress(None) => self.egress_reports = None,
                Wake::Egress(Some(e)) => {
                    if self.egress_pending.len() >= MAX_EGRESS_PENDING {
                        self.egress_pending.pop_front();
                    }
                    self.egress_pending.push_back(e);
                }
            }
            while self.welcomed
                && let Some(e) = self.egress_pending.pop_front()
            {
                if !self.send(InitRequest::Egress(e.clone())).await {
                    self.egress_pending.push_front(e);
                    break;
                }
            }
        }
        debug!("sandbox actor stopped");
    }

    fn is_lost(&self) -> bool {
        matches!(*self.shared.state.borrow(), SandboxState::Lost(_))
    }

    fn detach(&mut self) {
        self.output = None;
        self.input = None;
        self.welcomed = false;
        self.welcome_pages = None;
        self.welcome_bytes = 0;
        self.decoder = FrameDecoder::new();
        // Input in flight is sent again after the next attach (init places
        // it by offset, so nothing is taken twice); resets are not.
        for link in self.inputs.values_mut() {
            if let Some((_, p)) = link.in_flight.take() {
                link.queue.push_front(p);
            }
        }
        for reply in self.resets.drain(..) {
            let _ = reply.send(Err(WorkerError::Detached(self.id.to_string())));
        }
    }

    /// Attaches (again) to the container, or declares the sandbox lost.
    async fn connect(&mut self) {
        let started = tokio::time::Instant::now();
        let mut warned_after = Duration::from_secs(10);
        let mut delay = Duration::from_millis(50);
        loop {
            match self.runtime.running(&self.container).await {
                Ok(Some(true)) => match self.runtime.attach(&self.container).await {
                    Ok(attached) => {
                        self.output = Some(attached.output);
                        self.input = Some(attached.input);
                        let after_seq = lock(&self.shared.journal).last_seq();
                        self.granted = WINDOW_BYTES;
                        self.received = 0;
                        self.attaches += 1;
                        let attach = InitRequest::Attach {
                            after_seq,
                            window_bytes: WINDOW_BYTES,
                            attach: self.attaches,
                        };
                        if self.send(attach).await {
                            debug!(after_seq, "attached");
                            return;
                        }
                    }
                    Err(e) => debug!(error = %e, "attach failed"),
                },
                Ok(Some(false) | None) => {
                    let reason = self.runtime.exit_reason(&self.container).await;
                    self.lose(reason);
                    return;
                }
                // Docker does not answer: the sandbox may well be running
                // (its supervisor journals what happens meanwhile), so the
                // worker waits for the engine for as long as it takes.
                Err(e) => {
                    if started.elapsed() > warned_after {
                        warn!(error = %e, down_for = ?started.elapsed(), "Docker unreachable; still waiting to re-attach");
                        warned_after += Duration::from_secs(30);
                    }
                    debug!(error = %e, "Docker unreachable; retrying");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.shared.closed.cancelled() => return,
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// Writes one frame to init. On failure the link is dropped (and later
    /// re-established); returns whether the frame went out.
    async fn send(&mut self, req: InitRequest) -> bool {
        let Some(input) = self.input.as_mut() else {
            return false;
        };
        let bytes = frame::encode(&pb::InitRequest::from(req));
        let written = async {
            input.write_all(&bytes).await?;
            input.flush().await
        }
        .await;
        match written {
            Ok(()) => true,
            Err(e) => {
                debug!(error = %e, "writing to the supervisor failed");
                self.detach();
                false
            }
        }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, spec, reply } => {
                let result = self.submit(id, spec).await;
                let _ = reply.send(result);
            }
            Command::Cancel { id, reply } => {
                let running = lock(&self.shared.ops)
                    .ops
                    .get(&id)
                    .is_some_and(|r| r.result.is_none());
                if running {
                    self.send(InitRequest::Cancel { operation_id: id }).await;
                }
                let _ = reply.send(running);
            }
            Command::Signal { id, signal, reply } => {
                let known = lock(&self.shared.ops).ops.get(&id).map(|r| {
                    (
                        matches!(r.spec, OperationSpec::Shell(_)),
                        r.result.is_none(),
                    )
                });
                let answer = match known {
                    None => Err(WorkerError::UnknownOperation(id.to_string())),
                    Some((false, _)) => Err(WorkerError::NotApplicable(format!(
                        "operation {id} is no command: it takes no signal"
                    ))),
                    Some((true, false)) => Ok(false),
                    Some((true, true)) => {
                        self.send(InitRequest::Signal {
                            operation_id: id,
                            signal,
                        })
                        .await;
                        Ok(true)
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Input(p) => self.on_input(p).await,
            Command::Resize { id, size, reply } => {
                let terminal = lock(&self.shared.ops).ops.get(&id).map(|r| {
                    (
                        matches!(&r.spec, OperationSpec::Shell(s) if s.terminal.is_some()),
                        r.result.is_none(),
                    )
                });
                let answer = match terminal {
                    None => Err(WorkerError::UnknownOperation(id.to_string())),
                    Some((false, _)) => Err(WorkerError::NotApplicable(format!(
                        "operation {id} has no terminal"
                    ))),
                    Some((true, false)) => Ok(()),
                    Some((true, true)) => {
                        if self
                            .send(InitRequest::Resize {
                                operation_id: id,
                                size,
                            })
                            .await
                        {
                            Ok(())
                        } else {
                            Err(WorkerError::Detached(self.id.to_string()))
                        }
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Reset { reply } => {
                if let SandboxState::Lost(reason) = &*self.shared.state.borrow() {
                    let _ = reply.send(Err(WorkerError::SandboxLost {
                        id: self.id.to_string(),
                        reason: reason.clone(),
                    }));
                    return;
                }
                if self.welcomed && self.send(InitRequest::Reset).await {
                    self.resets.push_back(reply);
                } else {
                    let _ = reply.send(Err(WorkerError::Detached(self.id.to_string())));
                }
            }
        }
    }

    /// Takes a WriteInput: checked against the operation, then queued
    /// behind the others of the same operation.
    async fn on_input(&mut self, p: PendingInput) {
        let known = lock(&self.shared.ops)
            .ops
            .get(&p.id)
            .map(|r| (r.spec.takes_input(), r.result.is_some(), r.input_bytes));
        match known {
            None => {
                let _ = p
                    .reply
                    .send(Err(WorkerError::UnknownOperation(p.id.to_string())));
            }
            Some((false, _, _)) => {
                let _ = p.reply.send(Err(WorkerError::NotApplicable(format!(
                    "operation {} takes no input (ask for stdin, a terminal or a streamed write)",
                    p.id
                ))));
            }
            Some((true, true, taken)) => {
                let received = self.inputs.get(&p.id).map_or(taken, |l| l.received);
                let _ = p.reply.send(Ok(InputReply {
                    input_bytes: received,
                    closed: true,
                }));
            }
            Some((true, false, _)) => {
                let link = self.inputs.entry(p.id.clone()).or_default();
                if link.queue.len() >= MAX_QUEUED_INPUTS {
                    let _ = p.reply.send(Err(WorkerError::TooManyWatchers(format!(
                        "{MAX_QUEUED_INPUTS} input calls of operation {} are waiting already",
                        p.id
                    ))));
                    return;
                }
                let id = p.id.clone();
                link.queue.push_back(p);
                self.pump_input(&id).await;
            }
        }
    }

    /// Sends the next waiting input of `id` to init when its window has
    /// room and nothing of it is in flight.
    async fn pump_input(&mut self, id: &OperationId) {
        loop {
            if !self.welcomed {
                return;
            }
            let Some(link) = self.inputs.get_mut(id) else {
                return;
            };
            if link.in_flight.is_some() {
                return;
            }
            if link.closed {
                link.close_all();
                return;
            }
            let Some(front) = link.queue.front() else {
                return;
            };
            if front.offset > link.received {
                let Some(p) = link.queue.pop_front() else {
                    return;
                };
                let _ = p.reply.send(Err(WorkerError::InputGap(format!(
                    "input at offset {} of operation {id}, whose input ends at {}",
                    p.offset, link.received
                ))));
                continue;
            }
            let skip = usize::try_from(link.received - front.offset).unwrap_or(usize::MAX);
            if skip >= front.data.len() && !front.eof {
                if let Some(p) = link.queue.pop_front() {
                    let _ = p.reply.send(Ok(link.reply()));
                }
                continue;
            }
            let len = front.data.len().saturating_sub(skip) as u64;
            let waiting = link.received - link.consumed;
            if waiting > 0 && waiting + len > INPUT_WINDOW_BYTES {
                // Init has enough to write on: the next ack makes room.
                return;
            }
            let Some(p) = link.queue.pop_front() else {
                return;
            };
            let data = if skip >= p.data.len() {
                Bytes::new()
            } else {
                p.data.slice(skip..)
            };
            let offset = link.received;
            let end = offset + data.len() as u64;
            let req = InitRequest::Input {
                operation_id: id.clone(),
                offset,
                data,
                eof: p.eof,
            };
            link.in_flight = Some((end, p));
            if !self.send(req).await {
                return;
            }
        }
    }

    /// Init's word on an input: answers the call in flight once covered.
    async fn on_input_ack(&mut self, id: OperationId, received: u64, consumed: u64, closed: bool) {
        if closed && !self.inputs.contains_key(&id) {
            return;
        }
        let link = self.inputs.entry(id.clone()).or_default();
        link.received = link.received.max(received);
        link.consumed = link.consumed.max(consumed);
        // What GetOperation and ListOperations say it has taken.
        if let Some(rec) = lock(&self.shared.ops).ops.get_mut(&id) {
            rec.input_bytes = rec.input_bytes.max(link.received);
        }
        if closed {
            // Kept (closed) until the operation finishes: later calls are
            // told so, with where the input ended.
            link.close_all();
            return;
        }
        if let Some((end, _)) = &link.in_flight
            && link.received >= *end
            && let Some((_, p)) = link.in_flight.take()
        {
            let _ = p.reply.send(Ok(link.reply()));
        }
        self.pump_input(&id).await;
    }

    async fn submit(&mut self, id: OperationId, spec: OperationSpec) -> Result<OperationRecord> {
        if let SandboxState::Lost(reason) = &*self.shared.state.borrow() {
            return Err(WorkerError::SandboxLost {
                id: self.id.to_string(),
                reason: reason.clone(),
            });
        }
        let record = {
            let mut ops = lock(&self.shared.ops);
            if let Some(existing) = ops.ops.get(&id) {
                // A record learnt from init after a restart has no bytes of
                // a write (they are never echoed back).
                return if existing.spec == spec || existing.spec == spec.without_data() {
                    Ok(existing.clone())
                } else {
                    Err(WorkerError::Conflict {
                        what: "operation",
                        id: id.to_string(),
                    })
                };
            }
            let record = OperationRecord {
                id: id.clone(),
                spec: spec.clone(),
                result: None,
                first_seq: 0,
                input_bytes: 0,
            };
            ops.ops.insert(id.clone(), record.clone());
            record
        };
        info!(operation = %id, kind = spec.kind(), "operation submitted");
        // Before the supervisor's welcome the run is sent with the others
        // init does not know yet (see `on_welcome`).
        if self.welcomed {
            self.send(InitRequest::Run {
                operation_id: id,
                spec,
            })
            .await;
        }
        Ok(record)
    }

    async fn on_frames(&mut self, data: &Bytes) {
        self.decoder.extend(data);
        loop {
            match self.decoder.next_message::<pb::InitMessage>() {
                Ok(None) => break,
                Ok(Some(msg)) => {
                    let bytes = prost::Message::encoded_len(&msg);
                    match InitMessage::try_from(msg) {
                        Ok(msg) => self.on_message(msg, bytes).await,
                        Err(e) => warn!(error = %e, "invalid message from the supervisor, skipped"),
                    }
                }
                Err(e @ ProtocolError::FrameTooLarge { .. }) => {
                    // The link can no longer be trusted to be in step.
                    warn!(error = %e, "supervisor protocol error");
                    self.detach();
                    break;
                }
                Err(e) => warn!(error = %e, "undecodable frame from the supervisor, skipped"),
            }
        }
    }

    /// A message from the supervisor, `bytes` encoded.
    async fn on_message(&mut self, msg: InitMessage, bytes: usize) {
        match msg {
            InitMessage::Welcome(w) => self.on_welcome(w, bytes).await,
            // Events that reach a fresh attach before the Welcome were
            // written before init saw our Attach, so its replay (which follows
            // the Welcome) carries them too. Taking them now would move the
            // mirror's cursor past the replay and lose everything before them.
            InitMessage::Event(_) if !self.welcomed => {}
            InitMessage::Event(event) => self.on_event(event).await,
            InitMessage::Rejected {
                operation_id,
                reason,
            } => {
                warn!(operation = ?operation_id.as_ref().map(ToString::to_string), reason, "supervisor rejected a request");
                // Input it would not take is sent again once there is room.
                if let Some(id) = operation_id
                    && let Some(link) = self.inputs.get_mut(&id)
                    && let Some((_, p)) = link.in_flight.take()
                {
                    let finished = lock(&self.shared.ops)
                        .ops
                        .get(&id)
                        .is_none_or(|r| r.result.is_some());
                    link.queue.push_front(p);
                    if finished || reason.contains("unknown operation") {
                        // Nothing will take it any more: say so, not wait.
                        link.close_all();
                    }
                }
            }
            InitMessage::InputAck {
                operation_id,
                received,
                consumed,
                closed,
            } => {
                self.on_input_ack(operation_id, received, consumed, closed)
                    .await;
            }
            InitMessage::ResetDone { killed } => {
                info!(killed, "sandbox reset");
                if let Some(reply) = self.resets.pop_front() {
                    let _ = reply.send(Ok(killed));
                }
            }
        }
    }

    /// A page of the supervisor's Welcome (`bytes` encoded). A Welcome
    /// comes in pages, and is acted on once whole; pages of an earlier
    /// attach's Welcome (still in the pipe when this attach began) are
    /// skipped. Pages out of order, disagreeing or past any sane size are a
    /// broken or hostile supervisor: attaching again would only get the same
    /// Welcome, so the sandbox is lost.
    async fn on_welcome(&mut self, mut w: Welcome, bytes: usize) {
        // 0: a supervisor from before attaches were counted.
        if w.attach != 0 && w.attach != self.attaches {
            debug!(
                attach = w.attach,
                current = self.attaches,
                "a Welcome of an earlier attach, skipped"
            );
            return;
        }
        let expected = self.welcome_pages.as_ref().map_or(0, |p| p.page + 1);
        if w.attach != 0 && w.page != expected {
            self.lose(format!(
                "the sandbox's supervisor sent Welcome page {} where {expected} was due",
                w.page
            ));
            return;
        }
        self.welcome_bytes = self.welcome_bytes.saturating_add(bytes);
        if self.welcome_bytes > MAX_WELCOME_BYTES {
            self.lose(format!(
                "the sandbox's supervisor sent a Welcome of over {} MiB",
                MAX_WELCOME_BYTES >> 20
            ));
            return;
        }
        if let Some(mut earlier) = self.welcome_pages.take() {
            if earlier.boot_id != w.boot_id {
                self.lose("the sandbox's supervisor sent Welcome pages that disagree".into());
                return;
            }
            earlier.operations.append(&mut w.operations);
            earlier.last_seq = w.last_seq;
            earlier.more = w.more;
            earlier.page = w.page;
            w = earlier;
        }
        if w.more {
            self.welcome_pages = Some(w);
            return;
        }
        self.welcome_bytes = 0;
        if let Some(known) = &self.boot_id
            && known != &w.boot_id
        {
            self.lose("the sandbox's supervisor restarted".into());
            return;
        }
        info!(
            version = w.version,
            last_seq = w.last_seq,
            operations = w.operations.len(),
            "supervisor attached"
        );
        self.boot_id = Some(w.boot_id);
        self.live_after = w.last_seq;
        let known: std::collections::HashSet<OperationId> =
            w.operations.iter().map(|o| o.id.clone()).collect();
        for rec in w.operations.iter().filter(|r| r.result.is_none()) {
            if let Some(link) = self.inputs.get_mut(&rec.id) {
                link.received = rec.input_bytes;
                link.consumed = link.consumed.min(rec.input_bytes);
            }
        }
        let unsent: Vec<(OperationId, OperationSpec)> = {
            let mut ops = lock(&self.shared.ops);
            for rec in w.operations {
                ops.merge(rec);
            }
            ops.ops
                .values()
                .filter(|r| r.result.is_none() && !known.contains(&r.id))
                .map(|r| (r.id.clone(), r.spec.clone()))
                .collect()
        };
        self.welcomed = true;
        // A sandbox with egress has its relay before any command: a pool's
        // member, made without one, is given it now (the supervisor keeps
        // the one it has).
        if self.shared.egress.is_some() {
            self.send(InitRequest::StartRelay).await;
        }
        for (operation_id, spec) in unsent {
            self.send(InitRequest::Run { operation_id, spec }).await;
        }
        self.shared.state.send_replace(SandboxState::Ready);
        let waiting: Vec<OperationId> = self.inputs.keys().cloned().collect();
        for id in waiting {
            self.pump_input(&id).await;
        }
    }

    async fn on_event(&mut self, event: Event) {
        let seq = event.seq;
        if seq > self.live_after {
            let last = lock(&self.shared.journal).last_seq();
            let wrong = violation(&lock(&self.shared.ops), last, &event);
            if let Some(what) = wrong {
                self.lose(format!(
                    "its supervisor broke the protocol ({what}): the sandbox is treated as compromised"
                ));
                return;
            }
        }
        if seq > self.live_after {
            self.received += event.output_len() as u64;
        }
        {
            let mut ops = lock(&self.shared.ops);
            if let Some(id) = &event.operation_id {
                match &event.kind {
                    EventKind::Started { .. } => {
                        if let Some(r) = ops.ops.get_mut(id)
                            && r.first_seq == 0
                        {
                            r.first_seq = seq;
                        }
                    }
                    EventKind::Finished(result) => {
                        if let Some(r) = ops.ops.get_mut(id)
                            && r.first_seq == 0
                        {
                            r.first_seq = seq;
                        }
                        info!(operation = %id, outcome = %result.outcome, "operation finished");
                        if seq > self.live_after
                            && let Some(r) = ops.ops.get(id)
                        {
                            self.metrics.operation_finished(
                                r.spec.kind(),
                                crate::metrics::outcome_label(&result.outcome),
                                Duration::from_millis(result.duration_ms),
                            );
                        }
                        ops.finish(id, (**result).clone());
                        if let Some(mut link) = self.inputs.remove(id) {
                            link.close_all();
                        }
                    }
                    _ => {}
                }
            }
        }
        if lock(&self.shared.journal).insert(event) {
            self.shared.last_seq.send_replace(seq);
        }
        self.grant().await;
    }

    async fn grant(&mut self) {
        let mut backlog = self.shared.backlog();
        if self.shared.drop_stalled(self.stall_check, backlog) {
            self.stall_check = true;
        } else if std::mem::take(&mut self.stall_check) {
            // A watcher was dropped or caught up: the backlog changed.
            backlog = self.shared.backlog();
        }
        if !self.welcomed {
            return;
        }
        let in_flight = self.granted.saturating_sub(self.received);
        let used = in_flight + backlog;
        if used < WINDOW_BYTES / 2 {
            let more = WINDOW_BYTES - used;
            if self.send(InitRequest::Credit { bytes: more }).await {
                self.granted += more;
            }
        }
    }

    fn on_init_log(&mut self, data: &[u8]) {
        self.stderr.extend_from_slice(data);
        while let Some(nl) = self.stderr.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.stderr.drain(..=nl).collect();
            info!(line = %String::from_utf8_lossy(&line).trim_end(), "supervisor log");
        }
        if self.stderr.len() > 64 * 1024 {
            self.stderr.clear();
        }
    }

    /// The sandbox is gone: every running operation ends as lost.
    fn lose(&mut self, reason: String) {
        warn!(reason, "sandbox lost");
        self.detach();
        for (_, mut link) in self.inputs.drain() {
            link.fail_all(|| WorkerError::SandboxLost {
                id: self.id.to_string(),
                reason: reason.clone(),
            });
        }
        let running: Vec<OperationId> = lock(&self.shared.ops)
            .ops
            .values()
            .filter(|r| r.result.is_none())
            .map(|r| r.id.clone())
            .collect();
        let mut journal = lock(&self.shared.journal);
        for id in running {
            let result = OperationResult::with_outcome(Outcome::SandboxLost {
                reason: reason.clone(),
            });
            lock(&self.shared.ops).finish(&id, result.clone());
            journal.push(Some(id), EventKind::Finished(Box::new(result)));
        }
        journal.push(
            None,
            EventKind::SandboxLost {
                reason: reason.clone(),
            },
        );
        let seq = journal.last_seq();
        drop(journal);
        self.shared.last_seq.send_replace(seq);
        self.shared.state.send_replace(SandboxState::Lost(reason));
    }
}

async fn next_output(
    output: &mut Option<Output>,
) -> Option<Result<LogOutput, bollard::errors::Error>> {
    match output {
        Some(o) => o.next().await,
        None => std::future::pending().await,
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
