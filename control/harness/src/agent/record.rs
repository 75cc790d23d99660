//! The session's records: every change to a session is one of these,
//! appended (fsynced) to the session log before it has any effect outside
//! the process. Replaying them through [`super::State::apply`] rebuilds the
//! session exactly.

use corral_proto::{OperationId, OperationResult, OperationSpec, SandboxId};
use serde::{Deserialize, Serialize};

use crate::context::Budget;
use crate::llm::{Api, Response, Role, ToolChoice, ToolOutput};
use crate::ops::OpStatus;

/// How a session is set up; the first record of every session. A resumed
/// session keeps these settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionConfig {
    pub model: String,
    #[serde(default)]
    pub system_prompt: String,
    /// Tools offered (`None`: all of them).
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// Where the session's operations run.
    pub sandbox_id: SandboxId,
    #[serde(default)]
    pub image: Option<String>,
    /// A template of the worker's its sandbox is made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    pub budget: Budget,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// Most model requests a run makes before it gives up.
    pub max_turns: u64,
    /// Skills offered through `SkillUse` (recorded, so that a replay on
    /// another machine builds the same requests).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skills: Vec<SkillDef>,
    /// The worker the session was placed on (`None`: the embedded one). A
    /// resumed session goes back to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The model endpoint; a resumed session goes back to it unless told
    /// otherwise (`None` in sessions recorded before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<Endpoint>,
    /// Whether and which tool the model must call (`None`: the provider's
    /// default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// A forced tool choice stays after the tool was called (otherwise it
    /// is `auto` from then until the next user message).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_tool_choice: bool,
    /// The local directory whose contents were copied into /workspace
    /// before the first turn (once: never again on resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// The id of the worker the session was placed on (its address may
    /// change; its id does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// What a run does when the sandbox is lost.
    #[serde(default, skip_serializing_if = "OnSandboxLost::is_fail")]
    pub on_sandbox_lost: OnSandboxLost,
    /// The sandbox's generation: 0 for the first, one more for each
    /// replacement after a loss.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// The sandbox's egress rules (every generation's): what its commands
    /// may reach through the worker's proxy, and what the Bash tool tells
    /// the model it can reach. Empty: no network at all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<String>,
    /// The tenant the session was started for, at a front door: it alone
    /// reaches the session, and its sandboxes carry its name (see
    /// `corral_proto::sandbox::TENANT_LABEL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a run does when its sandbox is lost (its worker unreachable past
/// the deadline, or the worker says so).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnSandboxLost {
    /// The run fails, saying why (a resume goes on once the worker is
    /// back).
    #[default]
    Fail,
    /// The run goes on in a fresh sandbox, placed anew; the model is told
    /// what was lost.
    NewSandbox,
}

impl OnSandboxLost {
    pub fn is_fail(&self) -> bool {
        *self == Self::Fail
    }
}

impl SessionConfig {
    /// The tools the session offers.
    pub fn registry(&self) -> crate::tools::Registry {
        let mut r = crate::tools::Registry::with_skills(
            self.skills.iter().map(SkillDef::to_skill).collect(),
        );
        // The session's default bound of a command's output.
        let mut bash =
            crate::tools::bash::Bash::with_default_output(self.budget.max_tool_result_chars as u64);
        bash.egress.clone_from(&self.egress);
        r.register(Box::new(bash));
        if let Some(allowed) = &self.tools {
            r.retain(allowed);
        }
        r
    }
}

/// What a resumed run was told (flags, a request file); what differs from
/// the session's settings is recorded with the resume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub max_turns: Option<u64>,
    pub model: Option<String>,
    pub base_url: Option<String>,
    pub api: Option<Api>,
    pub tool_choice: Option<ToolChoice>,
    pub context_window_tokens: Option<u64>,
    pub max_output_tokens: Option<u32>,
    pub reasoning_effort: Option<String>,
}

impl Endpoint {
    /// `base_url` and `api` where given, the rest from `current`, else the
    /// defaults (OpenAI's Responses API).
    pub fn merge(current: Option<&Endpoint>, base_url: Option<String>, api: Option<Api>) -> Self {
        Self {
            base_url: base_url
                .map(|u| u.trim_end_matches('/').to_string())
                .or_else(|| current.map(|c| c.base_url.clone()))
                .unwrap_or_else(|| crate::llm::client::DEFAULT_BASE_URL.to_string()),
            api: api.or(current.map(|c| c.api)).unwrap_or(Api::Responses),
        }
    }
}

/// Where a session's model is served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// E.g. `https://api.openai.com/v1`.
    pub base_url: String,
    pub api: Api,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkillDef {
    pub name: String,
    pub description: String,
    /// Where its SKILL.md is in the sandbox.
    pub location: String,
    /// Its instructions.
    pub body: String,
}

impl SkillDef {
    pub fn to_skill(&self) -> crate::tools::skills::Skill {
        crate::tools::skills::Skill {
            info: crate::context::SkillInfo {
                name: self.name.clone(),
                description: self.description.clone(),
                location: self.location.clone(),
            },
            body: self.body.clone(),
        }
    }

    pub fn from_skill(s: &crate::tools::skills::Skill) -> Self {
        Self {
            name: s.info.name.clone(),
            description: s.info.description.clone(),
            location: s.info.location.clone(),
            body: s.body.clone(),
        }
    }
}

/// What the translator made of a tool call (recorded in `call`).
pub use crate::tools::CallOutcome;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpEntry {
    pub id: OperationId,
    pub spec: OperationSpec,
}

