//! The coordinator's decisions, without I/O: given what happened (an input,
//! a model answer, an operation update, a timer), it appends records to the
//! session log, applies them, and says what to do next as [`Effect`]s. The
//! event loop ([`super::Coordinator`]) carries the effects out. Keeping the
//! decisions here makes them testable step by step and replayable.

use std::collections::HashMap;

use corral_proto::{OperationId, SandboxId};

use super::events::{CallEnd, Change, Event};
pub use super::record::Ending;
pub use super::record::Overrides;
use super::record::{CallOutcome, OpEntry, OpSnapshot, Record, SessionConfig, StopCause, StopMode};
use super::state::{Shown, State};
use crate::llm::{Item, LlmError, Request, Response, ToolOutput};
use crate::ops::{OpStatus, Operation, Progress};
use crate::session::{LogError, SessionLog};
use crate::tools::{CallStatus, Registry};

/// How often a request refused as too long is cut down and sent again
/// before the run fails.
pub const MAX_SHRINKS: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(
        "session {0} was never started (its log has no start record); `corral session rm {0}` removes it"
    )]
    NoStart(String),
}

/// Something for the event loop to do.
#[derive(Debug)]
pub enum Effect {
    /// Send request `turn`.
    Send { turn: u64, request: Request },
    /// Cancel the request in flight (its answer is dropped).
    CancelRequest,
    /// Hand operations to the manager.
    Add(Vec<Operation>),
    /// Ask the manager to cancel operations.
    Cancel(Vec<OperationId>),
    /// Start the grace window that batches completions of this turn's calls.
    ArmGrace,
    /// Tell the watcher.
    Emit(Event),
}

pub struct Core {
    log: SessionLog<Record>,
    state: State,
    registry: Registry,
    /// The turn whose calls are in their grace window.
    grace: Option<u64>,
    /// What running operations printed so far (not persisted).
    progress: HashMap<OperationId, Progress>,
    /// When each running operation's progress was last told (ms).
    progress_told: HashMap<OperationId, i64>,
    effects: Vec<Effect>,
    observer: Option<Box<dyn RecordObserver>>,
    /// In tests: a listing's brief, folded beside the state from every
    /// record, checked to agree with it after each.
    #[cfg(test)]
    brief: super::state::Brief,
}

/// Told of every record a core appends, as it is appended (at the time
/// the log stamped on it): see [`crate::telemetry::RunTrace`].
pub trait RecordObserver: Send {
    fn on_record(&mut self, at_unix_ms: i64, record: &Record);
}

/// Least time between two `tool_progress` events of one operation.
const PROGRESS_EVERY_MS: i64 = 1000;

/// Rebuilds a session's state from its log, read once as a stream.
pub fn replay(dir: &std::path::Path, id: &str) -> Result<State, CoreError> {
    let mut state = State::new();
    for rec in SessionLog::<Record>::records(dir, id)? {
        state.apply(&rec?.1);
    }
    Ok(state)
}

impl Core {
    /// Starts a new session: its log must be new (and empty).
    pub fn create(log: SessionLog<Record>, config: SessionConfig) -> Result<Self, CoreError> {
        let registry = config.registry();
        let mut core = Self {
            log,
            state: State::new(),
            registry,
            grace: None,
            progress: HashMap::new(),
            progress_told: HashMap::new(),
            effects: Vec::new(),
            observer: None,
            #[cfg(test)]
            brief: super::state::Brief::default(),
        };
        core.record(Record::Start { config })?;
        Ok(core)
    }

    /// Opens session `id` (its lock held by this process), replays it in
    /// the same read, and resumes it.
    pub fn open(
        dir: &std::path::Path,
        id: &str,
        overrides: Overrides,
    ) -> Result<(Self, crate::session::Recovery), CoreError> {
        let mut state = State::new();
        let (log, recovery) = SessionLog::<Record>::open_with(dir, id, |_, rec| state.apply(&rec))?;
        Ok((Self::resume(log, state, overrides)?, recovery))
    }

