//! A runtime of no engine, for the lifecycle's tests: containers are
//! entries of a map, each with a supervisor that speaks the real framed
//! protocol (`corral/v1/init.proto`) over in-memory pipes: it answers
//! attaches with a Welcome, resets with ResetDone, and refuses to run
//! commands (it has nothing to run them in), as a supervisor refuses a
//! frame it cannot take. Every step can be made to take time (on the
//! test's paused clock) or to fail, so that each race and each failure
//! path of the lifecycle is a test of milliseconds. What it was asked is
//! kept, to be looked at.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bollard::container::{AttachContainerResults, LogOutput};
use bollard::models::{ContainerSummary, ContainerSummaryStateEnum};
use corral_init::treecopy::Copied;
use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest, RejectKind, Welcome};
use corral_proto::{SandboxId, SandboxSpec, pb};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::Runtime;
use crate::docker::{ContainerProcess, ContainerUsage, LABEL_SANDBOX, LABEL_WORKER};
use crate::error::{Result, WorkerError};

/// A step of the runtime, to be slowed or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Create,
    Attach,
    Remove,
    Pause,
    Unpause,
    Checkpoint,
    Restore,
    Copy,
    List,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Run {
    Running,
    Paused,
    /// Stopped by a checkpoint, to be restored.
    Checkpointed,
    /// Stopped otherwise (its supervisor died).
    Exited,
}

#[derive(Debug)]
struct Container {
    name: String,
    sandbox: String,
    run: Run,
    /// The supervisor's start: the same across a checkpoint and restore
    /// (its memory comes back), another after a stop.
    boot_id: String,
    /// Ends the supervisor's current attaches (its container stopped).
    attached: CancellationToken,
    spec: SandboxSpec,
    /// What a fork copied into it: the container it came from.
    copied_from: Option<String>,
    /// Its "process", a number only the fake reads (it names no process
    /// of the host).
    pid: u32,
}

#[derive(Default)]
struct State {
    containers: HashMap<String, Container>,
    made: u64,
    /// How many of the next calls of a step fail.
    faults: HashMap<Step, u32>,
    delays: HashMap<Step, Duration>,
    /// Every call, in order: the step and the container (or sandbox) named.
    calls: Vec<(Step, String)>,
}

/// See the module's documentation.
pub struct FakeRuntime {
    worker_id: String,
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The error the engine's failure of a step is.
fn engine_failed(step: Step) -> WorkerError {
    WorkerError::Docker(bollard::errors::Error::DockerResponseServerError {
        status_code: 500,
        message: format!("the fake engine failed {step:?}, as it was told to"),
    })
}

fn not_found(container: &str) -> WorkerError {
    WorkerError::Docker(bollard::errors::Error::DockerResponseServerError {
        status_code: 404,
        message: format!("No such container: {container}"),
    })
}

impl FakeRuntime {
    pub fn new(worker_id: &str) -> Arc<Self> {
        Arc::new(Self {
            worker_id: worker_id.into(),
            state: Mutex::new(State::default()),
        })
    }

    /// The next `times` calls of `step` fail.
    pub fn fail(&self, step: Step, times: u32) {
        lock(&self.state).faults.insert(step, times);
    }

    /// Each call of `step` takes `by` (on tokio's clock) before it acts.
    pub fn slow(&self, step: Step, by: Duration) {
        lock(&self.state).delays.insert(step, by);
    }

    /// The containers there are, by id, with their sandbox and state.
    pub fn containers(&self) -> Vec<(String, String, Run)> {
        let mut all: Vec<_> = lock(&self.state)
            .containers
            .iter()
            .map(|(id, c)| (id.clone(), c.sandbox.clone(), c.run))
            .collect();
        all.sort();
        all
    }

    /// How many times `step` was asked for.
    pub fn calls(&self, step: Step) -> usize {
        lock(&self.state)
            .calls
            .iter()
            .filter(|(s, _)| *s == step)
            .count()
    }

    /// The container a fork copied into `container`, if one did.
    pub fn copied_from(&self, container: &str) -> Option<String> {
        lock(&self.state)
            .containers
            .get(container)
            .and_then(|c| c.copied_from.clone())
    }

    /// The supervisor of `container` dies (its container exits).
    pub fn kill(&self, container: &str) {
        if let Some(c) = lock(&self.state).containers.get_mut(container) {
            c.run = Run::Exited;
            c.attached.cancel();
        }
    }

