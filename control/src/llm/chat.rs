//! Chat Completions (OpenAI's, and the servers that copy it: vLLM, Ollama,
//! llama.cpp, OpenRouter): request body and stream interpretation.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value, json};

use super::conform;
use super::model::{
    Item, LlmError, Request, Response, Role, StopReason, StreamDelta, ToolChoice, ToolOutput, Usage,
};
use super::responses::arguments_for_replay;

const API: &str = "chat completions";

/// What an assistant says between tool results and a user message that
/// follows them: Mistral's and Gemma's templates (and mistral_common)
/// refuse a user message right after a tool message.
pub const BRIDGE: &str = include_str!("../../../prompts/bridge.md");

/// One part of a user message.
enum Part {
    Text(Arc<str>),
    Image(Arc<str>),
}

/// A message on its way to the wire.
enum Msg {
    System(Arc<str>),
    User(Vec<Part>),
    Assistant {
        text: String,
        reasoning: String,
        calls: Vec<Value>,
    },
    Tool {
        id: String,
        text: String,
    },
}

#[derive(Default)]
struct Messages {
    list: Vec<Msg>,
}

impl Messages {
    /// User content: merged into a user message just before it (the
    /// templates want roles to alternate), and never right after a tool
    /// message.
    fn user(&mut self, parts: Vec<Part>) {
        if parts.is_empty() {
            return;
        }
        match self.list.last_mut() {
            Some(Msg::User(prev)) => prev.extend(parts),
            Some(Msg::Tool { .. }) => {
                self.list.push(Msg::Assistant {
                    text: BRIDGE.trim_end().to_string(),
                    reasoning: String::new(),
                    calls: Vec::new(),
                });
                self.list.push(Msg::User(parts));
            }
            _ => self.list.push(Msg::User(parts)),
        }
    }

    fn to_json(&self) -> Vec<Value> {
        self.list
            .iter()
            .map(|m| match m {
                Msg::System(text) => json!({ "role": "system", "content": text }),
                Msg::User(parts) if parts.iter().all(|p| matches!(p, Part::Text(_))) => {
                    let texts: Vec<&str> = parts
                        .iter()
                        .filter_map(|p| match p {
                            Part::Text(t) => Some(&**t),
                            Part::Image(_) => None,
                        })
                        .collect();
                    json!({ "role": "user", "content": texts.join("\n\n") })
                }
                Msg::User(parts) => {
                    let content: Vec<Value> = parts
                        .iter()
                        .map(|p| match p {
                            Part::Text(t) => json!({ "type": "text", "text": t }),
                            Part::Image(url) => {
                                json!({ "type": "image_url", "image_url": { "url": url } })
                            }
                        })
                        .collect();
                    json!({ "role": "user", "content": content })
                }
                Msg::Assistant {
                    text,
                    reasoning,
                    calls,
                } => {
                    // Always a string: a null content breaks the chat
                    // templates of llama.cpp's Python server.
                    let mut m = json!({ "role": "assistant", "content": text });
                    if !calls.is_empty() {
                        m["tool_calls"] = json!(calls);
                    }
                    if !reasoning.is_empty() {
                        m["reasoning_content"] = json!(reasoning);
                    }
                    m
                }
                Msg::Tool { id, text } => {
                    json!({ "role": "tool", "tool_call_id": id, "content": text })
                }
            })
            .collect()
    }
}

fn parts_of(output: &[ToolOutput]) -> Vec<Part> {
    output
        .iter()
        .map(|o| match o {
            ToolOutput::Text { text } => Part::Text(text.clone()),
            ToolOutput::Image { data_url } => Part::Image(data_url.clone()),
        })
        .collect()
}

