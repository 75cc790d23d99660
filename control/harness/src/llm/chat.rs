//! Chat Completions (OpenAI's, and the servers that copy it: vLLM, Ollama,
//! llama.cpp, OpenRouter): request body and stream interpretation.

use std::collections::{BTreeMap, HashMap};
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
pub const BRIDGE: &str = include_str!("../../../../prompts/bridge.md");

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

    fn into_json(mut self) -> Vec<Value> {
        // The templates want the conversation to open with the user (a
        // request's history may open with the assistant).
        let first = self.list.iter().position(|m| !matches!(m, Msg::System(_)));
        if let Some(i) = first
            && matches!(self.list[i], Msg::Assistant { .. })
        {
            self.list
                .insert(i, Msg::User(vec![Part::Text(BRIDGE.trim_end().into())]));
        }
        // DeepSeek's thinking mode wants reasoning back on every assistant
        // message once it reasons (a single space is the least it takes).
        let thinking = self
            .list
            .iter()
            .any(|m| matches!(m, Msg::Assistant { reasoning, .. } if !reasoning.is_empty()));
        if thinking {
            for m in &mut self.list {
                if let Msg::Assistant { reasoning, .. } = m
                    && reasoning.is_empty()
                {
                    reasoning.push(' ');
                }
            }
        }
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

/// The wire ids of calls: each occurrence of an id gets its own (sessions
/// of older builds may repeat one across turns), and a result answers the
/// latest occurrence before it.
#[derive(Default)]
struct WireIds {
    ids: conform::CallIds,
    seen: HashMap<Arc<str>, (u32, Arc<str>)>,
}

impl WireIds {
    fn call(&mut self, id: &Arc<str>) -> String {
        let key = match self.seen.get(id) {
            None => id.clone(),
            Some((n, _)) => format!("{id}\u{0}{}", n + 1).into(),
        };
        let n = self.seen.get(id).map_or(0, |(n, _)| n + 1);
        self.seen.insert(id.clone(), (n, key.clone()));
        self.ids.of(&key)
    }

    fn result(&mut self, id: &Arc<str>) -> String {
        let key = self
            .seen
            .get(id)
            .map_or_else(|| id.clone(), |(_, k)| k.clone());
        self.ids.of(&key)
    }
}

/// The request body, valid by construction (see [`super::conform`]).
pub fn request_body(req: &Request) -> Result<Value, LlmError> {
    let items = conform::arrange(&req.input);
    let mut ids = WireIds::default();
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
                        "id": ids.call(call_id),
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
                let id = ids.result(call_id);
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
        "messages": out.into_json(),
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
        // OpenAI's reasoning models refuse `max_tokens`; Mistral's API,
        // older llama.cpp servers and Ollama read only `max_tokens`.
        let key = if conform::may_reason(&req.model) {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        body[key] = json!(n);
    }
    if let Some(effort) = &req.reasoning_effort {
        body["reasoning_effort"] = json!(effort);
    }
    Ok(body)
}

/// What one endpoint refuses of the common body: Mistral's API refuses
/// every field it does not know (`stream_options` among them).
pub fn adapt_to_endpoint(body: &mut Value, base_url: &str) {
    let host = base_url
        .split("://")
        .nth(1)
        .unwrap_or(base_url)
        .split(['/', ':'])
        .next()
        .unwrap_or("");
    if (host == "mistral.ai" || host.ends_with(".mistral.ai"))
        && let Some(b) = body.as_object_mut()
    {
        b.remove("stream_options");
    }
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
    /// Data payloads seen: none at all is an empty answer.
    chunks: u64,
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
        self.chunks += 1;
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
            if self.chunks == 0 {
                return Err(LlmError::EmptyAnswer { api: API });
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::fixtures::{call, result, user};

    fn req(model: &str, input: Vec<Item>) -> Request {
        Request {
            model: model.into(),
            input,
            max_output_tokens: Some(100),
            ..Request::default()
        }
    }

    #[test]
    fn the_output_limit_is_named_as_the_model_wants_it() {
        let body = request_body(&req("gpt-5-mini", vec![user("u")])).unwrap();
        assert_eq!(body["max_completion_tokens"], 100);
        assert!(body.get("max_tokens").is_none());
        let body = request_body(&req("mistral-large-latest", vec![user("u")])).unwrap();
        assert_eq!(body["max_tokens"], 100);
        let mut body = body;
        adapt_to_endpoint(&mut body, "https://api.mistral.ai/v1");
        assert!(body.get("stream_options").is_none(), "Mistral refuses it");
        let mut body = request_body(&req("m", vec![user("u")])).unwrap();
        adapt_to_endpoint(&mut body, "http://127.0.0.1:8000/v1");
        assert!(body.get("stream_options").is_some());
    }

    #[test]
    fn an_id_repeated_across_turns_by_an_older_build_gets_a_result_each_time() {
        let body = request_body(&req(
            "m",
            vec![
                user("u"),
                call("call_0"),
                result("call_0", "call_0"),
                user("v"),
                call("call_0"),
                result("call_0", "call_0"),
            ],
        ))
        .unwrap();
        let m = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(
            roles,
            [
                "user",
                "assistant",
                "tool",
                "assistant",
                "user",
                "assistant",
                "tool"
            ]
        );
        let first = m[1]["tool_calls"][0]["id"].as_str().unwrap();
        let second = m[5]["tool_calls"][0]["id"].as_str().unwrap();
        assert_ne!(first, second, "each occurrence has its own wire id");
        assert_eq!(m[2]["tool_call_id"], first);
        assert_eq!(m[6]["tool_call_id"], second);
    }

    #[test]
    fn history_that_opens_with_the_assistant_gets_a_user_line_first() {
        let body = request_body(&req(
            "m",
            vec![
                Item::Message {
                    role: Role::Assistant,
                    text: "hello".into(),
                    provider_id: None,
                },
                user("u"),
            ],
        ))
        .unwrap();
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant", "user"]);
    }

    #[test]
    fn once_the_model_reasons_every_assistant_message_carries_reasoning() {
        let body = request_body(&req(
            "deepseek-v4",
            vec![
                user("u"),
                conform::chat_reasoning("think"),
                call("k1Lm2Nb3Q"),
                result("k1Lm2Nb3Q", "k1Lm2Nb3Q"),
                user("late"),
            ],
        ))
        .unwrap();
        let m = body["messages"].as_array().unwrap();
        assert_eq!(m[1]["reasoning_content"], "think");
        assert_eq!(m[3]["role"], "assistant", "the line between tool and user");
        assert_eq!(m[3]["reasoning_content"], " ");
    }
}
