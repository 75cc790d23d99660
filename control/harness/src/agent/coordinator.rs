//! The event loop: one task per session, the only writer of its state. It
//! selects over the inbox, the manager's operation snapshots, the model
//! request in flight (and its streaming deltas), the grace timer and the
//! heartbeat timer, hands each to [`Core`], and carries out the effects.

use std::sync::Arc;
use std::time::Duration;

use corral_proto::OperationId;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::core::{Core, CoreError, Effect, Ending, now_ms};
use super::events::Event;
use super::record::{StopCause, StopMode};
use crate::llm::{LlmError, Model, Response, StreamDelta};
use crate::ops::{Operation, OperationManager};

/// How long completions of one turn's calls are batched.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);
/// Default heartbeat interval.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(600);
/// Inputs waiting for the loop.
pub const INBOX_CAPACITY: usize = 64;

/// What the outside may send a running session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbox {
    /// A user input; inputs with an id seen before are ignored.
    Input {
        input_id: String,
        text: String,
    },
    Stop(StopMode),
    /// The session's sandbox is lost, for this reason: the run fails.
    SandboxLost(String),
    /// The sandbox's egress proxy decided on a connection.
    Egress(corral_proto::event::Egress),
    /// This many egress decisions came faster than the run took them.
    EgressUnrecorded(u64),
}

#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// `None`: no heartbeats.
    pub heartbeat: Option<Duration>,
    pub grace: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            heartbeat: Some(DEFAULT_HEARTBEAT),
            grace: DEFAULT_GRACE,
        }
    }
}

/// How a run ended, with its totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub ending: Ending,
    pub final_text: String,
    pub error: Option<String>,
    /// Why the sandbox was lost, when that is why the run failed.
    pub sandbox_lost: Option<String>,
    /// Model requests of the whole session, and of this run.
    pub turns: u64,
    pub run_turns: u64,
    pub tool_calls: u64,
    pub usage: crate::llm::Usage,
}

/// What the loop has under way besides the core: the request in flight,
/// the grace deadline, and manager jobs (adds, cancels).
struct Work {
    request: Option<InFlight>,
    grace_at: Option<Instant>,
    jobs: JoinSet<Vec<(OperationId, String)>>,
}

/// A streamed delta as an event for the watcher (display only).
fn delta_event(turn: u64, delta: StreamDelta) -> Option<Event> {
    match delta {
        StreamDelta::Text(text) => Some(Event::TextDelta { turn, text }),
        StreamDelta::Retrying { attempt, reason } => Some(Event::ModelRetry {
            turn,
            attempt,
            reason,
        }),
        StreamDelta::ToolCallStarted { .. } => None,
    }
}

struct InFlight {
    turn: u64,
    task: JoinHandle<Result<Response, LlmError>>,
    cancel: CancellationToken,
    deltas: mpsc::Receiver<StreamDelta>,
}

impl InFlight {
    fn abort(self) {
        self.cancel.cancel();
        self.task.abort();
    }
}

pub struct Coordinator<M: OperationManager + 'static> {
    core: Core,
    manager: Arc<M>,
    updates: mpsc::Receiver<Operation>,
    llm: Arc<dyn Model>,
    inbox: mpsc::Receiver<Inbox>,
    events: mpsc::Sender<Event>,
    settings: Settings,
}

enum FromModel {
    Delta(StreamDelta),
    Done(u64, Result<Response, LlmError>),
}

/// The next thing the request in flight has to say: streamed deltas first,
/// then how it ended.
async fn from_model(req: &mut Option<InFlight>) -> FromModel {
    let Some(r) = req else {
        return std::future::pending().await;
    };
    tokio::select! {
        biased;
        Some(d) = r.deltas.recv() => FromModel::Delta(d),
        res = &mut r.task => FromModel::Done(
            r.turn,
            res.unwrap_or_else(|e| Err(LlmError::Transport(format!("the request task ended: {e}")))),
        ),
    }
}

