//! A session's state, rebuilt from its records by one function, [`State::apply`].
//!
//! The live coordinator changes state only by appending a record and
//! applying it, and a replay applies the same records in the same order, so
//! a replayed session cannot drift from the live one.

use std::collections::{BTreeMap, HashMap, HashSet};

use corral_proto::{OperationId, OperationSpec};

use super::record::{CallOutcome, OpSnapshot, Record, SessionConfig, StopCause, StopMode};
use crate::context::{Budget, ContextBuilder, SkillInfo};
use crate::llm::{Item, Response, StopReason, Usage};
use crate::ops::{OpStatus, OpView};

/// What the model is shown of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// Answered at once: its result follows in the same step.
    Nothing,
    /// Running: its placeholder is staged (from the call record on) or sent.
    Placeholder,
    Final,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CallState {
    pub tool: String,
    pub arguments: String,
    pub turn: u64,
    pub at_unix_ms: i64,
    pub outcome: CallOutcome,
    pub ops: Vec<OperationId>,
    pub shown: Shown,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OpState {
    pub spec: OperationSpec,
    /// The last recorded terminal state (`None` while running).
    pub end: Option<OpSnapshot>,
    pub call_id: String,
}

/// A tool call the model made that has no `call` record yet.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingCall {
    pub call_id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct State {
    pub config: Option<SessionConfig>,
    pub context: ContextBuilder,
    /// The last turn started.
    pub last_turn: u64,
    /// The turn whose request is out (no response or failure yet).
    pub in_flight: Option<u64>,
    /// Something the model has not seen is staged.
    pub has_new: bool,
    /// Inputs staged since the last turn.
    pub fresh_inputs: u64,
    pub calls: BTreeMap<String, CallState>,
    pub ops: HashMap<OperationId, OpState>,
    /// Tool calls of the last response not translated yet.
    pub pending_calls: Vec<PendingCall>,
    pub stop: Option<(StopMode, StopCause)>,
    /// Why the run failed (a model failure, a refusal, a cut-off answer).
    pub failure: Option<String>,
    /// Why the sandbox was lost, when that failed the run (cleared by a
    /// resume, as the failure is).
    pub sandbox_lost: Option<String>,
    /// The text of the last response.
    pub final_text: String,
    pub usage: Usage,
    pub input_ids: HashSet<String>,
    /// Requests refused as too long since the last response.
    pub shrinks: u32,
    /// The text of the last input, and whether a run finished (done)
    /// after it.
    pub last_input: Option<(String, bool)>,
    /// How the last run ended (`None` before any did, or while one runs).
    pub last_end: Option<super::record::Ending>,
    /// A fork that no run has used yet (it has taken no input and sent no
    /// request since it was made).
    pub fresh_fork: bool,
    /// The last turn before this run started: `--max-turns` bounds one run.
    pub run_start_turn: u64,
    /// The turn limit of this run, when its resume gave one.
    pub run_max_turns: Option<u64>,
}

/// How `record` changes a session's settings: what [`State::apply`] does
/// to its `config`, without the rest of the replay (the context, the
/// calls), for a caller that wants the settings alone.
pub fn apply_to_config(config: &mut Option<SessionConfig>, record: &Record) {
    match record {
        Record::Start { config: c } => *config = Some(c.clone()),
        Record::Resume {
            model,
            endpoint,
            tool_choice,
            context_window_tokens,
            max_output_tokens,
            reasoning_effort,
            ..
        } => {
            if let Some(c) = config {
                if let Some(m) = model {
                    c.model = m.clone();
                }
                if let Some(e) = endpoint {
                    c.endpoint = Some(e.clone());
                }
                if let Some(t) = tool_choice {
                    c.tool_choice = Some(t.clone());
                }
                if let Some(r) = reasoning_effort {
                    c.reasoning_effort = Some(r.clone());
                }
                if let Some(m) = max_output_tokens {
                    c.max_output_tokens = Some(*m);
                    c.budget.reserve_output_tokens = u64::from(*m);
                }
                if let Some(w) = context_window_tokens {
                    c.budget.context_window_tokens = *w;
                }
            }
        }
        Record::Forked { sandbox_id, .. } => {
            if let Some(c) = config {
                c.sandbox_id = sandbox_id.clone();
            }
        }
        Record::Placed {
            worker,
            worker_id,
            sandbox_id,
            generation,
            ..
        } => {
            if let Some(c) = config {
                c.worker = worker.clone();
                c.worker_id = worker_id.clone();
                c.sandbox_id = sandbox_id.clone();
                c.generation = *generation;
            }
        }
        Record::Shrink {
            context_window_tokens,
            ..
        } => {
            if let Some(c) = config {
                c.budget = shrunk(c.budget, *context_window_tokens);
            }
        }
        _ => {}
    }
}

/// What a listing shows of a session: its settings and the few figures
/// [`State`] keeps about its runs, folded from its records as `State`
/// folds them ([`Brief::apply`]), in a few bytes however long its log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Brief {
    pub config: Option<SessionConfig>,
    /// As [`State::turns`].
    pub turns: u64,
    /// As [`State::tool_calls`].
    pub tool_calls: u64,
    pub last_end: Option<super::record::Ending>,
    pub fresh_fork: bool,
    pub final_text: String,
    in_flight: Option<u64>,
    /// The calls counted (a call id is counted once, as `State` keys its
    /// calls by id).
    calls: std::collections::HashSet<String>,
}