/// The request body, valid by construction (see [`super::conform`]).
pub fn request_body(req: &Request) -> Result<Value, LlmError> {
    let items = conform::arrange(&req.input);
    let mut ids = conform::CallIds::default();
    let mut out = Messages::default();
    // Images of the tool results just sent: a tool message carries text
    // only, so they follow the tool messages as one user message.
    let mut images: Vec<Part> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        if !matches!(items[i], Item::ToolResult { .. }) && !images.is_empty() {
            out.user(std::mem::take(&mut images));
        }
        if conform::is_model_item(&items[i]) {
            let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
            while i < items.len() && conform::is_model_item(&items[i]) {
                match &items[i] {
                    Item::Message { text: t, .. } => {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(t);
                    }
                    Item::ToolCall {
                        call_id,
                        name,
                        arguments,
                        ..
                    } => calls.push(json!({
                        "id": ids.of(call_id),
                        "type": "function",
                        "function": { "name": name, "arguments": arguments_for_replay(arguments) },
                    })),
                    Item::Reasoning { raw, .. } => {
                        if let Some(r) = conform::chat_reasoning_text(raw) {
                            reasoning.push_str(r);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            // An answer that was reasoning only says nothing to send back.
            if !text.is_empty() || !calls.is_empty() {
                out.list.push(Msg::Assistant {
                    text,
                    reasoning,
                    calls,
                });
            }
            continue;
        }
        match &items[i] {
            Item::ToolResult { call_id, output } => {
                let text = ToolOutput::text_of(output);
                let id = ids.of(call_id);
                let mut pictures: Vec<Part> = output
                    .iter()
                    .filter_map(|o| match o {
                        ToolOutput::Image { data_url } => Some(Part::Image(data_url.clone())),
                        ToolOutput::Text { .. } => None,
                    })
                    .collect();
                if !pictures.is_empty() {
                    images.push(Part::Text(
                        format!("Image output of tool call {id}:").into(),
                    ));
                    images.append(&mut pictures);
                }
                out.list.push(Msg::Tool {
                    id,
                    text: if text.is_empty() {
                        "(no text output)".into()
                    } else {
                        text
                    },
                });
            }
            Item::Message {
                role: Role::System | Role::Developer,
                text,
                ..
            } => out.list.push(Msg::System(text.clone())),
            Item::Message { text, .. } => out.user(vec![Part::Text(text.clone())]),
            Item::UserContent { parts } => out.user(parts_of(parts)),
            Item::ToolCall { .. } | Item::Reasoning { .. } => {}
        }
        i += 1;
    }
    if !images.is_empty() {
        out.user(images);
    }
    let mut body = json!({
        "model": req.model,
        "messages": out.to_json(),
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    if !req.tools.is_empty() {
        body["tools"] = req
            .tools
            .iter()
            .map(|t| {
                json!({ "type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters } })
            })
            .collect();
        if let Some(choice) = &req.tool_choice {
            body["tool_choice"] = match choice {
                ToolChoice::Auto => json!("auto"),
                ToolChoice::Required => json!("required"),
                ToolChoice::None => json!("none"),
                ToolChoice::Tool(name) => {
                    json!({ "type": "function", "function": { "name": name } })
                }
            };
        }
    }
    if let Some(n) = req.max_output_tokens {
        // OpenAI's reasoning models refuse `max_tokens`; vLLM, llama.cpp and
        // DeepSeek read this one as well.
        body["max_completion_tokens"] = json!(n);
    }
    if let Some(effort) = &req.reasoning_effort {
        body["reasoning_effort"] = json!(effort);
    }
    Ok(body)
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

#[derive(Debug, Default)]
pub struct StreamState {
    id: Option<String>,
    text: String,
    /// `reasoning_content` (DeepSeek, vLLM's reasoning parsers) or
    /// `reasoning` (OpenRouter, newer vLLM).
    reasoning: String,
    refusal: String,
    calls: BTreeMap<u64, PartialCall>,
    /// The legacy `function_call` some servers send beside `tool_calls`
    /// (llama.cpp's Python server): used only when no `tool_calls` came.
    legacy: PartialCall,
    finish: Option<String>,
    usage: Usage,
}

impl PartialCall {
    /// Some servers repeat the id and the name in every chunk (llama.cpp's
    /// Python server); OpenAI sends them once. Arguments are always deltas.
    fn merge(&mut self, f: &Value, delta: &mut dyn FnMut(StreamDelta)) {
        if let Some(name) = f["name"].as_str()
            && !name.is_empty()
            && name != self.name
        {
            if self.name.is_empty() {
                delta(StreamDelta::ToolCallStarted {
                    name: name.to_string(),
                });
            }
            self.name.push_str(name);
        }
        if let Some(args) = f["arguments"].as_str() {
            self.arguments.push_str(args);
        }
    }
}

fn protocol(message: impl Into<String>) -> LlmError {
    LlmError::Protocol {
        api: API,
        message: message.into(),
    }
}

impl StreamState {
    /// Handles one SSE data payload. Returns the response at `[DONE]`.
    pub fn on_data(
        &mut self,
        data: &str,
        delta: &mut dyn FnMut(StreamDelta),
    ) -> Result<Option<Response>, LlmError> {
        if data == "[DONE]" {
            return self.finish().map(Some);
        }
        let v: Value =
            serde_json::from_str(data).map_err(|e| protocol(format!("bad chunk JSON: {e}")))?;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(LlmError::InBand {
                api: API,
                code: err.get("code").and_then(|c| {
                    c.as_str()
                        .map(String::from)
                        .or_else(|| c.as_i64().map(|n| n.to_string()))
                }),
                message: err["message"].as_str().unwrap_or("no message").to_string(),
            });
        }
        if self.id.is_none() {
            self.id = v["id"].as_str().map(String::from);
        }
        for choice in v["choices"].as_array().into_iter().flatten() {
            let d = &choice["delta"];
            if let Some(t) = d["content"].as_str()
                && !t.is_empty()
            {
                self.text.push_str(t);
                delta(StreamDelta::Text(t.to_string()));
            }
            if let Some(r) = d["refusal"].as_str() {
                self.refusal.push_str(r);
            }
            for key in ["reasoning_content", "reasoning"] {
                if let Some(r) = d[key].as_str() {
                    self.reasoning.push_str(r);
                    break;
                }
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let index = tc["index"].as_u64().unwrap_or(self.calls.len() as u64);
                let call = self.calls.entry(index).or_default();
                if let Some(id) = tc["id"].as_str()
                    && !id.is_empty()
                {
                    call.id = id.to_string();
                }
                call.merge(&tc["function"], delta);
            }
            if d["function_call"].is_object()
                && d["tool_calls"].as_array().is_none_or(|a| a.is_empty())
            {
                self.legacy.merge(&d["function_call"], delta);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                self.finish = Some(f.to_string());
            }
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let n = |v: &Value| v.as_u64().unwrap_or(0);
            self.usage = Usage {
                input_tokens: n(&u["prompt_tokens"]),
                cached_input_tokens: n(&u["prompt_tokens_details"]["cached_tokens"]),
                output_tokens: n(&u["completion_tokens"]),
                reasoning_tokens: n(&u["completion_tokens_details"]["reasoning_tokens"]),
            };
        }
        Ok(None)
    }

    /// The response once the stream is over.
    pub fn finish(&mut self) -> Result<Response, LlmError> {
        let Some(finish) = self.finish.take() else {
            return Err(protocol("stream ended without a finish reason"));
        };
        let stop = match finish.as_str() {
            "length" => StopReason::MaxOutputTokens,
            "content_filter" => StopReason::Refused,
            _ if !self.refusal.is_empty() => StopReason::Refused,
            _ => StopReason::Complete,
        };
        let mut output = Vec::new();
        if !self.reasoning.is_empty() {
            output.push(conform::chat_reasoning(&std::mem::take(
                &mut self.reasoning,
            )));
        }
        if self.calls.is_empty() && !self.legacy.name.is_empty() {
            self.calls.insert(0, std::mem::take(&mut self.legacy));
        }
        let text = std::mem::take(&mut self.text) + &std::mem::take(&mut self.refusal);
        if !text.is_empty() {
            output.push(Item::Message {
                role: Role::Assistant,
                text: text.into(),
                provider_id: None,
            });
        }
        for (i, call) in std::mem::take(&mut self.calls) {
            output.push(Item::ToolCall {
                call_id: if call.id.is_empty() {
                    format!("call_{i}").into()
                } else {
                    call.id.into()
                },
                name: call.name.into(),
                arguments: call.arguments.into(),
                provider_id: None,
            });
        }
        Ok(Response {
            id: self.id.take(),
            stop,
            output,
            usage: self.usage,
        })
    }
}
