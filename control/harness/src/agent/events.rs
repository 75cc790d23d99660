//! What a run tells its watcher: the events `corral run --json` writes, one
//! JSON object per line, each with `"v": EVENTS_VERSION` and a `type`.
//! Fields are snake_case; new fields may be added within a version, and
//! nothing is removed or renamed without a new version.

use corral_proto::event::EgressDecision;
use serde::{Deserialize, Serialize};

use super::record::Ending;
use crate::context::ChangeKind;
use crate::llm::{StopReason, Usage};

/// Version of the event stream.
pub const EVENTS_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// omitted | truncated | compacted
    pub kind: ChangeKind,
    pub source: String,
    pub reason: String,
}

impl From<&crate::context::Change> for Change {
    fn from(c: &crate::context::Change) -> Self {
        Self {
            kind: c.kind,
            source: c.source.clone(),
            reason: c.reason.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The run began (`resumed`: the session existed).
    SessionStarted {
        session_id: String,
        resumed: bool,
        sandbox_id: String,
        model: String,
        /// The worker's URL (`None`: the embedded worker).
        worker: Option<String>,
    },
    /// The run goes on in a fresh sandbox after its sandbox was lost
    /// (`reason`): the same run, its turn limit counting on.
    SandboxReplaced {
        session_id: String,
        sandbox_id: String,
        /// The worker's URL (`None`: the embedded worker).
        worker: Option<String>,
        reason: String,
    },
    /// A request was sent; `changes` lists what the context builder left
    /// out or shortened to fit the budget.
    TurnStarted {
        turn: u64,
        estimated_tokens: u64,
        changes: Vec<Change>,
    },
    /// Streaming text of the answer to `turn` (display only).
    TextDelta {
        turn: u64,
        text: String,
    },
    /// The request failed and is tried again.
    ModelRetry {
        turn: u64,
        attempt: u32,
        reason: String,
    },
    TurnCompleted {
        turn: u64,
        text: String,
        tool_calls: usize,
        stop: StopReason,
        usage: Usage,
    },
    /// A new input canceled request `turn`.
    Steered {
        turn: u64,
    },
    /// A tool call was translated; `error` is set when it was refused.
    /// `replayed`: a call of an earlier run still unanswered, shown again
    /// when a resume takes it up (its result follows in this stream).
    ToolCall {
        call_id: String,
        tool: String,
        arguments: String,
        error: Option<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        replayed: bool,
    },
    /// A call's final result, as the model reads it.
    ToolResult {
        call_id: String,
        tool: String,
        text: String,
        images: usize,
        /// How the call ended.
        status: CallEnd,
        /// The exit code of its command, when one exited.
        #[serde(skip_serializing_if = "Option::is_none")]
        exit_code: Option<i32>,
        /// How long its operations ran, in the sandbox.
        #[serde(skip_serializing_if = "Option::is_none")]
        duration_ms: Option<u64>,
    },
    /// A running call printed more (at most once a second per
    /// operation): its newest line and how much each stream has printed.
    ToolProgress {
        call_id: String,
        tool: String,
        line: String,
        stdout_bytes: u64,
        stderr_bytes: u64,
    },
    Heartbeat {
        text: String,
    },
    /// The sandbox's egress proxy decided on a connection: allowed,
    /// blocked (with `reason`: not_allowed, internal_address, ...), or
    /// closed (cut by a policy change).
    Egress {
        host: String,
        port: u16,
        decision: EgressDecision,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },
    ModelFailed {
        turn: u64,
        error: String,
    },
    /// The last event of a run.
    Result(RunResult),
    /// The run could not go on (a usage error, an unreachable worker, a
    /// session log that cannot be written): the last event, instead of
    /// `result`.
    Error {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// done | failed | interrupted
    pub status: Ending,
    pub session_id: String,
    pub final_text: String,
    pub error: Option<String>,
    /// Model requests of the whole session (a resumed one counts its
    /// earlier runs), and of this run.
    pub turns: u64,
    pub run_turns: u64,
    /// Tool calls and token usage of the whole session.
    pub tool_calls: u64,
    pub usage: Usage,
    /// This run's.
    pub duration_ms: u64,
}

/// How a call ended, as its result says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallEnd {
    Ok,
    /// A non-zero exit, a file error...
    Failed,
    /// A command ran past its timeout.
    TimedOut,
    Canceled,
    /// Its sandbox or worker was lost.
    Lost,
    /// It never ran: malformed arguments, an unknown tool.
    Refused,
}

impl CallEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            CallEnd::Ok => "ok",
            CallEnd::Failed => "failed",
            CallEnd::TimedOut => "timed_out",
            CallEnd::Canceled => "canceled",
            CallEnd::Lost => "lost",
            CallEnd::Refused => "refused",
        }
    }
}