    /// Takes over an existing session whose log was opened and replayed
    /// into `state` (see [`SessionLog::open_with`]): records the resume,
    /// and queues what a resumed session must do (see `resume_effects`).
    /// Call [`Core::kick`] once its new inputs are given.
    pub fn resume(
        log: SessionLog<Record>,
        state: State,
        overrides: Overrides,
    ) -> Result<Self, CoreError> {
        let Some(config) = state.config.clone() else {
            return Err(CoreError::NoStart(log.id().into()));
        };
        let registry = config.registry();
        #[cfg(test)]
        let brief = super::state::Brief::of(&state);
        let mut core = Self {
            log,
            state,
            registry,
            grace: None,
            progress: HashMap::new(),
            progress_told: HashMap::new(),
            effects: Vec::new(),
            observer: None,
            #[cfg(test)]
            brief,
        };
        let current = config.endpoint.as_ref();
        let endpoint = super::record::Endpoint::merge(current, overrides.base_url, overrides.api);
        core.record(Record::Resume {
            at_unix_ms: core.log.now(),
            max_turns: overrides.max_turns,
            model: overrides.model.filter(|m| *m != config.model),
            endpoint: (Some(&endpoint) != current).then_some(endpoint),
            tool_choice: overrides
                .tool_choice
                .filter(|t| Some(t) != config.tool_choice.as_ref()),
            context_window_tokens: overrides
                .context_window_tokens
                .filter(|w| *w != config.budget.context_window_tokens),
            max_output_tokens: overrides
                .max_output_tokens
                .filter(|m| Some(*m) != config.max_output_tokens),
            reasoning_effort: overrides
                .reasoning_effort
                .filter(|r| Some(r) != config.reasoning_effort.as_ref()),
        })?;
        core.resume_effects()?;
        Ok(core)
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn config(&self) -> &SessionConfig {
        self.state
            .config
            .as_ref()
            .unwrap_or_else(|| unreachable!("a core always has a start record"))
    }

    pub fn session_id(&self) -> &str {
        self.log.id()
    }

    /// Reads the times of the records appended from now on from `clock`
    /// (a test's fixed clock; the system's by default).
    pub fn set_clock(&mut self, clock: crate::session::Clock) {
        self.log.set_clock(clock);
    }

    /// Effects queued since the last call.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub fn grace_active(&self) -> bool {
        self.grace.is_some()
    }

    /// Nothing but running calls is pending: the heartbeat's condition.
    pub fn waiting_only_for_calls(&self) -> bool {
        let s = &self.state;
        s.in_flight.is_none()
            && !s.has_new
            && s.failure.is_none()
            && !s.stop.is_some_and(|(m, _)| m == StopMode::Hard)
            && s.running_ops().next().is_some()
    }

    fn record(&mut self, rec: Record) -> Result<(), CoreError> {
        self.log.append(&rec)?;
        self.state.apply(&rec);
        #[cfg(test)]
        {
            self.brief.apply(&rec);
            assert_eq!(
                self.brief,
                super::state::Brief::of(&self.state),
                "a listing's brief and the state disagree after {rec:?}"
            );
        }
        if let Some(o) = &mut self.observer {
            o.on_record(self.log.last_at(), &rec);
        }
        Ok(())
    }

    /// Tells `observer` of every record appended from now on.
    pub fn set_observer(&mut self, observer: Box<dyn RecordObserver>) {
        self.observer = Some(observer);
    }

    fn emit(&mut self, e: Event) {
        self.effects.push(Effect::Emit(e));
    }

