//! The OpenAI Responses API: request body and stream interpretation.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::conform;
use super::model::{
    Item, LlmError, Request, Response, Role, StopReason, StreamDelta, ToolChoice, ToolOutput, Usage,
};

const API: &str = "responses";

/// Arguments that are not a JSON object are sent back wrapped, so the
/// provider accepts the history and the model still sees its own mistake.
pub fn arguments_for_replay(raw: &str) -> String {
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(_)) => raw.to_string(),
        _ => json!({ "invalid_arguments": raw }).to_string(),
    }
}

/// The smallest `max_output_tokens` OpenAI accepts.
pub const MIN_OUTPUT_TOKENS: u32 = 16;

fn content_parts(parts: &[ToolOutput], text_type: &str, image_type: &str) -> Vec<Value> {
    parts
        .iter()
        .map(|o| match o {
            ToolOutput::Text { text } => json!({"type": text_type, "text": text}),
            ToolOutput::Image { data_url } => json!({"type": image_type, "image_url": data_url}),
        })
        .collect()
}

/// The request body, valid by construction (see [`super::conform`]).
pub fn request_body(req: &Request) -> Result<Value, LlmError> {
    let items = conform::arrange(&req.input);
    let mut input = Vec::with_capacity(items.len());
    // Reasoning is asked for, and sent back, only for a model that
    // reasons: one that does not refuses encrypted reasoning (a session
    // resumed with another model, say).
    let reasons = req.reasoning_effort.is_some() || conform::may_reason(&req.model);
    for (n, item) in items.iter().enumerate() {
        input.push(match item {
            Item::Message { role, text, .. } => json!({ "role": role.as_str(), "content": text }),
            Item::ToolCall {
                call_id,
                name,
                arguments,
                ..
            } => json!({
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": arguments_for_replay(arguments),
            }),
            Item::ToolResult { call_id, output } => {
                let only_text = output.iter().all(|o| matches!(o, ToolOutput::Text { .. }));
                let out = if only_text {
                    Value::String(ToolOutput::text_of(output))
                } else {
                    Value::Array(content_parts(output, "input_text", "input_image"))
                };
                json!({ "type": "function_call_output", "call_id": call_id, "output": out })
            }
            Item::UserContent { parts } => json!({
                "role": "user",
                "content": content_parts(parts, "input_text", "input_image"),
            }),
            Item::Reasoning { raw, .. } => {
                // With `store: false` the server resolves nothing by id: a
                // reasoning item goes back only with its encrypted content,
                // and only followed by an item of its own response.
                let followed = matches!(
                    items.get(n + 1),
                    Some(
                        Item::ToolCall { .. }
                            | Item::Message {
                                role: Role::Assistant,
                                ..
                            }
                    )
                );
                if !(reasons && followed && conform::replayable_reasoning(raw)) {
                    continue;
                }
                raw.clone()
            }
        });
    }
    let tools: Vec<Value> = req
        .tools
        .iter()
        .map(|t| {
            json!({
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                // Arguments are validated by the tool itself; strict schemas
                // would reject schemas that are not fully closed.
                "strict": false,
            })
        })
        .collect();
    let mut body = json!({
        "model": req.model,
        "input": input,
        "stream": true,
        "store": false,
    });
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools);
        if let Some(choice) = &req.tool_choice {
            body["tool_choice"] = match choice {
                ToolChoice::Auto => json!("auto"),
                ToolChoice::Required => json!("required"),
                ToolChoice::None => json!("none"),
                ToolChoice::Tool(name) => json!({ "type": "function", "name": name }),
            };
        }
    }
    if let Some(n) = req.max_output_tokens {
        body["max_output_tokens"] = json!(n.max(MIN_OUTPUT_TOKENS));
    }
    if let Some(effort) = &req.reasoning_effort {
        body["reasoning"] = json!({ "effort": effort, "summary": "auto" });
    }
    // Reasoning comes back in a form that can be sent again only when asked
    // for; a model that does not reason refuses the ask.
    if reasons {
        body["include"] = json!(["reasoning.encrypted_content"]);
    }
    if let Some(key) = &req.cache_key {
        body["prompt_cache_key"] = json!(key);
    }
    Ok(body)
}

/// Follows one response stream to its terminal event.
#[derive(Debug, Default)]
pub struct StreamState {
    /// `response.output_item.done` items by output index: the fallback when
    /// the terminal event carries no output.
    done_items: BTreeMap<u64, Value>,
}

fn protocol(message: impl Into<String>) -> LlmError {
    LlmError::Protocol {
        api: API,
        message: message.into(),
    }
}

fn in_band(v: &Value) -> LlmError {
    let err = v.get("error").filter(|e| e.is_object()).unwrap_or(v);
    LlmError::InBand {
        api: API,
        code: err
            .get("code")
            .and_then(Value::as_str)
            .or_else(|| err.get("type").and_then(Value::as_str))
            .map(String::from),
        message: err
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message")
            .to_string(),
    }
}

