//! Chat Completions (OpenAI's, and the servers that copy it: vLLM, Ollama,
//! llama.cpp, OpenRouter): request body and stream interpretation.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::model::{
    Item, LlmError, Request, Response, Role, StopReason, StreamDelta, ToolOutput, Usage,
};
use super::responses::arguments_for_replay;

const API: &str = "chat completions";

pub fn request_body(req: &Request) -> Result<Value, LlmError> {
    let mut messages: Vec<Value> = Vec::new();
    for item in &req.input {
        match item {
            Item::Message { role, text, .. } => {
                let role = match role {
                    Role::Developer => "system",
                    r => r.as_str(),
                };
                messages.push(json!({ "role": role, "content": text }));
            }
            Item::ToolCall {
                call_id,
                name,
                arguments,
                ..
            } => {
                let call = json!({
                    "id": call_id,
                    "type": "function",
                    "function": { "name": name, "arguments": arguments_for_replay(arguments) },
                });
                // Calls of one turn belong to one assistant message.
                match messages.last_mut() {
                    Some(m) if m["role"] == "assistant" => {
                        if !m["tool_calls"].is_array() {
                            m["tool_calls"] = json!([]);
                        }
                        if let Some(calls) = m["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => messages.push(
                        json!({ "role": "assistant", "content": null, "tool_calls": [call] }),
                    ),
                }
            }
            Item::ToolResult { call_id, output } => {
                let text = ToolOutput::text_of(output);
                messages.push(json!({ "role": "tool", "tool_call_id": call_id, "content": text }));
                // Tool messages carry text only: images follow as a user message.
                let images: Vec<Value> = output
                    .iter()
                    .filter_map(|o| match o {
                        ToolOutput::Image { data_url } => {
                            Some(json!({ "type": "image_url", "image_url": { "url": data_url } }))
                        }
                        ToolOutput::Text { .. } => None,
                    })
                    .collect();
                if !images.is_empty() {
                    let mut content = vec![
                        json!({ "type": "text", "text": format!("Image output of tool call {call_id}:") }),
                    ];
                    content.extend(images);
                    messages.push(json!({ "role": "user", "content": content }));
                }
            }
            // Chat Completions has no way to send reasoning back.
            Item::Reasoning { .. } => {}
        }
    }
    let mut body = json!({
        "model": req.model,
        "messages": messages,
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
    }
    if let Some(n) = req.max_output_tokens {
        body["max_tokens"] = json!(n);
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
    refusal: String,
    calls: BTreeMap<u64, PartialCall>,
    finish: Option<String>,
    usage: Usage,
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
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let index = tc["index"].as_u64().unwrap_or(self.calls.len() as u64);
                let call = self.calls.entry(index).or_default();
                if let Some(id) = tc["id"].as_str() {
                    call.id = id.to_string();
                }
                if let Some(name) = tc["function"]["name"].as_str() {
                    if call.name.is_empty() {
                        delta(StreamDelta::ToolCallStarted {
                            name: name.to_string(),
                        });
                    }
                    call.name.push_str(name);
                }
                if let Some(args) = tc["function"]["arguments"].as_str() {
                    call.arguments.push_str(args);
                }
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
