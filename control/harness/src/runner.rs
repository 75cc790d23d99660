//! A session's run, wherever it goes: started on a worker of a [`Fleet`]
//! (placed) or resumed on the one it was placed on (found again by the
//! worker's id, waited for as its session asks), gone on in a fresh
//! sandbox after a loss when its session asked for that, and ended as its
//! caller asks (its files exported, its sandbox suspended). One [`Run`]
//! spans every sandbox generation: one inbox, one stream of events (a
//! replacement shows as [`Event::SandboxReplaced`]), one end. The command
//! line hosts a session through it, and so may any other caller.

use std::path::PathBuf;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::agent::events::{Event, RunResult};
use crate::agent::record::OnSandboxLost;
use crate::agent::{CoreError, Ending, Inbox, Summary};
use crate::fleet::Workers;
use crate::placement::Attempt;
use crate::session::LogError;
use crate::sessions::{RunOptions, SessionError, SessionHandle, Sessions, sandbox_spec};
use crate::transfer::{Moved, Unpacking};
use crate::worker_api::WorkerApi;

/// Inputs a run holds for its session beyond the session's own inbox.
const PENDING_INPUTS: usize = 64;

/// Fresh sandboxes one run may take after losses.
pub const MAX_REPLACEMENTS: usize = 3;

/// What is done once the session's run is over, however it ended.
#[derive(Debug, Clone, Default)]
pub struct RunEnd {
    /// Bring the sandbox's files here, by these rules.
    pub export: Option<(PathBuf, Unpacking)>,
    /// Leave the sandbox running (else it is suspended).
    pub keep_sandbox: bool,
}

/// How a run ended: its session's summary (turns counted across its
/// sandboxes), and how the export went, when one was asked for.
#[derive(Debug)]
pub struct RunOutcome {
    pub summary: Summary,
    pub exported: Option<Result<Moved, SessionError>>,
}

impl RunOutcome {
    /// The last event of the run, as `corral run` shows it: how it ended
    /// (`duration`: the run's, as its host measured it).
    pub fn result_event(&self, session_id: &str, duration: std::time::Duration) -> Event {
        let summary = &self.summary;
        Event::Result(RunResult {
            status: summary.ending,
            session_id: session_id.to_string(),
            final_text: summary.final_text.clone(),
            error: summary.error.clone(),
            turns: summary.turns,
            run_turns: summary.run_turns,
            tool_calls: summary.tool_calls,
            usage: summary.usage,
            duration_ms: duration.as_millis() as u64,
        })
    }
}

/// A running session, across its sandboxes.
pub struct Run {
    pub id: String,
    /// Inputs and stops (bounded). Closed when the run is over.
    pub inputs: mpsc::Sender<Inbox>,
    /// What happens, starting with [`Event::SessionStarted`].
    pub events: mpsc::Receiver<Event>,
    /// How it ended.
    pub task: JoinHandle<Result<RunOutcome, SessionError>>,
    leave: Option<oneshot::Sender<String>>,
}

impl Run {
    /// Sends an input or a stop; a run that is over is an error, never a
    /// silent drop.
    pub async fn send(&self, input: Inbox) -> Result<(), SessionError> {
        self.inputs
            .send(input)
            .await
            .map_err(|_| SessionError::Gone(self.id.clone()))
    }

    /// Leaves the session as it is now (its calls not waited for: its log
    /// lets a rerun resume), then ends the run as asked (export, suspend):
    /// the run ends `interrupted` with `why`.
    pub fn leave(&mut self, why: String) {
        if let Some(tx) = self.leave.take() {
            let _ = tx.send(why);
        }
    }
}

