//! A scripted worker behind the harness's `WorkerApi`, for tests of the
//! waiting logic (the follower, the operation manager) with paused time:
//! no process, no Docker, no sockets, so a test of a 60 s deadline runs in
//! milliseconds. It keeps the rules the real worker keeps where the
//! harness relies on them: events numbered from 1 with no gap, a watch
//! replays after its cursor then goes live, an operation id is run at
//! most once (the same id and spec again is answered with its record,
//! another spec is a conflict), an unknown sandbox is `NotFound`, a lost
//! sandbox refuses new operations. The test drives it: output, ends,
//! outages (every call and open stream fails as a broken connection), a
//! lost sandbox. [`FakeFleet`] puts several behind the session runner's
//! `Workers`, each known by its address.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use corral_harness::client::ClientError;
use corral_harness::fleet::{FleetError, Workers};
use corral_harness::placement::Attempt;
use corral_harness::worker_api::{ApiError, Events, Why, WorkerApi};
use corral_proto::init::OperationRecord;
use corral_proto::reason::Reason;
use corral_proto::{
    Event, EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream,
    SandboxId, SandboxInfo, SandboxSpec, SandboxState,
};
use tokio::sync::broadcast;

#[derive(Default)]
struct FakeSandbox {
    spec: SandboxSpec,
    events: Vec<Event>,
    ops: HashMap<OperationId, OperationRecord>,
    lost: Option<String>,
}

#[derive(Default)]
struct State {
    sandboxes: HashMap<SandboxId, FakeSandbox>,
    down: bool,
    /// Submits that reached the worker, by operation id (a retry of the
    /// same id counts, a run does not happen twice).
    submits: HashMap<OperationId, usize>,
    /// Operations actually started.
    started: Vec<OperationId>,
}

/// A fake worker. Cheap to clone: clones share it.
#[derive(Clone)]
pub struct FakeApi {
    /// Its address, as a fleet names it.
    address: Arc<str>,
    state: Arc<Mutex<State>>,
    /// Each new event, and each outage (as `None`), to open watches.
    live: broadcast::Sender<Option<(SandboxId, Event)>>,
}

