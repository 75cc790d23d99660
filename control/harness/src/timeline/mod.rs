//! A session on a time axis, read from its log alone: its model requests
//! (with their token counts), each tool call (queued, running, the
//! placeholder the model was shown while it ran, a result that came late,
//! how it ended) in lanes of calls that overlap, and the moments between:
//! inputs and steering inputs, heartbeats, stops, the fork point, lost and
//! replaced sandboxes, blocked egress, and the gaps where the session was
//! suspended between runs. [`Timeline`] is the data (`--json`); [`text`]
//! draws it for a terminal and [`html`] as one self-contained page.
//!
//! Times come from the log's lines (each record's `at`); a record written
//! before lines carried times takes its own time where it has one (a call,
//! a resume) or the time of the record before it.

pub mod html;
pub mod text;

use std::collections::HashMap;

use serde::Serialize;

use crate::agent::record::{Record, StopCause, StopMode};
use crate::llm::{Item, ToolOutput};
use crate::ops::OpStatus;
use crate::session::{LogError, SessionLog};
use crate::sessions::{SessionError, Sessions};
use crate::tools::CallOutcome;

/// The longest text kept of one thing (an input, arguments, an output).
const EXCERPT_CHARS: usize = 240;

/// A session on a time axis. Every `*_ms` is milliseconds since
/// `start_unix_ms`, the time of the session's first record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub session_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkedFrom>,
    pub start_unix_ms: i64,
    /// The time of the last record.
    pub end_ms: i64,
    pub requests: Vec<ModelRequest>,
    pub calls: Vec<ToolCall>,
    /// Lanes of tool calls: calls in one lane never overlap.
    pub lanes: usize,
    pub marks: Vec<Mark>,
    /// Where the session was not running (between one run's last record
    /// and the next run's resume).
    pub gaps: Vec<Gap>,
    /// How the last run ended: done | failed | interrupted (none: it has
    /// not ended, or its process died).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ending: Option<String>,
    pub totals: Totals,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForkedFrom {
    pub session_id: String,
    /// The parent's records up to this one were copied.
    pub upto_seq: u64,
    /// When the child went its own way (its first record of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    pub requests: u64,
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
    pub calls: u64,
}

/// One model request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelRequest {
    pub turn: u64,
    pub seq: u64,
    pub sent_ms: i64,
    /// When its answer (or failure) was recorded; for a request that was
    /// superseded, when the next one went out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<i64>,
    /// answered | failed | superseded (a steering input went out instead,
    /// or the run died and it was sent again; its late answer was dropped)
    /// | canceled (by a stop, a lost sandbox or the end of the run) |
    /// unfinished
    pub outcome: &'static str,
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
    /// The calls it made, by id.
    pub calls: Vec<String>,
    /// The start of its text (or of its failure).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub text: String,
}

/// One tool call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub call_id: String,
    pub tool: String,
    pub turn: u64,
    pub seq: u64,
    pub lane: usize,
    /// Copied from the parent session (before the fork point).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub inherited: bool,
    pub queued_ms: i64,
    /// When its operations began running (their end less their
    /// duration), when they ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<i64>,
    /// When its last operation ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<i64>,
    /// When the model was shown the placeholder of a call still running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placeholder_ms: Option<i64>,
    /// When the model was given its result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_ms: Option<i64>,
    /// Its result came after the model had been shown the placeholder.
    pub late: bool,
    /// exited | failed | canceled | lost | refused | answered | running
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// How it ended, in words.
    pub detail: String,
    pub arguments: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub output: String,
}

impl ToolCall {
    /// Whether the call ended well (exit 0, or answered at once).
    pub fn ok(&self) -> bool {
        match self.status {
            "exited" => self.exit_code == Some(0),
            "answered" => true,
            _ => false,
        }
    }

    /// The last moment the call occupies.
    fn last_ms(&self) -> Option<i64> {
        [self.ended_ms, self.result_ms, self.placeholder_ms]
            .into_iter()
            .flatten()
            .max()
    }
}

/// A moment of the session.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mark {
    pub at_ms: i64,
    pub seq: u64,
    /// input | steer | heartbeat | stop | end_when_idle (listed, not
    /// drawn) | fork | resume | sandbox_lost | sandbox_replaced |
    /// egress_blocked | context_shrunk | end
    pub kind: &'static str,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gap {
    pub from_ms: i64,
    pub to_ms: i64,
    /// suspended (between runs) | before_fork (from the parent's last
    /// record copied to the fork's own first)
    pub kind: &'static str,
}