    /// Takes the step: waits its delay, then fails it if told to.
    async fn step(&self, step: Step, what: &str) -> Result<()> {
        let delay = {
            let mut s = lock(&self.state);
            s.calls.push((step, what.to_string()));
            s.delays.get(&step).copied()
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let mut s = lock(&self.state);
        if let Some(n) = s.faults.get_mut(&step)
            && *n > 0
        {
            *n -= 1;
            return Err(engine_failed(step));
        }
        Ok(())
    }

    /// Sets the state of `container` when it is in one of `from`.
    fn change(&self, container: &str, from: &[Run], to: Run) -> Result<()> {
        let mut s = lock(&self.state);
        let c = s
            .containers
            .get_mut(container)
            .ok_or_else(|| not_found(container))?;
        if !from.contains(&c.run) {
            return Err(WorkerError::Docker(
                bollard::errors::Error::DockerResponseServerError {
                    status_code: 409,
                    message: format!("container {container} is {:?}", c.run),
                },
            ));
        }
        if matches!(to, Run::Checkpointed | Run::Exited) {
            c.attached.cancel();
            c.attached = CancellationToken::new();
        }
        c.run = to;
        Ok(())
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    fn worker_id(&self) -> &str {
        &self.worker_id
    }

    async fn version(&self) -> String {
        "fake".into()
    }

    async fn create(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        _egress_dir: Option<&Path>,
        _volumes: &[super::Bind],
    ) -> Result<String> {
        self.step(Step::Create, id.as_str()).await?;
        let mut s = lock(&self.state);
        s.made += 1;
        let container = format!("fake-{:04}", s.made);
        let pid = u32::try_from(s.made).unwrap_or(u32::MAX);
        let name = crate::docker::container_name(&self.worker_id, id);
        if s.containers.values().any(|c| c.name == name) {
            return Err(WorkerError::Docker(
                bollard::errors::Error::DockerResponseServerError {
                    status_code: 409,
                    message: format!("the container name {name:?} is already in use"),
                },
            ));
        }
        s.containers.insert(
            container.clone(),
            Container {
                name,
                sandbox: id.to_string(),
                run: Run::Running,
                boot_id: uuid::Uuid::new_v4().to_string(),
                attached: CancellationToken::new(),
                spec: spec.clone(),
                copied_from: None,
                pid,
            },
        );
        Ok(container)
    }

    async fn attach(&self, container: &str) -> Result<AttachContainerResults> {
        self.step(Step::Attach, container).await?;
        let (boot_id, ended) = {
            let s = lock(&self.state);
            let c = s
                .containers
                .get(container)
                .ok_or_else(|| not_found(container))?;
            if c.run != Run::Running {
                return Err(WorkerError::Docker(
                    bollard::errors::Error::DockerResponseServerError {
                        status_code: 409,
                        message: format!("container {container} is not running"),
                    },
                ));
            }
            (c.boot_id.clone(), c.attached.clone())
        };
        let (worker_end, supervisor_end) = tokio::io::duplex(64 << 10);
        let (worker_read, worker_write) = tokio::io::split(worker_end);
        drop(worker_read);
        let (out_tx, out_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
        tokio::spawn(supervise(supervisor_end, out_tx, boot_id, ended));
        let output = tokio_stream::wrappers::ReceiverStream::new(out_rx).map(|frame| {
            Ok(LogOutput::StdOut {
                message: frame.into(),
            })
        });
        Ok(AttachContainerResults {
            output: Box::pin(output),
            input: Box::pin(worker_write),
        })
    }

    async fn running(&self, container: &str) -> Result<Option<bool>> {
        Ok(lock(&self.state)
            .containers
            .get(container)
            .map(|c| c.run == Run::Running))
    }

    async fn exit_reason(&self, container: &str) -> String {
        match lock(&self.state).containers.get(container) {
            Some(c) => format!("container is {:?}", c.run),
            None => "container removed".into(),
        }
    }

    async fn remove_container(&self, container: &str) -> Result<()> {
        self.step(Step::Remove, container).await?;
        let mut s = lock(&self.state);
        // By id or by name, as the engine takes either.
        let id = s
            .containers
            .iter()
            .find(|(id, c)| *id == container || c.name == container)
            .map(|(id, _)| id.clone());
        if let Some(c) = id.and_then(|id| s.containers.remove(&id)) {
            c.attached.cancel();
        }
        Ok(())
    }

    async fn list_owned(&self) -> Result<Vec<ContainerSummary>> {
        self.step(Step::List, "").await?;
        let s = lock(&self.state);
        Ok(s.containers
            .iter()
            .map(|(id, c)| ContainerSummary {
                id: Some(id.clone()),
                names: Some(vec![format!("/{}", c.name)]),
                labels: Some(HashMap::from([
                    (LABEL_WORKER.to_string(), self.worker_id.clone()),
                    (LABEL_SANDBOX.to_string(), c.sandbox.clone()),
                ])),
                state: Some(match c.run {
                    Run::Running => ContainerSummaryStateEnum::RUNNING,
                    Run::Paused => ContainerSummaryStateEnum::PAUSED,
                    Run::Checkpointed | Run::Exited => ContainerSummaryStateEnum::EXITED,
                }),
                ..Default::default()
            })
            .collect())
    }

    async fn pause(&self, container: &str) -> Result<()> {
        self.step(Step::Pause, container).await?;
        self.change(container, &[Run::Running], Run::Paused)
    }

    async fn unpause(&self, container: &str) -> Result<()> {
        self.step(Step::Unpause, container).await?;
        self.change(container, &[Run::Paused], Run::Running)
    }

    async fn checkpoints_supported(&self) -> Result<()> {
        Ok(())
    }

    async fn checkpoint(&self, container: &str) -> Result<()> {
        self.step(Step::Checkpoint, container).await?;
        self.change(container, &[Run::Running], Run::Checkpointed)
    }

    async fn snapshot(&self, _image: &str, _workspace: &Path) -> Result<String> {
        Err(crate::error::WorkerError::NotApplicable(
            "the fake engine keeps no images".into(),
        ))
    }

    fn seed(
        &self,
        _container: &str,
    ) -> futures_util::stream::BoxStream<'static, Result<bytes::Bytes>> {
        use futures_util::StreamExt;
        futures_util::stream::empty().boxed()
    }

    async fn restore(&self, container: &str) -> Result<()> {
        self.step(Step::Restore, container).await?;
        self.change(container, &[Run::Checkpointed], Run::Running)
    }

    async fn process(&self, container: &str) -> Result<ContainerProcess> {
        let s = lock(&self.state);
        let c = s
            .containers
            .get(container)
            .ok_or_else(|| not_found(container))?;
        Ok(ContainerProcess {
            pid: (c.run == Run::Running || c.run == Run::Paused).then_some(c.pid),
            paused: c.run == Run::Paused,
            uid: 0,
            runtime: c.spec.runtime.clone().unwrap_or_default(),
            writable_rootfs: false,
        })
    }

    fn out_of_sight(&self, _p: &ContainerProcess, _container: &str) -> Option<String> {
        None
    }

    async fn copy_trees(&self, from: &ContainerProcess, to: &ContainerProcess) -> Result<Copied> {
        self.step(Step::Copy, "").await?;
        let mut s = lock(&self.state);
        let find = |pid: Option<u32>| {
            s.containers
                .iter()
                .find(|(_, c)| pid == Some(c.pid) && c.run != Run::Exited)
                .map(|(id, _)| id.clone())
        };
        let (Some(from), Some(to)) = (find(from.pid), find(to.pid)) else {
            return Err(WorkerError::Fork(
                "a sandbox of the fork is not running".into(),
            ));
        };
        if let Some(c) = s.containers.get_mut(&to) {
            c.copied_from = Some(from);
        }
        Ok(Copied::default())
    }

    async fn stats(&self, container: &str) -> Result<ContainerUsage> {
        lock(&self.state)
            .containers
            .get(container)
            .map(|_| ContainerUsage::default())
            .ok_or_else(|| not_found(container))
    }
}

/// One attach of a supervisor: frames from the worker on `pipe`, frames
/// back on `out`, until `ended` (its container stopped) or the worker
/// lets go.
async fn supervise(
    pipe: tokio::io::DuplexStream,
    out: tokio::sync::mpsc::Sender<Vec<u8>>,
    boot_id: String,
    ended: CancellationToken,
) {
    let (mut from_worker, mut to_worker) = tokio::io::split(pipe);
    // The supervisor's stdout, not the pipe, carries its frames back.
    let _ = to_worker.shutdown().await;
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = tokio::select! {
            () = ended.cancelled() => return,
            n = from_worker.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
        };
        decoder.extend(&buf[..n]);
        loop {
            let request = match decoder.next_message::<pb::InitRequest>() {
                Ok(Some(m)) => InitRequest::try_from(m),
                Ok(None) => break,
                // A stream that cannot be read any further.
                Err(_) => return,
            };
            let answer = match request {
                Ok(InitRequest::Attach { attach, .. }) => Some(InitMessage::Welcome(Welcome {
                    version: "fake".into(),
                    boot_id: boot_id.clone(),
                    last_seq: 0,
                    operations: Vec::new(),
                    more: false,
                    attach,
                    page: 0,
                })),
                Ok(InitRequest::Reset) => Some(InitMessage::ResetDone { killed: 0 }),
                Ok(InitRequest::Run { operation_id, .. }) => Some(InitMessage::Rejected {
                    operation_id: Some(operation_id),
                    kind: RejectKind::Malformed,
                    reason: "the fake runtime's supervisor runs no commands".into(),
                }),
                Ok(
                    InitRequest::Cancel { operation_id }
                    | InitRequest::Signal { operation_id, .. }
                    | InitRequest::Input { operation_id, .. }
                    | InitRequest::Resize { operation_id, .. },
                ) => Some(InitMessage::Rejected {
                    operation_id: Some(operation_id),
                    kind: RejectKind::UnknownOperation,
                    reason: "no such operation".into(),
                }),
                Ok(
                    InitRequest::Credit { .. }
                    | InitRequest::Egress(_)
                    | InitRequest::Port(_)
                    | InitRequest::StartRelay
                    | InitRequest::StartIngress { .. },
                ) => None,
                Err(e) => Some(InitMessage::Rejected {
                    operation_id: None,
                    kind: RejectKind::Malformed,
                    reason: e.to_string(),
                }),
            };
            if let Some(m) = answer
                && out
                    .send(frame::encode(&pb::InitMessage::from(m)))
                    .await
                    .is_err()
            {
                return;
            }
        }
    }
}