    /// A resumed session: re-add operations that have no terminal record (the
    /// worker never runs an id twice, so a command that may have started is
    /// followed, not re-run), translate calls that were never translated,
    /// give results that were never given, then go on.
    fn resume_effects(&mut self) -> Result<(), CoreError> {
        // Calls of an earlier run still unanswered: shown again, so that
        // a reader of this run's events sees the call before its result.
        let replayed: Vec<Event> = self
            .state
            .unanswered_calls()
            .filter(|(_, c)| c.outcome == CallOutcome::Submit)
            .map(|(id, c)| Event::ToolCall {
                call_id: id.clone(),
                tool: c.tool.clone(),
                arguments: c.arguments.clone(),
                error: None,
                replayed: true,
            })
            .collect();
        for e in replayed {
            self.emit(e);
        }
        let again: Vec<Operation> = self
            .state
            .running_op_ids()
            .into_iter()
            .map(|id| {
                let spec = self.state.ops[&id].spec.clone();
                Operation::new(id, spec)
            })
            .collect();
        if !again.is_empty() {
            self.effects.push(Effect::Add(again));
        }
        self.translate_pending(self.log.now())?;
        let finished: Vec<String> = self
            .state
            .unanswered_calls()
            .filter(|(_, c)| self.state.ops_over(c))
            .map(|(id, _)| id.clone())
            .collect();
        for id in finished {
            self.give_result(&id)?;
        }
        Ok(())
    }

    /// The session's sandbox is gone and a new one replaces it: operations
    /// that were running cannot be followed, and adding them again would
    /// run them a second time. They are recorded as failed instead, and
    /// their calls answered with that.
    pub fn sandbox_replaced(&mut self) -> Result<(), CoreError> {
        let lost = self.state.running_op_ids();
        for effect in &mut self.effects {
            if let Effect::Add(ops) = effect {
                ops.retain(|o| !lost.contains(&o.id));
            }
        }
        self.effects
            .retain(|e| !matches!(e, Effect::Add(ops) if ops.is_empty()));
        for id in lost {
            let Some(st) = self.state.ops.get(&id) else {
                continue;
            };
            let mut op = Operation::new(id, st.spec.clone());
            op.fail_lost(
                "the sandbox was lost while this ran; it may or may not have finished, and it was not run again",
            );
            self.operation_of(op, false)?;
        }
        Ok(())
    }

    /// A fresh sandbox (`sandbox`, of `generation`) on `worker` replaces
    /// the lost one: operations that were running are answered as lost,
    /// and the model is told (`prompts/sandbox-replaced.md`).
    pub fn placed_again(
        &mut self,
        worker: Option<String>,
        worker_id: Option<String>,
        sandbox: SandboxId,
        generation: u64,
        reason: &str,
        files_kept: bool,
    ) -> Result<(), CoreError> {
        // The notice first: answering the lost calls may start a turn,
        // which must carry it.
        let reason = reason.strip_prefix("sandbox lost: ").unwrap_or(reason);
        let notice = if files_kept {
            crate::context::SANDBOX_MOVED
        } else {
            crate::context::SANDBOX_REPLACED
        };
        let text = notice.trim_end().replace("{reason}", reason);
        self.record(Record::Placed {
            worker,
            worker_id,
            sandbox_id: sandbox,
            generation,
            text,
        })?;
        self.sandbox_replaced()
    }

    /// Starts a turn if one is due (after creating or resuming a session
    /// and giving it its inputs).
    pub fn kick(&mut self) -> Result<(), CoreError> {
        self.settle()
    }

    /// A user input (ignored when its id was seen before).
    pub fn input(&mut self, input_id: &str, text: &str) -> Result<(), CoreError> {
        let steering = self.state.in_flight;
        if !self.add_input(input_id, text)? {
            return Ok(());
        }
        if let Some(turn) = steering {
            self.effects.push(Effect::CancelRequest);
            self.emit(Event::Steered { turn });
        }
        self.settle()
    }

    /// Records an input without starting a turn (inputs given up front,
    /// before [`Core::kick`]). Returns false when its id was seen before.
    pub fn add_input(&mut self, input_id: &str, text: &str) -> Result<bool, CoreError> {
        if self.state.input_ids.contains(input_id) {
            return Ok(false);
        }
        self.record(Record::Input {
            input_id: input_id.into(),
            text: text.into(),
        })?;
        Ok(true)
    }