/// Starts session `id` (placed among `fleet`'s workers) or resumes it (on
/// the worker it was placed on), and runs it to its end, then ends it as
/// `end` says. What cannot start is an error here; what happens after, in
/// the run's events and outcome.
pub async fn run<F: Workers>(
    store: &Sessions,
    fleet: &F,
    id: &str,
    mut opts: RunOptions,
    end: RunEnd,
) -> Result<Run, SessionError> {
    // The run's trace spans its sandbox's making and its end too.
    let trace = opts
        .telemetry
        .as_ref()
        .map(|t| crate::telemetry::RunTrace::start(t, id));
    opts.trace = trace.clone();
    let suspended = store.saved_workspace(id).exists();
    let existed = store.exists(id)?;
    // Where the session's count of turns stood before this run.
    let start_turns = if existed {
        store.brief_of(id).map_or(0, |b| b.turns)
    } else {
        0
    };
    let (handle, worker) = begin(store, fleet, id, &opts).await?;
    if let Some(t) = &trace {
        let (sandbox, at) = (handle.config.sandbox_id.to_string(), worker.address());
        let what = match (existed, suspended) {
            (false, _) => "sandbox_created",
            (true, true) => "sandbox_resumed",
            (true, false) => "session_resumed",
        };
        t.with(|t| {
            t.note(
                what,
                vec![
                    opentelemetry::KeyValue::new("corral.sandbox.id", sandbox),
                    opentelemetry::KeyValue::new("corral.worker", at),
                ],
            )
        });
    }
    let (inputs, inbox) = mpsc::channel(64);
    let (events_tx, events) = mpsc::channel(256);
    let (leave, left) = oneshot::channel();
    let driver = Driver {
        store: store.clone(),
        fleet: fleet.clone(),
        id: id.to_string(),
        opts,
        end,
        events: events_tx,
        trace,
        start_turns,
    };
    let task = tokio::spawn(driver.drive(handle, worker, inbox, left));
    Ok(Run {
        id: id.to_string(),
        inputs,
        events,
        task,
        leave: Some(leave),
    })
}

/// The run's first sandbox: the session resumed where it was placed, or
/// placed and started.
async fn begin<F: Workers>(
    store: &Sessions,
    fleet: &F,
    id: &str,
    opts: &RunOptions,
) -> Result<(SessionHandle, F::Api), SessionError> {
    let urls = fleet.urls().await?;
    if !store.exists(id)? {
        // Checked before any worker is asked.
        let new = store.prepare(id, opts.clone())?;
        if urls.len() > 1 {
            let spec = sandbox_spec(new.config());
            return fleet
                .place(&urls, &spec, |url, client| {
                    // Owned: a placement's attempts borrow nothing (the
                    // future stays `Send` however the caller spawns it).
                    let (store, new) = (store.clone(), new.clone().placed_on(Some(url)));
                    async move {
                        match store.start(new, client.clone()).await {
                            Ok(handle) => Ok((handle, client)),
                            Err(e @ SessionError::Refused { .. }) => {
                                Err(Attempt::Refused(e.to_string()))
                            }
                            Err(e) => Err(Attempt::Failed(e)),
                        }
                    }
                })
                .await;
        }
        let url = urls.first().cloned();
        let client = fleet.connect(url.as_deref()).await?;
        let handle = store.start(new.placed_on(url), client.clone()).await?;
        return Ok((handle, client));
    }
    let stored = store.open(id)?;
    if stored.recovery().torn_bytes > 0 {
        tracing::warn!(
            session = %id,
            bytes = stored.recovery().torn_bytes,
            "the session log ended in a torn record (a crash mid-write); it was cut off"
        );
    }
    let Some(config) = stored.config() else {
        return Err(SessionError::Core(CoreError::NoStart(id.to_string())));
    };
    // Recorded, or (none recorded) the local worker.
    let worker = config.worker.clone();
    if !urls.is_empty() && worker.as_ref().is_none_or(|w| !urls.contains(w)) {
        tracing::warn!(
            worker = worker.as_deref().unwrap_or("the local worker"),
            "the session stays on the worker it was placed on"
        );
    }
    let worker_id = config.worker_id.clone();
    let moves = config.on_sandbox_lost == OnSandboxLost::NewSandbox;
    let reached = if moves {
        // A worker that restarts is waited for, one that is gone is not.
        fleet
            .reach(&urls, worker.as_deref(), worker_id.as_deref())
            .await
    } else {
        fleet
            .connect_recorded(&urls, worker.as_deref(), worker_id.as_deref())
            .await
    };
    let at = worker.as_deref().unwrap_or("in this process");
    match reached {
        Ok(client) => Ok((
            store.resume(stored, client.clone(), opts.clone()).await?,
            client,
        )),
        // Suspended, it holds nothing on its worker: whatever its policy,
        // it goes on elsewhere with its files.
        Err(e) if e.is_unreachable() && store.saved_workspace(id).exists() => {
            drop(stored);
            let reason = format!("its worker {at} does not answer: {e}");
            tracing::warn!(%reason, "the suspended session goes on on another worker");
            elsewhere(store, fleet, id, &reason, opts).await
        }
        Err(e) if moves && e.is_unreachable() => {
            drop(stored);
            let reason = format!("sandbox lost: worker {at} unreachable ({e})");
            tracing::warn!(%reason, "the session's worker is gone; it goes on in a fresh sandbox");
            elsewhere(store, fleet, id, &reason, opts).await
        }
        Err(e) => Err(e.into()),
    }
}