impl Default for FakeApi {
    fn default() -> Self {
        Self::new()
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unreachable() -> ApiError {
    ApiError::Transient("cannot reach the worker: connection refused".into())
}

impl FakeApi {
    pub fn new() -> Self {
        Self::at("fake")
    }

    /// A fake worker at `address` (one of a [`FakeFleet`]).
    pub fn at(address: &str) -> Self {
        Self {
            address: address.into(),
            state: Arc::default(),
            live: broadcast::channel(4096).0,
        }
    }

    /// Whether it is down (see [`Self::go_down`]).
    pub fn is_down(&self) -> bool {
        lock(&self.state).down
    }

    /// The sandboxes it has.
    pub fn sandboxes(&self) -> Vec<SandboxId> {
        let mut all: Vec<SandboxId> = lock(&self.state).sandboxes.keys().cloned().collect();
        all.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        all
    }

    /// Calls fail as a refused connection, and open streams break, until
    /// [`Self::come_back`].
    pub fn go_down(&self) {
        lock(&self.state).down = true;
        let _ = self.live.send(None);
    }

    pub fn come_back(&self) {
        lock(&self.state).down = false;
    }

    /// How often `id` was submitted, and whether it was started (once).
    pub fn submits(&self, id: &OperationId) -> usize {
        lock(&self.state).submits.get(id).copied().unwrap_or(0)
    }

    pub fn started(&self) -> Vec<OperationId> {
        lock(&self.state).started.clone()
    }

    fn push(&self, sandbox: &SandboxId, op: Option<&OperationId>, kind: EventKind) -> u64 {
        let mut st = lock(&self.state);
        let Some(sb) = st.sandboxes.get_mut(sandbox) else {
            return 0;
        };
        let event = Event {
            seq: sb.events.len() as u64 + 1,
            operation_id: op.cloned(),
            kind,
        };
        let seq = event.seq;
        sb.events.push(event.clone());
        if let Some(first) = op.and_then(|id| sb.ops.get_mut(id))
            && first.first_seq == 0
        {
            first.first_seq = seq;
        }
        drop(st);
        let _ = self.live.send(Some((sandbox.clone(), event)));
        seq
    }

    /// Output of a running operation.
    pub fn output(&self, sandbox: &SandboxId, op: &OperationId, data: &str) {
        self.push(
            sandbox,
            Some(op),
            EventKind::Output {
                stream: OutputStream::Stdout,
                data: Bytes::copy_from_slice(data.as_bytes()),
            },
        );
    }

    /// Ends a running operation with an exit code.
    pub fn exit(&self, sandbox: &SandboxId, op: &OperationId, code: i32) {
        let result = OperationResult::with_outcome(Outcome::Exited { code });
        if let Some(r) = lock(&self.state)
            .sandboxes
            .get_mut(sandbox)
            .and_then(|sb| sb.ops.get_mut(op))
        {
            r.result = Some(result.clone());
        }
        self.push(sandbox, Some(op), EventKind::Finished(Box::new(result)));
    }

    /// The sandbox is lost: its running operations end so, it takes no
    /// new ones.
    pub fn lose(&self, sandbox: &SandboxId, reason: &str) {
        let running: Vec<OperationId> = {
            let mut st = lock(&self.state);
            let Some(sb) = st.sandboxes.get_mut(sandbox) else {
                return;
            };
            sb.lost = Some(reason.to_string());
            sb.ops
                .values()
                .filter(|r| r.result.is_none())
                .map(|r| r.id.clone())
                .collect()
        };
        for op in running {
            let result = OperationResult::with_outcome(Outcome::SandboxLost {
                reason: reason.to_string(),
            });
            if let Some(r) = lock(&self.state)
                .sandboxes
                .get_mut(sandbox)
                .and_then(|sb| sb.ops.get_mut(&op))
            {
                r.result = Some(result.clone());
            }
            self.push(sandbox, Some(&op), EventKind::Finished(Box::new(result)));
        }
        self.push(
            sandbox,
            None,
            EventKind::SandboxLost {
                reason: reason.to_string(),
            },
        );
    }

    fn info(&self, id: &SandboxId, sb: &FakeSandbox) -> SandboxInfo {
        SandboxInfo {
            id: id.clone(),
            spec: sb.spec.clone(),
            state: match &sb.lost {
                Some(r) => SandboxState::Lost(r.clone()),
                None => SandboxState::Ready,
            },
            container_id: format!("fake-{id}"),
            last_seq: sb.events.len() as u64,
            running_operations: sb.ops.values().filter(|r| r.result.is_none()).count() as u32,
            created_at_unix_ms: 0,
            last_used_unix_ms: 0,
            worker_id: self.address.to_string(),
            image: "fake".into(),
            limits: corral_proto::Limits {
                memory_bytes: sb.spec.memory_bytes.unwrap_or(1 << 30),
                cpu_millis: sb.spec.cpu_millis.unwrap_or(1000),
                pids_limit: sb.spec.pids_limit.unwrap_or(256),
            },
        }
    }

    fn up(&self) -> Result<std::sync::MutexGuard<'_, State>, ApiError> {
        let st = lock(&self.state);
        if st.down {
            return Err(unreachable());
        }
        Ok(st)
    }
}

impl WorkerApi for FakeApi {
    fn describe(&self) -> String {
        format!("the fake worker {}", self.address)
    }

    fn name(&self) -> String {
        format!("worker {}", self.address)
    }

    fn address(&self) -> String {
        self.address.to_string()
    }