    /// Conversation entries given up front.
    pub fn history(&mut self, role: crate::llm::Role, text: &str) -> Result<(), CoreError> {
        self.record(Record::History {
            role,
            text: text.into(),
        })
    }

    /// The sandbox is lost: the run fails with `reason` (once), its
    /// request in flight is dropped (a resume sends it again).
    pub fn sandbox_lost(&mut self, reason: &str) -> Result<(), CoreError> {
        if self.state.failure.is_some() {
            return Ok(());
        }
        if self.state.in_flight.is_some() {
            self.effects.push(Effect::CancelRequest);
        }
        self.grace = None;
        self.record(Record::SandboxLost {
            reason: reason.into(),
        })
    }

    /// The sandbox's egress proxy decided on a connection: recorded and
    /// told.
    /// Egress decisions the worker told that came faster than the run
    /// took them: the gap is recorded.
    pub fn egress_unrecorded(&mut self, count: u64) -> Result<(), CoreError> {
        self.record(Record::EgressUnrecorded { count })
    }

    pub fn egress(&mut self, e: &corral_proto::event::Egress) -> Result<(), CoreError> {
        self.record(Record::Egress {
            host: e.host.clone(),
            port: e.port,
            decision: e.decision,
            reason: e.reason.clone(),
            unreported: u64::from(e.unreported),
        })?;
        self.emit(Event::Egress {
            host: e.host.clone(),
            port: e.port,
            decision: e.decision,
            reason: e.reason.clone(),
        });
        Ok(())
    }

    pub fn stop(&mut self, mode: StopMode, cause: StopCause) -> Result<(), CoreError> {
        if self.state.stop.is_some_and(|(m, _)| m == StopMode::Hard) {
            return Ok(());
        }
        let in_flight = self.state.in_flight.is_some();
        self.record(Record::Stop { mode, cause })?;
        if mode == StopMode::Hard {
            self.grace = None;
            if in_flight {
                self.effects.push(Effect::CancelRequest);
            }
            let ids = self.state.running_op_ids();
            if !ids.is_empty() {
                self.effects.push(Effect::Cancel(ids));
            }
        }
        // A stop never starts a turn.
        Ok(())
    }

    /// How request `turn` ended. Late answers (a steered or stopped turn)
    /// are dropped.
    pub fn model_done(
        &mut self,
        turn: u64,
        result: Result<Response, LlmError>,
    ) -> Result<(), CoreError> {
        if self.state.in_flight != Some(turn) {
            return Ok(());
        }
        match result {
            Err(LlmError::Canceled) => {}
            Err(e) if e.is_context_length_exceeded() && self.state.shrinks < MAX_SHRINKS => {
                // The estimate was off for this model: fit the request to
                // three quarters of what was refused, and ask again; to half
                // of it when the server said nothing of its window (an
                // empty answer, as llama.cpp's servers give), so that a
                // request far over the window fits within the shrinks allowed.
                let budget = self.state.context.budget();
                let refused = self.state.context.build().estimated_tokens;
                let target = if matches!(e, LlmError::EmptyAnswer { .. }) {
                    refused / 2
                } else {
                    refused * 3 / 4
                };
                // The window whose room for the request (the window less
                // its reserve, at most a quarter of it) is that much.
                let most = budget.reserve_output_tokens;
                let fitted = if target >= 3 * most {
                    target + most
                } else {
                    target * 4 / 3
                };
                let context_window_tokens = if fitted < budget.context_window_tokens {
                    fitted
                } else {
                    budget.context_window_tokens * 3 / 4
                };
                self.emit(Event::ModelRetry {
                    turn,
                    attempt: self.state.shrinks + 1,
                    reason: format!(
                        "{e}; the context is cut to a window of {context_window_tokens} tokens"
                    ),
                });
                self.record(Record::Shrink {
                    turn,
                    context_window_tokens,
                    error: e.to_string(),
                })?;
            }
            Err(e) => {
                let error = e.to_string();
                self.record(Record::ModelFailure {
                    turn,
                    error: error.clone(),
                    code: e.code().map(String::from),
                })?;
                self.emit(Event::ModelFailed { turn, error });
            }
            Ok(response) => {
                let response = bound_arguments(self.unique_call_ids(turn, response));
                let calls = response.tool_calls().count();
                self.record(Record::Response {
                    turn,
                    response: response.clone(),
                })?;
                self.emit(Event::TurnCompleted {
                    turn,
                    text: response.text(),
                    tool_calls: calls,
                    stop: response.stop,
                    usage: response.usage,
                });
                self.translate_pending(self.log.now())?;
            }
        }
        self.settle()
    }