impl StreamState {
    /// Handles one SSE data payload. Returns the response at the end.
    pub fn on_data(
        &mut self,
        data: &str,
        delta: &mut dyn FnMut(StreamDelta),
    ) -> Result<Option<Response>, LlmError> {
        if data == "[DONE]" {
            return Ok(None);
        }
        let v: Value =
            serde_json::from_str(data).map_err(|e| protocol(format!("bad event JSON: {e}")))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "response.output_text.delta" => {
                if let Some(d) = v.get("delta").and_then(Value::as_str) {
                    delta(StreamDelta::Text(d.to_string()));
                }
            }
            "response.output_item.added" => {
                let item = &v["item"];
                if item["type"] == "function_call"
                    && let Some(name) = item["name"].as_str()
                {
                    delta(StreamDelta::ToolCallStarted { name: name.into() });
                }
            }
            "response.output_item.done" => {
                if let Some(i) = v.get("output_index").and_then(Value::as_u64) {
                    self.done_items.insert(i, v["item"].clone());
                }
            }
            "response.completed" | "response.incomplete" => {
                return self.terminal(&v["response"]).map(Some);
            }
            "response.failed" => {
                let r = &v["response"];
                return Err(in_band(
                    r.get("error").filter(|e| !e.is_null()).unwrap_or(r),
                ));
            }
            "error" => return Err(in_band(&v)),
            _ => {}
        }
        Ok(None)
    }

    fn terminal(&mut self, r: &Value) -> Result<Response, LlmError> {
        let items: Vec<Value> = match r.get("output").and_then(Value::as_array) {
            Some(out) if !out.is_empty() => out.clone(),
            _ => std::mem::take(&mut self.done_items).into_values().collect(),
        };
        let mut output = Vec::new();
        let mut refused = false;
        for item in items {
            match item["type"].as_str().unwrap_or("") {
                "message" => {
                    let mut text = String::new();
                    for part in item["content"].as_array().into_iter().flatten() {
                        match part["type"].as_str() {
                            Some("output_text") => {
                                text.push_str(part["text"].as_str().unwrap_or(""))
                            }
                            Some("refusal") => {
                                refused = true;
                                text.push_str(part["refusal"].as_str().unwrap_or(""));
                            }
                            _ => {}
                        }
                    }
                    output.push(Item::Message {
                        role: Role::Assistant,
                        text: text.into(),
                        provider_id: item["id"].as_str().map(String::from),
                    });
                }
                "function_call" => {
                    if matches!(item["status"].as_str(), Some("in_progress" | "incomplete")) {
                        continue;
                    }
                    output.push(Item::ToolCall {
                        call_id: item["call_id"]
                            .as_str()
                            .ok_or_else(|| protocol("function_call without call_id"))?
                            .into(),
                        name: item["name"].as_str().unwrap_or("").into(),
                        arguments: item["arguments"].as_str().unwrap_or("").into(),
                        provider_id: item["id"].as_str().map(String::from),
                    });
                }
                "reasoning" => output.push(Item::Reasoning {
                    summary: item["summary"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s["text"].as_str().map(String::from))
                        .collect(),
                    raw: item.clone(),
                }),
                // Hosted tool calls and item kinds added later: not ours to replay.
                other => tracing::debug!(kind = other, "output item skipped"),
            }
        }
        let stop = match r["status"].as_str() {
            Some("completed") | None if refused => StopReason::Refused,
            Some("completed") | None => StopReason::Complete,
            Some("incomplete") => match r["incomplete_details"]["reason"].as_str() {
                Some("max_output_tokens") => StopReason::MaxOutputTokens,
                Some("content_filter") => StopReason::Refused,
                other => {
                    return Err(LlmError::InBand {
                        api: API,
                        code: other.map(String::from),
                        message: format!(
                            "response incomplete: {}",
                            other.unwrap_or("no reason given")
                        ),
                    });
                }
            },
            Some(other) => return Err(protocol(format!("unexpected terminal status {other:?}"))),
        };
        let u = &r["usage"];
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        Ok(Response {
            id: r["id"].as_str().map(String::from),
            stop,
            output,
            usage: Usage {
                input_tokens: n(&u["input_tokens"]),
                cached_input_tokens: n(&u["input_tokens_details"]["cached_tokens"]),
                output_tokens: n(&u["output_tokens"]),
                reasoning_tokens: n(&u["output_tokens_details"]["reasoning_tokens"]),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reasoning_then_call(model: &str) -> Request {
        Request {
            model: model.into(),
            input: vec![
                Item::Reasoning {
                    summary: Vec::new(),
                    raw: json!({"type": "reasoning", "id": "rs_1", "encrypted_content": "e"}),
                },
                Item::ToolCall {
                    call_id: "c1".into(),
                    name: "Bash".into(),
                    arguments: "{}".into(),
                    provider_id: None,
                },
                Item::ToolResult {
                    call_id: "c1".into(),
                    output: vec![ToolOutput::Text { text: "ok".into() }],
                },
            ],
            ..Request::default()
        }
    }

    #[test]
    fn reasoning_is_asked_for_and_sent_back_only_for_a_model_that_reasons() {
        let body = request_body(&reasoning_then_call("gpt-5-mini")).unwrap();
        assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
        assert_eq!(body["input"][0]["type"], "reasoning");
        // A session resumed with a model that does not reason, or a chat
        // variant of a reasoning family: both refuse encrypted reasoning.
        for model in ["gpt-4.1", "gpt-5-chat-latest"] {
            let body = request_body(&reasoning_then_call(model)).unwrap();
            assert!(body.get("include").is_none(), "{model}");
            assert_eq!(body["input"][0]["type"], "function_call", "{model}");
        }
    }

    #[test]
    fn malformed_arguments_are_wrapped_for_replay() {
        assert_eq!(arguments_for_replay(r#"{"a":1}"#), r#"{"a":1}"#);
        assert_eq!(
            arguments_for_replay("{oops"),
            r#"{"invalid_arguments":"{oops"}"#
        );
        assert_eq!(
            arguments_for_replay("[1]"),
            r#"{"invalid_arguments":"[1]"}"#
        );
    }
}
