//! What a caller asks of a session: the request (`corral run --request`'s
//! JSON), its messages and limits, and the options of a run.

use super::*;

/// A run's request: what `corral run --request` reads as JSON.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// Tools offered (default: all).
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// low | medium | high.
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// auto | required | none | a tool's name.
    #[serde(default)]
    pub tool_choice: Option<String>,
    /// A forced tool choice stays after the tool was called (by default it
    /// is `auto` from then until the next user message).
    #[serde(default)]
    pub keep_tool_choice: bool,
    /// fail (the default) | new_sandbox: what a run does when its sandbox
    /// is lost.
    #[serde(default)]
    pub on_sandbox_lost: Option<OnSandboxLost>,
    #[serde(default)]
    pub limits: Limits,
    /// The sandbox's network: `{"egress": ["pypi.org", ...]}`.
    #[serde(default)]
    pub network: Option<NetworkRequest>,
}

/// What a new session's sandbox may reach.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// Egress rules (see `corral sandbox create --egress`), within the
    /// worker's `--allow-egress`.
    #[serde(default)]
    pub egress: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: MessageRole,
    pub content: String,
    /// De-duplicates the message across reruns of a session (default: its
    /// position and content).
    #[serde(default)]
    pub message_id: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MessageRole {
    User,
    Assistant,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "low" => Some(Self::Low),
            "medium" => Some(Self::Medium),
            "high" => Some(Self::High),
            _ => None,
        }
    }
}

#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub max_turns: Option<u64>,
    pub max_output_tokens: Option<u32>,
    pub context_window_tokens: Option<u64>,
    pub max_tool_result_chars: Option<usize>,
}

/// Parses a request document.
pub fn parse_request(text: &str) -> Result<SessionRequest, String> {
    serde_json::from_str(text).map_err(|e| e.to_string())
}

/// How a session is run, besides its request.
#[derive(Clone, Default)]
pub struct RunOptions {
    pub request: SessionRequest,
    /// `reasoning_effort` as given by the caller (over the request's).
    pub reasoning_effort: Option<String>,
    /// The sandbox image of a new session.
    pub image: Option<String>,
    /// A template of the worker's for a new session's sandbox.
    pub template: Option<String>,
    /// The model endpoint (a new session's, or a resumed one's new one).
    pub base_url: Option<String>,
    pub api: Option<Api>,
    pub api_key: Option<String>,
    /// A directory of skills (`NAME/SKILL.md`) for a new session.
    pub skills: Option<PathBuf>,
    /// A local directory whose contents a new session's /workspace starts
    /// with.
    pub workspace: Option<PathBuf>,
    pub settings: Settings,
    /// End the run once the session is idle (as `corral run` does), rather
    /// than when the input sender is dropped.
    pub until_idle: bool,
    /// How long the worker may stay unreachable before the sandbox is taken
    /// for lost and the run fails (`None`: [`crate::follow::DEFAULT_PATIENCE`]).
    pub worker_lost_after: Option<Duration>,
    /// What a new session's runs do when its sandbox is lost (over the
    /// request's).
    pub on_sandbox_lost: Option<OnSandboxLost>,
    /// Traces of the run, when the caller exports them.
    pub telemetry: Option<crate::telemetry::Telemetry>,
    /// The run's trace, when its runner made one (see
    /// [`crate::runner::run`]); else a run with `telemetry` makes its own.
    pub trace: Option<crate::telemetry::RunTrace>,
    /// The tenant a front door starts the session for (see
    /// `SessionConfig::tenant`).
    pub tenant: Option<String>,
}

// The key is never shown, not even in a debug line.
impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("request", &self.request)
            .field("reasoning_effort", &self.reasoning_effort)
            .field("image", &self.image)
            .field("base_url", &self.base_url)
            .field("api", &self.api)
            .field("api_key", &self.api_key.as_ref().map(|_| "(hidden)"))
            .field("skills", &self.skills)
            .field("workspace", &self.workspace)
            .field("settings", &self.settings)
            .field("until_idle", &self.until_idle)
            .field("worker_lost_after", &self.worker_lost_after)
            .field("on_sandbox_lost", &self.on_sandbox_lost)
            .field("telemetry", &self.telemetry.is_some())
            .field("trace", &self.trace.is_some())
            .finish()
    }
}