    /// Results are matched to calls by id, so ids must be unique in a
    /// session; some servers repeat them (`call_0` every turn, or none at
    /// all). A repeated id gets the turn added, before the response is
    /// recorded, so the history sent back stays consistent.
    fn unique_call_ids(&self, turn: u64, mut response: Response) -> Response {
        let mut seen = std::collections::HashSet::new();
        for item in &mut response.output {
            let Item::ToolCall { call_id, .. } = item else {
                continue;
            };
            let taken = |id: &str, seen: &std::collections::HashSet<String>| {
                self.state.calls.contains_key(id) || seen.contains(id)
            };
            let mut id = call_id.to_string();
            let mut n = 1;
            while taken(&id, &seen) {
                id = format!("{call_id}.t{turn}.{n}");
                n += 1;
            }
            if *id != **call_id {
                *call_id = id.as_str().into();
            }
            seen.insert(id);
        }
        response
    }

    /// Translates and records the tool calls of the last response.
    fn translate_pending(&mut self, at_unix_ms: i64) -> Result<(), CoreError> {
        let pending = self.state.pending_calls.clone();
        let cut_off = self.state.failure.clone();
        let mut add = Vec::new();
        let mut immediate = false;
        for call in pending {
            let status = match &cut_off {
                Some(why) => CallStatus::Error(format!("Error: the call was not run: {why}")),
                None => self.registry.translate(&call.name, &call.arguments),
            };
            let (outcome, operations) = match status {
                CallStatus::Error(text) => (CallOutcome::Error { text }, Vec::new()),
                CallStatus::Done(output) => (CallOutcome::Done { output }, Vec::new()),
                CallStatus::Submit(specs) => (
                    CallOutcome::Submit,
                    specs
                        .into_iter()
                        .map(|spec| OpEntry {
                            id: OperationId::random(),
                            spec,
                        })
                        .collect(),
                ),
            };
            self.emit(Event::ToolCall {
                call_id: call.call_id.clone(),
                tool: call.name.clone(),
                arguments: call.arguments.clone(),
                error: match &outcome {
                    CallOutcome::Error { text } => Some(text.clone()),
                    _ => None,
                },
                replayed: false,
            });
            for op in &operations {
                add.push(Operation::new(op.id.clone(), op.spec.clone()));
            }
            self.record(Record::Call {
                call_id: call.call_id.clone(),
                tool: call.name.clone(),
                arguments: call.arguments.clone(),
                turn: self.state.last_turn,
                at_unix_ms,
                outcome: outcome.clone(),
                operations,
            })?;
            if outcome != CallOutcome::Submit {
                immediate = true;
                self.give_result(&call.call_id)?;
            }
        }
        if !add.is_empty() {
            self.effects.push(Effect::Add(add));
            // A call answered at once (an error) wakes the model now, with
            // placeholders for the rest; otherwise completions of this
            // turn's calls are batched, and this window replaces any older.
            if !self.state.stop.is_some_and(|(m, _)| m == StopMode::Hard) && !immediate {
                self.grace = Some(self.state.last_turn);
                self.effects.push(Effect::ArmGrace);
            }
        }
        Ok(())
    }