    async fn create_sandbox(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
    ) -> Result<SandboxInfo, ApiError> {
        let mut st = self.up()?;
        let sb = st
            .sandboxes
            .entry(id.clone())
            .or_insert_with(|| FakeSandbox {
                spec: spec.clone(),
                ..FakeSandbox::default()
            });
        if &sb.spec != spec {
            return Err(ApiError::Rejected(
                format!("sandbox {id} already exists with a different spec"),
                Some(Why::new(Reason::Conflict)),
            ));
        }
        Ok(self.info(id, sb))
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxInfo, ApiError> {
        let st = self.up()?;
        st.sandboxes
            .get(id)
            .map(|sb| self.info(id, sb))
            .ok_or_else(|| ApiError::NotFound(format!("unknown sandbox {id}")))
    }

    async fn destroy_sandbox(&self, id: &SandboxId) -> Result<bool, ApiError> {
        Ok(self.up()?.sandboxes.remove(id).is_some())
    }

    async fn submit(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
        spec: &OperationSpec,
    ) -> Result<OperationRecord, ApiError> {
        let record = {
            let mut st = self.up()?;
            *st.submits.entry(id.clone()).or_default() += 1;
            let Some(sb) = st.sandboxes.get_mut(sandbox) else {
                return Err(ApiError::NotFound(format!("unknown sandbox {sandbox}")));
            };
            if let Some(reason) = &sb.lost {
                return Err(ApiError::Rejected(
                    format!("sandbox {sandbox} is lost: {reason}"),
                    Some(Why::new(Reason::SandboxLost)),
                ));
            }
            if let Some(existing) = sb.ops.get(id) {
                return if &existing.spec == spec {
                    Ok(existing.clone())
                } else {
                    Err(ApiError::Rejected(
                        format!("operation {id} already exists with a different spec"),
                        Some(Why::new(Reason::Conflict)),
                    ))
                };
            }
            let record = OperationRecord {
                id: id.clone(),
                spec: spec.clone(),
                result: None,
                first_seq: 0,
                input_bytes: 0,
            };
            sb.ops.insert(id.clone(), record.clone());
            st.started.push(id.clone());
            record
        };
        self.push(sandbox, Some(id), EventKind::Started { pid: 1 });
        Ok(record)
    }

    async fn cancel(&self, sandbox: &SandboxId, id: &OperationId) -> Result<bool, ApiError> {
        let running = {
            let st = self.up()?;
            st.sandboxes
                .get(sandbox)
                .and_then(|sb| sb.ops.get(id))
                .is_some_and(|r| r.result.is_none())
        };
        if running {
            let result = OperationResult::with_outcome(Outcome::Canceled);
            if let Some(r) = lock(&self.state)
                .sandboxes
                .get_mut(sandbox)
                .and_then(|sb| sb.ops.get_mut(id))
            {
                r.result = Some(result.clone());
            }
            self.push(sandbox, Some(id), EventKind::Finished(Box::new(result)));
        }
        Ok(running)
    }

    async fn operation(
        &self,
        sandbox: &SandboxId,
        id: &OperationId,
    ) -> Result<OperationRecord, ApiError> {
        let st = self.up()?;
        st.sandboxes
            .get(sandbox)
            .and_then(|sb| sb.ops.get(id))
            .cloned()
            .ok_or_else(|| ApiError::NotFound(format!("unknown operation {id}")))
    }

    async fn watch(
        &self,
        sandbox: &SandboxId,
        after_seq: u64,
        only: Option<&OperationId>,
    ) -> Result<Events, ApiError> {
        use futures_util::StreamExt;
        // Subscribed before the replay is read: nothing falls between.
        let mut live = self.live.subscribe();
        let replay: Vec<Event> = {
            let st = self.up()?;
            let sb = st
                .sandboxes
                .get(sandbox)
                .ok_or_else(|| ApiError::NotFound(format!("unknown sandbox {sandbox}")))?;
            sb.events
                .iter()
                .filter(|e| e.seq > after_seq)
                .cloned()
                .collect()
        };
        let last = replay.last().map_or(after_seq, |e| e.seq);
        let (sandbox, only) = (sandbox.clone(), only.cloned());
        let wanted = move |e: &Event| match (&only, &e.operation_id) {
            (None, _) => true,
            (Some(want), Some(got)) => want == got,
            (Some(_), None) => matches!(e.kind, EventKind::SandboxLost { .. }),
        };
        let replayed = futures_util::stream::iter(
            replay
                .into_iter()
                .filter(wanted.clone())
                .map(Ok::<_, ApiError>),
        );
        let live = async_stream(move |tx| async move {
            loop {
                match live.recv().await {
                    Ok(Some((sb, e))) if sb == sandbox && e.seq > last => {
                        if wanted(&e) && tx.send(Ok(e)).await.is_err() {
                            return;
                        }
                    }
                    Ok(Some(_)) => {}
                    // An outage breaks the stream as a lost connection does.
                    Ok(None) => {
                        let _ = tx.send(Err(unreachable())).await;
                        return;
                    }
                    Err(_) => return,
                }
            }
        });
        Ok(Box::pin(replayed.chain(live)))
    }

    async fn write_input(
        &self,
        _: &SandboxId,
        _: &OperationId,
        _: u64,
        _: Bytes,
        _: bool,
    ) -> Result<(u64, bool), ApiError> {
        Err(ApiError::Rejected(
            "the fake worker takes no input".into(),
            None,
        ))
    }

    async fn resize_terminal(
        &self,
        _: &SandboxId,
        _: &OperationId,
        _: corral_proto::TerminalSize,
    ) -> Result<(), ApiError> {
        Err(ApiError::Rejected(
            "the fake worker has no terminals".into(),
            None,
        ))
    }

    async fn fork_sandbox(
        &self,
        _: &SandboxId,
        _: &SandboxId,
    ) -> Result<Option<std::time::Duration>, ApiError> {
        Ok(None)
    }
}

/// A stream fed by a task (bounded, so a slow reader holds the task back).
fn async_stream<F, Fut>(f: F) -> impl futures_util::Stream<Item = Result<Event, ApiError>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Event, ApiError>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let task = tokio::spawn(f(tx));
    // The task ends with the stream's reader.
    let guard = tokio_util::task::AbortOnDropHandle::new(task);
    futures_util::stream::unfold((rx, guard), |(mut rx, guard)| async move {
        rx.recv().await.map(|e| (e, (rx, guard)))
    })
}

/// Fake workers behind the runner's [`Workers`]: each named by its
/// address, placed on in order (a worker that is down or refuses is passed
/// over, as placement does), found again by its id (its address). Its
/// patience for a session's worker is the real one's logic
/// ([`Workers::reach`]) over these.
#[derive(Clone)]
pub struct FakeFleet {
    workers: Arc<Vec<FakeApi>>,
    patience: std::time::Duration,
}

impl FakeFleet {
    /// Workers at `addresses`, in placement order; 60 s of patience.
    pub fn new(addresses: &[&str]) -> Self {
        Self {
            workers: Arc::new(addresses.iter().map(|a| FakeApi::at(a)).collect()),
            patience: std::time::Duration::from_secs(60),
        }
    }