impl Brief {
    /// Applies one record (see [`State::apply`]).
    pub fn apply(&mut self, record: &Record) {
        apply_to_config(&mut self.config, record);
        match record {
            Record::Resume { .. } => {
                self.last_end = None;
                self.in_flight = None;
            }
            Record::Forked { .. } => self.fresh_fork = true,
            Record::Input { .. } => {
                self.fresh_fork = false;
                self.in_flight = None;
            }
            Record::Turn { turn } => {
                self.fresh_fork = false;
                self.turns = *turn;
                self.in_flight = Some(*turn);
            }
            Record::Response { turn, response } if self.in_flight == Some(*turn) => {
                self.in_flight = None;
                self.final_text = response.text();
            }
            Record::ModelFailure { turn, .. } | Record::Shrink { turn, .. }
                if self.in_flight == Some(*turn) =>
            {
                self.in_flight = None;
            }
            Record::Call { call_id, .. } if self.calls.insert(call_id.clone()) => {
                self.tool_calls += 1;
            }
            Record::Stop { mode, .. } if *mode == StopMode::Hard => self.in_flight = None,
            Record::Finished { ending } => self.last_end = Some(*ending),
            _ => {}
        }
    }

    /// The same figures of a whole state.
    pub fn of(state: &State) -> Self {
        Self {
            config: state.config.clone(),
            turns: state.turns(),
            tool_calls: state.tool_calls(),
            last_end: state.last_end,
            fresh_fork: state.fresh_fork,
            final_text: state.final_text.clone(),
            in_flight: state.in_flight,
            calls: state.calls.keys().cloned().collect(),
        }
    }
}

/// The budget after a request was found too long for a window of
/// `context_window_tokens`.
fn shrunk(mut budget: Budget, context_window_tokens: u64) -> Budget {
    budget.context_window_tokens = context_window_tokens;
    // One result may take at most about a quarter of the room left for the
    // request (four characters a token).
    let room = context_window_tokens.saturating_sub(budget.reserve());
    budget.max_tool_result_chars = budget.max_tool_result_chars.min(room.max(1_000) as usize);
    budget
}

impl State {
    /// An empty session.
    pub fn new() -> Self {
        Self {
            config: None,
            context: ContextBuilder::new(&[], Budget::default()),
            last_turn: 0,
            in_flight: None,
            has_new: false,
            fresh_inputs: 0,
            calls: BTreeMap::new(),
            ops: HashMap::new(),
            pending_calls: Vec::new(),
            stop: None,
            failure: None,
            sandbox_lost: None,
            final_text: String::new(),
            usage: Usage::default(),
            input_ids: HashSet::new(),
            last_input: None,
            last_end: None,
            fresh_fork: false,
            shrinks: 0,
            run_start_turn: 0,
            run_max_turns: None,
        }
    }