    /// Records the final result of a call whose operations are all over.
    fn give_result(&mut self, call_id: &str) -> Result<(), CoreError> {
        let Some(call) = self.state.calls.get(call_id) else {
            return Ok(());
        };
        if call.shown == Shown::Final {
            return Ok(());
        }
        let ops = self.state.views_of(call);
        let output = self.registry.render(&call.tool, &call.outcome, &ops);
        let tool = call.tool.clone();
        let ended = Ended::of(&call.outcome, &ops);
        drop(ops);
        self.emit(Event::ToolResult {
            call_id: call_id.into(),
            tool,
            text: ToolOutput::text_of(&output),
            images: ToolOutput::images_in(&output),
            status: ended.status,
            exit_code: ended.exit_code,
            duration_ms: ended.duration_ms,
        });
        self.record(Record::Result {
            call_id: call_id.into(),
            output,
            running: false,
        })
    }

    /// An operation snapshot from the manager (of the sandbox the session
    /// runs in now).
    pub fn operation(&mut self, op: Operation) -> Result<(), CoreError> {
        self.operation_of(op, true)
    }

    /// An operation's snapshot; `live`: from the sandbox the session runs
    /// in now (not one answered as lost after its sandbox was replaced).
    fn operation_of(&mut self, op: Operation, live: bool) -> Result<(), CoreError> {
        let Some(st) = self.state.ops.get(&op.id) else {
            return Ok(());
        };
        if st.end.is_some() {
            return Ok(());
        }
        if !op.status.is_terminal() {
            // An operation whose add was still on its way when a hard stop
            // canceled everything: cancel it now that the worker has it.
            if op.status == crate::ops::OpStatus::Awaiting
                && self.state.stop.is_some_and(|(m, _)| m == StopMode::Hard)
            {
                self.effects.push(Effect::Cancel(vec![op.id.clone()]));
            }
            let now = self.log.now();
            let due = self
                .progress_told
                .get(&op.id)
                .is_none_or(|t| now - t >= PROGRESS_EVERY_MS);
            let printed = op.progress.stdout_bytes + op.progress.stderr_bytes > 0;
            if due && printed {
                self.progress_told.insert(op.id.clone(), now);
                let call_id = st.call_id.clone();
                let tool = self
                    .state
                    .calls
                    .get(&call_id)
                    .map(|c| c.tool.clone())
                    .unwrap_or_default();
                let p = &op.progress;
                // The newest line of stdout, else of stderr.
                let tail = if p.stdout_tail.is_empty() {
                    &p.stderr_tail
                } else {
                    &p.stdout_tail
                };
                let text = String::from_utf8_lossy(tail);
                let line = text
                    .trim_end()
                    .rsplit('\n')
                    .next()
                    .unwrap_or_default()
                    .to_string();
                self.emit(Event::ToolProgress {
                    call_id,
                    tool,
                    line,
                    stdout_bytes: p.stdout_bytes,
                    stderr_bytes: p.stderr_bytes,
                });
            }
            self.progress.insert(op.id.clone(), op.progress);
            return Ok(());
        }
        let call_id = st.call_id.clone();
        self.progress.remove(&op.id);
        self.progress_told.remove(&op.id);
        // Ended by the loss of the sandbox the session runs in (the worker
        // says so before it says the sandbox is lost): the run is over once
        // the call has its result, before any new request goes out for it.
        let lost = match op.result.as_ref().map(|r| &r.outcome) {
            _ if !live => None,
            Some(corral_proto::Outcome::SandboxLost { reason }) => {
                Some(format!("sandbox lost: {reason}"))
            }
            _ if op.lost => Some(
                op.failure
                    .clone()
                    .unwrap_or_else(|| "sandbox lost".to_string()),
            ),
            _ => None,
        };
        self.record(Record::Operation {
            snapshot: OpSnapshot {
                id: op.id.clone(),
                status: op.status,
                result: op.result,
                failure: op.failure,
                lost: op.lost,
            },
        })?;
        let done = self
            .state
            .calls
            .get(&call_id)
            .is_some_and(|c| self.state.ops_over(c));
        if done {
            self.give_result(&call_id)?;
        }
        if let Some(reason) = lost {
            self.sandbox_lost(&reason)?;
        }
        self.settle()
    }