    pub fn with_patience(mut self, patience: std::time::Duration) -> Self {
        self.patience = patience;
        self
    }

    /// The worker at `address`.
    pub fn worker(&self, address: &str) -> &FakeApi {
        self.workers
            .iter()
            .find(|w| &*w.address == address)
            .unwrap_or_else(|| panic!("no fake worker {address}"))
    }

    fn reachable(&self, url: &str) -> Result<FakeApi, FleetError> {
        let down = || {
            FleetError::Client(ClientError::Connect {
                url: url.to_string(),
                reason: "connection refused".into(),
            })
        };
        let w = self
            .workers
            .iter()
            .find(|w| &*w.address == url)
            .ok_or_else(down)?;
        if w.is_down() {
            return Err(down());
        }
        Ok(w.clone())
    }
}

impl Workers for FakeFleet {
    type Api = FakeApi;

    async fn urls(&self) -> Result<Vec<String>, FleetError> {
        Ok(self.workers.iter().map(|w| w.address.to_string()).collect())
    }

    async fn connect(&self, url: Option<&str>) -> Result<FakeApi, FleetError> {
        match url {
            Some(url) => self.reachable(url),
            None => Err(FleetError::NoLocal),
        }
    }

    fn place<T, E, F, Fut>(
        &self,
        urls: &[String],
        _spec: &SandboxSpec,
        mut create: F,
    ) -> impl std::future::Future<Output = Result<T, E>> + Send
    where
        T: Send,
        E: std::fmt::Display + From<FleetError> + Send,
        F: FnMut(String, FakeApi) -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, Attempt<E>>> + Send,
    {
        let urls = urls.to_vec();
        let this = self.clone();
        async move {
            let mut why = Vec::new();
            for url in urls {
                let Ok(api) = this.reachable(&url) else {
                    why.push(format!("{url}: down"));
                    continue;
                };
                match create(url.clone(), api).await {
                    Ok(v) => return Ok(v),
                    Err(Attempt::Refused(r)) => why.push(format!("{url}: {r}")),
                    Err(Attempt::Failed(e)) => return Err(e),
                }
            }
            Err(FleetError::NoWorker(why.join("; ")).into())
        }
    }

    async fn connect_recorded(
        &self,
        urls: &[String],
        url: Option<&str>,
        worker_id: Option<&str>,
    ) -> Result<FakeApi, FleetError> {
        // A fake worker's id is its address: found where it was, or not.
        let _ = (urls, worker_id);
        self.connect(url).await
    }

    fn patience(&self) -> std::time::Duration {
        self.patience
    }
}