/// Resumes session `id` in a fresh sandbox, placed among the fleet's
/// workers (or on the one worker, or the local one).
async fn elsewhere<F: Workers>(
    store: &Sessions,
    fleet: &F,
    id: &str,
    reason: &str,
    opts: &RunOptions,
) -> Result<(SessionHandle, F::Api), SessionError> {
    let urls = fleet.urls().await?;
    if urls.len() > 1 {
        let spec = sandbox_spec(&store.config_of(id)?);
        return fleet
            .place(&urls, &spec, |url, client| {
                let (store, id, reason, opts) = (
                    store.clone(),
                    id.to_string(),
                    reason.to_string(),
                    opts.clone(),
                );
                async move {
                    let stored = store.open(&id).map_err(Attempt::Failed)?;
                    match store
                        .resume_elsewhere(stored, client.clone(), Some(url), &reason, opts)
                        .await
                    {
                        Ok(handle) => Ok((handle, client)),
                        Err(e @ SessionError::Refused { .. }) => {
                            Err(Attempt::Refused(e.to_string()))
                        }
                        Err(e) => Err(Attempt::Failed(e)),
                    }
                }
            })
            .await;
    }
    let url = urls.first().cloned();
    let client = fleet.connect(url.as_deref()).await?;
    let stored = store.open(id)?;
    let handle = store
        .resume_elsewhere(stored, client.clone(), url, reason, opts.clone())
        .await?;
    Ok((handle, client))
}

/// The run's own task: it carries inputs in and events out across the
/// session's sandboxes, and ends the run.
struct Driver<F: Workers> {
    store: Sessions,
    fleet: F,
    id: String,
    opts: RunOptions,
    end: RunEnd,
    events: mpsc::Sender<Event>,
    trace: Option<crate::telemetry::RunTrace>,
    /// The session's turns before this run.
    start_turns: u64,
}

/// How one sandbox generation's run ended.
enum Generation {
    Ended(Summary),
    /// Its caller left it (see [`Run::leave`]).
    Left(String),
}

impl<F: Workers> Driver<F> {
    async fn drive(
        self,
        first: SessionHandle,
        mut worker: F::Api,
        mut inbox: mpsc::Receiver<Inbox>,
        mut left: oneshot::Receiver<String>,
    ) -> Result<RunOutcome, SessionError> {
        let limit = match self.opts.request.limits.max_turns {
            Some(n) => n,
            None => self.store.config_of(&self.id)?.max_turns,
        };
        let start_turns = self.start_turns;
        let mut handle = first;
        let mut replacing: Option<String> = None;
        let (mut used, mut replaced) = (0, 0);
        // The caller dropped its handle without leaving: the run goes on
        // to its end (a oneshot is not asked again once it answered).
        let mut caller_gone = false;
        let summary = loop {
            let ended = self
                .carry(
                    handle,
                    replacing.as_deref(),
                    &mut inbox,
                    &mut left,
                    &mut caller_gone,
                )
                .await?;
            let mut summary = match ended {
                Generation::Ended(s) => s,
                Generation::Left(why) => {
                    // The session's own totals, as its log has them.
                    let brief = self.store.brief_of(&self.id).unwrap_or_default();
                    let mut s = left_unfinished(why);
                    (s.turns, s.tool_calls) = (brief.turns, brief.tool_calls);
                    s.run_turns = brief.turns.saturating_sub(start_turns);
                    break s;
                }
            };
            used += summary.run_turns;
            summary.run_turns = used;
            // A session that asked for it goes on in a fresh sandbox when
            // its sandbox is lost, placed anew (the lost worker does not
            // answer): the same run, its turn limit counting on.
            let Some(reason) = self.lost(&summary) else {
                break summary;
            };
            if replaced >= MAX_REPLACEMENTS {
                break summary;
            }
            replaced += 1;
            let mut rest = self.opts.clone();
            rest.request.limits.max_turns = Some(limit.saturating_sub(used));
            let (next, at) = elsewhere(&self.store, &self.fleet, &self.id, &reason, &rest).await?;
            handle = next;
            worker = at;
            replacing = Some(reason);
        };
        // However the run ended, what it made is brought back.
        let exported = match &self.end.export {
            Some((dest, rules)) => Some(
                self.store
                    .export(&self.id, worker.clone(), dest, rules.clone())
                    .await,
            ),
            None => None,
        };
        if let (Some(t), Some(e)) = (&self.trace, &exported) {
            t.with(|t| {
                t.note(
                    "exported",
                    vec![opentelemetry::KeyValue::new("corral.exported", e.is_ok())],
                )
            });
        }
        if !self.end.keep_sandbox {
            self.suspend(worker).await;
        }
        if let Some(t) = &self.trace {
            t.end();
        }
        Ok(RunOutcome { summary, exported })
    }