async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl<M: OperationManager + 'static> Coordinator<M> {
    /// `updates` is the manager's snapshot channel. Returns the coordinator
    /// and the sender of its inbox.
    pub fn new(
        core: Core,
        manager: Arc<M>,
        updates: mpsc::Receiver<Operation>,
        llm: Arc<dyn Model>,
        events: mpsc::Sender<Event>,
        settings: Settings,
    ) -> (Self, mpsc::Sender<Inbox>) {
        let (tx, inbox) = mpsc::channel(INBOX_CAPACITY);
        (
            Self {
                core,
                manager,
                updates,
                llm,
                inbox,
                events,
                settings,
            },
            tx,
        )
    }

    /// Runs the session until it ends (see [`Core::ending`]). A closed
    /// inbox is a request to stop when idle.
    pub async fn run(self) -> Result<Summary, CoreError> {
        let span = info_span!("session", id = %self.core.session_id());
        self.run_inner().instrument(span).await
    }

    /// Carries out one effect of the core.
    async fn carry_out(&mut self, effect: Effect, work: &mut Work) {
        match effect {
            Effect::Send { turn, request } => {
                if let Some(old) = work.request.take() {
                    old.abort();
                }
                let (dtx, drx) = mpsc::channel(256);
                let cancel = CancellationToken::new();
                let (llm, token) = (self.llm.clone(), cancel.clone());
                let task = tokio::spawn(
                    async move { llm.respond(&request, Some(&dtx), &token).await }
                        .instrument(info_span!("turn", turn)),
                );
                work.request = Some(InFlight {
                    turn,
                    task,
                    cancel,
                    deltas: drx,
                });
            }
            Effect::CancelRequest => {
                if let Some(old) = work.request.take() {
                    debug!(turn = old.turn, "request canceled");
                    old.abort();
                }
            }
            Effect::Add(ops) => {
                let m = self.manager.clone();
                work.jobs.spawn(async move {
                    let mut failed = Vec::new();
                    for op in ops {
                        let id = op.id.clone();
                        if let Err(e) = m.add(op).await {
                            failed.push((id, e.to_string()));
                        }
                    }
                    failed
                });
            }
            Effect::Cancel(ids) => {
                let m = self.manager.clone();
                work.jobs.spawn(async move {
                    for id in ids {
                        if let Err(e) = m.cancel(&id, "the session stopped").await {
                            warn!(operation = %id, error = %e, "cancel failed");
                        }
                    }
                    Vec::new()
                });
            }
            Effect::ArmGrace => work.grace_at = Some(Instant::now() + self.settings.grace),
            Effect::Emit(e) => {
                let _ = self.events.send(e).await;
            }
        }
    }

    /// Operations the manager would not take (it stopped) fail.
    fn not_started(&mut self, failed: Vec<(OperationId, String)>) -> Result<(), CoreError> {
        for (id, error) in failed {
            if let Some(st) = self.core.state().ops.get(&id) {
                let mut op = Operation::new(id.clone(), st.spec.clone());
                op.fail(format!("the operation could not be started: {error}"));
                self.core.operation(op)?;
            }
        }
        Ok(())
    }

    async fn run_inner(mut self) -> Result<Summary, CoreError> {
        let mut work = Work {
            request: None,
            grace_at: None,
            jobs: JoinSet::new(),
        };
        // Armed when the session starts waiting for nothing but calls (not
        // reset by their progress), disarmed when anything else is pending.
        let mut heartbeat_at: Option<Instant> = None;
        let mut inbox_open = true;
        let result: Result<Ending, CoreError> = loop {
            for effect in self.core.take_effects() {
                self.carry_out(effect, &mut work).await;
            }
            if !self.core.grace_active() {
                work.grace_at = None;
            }
            if !self.core.waiting_only_for_calls() {
                heartbeat_at = None;
            } else if heartbeat_at.is_none() {
                heartbeat_at = self.settings.heartbeat.map(|h| Instant::now() + h);
            }
            if let Some(ending) = self.core.ending() {
                break self.core.finish(ending).map(|()| ending);
            }
            let step = tokio::select! {
                msg = self.inbox.recv(), if inbox_open => match msg {
                    Some(Inbox::Input { input_id, text }) => self.core.input(&input_id, &text),
                    Some(Inbox::Stop(mode)) => self.core.stop(mode, StopCause::Requested),
                    Some(Inbox::SandboxLost(reason)) => self.core.sandbox_lost(&reason),
                    Some(Inbox::Egress(e)) => self.core.egress(&e),
                    Some(Inbox::EgressUnrecorded(n)) => self.core.egress_unrecorded(n),
                    None => {
                        inbox_open = false;
                        self.core.stop(StopMode::WhenIdle, StopCause::Requested)
                    }
                },
                Some(op) = self.updates.recv() => self.core.operation(op),
                m = from_model(&mut work.request) => match m {
                    FromModel::Done(turn, res) => {
                        work.request = None;
                        self.core.model_done(turn, res)
                    }
                    FromModel::Delta(delta) => {
                        let turn = work.request.as_ref().map_or(0, |r| r.turn);
                        if let Some(e) = delta_event(turn, delta) {
                            let _ = self.events.try_send(e);
                        }
                        Ok(())
                    }
                },
                Some(done) = work.jobs.join_next(), if !work.jobs.is_empty() => {
                    self.not_started(done.unwrap_or_default())
                }
                () = until(work.grace_at) => {
                    work.grace_at = None;
                    self.core.grace_over()
                }
                () = until(heartbeat_at) => {
                    heartbeat_at = None;
                    self.core.heartbeat(now_ms())
                }
            };
            if let Err(e) = step {
                break Err(e);
            }
        };
        if let Some(r) = work.request.take() {
            r.abort();
        }
        // Cancels and adds still under way finish before the run reports.
        while work.jobs.join_next().await.is_some() {}
        let ending = result?;
        let s = self.core.state();
        Ok(Summary {
            ending,
            final_text: s.final_text.clone(),
            error: match ending {
                Ending::Done => None,
                Ending::Interrupted => Some("interrupted".into()),
                Ending::Failed => Some(s.failure.clone().unwrap_or_else(|| {
                    format!("the run reached its limit of {} turns", s.max_turns())
                })),
            },
            sandbox_lost: s.sandbox_lost.clone().filter(|_| ending == Ending::Failed),
            turns: s.turns(),
            run_turns: s.run_turns(),
            tool_calls: s.tool_calls(),
            usage: s.usage,
        })
    }
}
