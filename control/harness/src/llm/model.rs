//! The provider-neutral model of a request and its response.
//!
//! Texts are `Arc<str>`: a request is rebuilt from the whole conversation
//! every turn, and sharing the texts makes that a copy of pointers.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One part of a tool's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolOutput {
    Text {
        text: Arc<str>,
    },
    /// An image as a `data:` URL.
    Image {
        data_url: Arc<str>,
    },
}

impl ToolOutput {
    /// The text parts of a tool's result, joined by newlines.
    pub fn text_of(output: &[ToolOutput]) -> String {
        output
            .iter()
            .filter_map(|o| match o {
                ToolOutput::Text { text } => Some(&**text),
                ToolOutput::Image { .. } => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// How many images a tool's result holds.
    pub fn images_in(output: &[ToolOutput]) -> usize {
        output
            .iter()
            .filter(|o| matches!(o, ToolOutput::Image { .. }))
            .count()
    }
}

/// One entry of the conversation, in or out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Item {
    Message {
        role: Role,
        text: Arc<str>,
        /// The provider's own id, echoed back when replayed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider_id: Option<String>,
    },
    ToolCall {
        call_id: Arc<str>,
        name: Arc<str>,
        /// Raw JSON text as the model produced it (it may be malformed).
        arguments: Arc<str>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider_id: Option<String>,
    },
    ToolResult {
        call_id: Arc<str>,
        output: Vec<ToolOutput>,
    },
    /// Reasoning, kept verbatim (`raw`) so it can be sent back.
    Reasoning {
        summary: Vec<String>,
        raw: serde_json::Value,
    },
    /// A user message of text and images: a late result, or what a wire
    /// protocol cannot carry in a tool result (Chat Completions' images).
    /// Built for requests only, never part of a response.
    UserContent { parts: Vec<ToolOutput> },
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides (the providers' default).
    Auto,
    /// Some tool must be called.
    Required,
    /// No tool may be called.
    None,
    /// This tool must be called.
    Tool(String),
}

impl ToolChoice {
    /// `auto`, `required`, `none`, or a tool's name.
    pub fn parse(s: &str) -> Self {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "required" => Self::Required,
            "none" => Self::None,
            _ => Self::Tool(s.to_string()),
        }
    }
}

/// A function tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    pub model: String,
    pub input: Vec<Item>,
    pub tools: Vec<Tool>,
    pub max_output_tokens: Option<u32>,
    /// low | medium | high (Responses API only).
    pub reasoning_effort: Option<String>,
    /// Lets the provider reuse its prompt cache across a session's requests.
    pub cache_key: Option<String>,
    /// `None`: the provider's default (auto).
    pub tool_choice: Option<ToolChoice>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model finished (with or without tool calls).
    Complete,
    /// Cut off at the output-token limit: the answer is incomplete.
    MaxOutputTokens,
    /// The model or the provider's filter refused.
    Refused,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
    pub reasoning_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: Option<String>,
    pub stop: StopReason,
    pub output: Vec<Item>,
    pub usage: Usage,
}

impl Response {
    /// The assistant's text, all messages joined.
    pub fn text(&self) -> String {
        self.output
            .iter()
            .filter_map(|i| match i {
                Item::Message {
                    role: Role::Assistant,
                    text,
                    ..
                } => Some(&**text),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn tool_calls(&self) -> impl Iterator<Item = &Item> {
        self.output
            .iter()
            .filter(|i| matches!(i, Item::ToolCall { .. }))
    }
}

/// Streaming progress, for display only (the final [`Response`] is the truth).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamDelta {
    Text(String),
    ToolCallStarted {
        name: String,
    },
    /// A new attempt after a retryable failure.
    Retrying {
        attempt: u32,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    /// A non-2xx answer.
    #[error("{api} request failed with status {status}{}: {message}", code.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Http {
        api: &'static str,
        status: u16,
        code: Option<String>,
        message: String,
        /// From `Retry-After`, when given.
        retry_after: Option<std::time::Duration>,
    },
    /// The provider reported a failure inside a 2xx stream
    /// (`response.failed`, an `error` event).
    #[error("{api} reported a failure{}: {message}", code.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    InBand {
        api: &'static str,
        code: Option<String>,
        message: String,
    },
    #[error("cannot reach the model endpoint: {0}")]
    Transport(String),
    /// The stream broke off or did not follow the protocol.
    #[error("malformed {api} stream: {message}")]
    Protocol { api: &'static str, message: String },
    /// A 2xx answer whose stream held nothing at all: what llama.cpp's
    /// servers send for a request longer than their context window (the
    /// failure comes after the status). Treated as a context overflow.
    #[error(
        "the {api} endpoint answered with an empty stream (a llama.cpp server does so for a request longer than its context window)"
    )]
    EmptyAnswer { api: &'static str },
    #[error("request could not be built: {0}")]
    Request(String),
    #[error("canceled")]
    Canceled,
    #[error("gave up after {attempts} attempts: {last}")]
    GaveUp { attempts: u32, last: Box<LlmError> },
}

impl LlmError {
    /// The provider's error code, where there is one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Http { code, .. } | Self::InBand { code, .. } => code.as_deref(),
            Self::GaveUp { last, .. } => last.code(),
            _ => None,
        }
    }

    /// The request does not fit the model's context window.
    pub fn is_context_length_exceeded(&self) -> bool {
        matches!(self, Self::EmptyAnswer { .. })
            || self.code() == Some("context_length_exceeded")
            || self.to_string().contains("maximum context length")
    }
}
