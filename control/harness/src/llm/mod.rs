//! Model access: a provider-neutral request/response model ([`model`]) and
//! two wire protocols over reqwest with SSE streaming: the OpenAI Responses
//! API ([`responses`]) and Chat Completions ([`chat`], which also serves
//! vLLM, Ollama, llama.cpp's server and OpenRouter).
//!
//! [`client::LlmClient`] owns the transport and the retry policy
//! ([`retry`]): exponential backoff with jitter that honours `Retry-After`,
//! a fixed list of codes never retried, and a clear error after the last
//! attempt. In-band failures (`response.failed`, an `error` event, a
//! context-length error) are errors, never an empty answer; a refusal or a
//! cut-off at the output-token limit is a [`model::StopReason`] the caller
//! must act on.

pub mod chat;
pub mod client;
pub mod conform;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod model;
pub mod responses;
pub mod retry;
pub mod sse;

pub use client::{Api, LlmClient, LlmConfig, MakeModel, Model, http_model};
pub use model::{
    Item, LlmError, Request, Response, Role, StopReason, StreamDelta, Tool, ToolChoice, ToolOutput,
    Usage,
};