/// An event read back from a line of `--json` output (a served session's
/// events, say). Its version must be this build's.
pub fn from_json_line(line: &str) -> Result<Event, String> {
    let mut value: serde_json::Value =
        serde_json::from_str(line.trim_end()).map_err(|e| e.to_string())?;
    let v = value
        .as_object_mut()
        .and_then(|o| o.remove("v"))
        .and_then(|v| v.as_u64());
    if v != Some(u64::from(EVENTS_VERSION)) {
        return Err(format!(
            "events of version {} (this build reads {EVENTS_VERSION})",
            v.map_or("none".to_string(), |v| v.to_string())
        ));
    }
    Event::deserialize(value).map_err(|e| e.to_string())
}

/// One event as a line of `--json` output.
pub fn to_json_line(event: &Event) -> String {
    #[derive(Serialize)]
    struct Line<'a> {
        v: u32,
        #[serde(flatten)]
        event: &'a Event,
    }
    let mut s = serde_json::to_string(&Line {
        v: EVENTS_VERSION,
        event,
    })
    .unwrap_or_else(|e| {
        format!(
            "{{\"v\":{EVENTS_VERSION},\"type\":\"encode_error\",\"error\":{:?}}}",
            e.to_string()
        )
    });
    s = escape_terminal_controls(s);
    s.push('\n');
    s
}

/// JSON leaves C1 controls (U+0080–U+009F, of which U+009B starts an escape
/// sequence) and the bidirectional overrides raw: written as `\uXXXX`
/// escapes (the same JSON), a line shown on a terminal (`corral run | cat`)
/// moves no cursor and reorders no text.
fn escape_terminal_controls(s: String) -> String {
    let hostile = |c: char| matches!(c, '\u{80}'..='\u{9f}' | '\u{200e}' | '\u{200f}' | '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !s.chars().any(hostile) {
        return s;
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if hostile(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod terminal_tests {
    use super::*;

    #[test]
    fn every_event_reads_back_as_it_was_written() {
        let mut events = vec![
            Event::ToolResult {
                call_id: "c1".into(),
                tool: "Bash".into(),
                text: "hi".into(),
                images: 0,
                status: CallEnd::Lost,
                exit_code: None,
                duration_ms: Some(3),
            },
            Event::TurnStarted {
                turn: 2,
                estimated_tokens: 9,
                changes: vec![Change {
                    kind: ChangeKind::Compacted,
                    source: "s".into(),
                    reason: "r".into(),
                }],
            },
            Event::Egress {
                host: "h".into(),
                port: 443,
                decision: EgressDecision::Allowed,
                reason: String::new(),
            },
            Event::Result(RunResult {
                status: Ending::Interrupted,
                session_id: "s".into(),
                final_text: String::new(),
                error: Some("e".into()),
                turns: 1,
                run_turns: 1,
                tool_calls: 0,
                usage: Default::default(),
                duration_ms: 5,
            }),
        ];
        // Every way a call ends reads back, a timeout's among them (its
        // word was once missing from the words read back).
        for status in [
            CallEnd::Ok,
            CallEnd::Failed,
            CallEnd::TimedOut,
            CallEnd::Canceled,
            CallEnd::Lost,
            CallEnd::Refused,
        ] {
            events.push(Event::ToolResult {
                call_id: "c2".into(),
                tool: "Bash".into(),
                text: String::new(),
                images: 0,
                status,
                exit_code: None,
                duration_ms: None,
            });
            let line = to_json_line(events.last().unwrap());
            assert!(
                line.contains(&format!("\"status\":\"{}\"", status.as_str())),
                "{line}"
            );
        }
        for e in events {
            assert_eq!(from_json_line(&to_json_line(&e)).unwrap(), e);
        }
        let bad = r#"{"v":1,"type":"tool_result","call_id":"c","tool":"t","text":"","images":0,"status":"weird"}"#;
        assert!(from_json_line(bad).unwrap_err().contains("weird"));
        assert!(from_json_line(r#"{"v":2,"type":"heartbeat","text":""}"#).is_err());
    }

    #[test]
    fn json_lines_carry_no_raw_terminal_control() {
        let line = to_json_line(&Event::Heartbeat {
            text: "a\u{1b}[2J\u{9b}31m\u{202e}b".into(),
        });
        assert!(
            !line.chars().any(|c| c.is_control() && c != '\n'),
            "{line:?}"
        );
        assert!(!line.contains('\u{202e}'), "{line:?}");
        let back: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(back["text"], "a\u{1b}[2J\u{9b}31m\u{202e}b");
    }
}