/// The persisted state of an operation: only terminal states are recorded
/// (progress and intermediate states live in memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpSnapshot {
    pub id: OperationId,
    pub status: OpStatus,
    #[serde(default)]
    pub result: Option<OperationResult>,
    #[serde(default)]
    pub failure: Option<String>,
    /// Failed because its sandbox was lost (absent: not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lost: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    /// End once nothing is pending: no request in flight, no call running,
    /// nothing new for the model.
    WhenIdle,
    /// Cancel the request in flight and every running operation, record
    /// their final states, and end.
    Hard,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopCause {
    /// Asked for (an interrupt, or the embedding program).
    Requested,
    /// The run reached its turn limit.
    TurnLimit,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    Done,
    Failed,
    Interrupted,
}

impl OnSandboxLost {
    /// fail | new_sandbox
    pub fn as_str(self) -> &'static str {
        match self {
            OnSandboxLost::Fail => "fail",
            OnSandboxLost::NewSandbox => "new_sandbox",
        }
    }
}

impl Ending {
    /// done | failed | interrupted
    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Done => "done",
            Ending::Failed => "failed",
            Ending::Interrupted => "interrupted",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// The session's settings (the first record).
    Start {
        config: SessionConfig,
    },
    /// A process took the session over again: a request that was in flight
    /// is lost and will be sent again; a stop or failure of the previous
    /// run no longer holds.
    Resume {
        at_unix_ms: i64,
        /// The turn limit of the run that starts here, when it was given
        /// (otherwise the session's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_turns: Option<u64>,
        /// A model that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
        /// An endpoint that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        endpoint: Option<Endpoint>,
        /// A tool choice that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<ToolChoice>,
        /// A context window that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context_window_tokens: Option<u64>,
        /// A bound on each answer that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_output_tokens: Option<u32>,
        /// A reasoning effort that replaces the session's from here on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning_effort: Option<String>,
    },
    /// This session was forked from another; its operations run in a
    /// sandbox of its own.
    Forked {
        parent: String,
        sandbox_id: SandboxId,
    },
    /// A conversation entry given up front (`--request` messages).
    History {
        role: Role,
        text: String,
    },
    /// A user input; `input_id` de-duplicates redelivery.
    Input {
        input_id: String,
        text: String,
    },
    /// A control input shown to the model as a user message.
    Heartbeat {
        text: String,
    },
    /// Request `turn` is about to be sent (the context is committed).
    Turn {
        turn: u64,
    },
    /// How request `turn` ended, when it produced a response.
    Response {
        turn: u64,
        response: Response,
    },
    /// How request `turn` ended, when it failed for good.
    ModelFailure {
        turn: u64,
        error: String,
        #[serde(default)]
        code: Option<String>,
    },
    /// A tool call of the last response, translated. The operations are
    /// recorded here, before any is handed to a manager.
    Call {
        call_id: String,
        tool: String,
        /// As the model wrote them.
        #[serde(default)]
        arguments: String,
        turn: u64,
        at_unix_ms: i64,
        outcome: CallOutcome,
        #[serde(default)]
        operations: Vec<OpEntry>,
    },
    /// Request `turn` was refused as longer than the model's context
    /// window: the session's window becomes `context_window_tokens`, the
    /// longest tool result shrinks with it, and the request is built again
    /// (older tool outputs elided, long ones cut, to fit).
    Shrink {
        turn: u64,
        context_window_tokens: u64,
        error: String,
    },
    /// An operation reached a terminal state.
    Operation {
        snapshot: OpSnapshot,
    },
    /// What the model is given for a call: its result, or (`running`) the
    /// placeholder of a call still running.
    Result {
        call_id: String,
        output: Vec<ToolOutput>,
        running: bool,
    },
    Stop {
        mode: StopMode,
        cause: StopCause,
    },
    /// The session's sandbox was lost (its worker unreachable past the
    /// deadline, or the worker says so): the run fails with `reason`; a
    /// resume goes on where it can.
    SandboxLost {
        reason: String,
    },
    /// A fresh sandbox replaces a lost one, on `worker` (the model is told
    /// with `text`, as a user message).
    Placed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker_id: Option<String>,
        sandbox_id: SandboxId,
        generation: u64,
        text: String,
    },
    /// The sandbox's egress proxy decided on a connection (see
    /// worker.proto's `SandboxEvent.Egress`).
    Egress {
        host: String,
        port: u16,
        /// allowed | blocked | closed
        decision: corral_proto::event::EgressDecision,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
        /// Decisions made before this one that the worker could not tell
        /// (a flood of refused connections).
        #[serde(default, skip_serializing_if = "is_zero")]
        unreported: u64,
    },
    /// Egress decisions told by the worker that this process could not
    /// record (they came faster than the run took them): the gap, said.
    EgressUnrecorded {
        count: u64,
    },
    /// A run ended.
    Finished {
        ending: Ending,
    },
}

impl Record {
    /// A short name, for logs and `corral session show`.
    pub fn kind(&self) -> &'static str {
        match self {
            Record::Start { .. } => "start",
            Record::Resume { .. } => "resume",
            Record::Forked { .. } => "forked",
            Record::History { .. } => "history",
            Record::Input { .. } => "input",
            Record::Heartbeat { .. } => "heartbeat",
            Record::Turn { .. } => "turn",
            Record::Response { .. } => "response",
            Record::ModelFailure { .. } => "model_failure",
            Record::Call { .. } => "call",
            Record::Shrink { .. } => "shrink",
            Record::Operation { .. } => "operation",
            Record::Result { .. } => "result",
            Record::Stop { .. } => "stop",
            Record::SandboxLost { .. } => "sandbox_lost",
            Record::Placed { .. } => "placed",
            Record::Egress { .. } => "egress",
            Record::EgressUnrecorded { .. } => "egress_unrecorded",
            Record::Finished { .. } => "finished",
        }
    }
}