    /// The grace window is over: calls still running get their placeholder.
    pub fn grace_over(&mut self) -> Result<(), CoreError> {
        self.grace = None;
        self.settle()
    }

    /// The heartbeat timer fired. While only calls are pending, the model
    /// is told what is running, for how long, and what it printed so far.
    pub fn heartbeat(&mut self, now_unix_ms: i64) -> Result<(), CoreError> {
        if !self.waiting_only_for_calls() || self.grace.is_some() {
            return Ok(());
        }
        let mut text = crate::context::HEARTBEAT.trim_end().to_string();
        text.push('\n');
        let running = self
            .state
            .unanswered_calls()
            .filter(|(_, c)| c.outcome == CallOutcome::Submit);
        for (call_id, call) in running {
            let secs = (now_unix_ms - call.at_unix_ms).max(0) / 1000;
            let args: String = call.arguments.chars().take(300).collect();
            let progress = call
                .ops
                .iter()
                .find_map(|op| self.progress.get(op))
                .cloned()
                .unwrap_or_default();
            text.push_str(&format!(
                "\n- {} call {call_id} {args}: running for {secs}s, {} bytes of output",
                call.tool,
                progress.stdout_bytes + progress.stderr_bytes
            ));
            for (name, tail) in [
                ("stdout", &progress.stdout_tail),
                ("stderr", &progress.stderr_tail),
            ] {
                if !tail.is_empty() {
                    let tail = String::from_utf8_lossy(tail);
                    let n = tail.chars().count();
                    let tail: String = tail.chars().skip(n.saturating_sub(2000)).collect();
                    text.push_str(&format!("\n  last {name}:\n{}", tail.trim_end()));
                }
            }
        }
        self.emit(Event::Heartbeat { text: text.clone() });
        self.record(Record::Heartbeat { text })?;
        self.settle()
    }

    /// Decides whether a turn starts now.
    fn settle(&mut self) -> Result<(), CoreError> {
        if self.state.stop.is_some_and(|(m, _)| m == StopMode::Hard) || self.state.failure.is_some()
        {
            return Ok(());
        }
        if let Some(turn) = self.grace {
            let all_done = self
                .state
                .calls
                .values()
                .filter(|c| c.turn == turn && c.outcome == CallOutcome::Submit)
                .all(|c| c.shown == Shown::Final);
            if all_done || self.state.fresh_inputs > 0 {
                self.grace = None;
            } else {
                return Ok(());
            }
        }
        if self.state.in_flight.is_some() || !self.state.has_new {
            return Ok(());
        }
        if self.state.run_turns() >= self.state.max_turns() {
            return self.stop(StopMode::Hard, StopCause::TurnLimit);
        }
        // Every call in the request has a result: a running call's
        // placeholder was staged when the call was recorded.
        let turn = self.state.last_turn + 1;
        self.record(Record::Turn { turn })?;
        let built = self.state.context.build();
        self.emit(Event::TurnStarted {
            turn,
            estimated_tokens: built.estimated_tokens,
            changes: built.report.changes.iter().map(Change::from).collect(),
        });
        let mut request = built.request;
        request.cache_key = Some(cache_key(self.log.id()));
        self.effects.push(Effect::Send { turn, request });
        Ok(())
    }

    /// Records how the run ended (once [`Core::ending`] says it has).
    pub fn finish(&mut self, ending: Ending) -> Result<(), CoreError> {
        self.record(Record::Finished { ending })
    }