    /// Requests sent in this session (turn ids count up from 1).
    pub fn turns(&self) -> u64 {
        self.last_turn
    }

    /// Requests sent by the run in progress (or the last one).
    pub fn run_turns(&self) -> u64 {
        self.last_turn - self.run_start_turn
    }

    /// The most requests this run may send.
    pub fn max_turns(&self) -> u64 {
        self.run_max_turns
            .or(self.config.as_ref().map(|c| c.max_turns))
            .unwrap_or(u64::MAX)
    }

    /// Tool calls the model made in this session.
    pub fn tool_calls(&self) -> u64 {
        self.calls.len() as u64
    }

    /// Calls whose result the model has not been given yet.
    pub fn unanswered_calls(&self) -> impl Iterator<Item = (&String, &CallState)> {
        self.calls.iter().filter(|(_, c)| c.shown != Shown::Final)
    }

    /// Operations without a terminal record.
    pub fn running_ops(&self) -> impl Iterator<Item = (&OperationId, &OpState)> {
        self.ops.iter().filter(|(_, o)| o.end.is_none())
    }

    /// Ids of the operations without a terminal record, sorted.
    pub fn running_op_ids(&self) -> Vec<OperationId> {
        let mut ids: Vec<OperationId> = self.running_ops().map(|(id, _)| id.clone()).collect();
        ids.sort();
        ids
    }

    /// Every operation of `call` has a terminal record.
    pub fn ops_over(&self, call: &CallState) -> bool {
        call.ops
            .iter()
            .all(|o| self.ops.get(o).is_none_or(|st| st.end.is_some()))
    }