/// Session `id` of `store` on a time axis.
pub fn of_session(store: &Sessions, id: &str) -> Result<Timeline, SessionError> {
    let records = SessionLog::<Record>::records(store.dir(), id)?;
    let header = records.header().clone();
    let mut timed = Vec::new();
    for r in records.timed() {
        let r = r.map_err(|e: LogError| SessionError::Log(e))?;
        timed.push((r.seq, r.at_unix_ms, r.record));
    }
    Ok(build(
        id,
        header.created_at_unix_ms,
        header.forked_from.map(|f| (f.session_id, f.upto_seq)),
        &timed,
    ))
}

/// The timeline of records `(seq, at, record)` of session `id`, created at
/// `created_ms`, forked from `(parent, upto_seq)` when it was.
pub fn build(
    id: &str,
    created_ms: i64,
    forked_from: Option<(String, u64)>,
    records: &[(u64, Option<i64>, Record)],
) -> Timeline {
    let mut b = Builder::default();
    let start = records
        .iter()
        .find_map(|(_, at, r)| at.or_else(|| own_time(r)))
        .unwrap_or(created_ms);
    let upto = forked_from.as_ref().map(|(_, upto)| *upto);
    let mut now = start;
    let mut fork_at = None;
    // A fork is made with records of its own after the parent's (its
    // calls cut, then a resume): they are its making, not a run.
    let mut forking = upto.is_some();
    for (seq, at, record) in records {
        // Never back in time: an older line without a time, a clock step.
        now = at.or_else(|| own_time(record)).unwrap_or(now).max(now);
        let t = now - start;
        let inherited = upto.is_some_and(|u| *seq <= u);
        if upto.is_some() && !inherited && fork_at.is_none() {
            fork_at = Some(t);
            if t > b.last_ms {
                b.gaps.push(Gap {
                    from_ms: b.last_ms,
                    to_ms: t,
                    kind: "before_fork",
                });
            }
            b.mark(
                t,
                *seq,
                "fork",
                format!(
                    "forked from {}",
                    forked_from.as_ref().map(|f| f.0.as_str()).unwrap_or("")
                ),
            );
        }
        let making_fork = forking && !inherited;
        if making_fork && matches!(record, Record::Resume { .. }) {
            forking = false;
        }
        b.record(*seq, t, inherited, making_fork, record);
    }
    let end_ms = now - start;
    let mut calls = b.calls;
    let lanes = pack(&mut calls, end_ms);
    let totals = Totals {
        requests: b.requests.len() as u64,
        input_tokens: b.requests.iter().map(|r| r.input_tokens).sum(),
        cached_input_tokens: b.requests.iter().map(|r| r.cached_input_tokens).sum(),
        output_tokens: b.requests.iter().map(|r| r.output_tokens).sum(),
        calls: calls.len() as u64,
    };
    Timeline {
        session_id: id.to_string(),
        forked_from: forked_from.map(|(session_id, upto_seq)| ForkedFrom {
            session_id,
            upto_seq,
            at_ms: fork_at,
        }),
        start_unix_ms: start,
        end_ms,
        requests: b.requests,
        calls,
        lanes,
        marks: b.marks,
        gaps: b.gaps,
        ending: b.ending,
        totals,
    }
}

/// The time a record carries itself, for lines written without one.
fn own_time(r: &Record) -> Option<i64> {
    match r {
        Record::Resume { at_unix_ms, .. } | Record::Call { at_unix_ms, .. } => Some(*at_unix_ms),
        _ => None,
    }
}

#[derive(Default)]
struct Builder {
    requests: Vec<ModelRequest>,
    calls: Vec<ToolCall>,
    marks: Vec<Mark>,
    gaps: Vec<Gap>,
    ending: Option<String>,
    /// Call index by call id, and by operation id.
    by_call: HashMap<String, usize>,
    by_op: HashMap<String, usize>,
    /// Operations of each call not yet ended.
    open_ops: HashMap<usize, usize>,
    /// The time of the previous record.
    last_ms: i64,
}

impl Builder {
    fn mark(&mut self, at_ms: i64, seq: u64, kind: &'static str, text: String) {
        self.marks.push(Mark {
            at_ms,
            seq,
            kind,
            text: excerpt(&text),
        });
    }

    /// The request in flight, if any.
    fn in_flight(&mut self) -> Option<&mut ModelRequest> {
        self.requests
            .last_mut()
            .filter(|r| r.outcome == "unfinished")
    }

    fn cancel_in_flight(&mut self, t: i64) {
        if let Some(r) = self.in_flight() {
            r.outcome = "canceled";
            r.ended_ms = Some(t);
        }
    }