    /// `Some` once the run is over.
    pub fn ending(&self) -> Option<Ending> {
        let s = &self.state;
        let ops_running = s.running_ops().next().is_some();
        if let Some((mode, cause)) = s.stop
            && mode == StopMode::Hard
        {
            return (!ops_running).then_some(match cause {
                StopCause::Requested => Ending::Interrupted,
                StopCause::TurnLimit => Ending::Failed,
            });
        }
        if s.failure.is_some() {
            return Some(Ending::Failed);
        }
        let idle = s.in_flight.is_none()
            && self.grace.is_none()
            && !s.has_new
            && !ops_running
            && s.unanswered_calls().next().is_none()
            && s.pending_calls.is_empty();
        (idle && s.stop.is_some()).then_some(Ending::Done)
    }
}

/// The provider's prompt-cache key of a session: a digest of its id, of
/// fixed length (OpenAI refuses keys over 64 characters; ids may have 128).
pub fn cache_key(session_id: &str) -> String {
    use base64::Engine;
    let digest = ring::digest::digest(&ring::digest::SHA256, session_id.as_bytes());
    format!(
        "corral-{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest.as_ref()[..24])
    )
}

/// Tool-call arguments over [`crate::tools::MAX_TOOL_ARGUMENT_BYTES`], and
/// names over [`crate::tools::MAX_TOOL_NAME_BYTES`], replaced, before the
/// response is recorded, by placeholders the registry answers with an
/// error: never run, and never sent back to the model.
fn bound_arguments(mut response: Response) -> Response {
    for item in &mut response.output {
        if let Item::ToolCall {
            name, arguments, ..
        } = item
        {
            if arguments.len() > crate::tools::MAX_TOOL_ARGUMENT_BYTES {
                *arguments = crate::tools::omitted_arguments(arguments.len()).into();
            }
            if name.len() > crate::tools::MAX_TOOL_NAME_BYTES {
                *name = crate::tools::omitted_name(name.len()).into();
            }
        }
    }
    response
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;

/// How a call ended, as its `tool_result` event tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub status: CallEnd,
    pub exit_code: Option<i32>,
    pub duration_ms: Option<u64>,
}

impl Ended {
    /// From the call's outcome and its operations (in order): the worst of
    /// them sets the status; the last command that exited, the exit code.
    pub fn of(outcome: &CallOutcome, ops: &[crate::ops::OpView<'_>]) -> Self {
        use corral_proto::Outcome;
        let mut ended = Self {
            status: CallEnd::Ok,
            exit_code: None,
            duration_ms: None,
        };
        match outcome {
            CallOutcome::Error { .. } => {
                ended.status = CallEnd::Refused;
                return ended;
            }
            CallOutcome::Done { .. } => return ended,
            CallOutcome::Submit => {}
        }
        let rank = |s: CallEnd| match s {
            CallEnd::Ok => 0,
            CallEnd::Failed => 1,
            CallEnd::TimedOut => 2,
            CallEnd::Canceled => 3,
            CallEnd::Lost | CallEnd::Refused => 4,
        };
        for op in ops {
            let status = match (op.status, op.result.map(|r| &r.outcome)) {
                (OpStatus::Canceled, _) | (_, Some(Outcome::Canceled)) => CallEnd::Canceled,
                (_, Some(Outcome::SandboxLost { .. })) => CallEnd::Lost,
                (OpStatus::Failed, _) if op.lost => CallEnd::Lost,
                (OpStatus::Failed, _) => CallEnd::Failed,
                (_, Some(Outcome::TimedOut)) => CallEnd::TimedOut,
                (_, Some(o)) if !o.is_success() => CallEnd::Failed,
                _ => CallEnd::Ok,
            };
            if rank(status) > rank(ended.status) {
                ended.status = status;
            }
            if let Some(r) = op.result {
                if let Outcome::Exited { code } = r.outcome {
                    ended.exit_code = Some(code);
                }
                *ended.duration_ms.get_or_insert(0) += r.duration_ms;
            }
        }
        ended
    }
}