    /// The operations of a call as recorded (terminal ones with their
    /// result; the rest awaiting), borrowed for rendering.
    pub fn views_of(&self, call: &CallState) -> Vec<OpView<'_>> {
        call.ops
            .iter()
            .filter_map(|id| {
                let st = self.ops.get(id)?;
                Some(match &st.end {
                    Some(end) => OpView {
                        spec: &st.spec,
                        status: end.status,
                        result: end.result.as_ref(),
                        failure: end.failure.as_deref(),
                        lost: end.lost,
                    },
                    None => OpView {
                        spec: &st.spec,
                        status: OpStatus::Awaiting,
                        result: None,
                        failure: None,
                        lost: false,
                    },
                })
            })
            .collect()
    }

    /// Applies one record.
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Start { config } => {
                let skills: Vec<SkillInfo> =
                    config.skills.iter().map(|s| s.to_skill().info).collect();
                self.context.set_skills(&skills);
                self.context.set_model(&config.model);
                self.context.set_system_prompt(&config.system_prompt);
                self.context.set_budget(config.budget);
                self.context.set_max_output_tokens(config.max_output_tokens);
                self.context
                    .set_reasoning_effort(config.reasoning_effort.clone());
                self.context.set_tool_choice(config.tool_choice.clone());
                self.context.set_keep_tool_choice(config.keep_tool_choice);
                for t in config.registry().tools() {
                    self.context.add_tool(t);
                }
                self.config = Some(config.clone());
            }
            Record::Resume {
                max_turns,
                model,
                endpoint,
                tool_choice,
                context_window_tokens,
                max_output_tokens,
                reasoning_effort,
                ..
            } => {
                self.run_start_turn = self.last_turn;
                self.run_max_turns = *max_turns;
                if let Some(c) = &mut self.config {
                    if let Some(m) = model {
                        c.model = m.clone();
                        self.context.set_model(m);
                    }
                    if let Some(e) = endpoint {
                        c.endpoint = Some(e.clone());
                    }
                    if let Some(t) = tool_choice {
                        c.tool_choice = Some(t.clone());
                        self.context.set_tool_choice(Some(t.clone()));
                    }
                    if let Some(r) = reasoning_effort {
                        c.reasoning_effort = Some(r.clone());
                        self.context.set_reasoning_effort(Some(r.clone()));
                    }
                    if let Some(m) = max_output_tokens {
                        c.max_output_tokens = Some(*m);
                        c.budget.reserve_output_tokens = u64::from(*m);
                        self.context.set_max_output_tokens(Some(*m));
                    }
                    if let Some(w) = context_window_tokens {
                        c.budget.context_window_tokens = *w;
                    }
                    if context_window_tokens.is_some() || max_output_tokens.is_some() {
                        self.context.set_budget(c.budget);
                    }
                }
                self.last_end = None;
                self.stop = None;
                self.failure = None;
                self.sandbox_lost = None;
                if self.in_flight.take().is_some() {
                    // Its answer is lost: the same context goes out again.
                    self.has_new = true;
                }
            }
            Record::Forked { sandbox_id, .. } => {
                if let Some(c) = &mut self.config {
                    c.sandbox_id = sandbox_id.clone();
                }
                self.fresh_fork = true;
            }
            Record::History { role, text } => {
                let response = Response {
                    id: None,
                    stop: StopReason::Complete,
                    output: vec![Item::Message {
                        role: *role,
                        text: text.as_str().into(),
                        provider_id: None,
                    }],
                    usage: Usage::default(),
                };
                match role {
                    crate::llm::Role::User => {
                        self.context.add_user_input(text);
                        self.has_new = true;
                        self.fresh_inputs += 1;
                    }
                    _ => {
                        self.context.commit();
                        self.context.add_model_response(&response);
                        // The model's turn is given: nothing is left for
                        // it to answer until something new comes.
                        self.has_new = false;
                        self.fresh_inputs = 0;
                    }
                }
            }
            Record::Input { input_id, text } => {
                self.fresh_fork = false;
                self.input_ids.insert(input_id.clone());
                self.last_input = Some((text.clone(), false));
                self.context.add_user_input(text);
                self.has_new = true;
                self.fresh_inputs += 1;
                // Steering: a request in flight is canceled; its answer,
                // should it still arrive, is dropped.
                self.in_flight = None;
                // New work: a previous stop or failure no longer holds.
                self.failure = None;
                self.sandbox_lost = None;
            }
            Record::Heartbeat { text } => {
                self.context.add_heartbeat(text);
                self.has_new = true;
            }
            Record::Turn { turn } => {
                self.fresh_fork = false;
                self.context.commit();
                self.last_turn = *turn;
                self.in_flight = Some(*turn);
                self.has_new = false;
                self.fresh_inputs = 0;
            }
            Record::Response { turn, response } => {
                if self.in_flight != Some(*turn) {
                    return;
                }
                self.in_flight = None;
                self.shrinks = 0;
                self.context.add_model_response(response);
                self.final_text = response.text();
                add_usage(&mut self.usage, &response.usage);
                for item in &response.output {
                    if let Item::ToolCall {
                        call_id,
                        name,
                        arguments,
                        ..
                    } = item
                    {
                        self.pending_calls.push(PendingCall {
                            call_id: call_id.to_string(),
                            name: name.to_string(),
                            arguments: arguments.to_string(),
                        });
                    }
                }
                match response.stop {
                    StopReason::Complete => {}
                    StopReason::Refused => {
                        self.failure = Some(format!(
                            "the model refused: {}",
                            if self.final_text.is_empty() {
                                "(no text)"
                            } else {
                                &self.final_text
                            }
                        ));
                    }
                    StopReason::MaxOutputTokens => {
                        self.failure =
                            Some("the model's answer was cut off at its output-token limit".into());
                    }
                }
            }
            Record::SandboxLost { reason } => {
                self.failure = Some(reason.clone());
                self.sandbox_lost = Some(reason.clone());
            }
            Record::Placed {
                worker,
                worker_id,
                sandbox_id,
                generation,
                text,
            } => {
                if let Some(c) = &mut self.config {
                    c.worker = worker.clone();
                    c.worker_id = worker_id.clone();
                    c.sandbox_id = sandbox_id.clone();
                    c.generation = *generation;
                }
                self.context.add_heartbeat(text);
                self.has_new = true;
            }
            Record::ModelFailure { turn, error, .. } => {
                if self.in_flight == Some(*turn) {
                    self.in_flight = None;
                }
                self.failure = Some(error.clone());
                // Unanswered: a resumed run sends it again.
                self.has_new = true;
            }
            Record::Shrink {
                turn,
                context_window_tokens,
                ..
            } => {
                if self.in_flight == Some(*turn) {
                    self.in_flight = None;
                }
                let budget = shrunk(self.context.budget(), *context_window_tokens);
                self.context.set_budget(budget);
                if let Some(c) = &mut self.config {
                    c.budget = budget;
                }
                self.shrinks += 1;
                // The same conversation goes out again, cut down.
                self.has_new = true;
            }
            Record::Call {
                call_id,
                tool,
                arguments,
                turn,
                at_unix_ms,
                outcome,
                operations,
            } => {
                self.pending_calls.retain(|p| &p.call_id != call_id);
                for op in operations {
                    self.ops.insert(
                        op.id.clone(),
                        OpState {
                            spec: op.spec.clone(),
                            end: None,
                            call_id: call_id.clone(),
                        },
                    );
                }
                // A call that runs shows its placeholder from now on, right
                // after the response that made it (as the reference stages
                // it), whatever is staged later; its result replaces it in
                // place until a turn sends it.
                let running = *outcome == CallOutcome::Submit;
                if running {
                    self.context.add_tool_result(call_id, Vec::new(), true);
                }
                self.calls.insert(
                    call_id.clone(),
                    CallState {
                        tool: tool.clone(),
                        arguments: arguments.clone(),
                        turn: *turn,
                        at_unix_ms: *at_unix_ms,
                        outcome: outcome.clone(),
                        ops: operations.iter().map(|o| o.id.clone()).collect(),
                        shown: if running {
                            Shown::Placeholder
                        } else {
                            Shown::Nothing
                        },
                    },
                );
            }
            Record::Operation { snapshot } => {
                if let Some(op) = self.ops.get_mut(&snapshot.id)
                    && op.end.is_none()
                {
                    op.end = Some(snapshot.clone());
                }
            }
            Record::Result {
                call_id,
                output,
                running,
            } => {
                self.context
                    .add_tool_result(call_id, output.clone(), *running);
                if let Some(c) = self.calls.get_mut(call_id) {
                    c.shown = if *running {
                        Shown::Placeholder
                    } else {
                        Shown::Final
                    };
                }
                if !*running {
                    self.has_new = true;
                }
            }
            Record::Stop { mode, cause } => {
                self.stop = Some((*mode, *cause));
                if *mode == StopMode::Hard && self.in_flight.take().is_some() {
                    // The request is canceled; its answer, if it still
                    // comes, is dropped, and a later run asks again.
                    self.has_new = true;
                }
            }
            // What the sandbox reached (or was refused) changes nothing
            // the model is given.
            Record::Egress { .. } | Record::EgressUnrecorded { .. } => {}
            Record::Finished { ending } => {
                self.last_end = Some(*ending);
                if *ending == super::record::Ending::Done
                    && let Some((_, answered)) = &mut self.last_input
                {
                    *answered = true;
                }
            }
        }
    }
}

impl Default for State {
    fn default() -> Self {
        Self::new()
    }
}

fn add_usage(total: &mut Usage, u: &Usage) {
    total.input_tokens += u.input_tokens;
    total.cached_input_tokens += u.cached_input_tokens;
    total.output_tokens += u.output_tokens;
    total.reasoning_tokens += u.reasoning_tokens;
}