    fn busy(&self) -> bool {
        self.requests
            .last()
            .is_some_and(|r| r.outcome == "unfinished")
            || self.calls.iter().any(|c| c.status == "running")
    }

    /// Adds `record` at `t`: `inherited` from a fork's parent, or part of
    /// `making_fork` (the records that made this session a fork).
    fn record(&mut self, seq: u64, t: i64, inherited: bool, making_fork: bool, record: &Record) {
        match record {
            Record::Start { .. } | Record::History { .. } | Record::Forked { .. } => {}
            Record::Resume { .. } => {
                // The session was away between its last record and now
                // (its last run ended, or its process died); a fork's own
                // resume is where it starts from, drawn as its fork mark.
                if t > self.last_ms && seq > 2 && !making_fork {
                    self.gaps.push(Gap {
                        from_ms: self.last_ms,
                        to_ms: t,
                        kind: "suspended",
                    });
                }
                // A request in flight when the run ended is lost; it is
                // sent again.
                if let Some(r) = self.in_flight() {
                    r.outcome = "superseded";
                    r.ended_ms = Some(t);
                }
                if !making_fork {
                    self.mark(t, seq, "resume", "resumed".into());
                }
            }
            Record::Input { text, .. } => {
                let kind = if self.busy() { "steer" } else { "input" };
                self.mark(t, seq, kind, text.clone());
            }
            Record::Heartbeat { text } => self.mark(t, seq, "heartbeat", text.clone()),
            Record::Turn { turn } => {
                if let Some(r) = self.in_flight() {
                    r.outcome = "superseded";
                    r.ended_ms = Some(t);
                }
                // A call without its result goes out as the placeholder
                // of a call still running (staged when it was recorded).
                for c in &mut self.calls {
                    let submitted = !matches!(c.status, "refused" | "answered");
                    if submitted && c.result_ms.is_none() && c.placeholder_ms.is_none() {
                        c.placeholder_ms = Some(t);
                    }
                }
                self.requests.push(ModelRequest {
                    turn: *turn,
                    seq,
                    sent_ms: t,
                    ended_ms: None,
                    outcome: "unfinished",
                    input_tokens: 0,
                    cached_input_tokens: 0,
                    output_tokens: 0,
                    calls: Vec::new(),
                    text: String::new(),
                });
            }
            Record::Response { turn, response } => {
                if let Some(r) = self.requests.iter_mut().rev().find(|r| r.turn == *turn) {
                    r.ended_ms = Some(t);
                    r.outcome = "answered";
                    r.input_tokens = response.usage.input_tokens;
                    r.cached_input_tokens = response.usage.cached_input_tokens;
                    r.output_tokens = response.usage.output_tokens;
                    let mut text = String::new();
                    for item in &response.output {
                        match item {
                            Item::Message { text: m, .. } => text.push_str(m),
                            Item::ToolCall { call_id, .. } => r.calls.push(call_id.to_string()),
                            _ => {}
                        }
                    }
                    r.text = excerpt(&text);
                }
            }
            Record::ModelFailure { turn, error, .. } => {
                if let Some(r) = self.requests.iter_mut().rev().find(|r| r.turn == *turn) {
                    r.ended_ms = Some(t);
                    r.outcome = "failed";
                    r.text = excerpt(error);
                }
            }
            Record::Shrink {
                context_window_tokens,
                ..
            } => self.mark(
                t,
                seq,
                "context_shrunk",
                format!("the context window is now {context_window_tokens} tokens"),
            ),
            Record::Call {
                call_id,
                tool,
                arguments,
                turn,
                outcome,
                operations,
                ..
            } => {
                let (status, detail, output, ended) = match outcome {
                    CallOutcome::Error { text } => {
                        ("refused", excerpt(text), String::new(), Some(t))
                    }
                    CallOutcome::Done { output } => (
                        "answered",
                        "answered at once".into(),
                        outputs(output),
                        Some(t),
                    ),
                    CallOutcome::Submit => ("running", String::new(), String::new(), None),
                };
                let i = self.calls.len();
                self.by_call.insert(call_id.clone(), i);
                for op in operations {
                    self.by_op.insert(op.id.to_string(), i);
                }
                if status == "running" && !operations.is_empty() {
                    self.open_ops.insert(i, operations.len());
                }
                self.calls.push(ToolCall {
                    call_id: call_id.clone(),
                    tool: tool.clone(),
                    turn: *turn,
                    seq,
                    lane: 0,
                    inherited,
                    queued_ms: t,
                    started_ms: None,
                    ended_ms: ended,
                    placeholder_ms: None,
                    result_ms: None,
                    late: false,
                    status,
                    exit_code: None,
                    detail,
                    arguments: excerpt(arguments),
                    output,
                });
            }
            Record::Operation { snapshot } => {
                let Some(&i) = self.by_op.get(&snapshot.id.to_string()) else {
                    return;
                };
                let call = &mut self.calls[i];
                if let Some(r) = &snapshot.result {
                    let began = (t - r.duration_ms as i64).max(call.queued_ms);
                    call.started_ms = Some(call.started_ms.map_or(began, |s| s.min(began)));
                    call.exit_code = Some(r.outcome.exit_status());
                    call.detail = r.outcome.to_string();
                }
                let (status, detail) = match snapshot.status {
                    OpStatus::Completed => ("exited", None),
                    OpStatus::Canceled => ("canceled", Some("canceled".to_string())),
                    _ if snapshot.lost => ("lost", snapshot.failure.clone()),
                    _ => ("failed", snapshot.failure.clone()),
                };
                // The worst of its operations stands for the call.
                if call.status == "running" || call.status == "exited" {
                    call.status = status;
                }
                if let Some(d) = detail {
                    call.detail = excerpt(&d);
                }
                let left = self.open_ops.entry(i).or_insert(1);
                *left = left.saturating_sub(1);
                if *left == 0 {
                    call.ended_ms = Some(t);
                }
            }
            Record::Result {
                call_id,
                output,
                running,
            } => {
                let Some(&i) = self.by_call.get(call_id) else {
                    return;
                };
                let call = &mut self.calls[i];
                if *running {
                    call.placeholder_ms.get_or_insert(t);
                } else {
                    call.result_ms = Some(t);
                    call.late = call.placeholder_ms.is_some();
                    if call.output.is_empty() {
                        call.output = outputs(output);
                    }
                }
            }
            Record::Stop { mode, cause } => {
                let why = match cause {
                    StopCause::Requested => "asked",
                    StopCause::TurnLimit => "the turn limit",
                };
                // Ending once idle interrupts nothing (`corral run` asks it
                // of every run before its work starts): a step, not a stop.
                let (kind, what) = match mode {
                    StopMode::Hard => {
                        self.cancel_in_flight(t);
                        ("stop", "stop now")
                    }
                    StopMode::WhenIdle => ("end_when_idle", "end when idle"),
                };
                self.mark(t, seq, kind, format!("{what} ({why})"));
            }
            Record::SandboxLost { reason } => {
                self.cancel_in_flight(t);
                self.mark(t, seq, "sandbox_lost", reason.clone());
            }
            Record::Placed {
                worker, sandbox_id, ..
            } => self.mark(
                t,
                seq,
                "sandbox_replaced",
                format!(
                    "a fresh sandbox {sandbox_id} on {}",
                    worker.as_deref().unwrap_or("the local worker")
                ),
            ),
            Record::Egress {
                host,
                port,
                decision,
                reason,
                unreported,
            } => {
                if *unreported > 0 {
                    self.mark(
                        t,
                        seq,
                        "egress_unrecorded",
                        format!("{unreported} egress decisions before this one were not told"),
                    );
                }
                if *decision == corral_proto::event::EgressDecision::Blocked {
                    self.mark(
                        t,
                        seq,
                        "egress_blocked",
                        format!("{host}:{port} ({reason})"),
                    );
                }
            }
            Record::EgressUnrecorded { count } => self.mark(
                t,
                seq,
                "egress_unrecorded",
                format!("{count} egress decisions came too fast to be recorded"),
            ),
            Record::Finished { ending } => {
                let word = ending.as_str();
                self.ending = Some(word.to_string());
                self.cancel_in_flight(t);
                self.mark(t, seq, "end", format!("the run ended {word}"));
            }
        }
        self.last_ms = t;
    }
}