    /// Carries one generation's events out and the caller's inputs in,
    /// until its session's task ends or the caller leaves.
    async fn carry(
        &self,
        handle: SessionHandle,
        replacing: Option<&str>,
        inbox: &mut mpsc::Receiver<Inbox>,
        left: &mut oneshot::Receiver<String>,
        caller_gone: &mut bool,
    ) -> Result<Generation, SessionError> {
        let SessionHandle {
            inputs,
            mut events,
            task,
            ..
        } = handle;
        // Owned here: a run that is aborted or left aborts its session
        // task (the log lets a rerun resume).
        let mut task = tokio_util::task::AbortOnDropHandle::new(task);
        // Inputs not yet taken by the session (its inbox is bounded; the
        // run never blocks on it while events wait).
        let mut pending = std::collections::VecDeque::new();
        loop {
            tokio::select! {
                biased;
                Some(e) = events.recv() => self.show(e, replacing).await,
                res = &mut task => {
                    // What the loop said before it ended.
                    while let Ok(e) = events.try_recv() {
                        self.show(e, replacing).await;
                    }
                    let summary = res.map_err(|e| SessionError::Task(e.to_string()))??;
                    return Ok(Generation::Ended(summary));
                }
                why = &mut *left, if !*caller_gone => match why {
                    Ok(why) => return Ok(Generation::Left(why)),
                    Err(_) => *caller_gone = true,
                },
                permit = inputs.reserve(), if !pending.is_empty() => {
                    if let (Ok(permit), Some(input)) = (permit, pending.pop_front()) {
                        permit.send(input);
                    }
                }
                // Bounded: past this many, the caller's sends wait.
                Some(input) = inbox.recv(), if pending.len() < PENDING_INPUTS => pending.push_back(input),
            }
        }
    }

    /// An event of the session, a replacement's start shown as what it is.
    async fn show(&self, e: Event, replacing: Option<&str>) {
        let e = match (e, replacing) {
            (
                Event::SessionStarted {
                    session_id,
                    sandbox_id,
                    worker,
                    ..
                },
                Some(reason),
            ) => Event::SandboxReplaced {
                session_id,
                sandbox_id,
                worker,
                reason: reason.to_string(),
            },
            (e, _) => e,
        };
        // A caller that stopped reading still gets the run's end.
        let _ = self.events.send(e).await;
    }

    /// Why the run's sandbox was lost, when the run failed for it and its
    /// session asked to go on in a fresh sandbox.
    fn lost(&self, summary: &Summary) -> Option<String> {
        let reason = summary.sandbox_lost.clone()?;
        let config = self.store.config_of(&self.id).ok()?;
        (config.on_sandbox_lost == OnSandboxLost::NewSandbox).then_some(reason)
    }

    /// Suspends the session (see [`Sessions::suspend`]). Not done, the
    /// sandbox keeps running, which loses nothing: said, not failed.
    async fn suspend(&self, worker: F::Api) {
        let suspended = match self.store.open(&self.id) {
            Ok(stored) => self.store.suspend(&stored, worker).await,
            // Another run has it now.
            Err(SessionError::Log(LogError::Locked(_))) => return,
            Err(e) => Err(e),
        };
        if let Some(t) = &self.trace {
            t.with(|t| {
                t.note(
                    "sandbox_suspended",
                    vec![opentelemetry::KeyValue::new(
                        "corral.suspended",
                        suspended.is_ok(),
                    )],
                )
            });
        }
        if let Err(e) = suspended {
            tracing::warn!(session = %self.id, error = %e, "the session's sandbox stays (it could not be suspended)");
        }
    }
}

/// The summary of a run its caller left before it ended.
fn left_unfinished(error: String) -> Summary {
    Summary {
        ending: Ending::Interrupted,
        final_text: String::new(),
        error: Some(error),
        sandbox_lost: None,
        turns: 0,
        run_turns: 0,
        tool_calls: 0,
        usage: Default::default(),
    }
}