/// Puts each call in the first lane free at its start; the number of lanes.
fn pack(calls: &mut [ToolCall], end_ms: i64) -> usize {
    let mut lanes: Vec<i64> = Vec::new();
    for call in calls.iter_mut() {
        let last = call.last_ms().unwrap_or(end_ms).max(call.queued_ms);
        match lanes.iter().position(|&free| free < call.queued_ms) {
            Some(l) => {
                lanes[l] = last;
                call.lane = l;
            }
            None => {
                lanes.push(last);
                call.lane = lanes.len() - 1;
            }
        }
    }
    lanes.len()
}

fn outputs(output: &[ToolOutput]) -> String {
    let mut text = String::new();
    for o in output {
        match o {
            ToolOutput::Text { text: t } => text.push_str(t),
            ToolOutput::Image { .. } => text.push_str("[image]"),
        }
    }
    excerpt(&text)
}

/// The start of `text` (one line's worth of characters).
fn excerpt(text: &str) -> String {
    let mut out: String = text.chars().take(EXCERPT_CHARS).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn call(id: &str, at: i64) -> Record {
        Record::Call {
            call_id: id.into(),
            tool: "Bash".into(),
            arguments: "{}".into(),
            turn: 1,
            at_unix_ms: at,
            outcome: CallOutcome::Error {
                text: "refused".into(),
            },
            operations: Vec::new(),
        }
    }

    #[test]
    fn a_log_written_before_records_had_times_still_draws() {
        // No line time at all: a record takes its own time, else the one
        // before it; time never runs backwards.
        let records = vec![
            (1, None, Record::Turn { turn: 1 }),
            (2, None, call("a", 10_000)),
            (3, None, Record::Heartbeat { text: "h".into() }),
            (4, None, call("b", 9_000)),
            (5, Some(12_500), Record::Heartbeat { text: "h2".into() }),
        ];
        let t = build("old", 1_000, None, &records);
        assert_eq!(t.start_unix_ms, 10_000);
        assert_eq!(t.calls[0].queued_ms, 0);
        assert_eq!(
            t.calls[1].queued_ms, 0,
            "an earlier own time does not go back"
        );
        assert_eq!(t.marks[0].at_ms, 0);
        assert_eq!(t.end_ms, 2_500);
        assert_eq!(t.requests[0].outcome, "unfinished");
        let drawn = text::render(&t, 80);
        assert!(drawn.contains("session old"), "{drawn}");
    }

    #[test]
    fn a_hostile_sessions_view_holds_no_control_character() {
        // A tool name, a refusal and a lost sandbox's reason, each the
        // model's, the sandbox's or a worker's words.
        let hostile = "x\x1b]0;owned\x07\x1b[2J\u{9b}31m\u{202e}";
        let records = vec![
            (1, Some(1_000), Record::Turn { turn: 1 }),
            (
                2,
                Some(1_100),
                Record::Call {
                    call_id: "c1".into(),
                    tool: hostile.into(),
                    arguments: hostile.into(),
                    turn: 1,
                    at_unix_ms: 1_100,
                    outcome: CallOutcome::Error {
                        text: hostile.into(),
                    },
                    operations: Vec::new(),
                },
            ),
            (
                3,
                Some(1_200),
                Record::SandboxLost {
                    reason: hostile.into(),
                },
            ),
        ];
        let drawn = text::render(&build("hostile", 1_000, None, &records), 100);
        assert!(
            !drawn
                .chars()
                .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
            "{drawn:?}"
        );
    }

    #[test]
    fn only_a_stop_that_interrupts_is_drawn_as_one() {
        // `corral run` asks every run to end once idle before its work
        // starts: listed as a step, never drawn as a stop.
        let stop = |mode| Record::Stop {
            mode,
            cause: StopCause::Requested,
        };
        let idle = build(
            "idle",
            1_000,
            None,
            &[
                (1, Some(1_000), stop(StopMode::WhenIdle)),
                (2, Some(2_000), Record::Turn { turn: 1 }),
            ],
        );
        assert_eq!(idle.marks[0].kind, "end_when_idle");
        let drawn = text::render(&idle, 80);
        let moments = drawn.lines().find(|l| l.starts_with("moments")).unwrap();
        assert!(!moments.contains('x'), "{drawn}");
        assert!(drawn.contains("end when idle (asked)"), "{drawn}");
        let hard = build(
            "hard",
            1_000,
            None,
            &[
                (1, Some(1_000), Record::Turn { turn: 1 }),
                (2, Some(2_000), stop(StopMode::Hard)),
            ],
        );
        assert_eq!(hard.marks[0].kind, "stop");
        let drawn = text::render(&hard, 80);
        let moments = drawn.lines().find(|l| l.starts_with("moments")).unwrap();
        assert!(moments.contains('x'), "{drawn}");
        assert!(drawn.contains("stop now (asked)"), "{drawn}");
    }

    #[test]
    fn an_empty_log_draws_an_empty_axis() {
        let t = build("empty", 5_000, None, &[]);
        assert_eq!((t.start_unix_ms, t.end_ms, t.lanes), (5_000, 0, 0));
        let drawn = text::render(&t, 40);
        assert!(drawn.contains("0 requests"), "{drawn}");
        assert!(html::render(&t).contains("Timeline of session empty"));
    }
}
