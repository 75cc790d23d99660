//! The rules real model servers enforce on a request, with the errors they
//! answer (status, body and text as the real servers send them), so that a
//! test passes only when a real server would accept what Corral sends.
//!
//! Profiles:
//! - [`Profile::OpenAiChat`]: OpenAI's Chat Completions.
//! - [`Profile::OpenAiResponses`]: OpenAI's Responses API with `store: false`.
//! - [`Profile::StrictCompat`]: what the strictest OpenAI-compatible chat
//!   servers add: role order as mistral_common (and the hosted Mistral API)
//!   checks it, with a user message right after a tool message refused;
//!   roles alternating as the Mistral and Gemma chat templates require
//!   (refused the way llama.cpp's server reports a template exception);
//!   call ids of nine letters and digits (Mistral); tool messages adjacent
//!   to their call and `reasoning_content` sent back with the assistant
//!   message it came with (DeepSeek's thinking mode); assistant content
//!   never null (llama.cpp's Python server fails on it in chat templates).

use std::collections::HashMap;

use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    OpenAiChat,
    OpenAiResponses,
    StrictCompat,
}

impl Profile {
    pub const ALL: [Profile; 3] = [
        Profile::OpenAiChat,
        Profile::OpenAiResponses,
        Profile::StrictCompat,
    ];

    /// Whether the profile applies to a request on this path.
    pub fn serves(self, path: &str) -> bool {
        match self {
            Profile::OpenAiResponses => path.ends_with("/responses"),
            Profile::OpenAiChat | Profile::StrictCompat => path.ends_with("/chat/completions"),
        }
    }
}

/// A refusal: what the real server answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub status: u16,
    pub body: Value,
}

impl Refusal {
    /// The error's message, for assertions.
    pub fn message(&self) -> &str {
        self.body["error"]["message"]
            .as_str()
            .or_else(|| self.body["message"].as_str())
            .unwrap_or("")
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message())
    }
}

/// What a stateful server remembers between requests: the reasoning it
/// streamed with each tool call (DeepSeek wants it back).
#[derive(Debug, Clone, Default)]
pub struct Memory {
    pub reasoning_by_call: HashMap<String, String>,
}

fn openai(status: u16, message: String, param: Option<String>, code: Option<&str>) -> Refusal {
    Refusal {
        status,
        body: json!({"error": {"message": message, "type": "invalid_request_error",
                              "param": param, "code": code}}),
    }
}

/// OpenAI's reasoning models (which refuse `max_tokens`).
fn reasoning_model(model: &str) -> bool {
    ["o1", "o3", "o4", "gpt-5"]
        .iter()
        .any(|p| model.starts_with(p))
        && !model.contains("-chat")
}

/// Checks `body` (a request on `path`) against `profile`.
pub fn check(profile: Profile, body: &Value, memory: &Memory) -> Result<(), Refusal> {
    match profile {
        Profile::OpenAiChat => check_openai_chat(body),
        Profile::OpenAiResponses => check_openai_responses(body),
        Profile::StrictCompat => check_strict_compat(body, memory),
    }
}

fn messages(body: &Value) -> &[Value] {
    body["messages"].as_array().map_or(&[], Vec::as_slice)
}

fn call_ids(m: &Value) -> Vec<&str> {
    m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str())
        .collect()
}

/// Tool messages must follow, contiguously, the assistant message that made
/// their calls, one per call id. Returns the index of the offending message
/// and what was wrong.
enum Adjacency {
    Unanswered { at: usize, ids: Vec<String> },
    Stray { at: usize },
}

fn adjacency(msgs: &[Value]) -> Option<Adjacency> {
    let mut i = 0;
    while i < msgs.len() {
        let m = &msgs[i];
        if m["role"] == "tool" {
            return Some(Adjacency::Stray { at: i });
        }
        let ids = call_ids(m);
        if m["role"] != "assistant" || ids.is_empty() {
            i += 1;
            continue;
        }
        let mut pending: Vec<&str> = ids.clone();
        let mut j = i + 1;
        while j < msgs.len() && msgs[j]["role"] == "tool" {
            let id = msgs[j]["tool_call_id"].as_str().unwrap_or("");
            match pending.iter().position(|p| *p == id) {
                Some(k) => {
                    pending.remove(k);
                }
                None => return Some(Adjacency::Stray { at: j }),
            }
            j += 1;
        }
        if !pending.is_empty() {
            return Some(Adjacency::Unanswered {
                at: j.min(msgs.len().saturating_sub(1)),
                ids: pending.iter().map(|s| s.to_string()).collect(),
            });
        }
        i = j;
    }
    None
}

fn check_openai_chat(body: &Value) -> Result<(), Refusal> {
    let model = body["model"].as_str().unwrap_or("");
    if body.get("max_tokens").is_some() && reasoning_model(model) {
        return Err(openai(
            400,
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.".into(),
            Some("max_tokens".into()),
            Some("unsupported_parameter"),
        ));
    }
    if let Some(key) = body["prompt_cache_key"].as_str() {
        check_cache_key(key)?;
    }
    let msgs = messages(body);
    match adjacency(msgs) {
        Some(Adjacency::Unanswered { at, ids }) => {
            return Err(openai(
                400,
                format!(
                    "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                    ids.join(", ")
                ),
                Some(format!("messages.[{at}].role")),
                None,
            ));
        }
        Some(Adjacency::Stray { at }) => {
            return Err(openai(
                400,
                "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.".into(),
                Some(format!("messages.[{at}].role")),
                None,
            ));
        }
        None => {}
    }
    for (i, m) in msgs.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        let has_image = m["content"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["type"] == "image_url");
        if has_image && role != "user" {
            return Err(openai(
                400,
                format!(
                    "Image URLs are only allowed for messages with role 'user', but this message with role '{role}' contains an image URL."
                ),
                Some(format!("messages.[{i}]")),
                None,
            ));
        }
    }
    Ok(())
}

fn check_cache_key(key: &str) -> Result<(), Refusal> {
    let n = key.chars().count();
    if n > 64 {
        return Err(openai(
            400,
            format!(
                "Invalid 'prompt_cache_key': string too long. Expected a string with maximum length 64, but got a string with length {n} instead."
            ),
            Some("prompt_cache_key".into()),
            Some("string_above_max_length"),
        ));
    }
    Ok(())
}

fn not_persisted(id: &str) -> Refusal {
    openai(
        404,
        format!(
            "Item with id '{id}' not found. Items are not persisted when `store` is set to false. Try again with `store` set to true, or remove this item from your input."
        ),
        Some("input".into()),
        None,
    )
}

fn check_openai_responses(body: &Value) -> Result<(), Refusal> {
    let model = body["model"].as_str().unwrap_or("");
    let store = body["store"].as_bool().unwrap_or(true);
    if let Some(n) = body["max_output_tokens"].as_i64()
        && n < 16
    {
        return Err(openai(
            400,
            format!(
                "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got {n} instead."
            ),
            Some("max_output_tokens".into()),
            Some("integer_below_min_value"),
        ));
    }
    if let Some(key) = body["prompt_cache_key"].as_str() {
        check_cache_key(key)?;
    }
    let wants_encrypted = body["include"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| v == "reasoning.encrypted_content");
    if wants_encrypted && !reasoning_model(model) && !model.starts_with("gpt-oss") {
        return Err(openai(
            400,
            "Encrypted content is not supported with this model.".into(),
            Some("include".into()),
            None,
        ));
    }
    let input = body["input"].as_array().map_or(&[][..], Vec::as_slice);
    let mut calls: Vec<&str> = Vec::new();
    let mut outputs: Vec<&str> = Vec::new();
    for (i, item) in input.iter().enumerate() {
        let kind = item["type"].as_str().unwrap_or("message");
        let id = item["id"].as_str();
        match kind {
            "reasoning" => {
                let encrypted = item["encrypted_content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty());
                if !store && !encrypted {
                    return Err(not_persisted(id.unwrap_or("rs_unknown")));
                }
                let next = input
                    .get(i + 1)
                    .map(|n| n["type"].as_str().unwrap_or("message"));
                let next_role = input.get(i + 1).and_then(|n| n["role"].as_str());
                let followed = matches!(next, Some("function_call"))
                    || (matches!(next, Some("message")) && next_role == Some("assistant"));
                if !followed {
                    return Err(openai(
                        400,
                        format!(
                            "Item '{}' of type 'reasoning' was provided without its required following item.",
                            id.unwrap_or("rs_unknown")
                        ),
                        Some("input".into()),
                        None,
                    ));
                }
            }
            "function_call" => {
                if let (false, Some(id)) = (store, id) {
                    return Err(not_persisted(id));
                }
                calls.push(item["call_id"].as_str().unwrap_or(""));
            }
            "function_call_output" => {
                let call_id = item["call_id"].as_str().unwrap_or("");
                if !calls.contains(&call_id) {
                    return Err(openai(
                        400,
                        format!(
                            "No tool call found for function call output with call_id {call_id}."
                        ),
                        Some("input".into()),
                        None,
                    ));
                }
                outputs.push(call_id);
            }
            _ => {
                if let (false, Some(id)) = (store, id) {
                    return Err(not_persisted(id));
                }
                let images = item["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["type"] == "input_image");
                if images && item["role"] != "user" {
                    return Err(openai(
                        400,
                        format!(
                            "Invalid value: 'input_image'. Supported values are: 'output_text' and 'refusal'. (role {})",
                            item["role"]
                        ),
                        Some(format!("input[{i}].content[0]")),
                        Some("invalid_value"),
                    ));
                }
            }
        }
    }
    if let Some(call) = calls.iter().find(|c| !outputs.contains(c)) {
        return Err(openai(
            400,
            format!("No tool output found for function call {call}."),
            Some("input".into()),
            None,
        ));
    }
    Ok(())
}

fn mistral(message: String, kind: &str, code: &str) -> Refusal {
    Refusal {
        status: 400,
        body: json!({"object": "error", "message": message, "type": kind, "param": null, "code": code}),
    }
}

/// A chat template that raised, as llama.cpp's server reports it.
fn template_exception(message: &str) -> Refusal {
    Refusal {
        status: 500,
        body: json!({"error": {"code": 500, "type": "server_error", "message": format!(
            "\n------------\nWhile executing CallExpression at line 1, column 1 in source:\n{{{{ raise_exception(...) }}}}\n^\nError: Jinja Exception: {message}")}}),
    }
}

fn deepseek(message: String) -> Refusal {
    Refusal {
        status: 400,
        body: json!({"error": {"message": message, "type": "invalid_request_error",
                              "param": null, "code": "invalid_request_error"}}),
    }
}

fn check_strict_compat(body: &Value, memory: &Memory) -> Result<(), Refusal> {
    let msgs = messages(body);
    // DeepSeek: tool messages right after their call.
    match adjacency(msgs) {
        Some(Adjacency::Unanswered { .. }) => {
            return Err(deepseek("An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. (insufficient tool messages following tool_calls message)".into()));
        }
        Some(Adjacency::Stray { .. }) => {
            return Err(deepseek(
                "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
                    .into(),
            ));
        }
        None => {}
    }
    // Mistral: call ids.
    for m in msgs {
        let ids = call_ids(m)
            .into_iter()
            .chain(m["tool_call_id"].as_str())
            .collect::<Vec<_>>();
        for id in ids {
            if !(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())) {
                return Err(mistral(
                    format!("Tool call id was {id} but must be a-z, A-Z, 0-9, with a length of 9."),
                    "invalid_function_call",
                    "3280",
                ));
            }
        }
    }
    // mistral_common's role order (a user message after a tool message is
    // refused by the hosted API and by mistral_common before 1.11.1).
    let mut previous: Option<&str> = None;
    for m in msgs {
        let role = m["role"].as_str().unwrap_or("");
        if let Some(prev) = previous {
            let allowed: &[&str] = match prev {
                "system" => &["user", "assistant", "system"],
                "user" => &["assistant", "system", "user"],
                "assistant" => &["assistant", "user", "tool"],
                "tool" => &["assistant", "tool"],
                _ => &[],
            };
            if !allowed.contains(&role) {
                return Err(mistral(
                    format!("Unexpected role '{role}' after role '{prev}'"),
                    "invalid_request_message_order",
                    "3230",
                ));
            }
        }
        previous = Some(role);
    }
    if let Some(last) = previous
        && !matches!(last, "user" | "tool")
    {
        return Err(mistral(
            format!(
                "Expected last role User or Tool (or Assistant with prefix or continue_final_message set to True) for serving but got {last}"
            ),
            "invalid_request_error",
            "3230",
        ));
    }
    // The chat templates: after the system message, user and assistant
    // alternate; an assistant's tool calls and their results are part of
    // its turn, which goes on with another assistant message.
    #[derive(PartialEq)]
    enum Next {
        User,
        Assistant,
        Tool,
        AssistantOrTool,
    }
    let mut next = Next::User;
    for m in msgs.iter().skip_while(|m| m["role"] == "system") {
        let role = m["role"].as_str().unwrap_or("");
        next = match (role, &next) {
            ("user", Next::User) => Next::Assistant,
            ("assistant", Next::Assistant | Next::AssistantOrTool) if call_ids(m).is_empty() => {
                Next::User
            }
            ("assistant", Next::Assistant | Next::AssistantOrTool) => Next::Tool,
            ("tool", Next::Tool | Next::AssistantOrTool) => Next::AssistantOrTool,
            _ => {
                return Err(template_exception(
                    "Conversation roles must alternate user/assistant/user/assistant/...",
                ));
            }
        };
    }
    // llama.cpp's Python server: the templates concatenate content.
    for m in msgs {
        if m["content"].is_null() {
            return Err(Refusal {
                status: 500,
                body: json!({"error": {"message": "can only concatenate str (not \"NoneType\") to str",
                                      "type": "internal_server_error", "param": null, "code": null}}),
            });
        }
    }
    // DeepSeek's thinking mode (V4): once the conversation reasons, every
    // assistant message carries its reasoning back.
    let thinking = msgs
        .iter()
        .any(|m| m["role"] == "assistant" && m.get("reasoning_content").is_some());
    if thinking
        && msgs
            .iter()
            .any(|m| m["role"] == "assistant" && m.get("reasoning_content").is_none())
    {
        return Err(deepseek(
            "The `reasoning_content` in the thinking mode must be passed back to the API.".into(),
        ));
    }
    // DeepSeek's thinking mode: reasoning goes back with its tool calls.
    for (i, m) in msgs.iter().enumerate() {
        let wanted = call_ids(m)
            .into_iter()
            .find_map(|id| memory.reasoning_by_call.get(id));
        if let Some(wanted) = wanted
            && m["reasoning_content"].as_str() != Some(wanted.as_str())
        {
            return Err(deepseek(format!(
                "Missing `reasoning_content` field in the assistant message at message index {i}. For more information, please refer to https://api-docs.deepseek.com/guides/thinking_mode#tool-calls"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(msgs: Value) -> Value {
        json!({"model": "gpt-4.1", "messages": msgs})
    }

    fn refused(p: Profile, body: &Value) -> String {
        check(p, body, &Memory::default())
            .err()
            .map(|r| r.message().to_string())
            .unwrap_or_default()
    }

    const CALL: &str = "abcDEF123";

    fn calls_msg() -> Value {
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": CALL, "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]})
    }

    fn tool_msg() -> Value {
        json!({"role": "tool", "tool_call_id": CALL, "content": "ok"})
    }

    #[test]
    fn a_valid_conversation_passes_every_chat_profile() {
        let body = chat(json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            calls_msg(),
            tool_msg(),
            {"role": "assistant", "content": "(Continuing.)"},
            {"role": "user", "content": "more"},
        ]));
        assert_eq!(
            check(Profile::OpenAiChat, &body, &Memory::default()),
            Ok(())
        );
        assert_eq!(
            check(Profile::StrictCompat, &body, &Memory::default()),
            Ok(())
        );
    }

    #[test]
    fn openai_chat_refuses_a_user_message_between_calls_and_results() {
        let body = chat(json!([{"role": "user", "content": "u"}, calls_msg(),
            {"role": "user", "content": "typed"}, tool_msg()]));
        assert_eq!(
            refused(Profile::OpenAiChat, &body),
            format!(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {CALL}"
            )
        );
        let stray = chat(json!([{"role": "user", "content": "u"}, tool_msg()]));
        assert!(
            refused(Profile::OpenAiChat, &stray).contains("preceeding message with 'tool_calls'")
        );
    }

    #[test]
    fn openai_chat_refuses_a_long_cache_key() {
        let body = json!({"model": "gpt-4.1", "messages": [], "prompt_cache_key": "k".repeat(65)});
        assert!(
            refused(Profile::OpenAiChat, &body)
                .starts_with("Invalid 'prompt_cache_key': string too long.")
        );
    }

    #[test]
    fn openai_chat_refuses_max_tokens_for_reasoning_models_and_images_outside_user_messages() {
        let body = json!({"model": "gpt-5-mini", "max_tokens": 100, "messages": []});
        assert!(
            refused(Profile::OpenAiChat, &body).contains("Use 'max_completion_tokens' instead")
        );
        let image = chat(json!([{"role": "user", "content": "u"}, calls_msg(),
            {"role": "tool", "tool_call_id": CALL, "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]));
        assert!(refused(Profile::OpenAiChat, &image).contains("Image URLs are only allowed"));
    }

    #[test]
    fn openai_responses_refuses_what_store_false_cannot_resolve() {
        let body = |input: Value| json!({"model": "gpt-5-mini", "store": false, "input": input});
        let rs = json!({"type": "reasoning", "id": "rs_1", "summary": []});
        let fc =
            json!({"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": "{}"});
        let out = json!({"type": "function_call_output", "call_id": "c1", "output": "ok"});
        let r = check(
            Profile::OpenAiResponses,
            &body(json!([rs, fc, out])),
            &Memory::default(),
        );
        assert_eq!(r.as_ref().map_err(|r| r.status), Err(404));
        assert!(
            r.unwrap_err()
                .message()
                .starts_with("Item with id 'rs_1' not found.")
        );
        let rs_ok =
            json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"});
        assert_eq!(
            check(
                Profile::OpenAiResponses,
                &body(json!([rs_ok, fc, out])),
                &Memory::default()
            ),
            Ok(())
        );
        assert_eq!(
            refused(
                Profile::OpenAiResponses,
                &body(json!([rs_ok, {"role": "user", "content": "u"}]))
            ),
            "Item 'rs_1' of type 'reasoning' was provided without its required following item."
        );
        assert_eq!(
            refused(Profile::OpenAiResponses, &body(json!([fc]))),
            "No tool output found for function call c1."
        );
        assert_eq!(
            refused(Profile::OpenAiResponses, &body(json!([out]))),
            "No tool call found for function call output with call_id c1."
        );
        let mut long = body(json!([]));
        long["prompt_cache_key"] = json!("k".repeat(72));
        assert!(
            refused(Profile::OpenAiResponses, &long)
                .contains("maximum length 64, but got a string with length 72")
        );
        let mut few = body(json!([]));
        few["max_output_tokens"] = json!(10);
        assert!(
            refused(Profile::OpenAiResponses, &few).contains("Expected a value >= 16, but got 10")
        );
        // Nothing is resolved by id: a message or call that names one.
        let named = json!({"type": "message", "id": "msg_1", "role": "assistant", "content": "a"});
        let r = check(
            Profile::OpenAiResponses,
            &body(json!([named])),
            &Memory::default(),
        );
        assert_eq!(r.map_err(|r| r.status), Err(404));
        let image_from_assistant = json!({"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]});
        assert!(
            refused(
                Profile::OpenAiResponses,
                &body(json!([image_from_assistant]))
            )
            .starts_with("Invalid value: 'input_image'")
        );
        let mut old = body(json!([]));
        old["model"] = json!("gpt-4.1");
        old["include"] = json!(["reasoning.encrypted_content"]);
        assert_eq!(
            refused(Profile::OpenAiResponses, &old),
            "Encrypted content is not supported with this model."
        );
    }

    #[test]
    fn strict_compat_refuses_what_mistral_gemma_deepseek_and_llama_cpp_refuse() {
        let p = Profile::StrictCompat;
        // T then U.
        let tu = chat(
            json!([{"role": "user", "content": "u"}, calls_msg(), tool_msg(),
            {"role": "user", "content": "typed"}]),
        );
        assert_eq!(refused(p, &tu), "Unexpected role 'user' after role 'tool'");
        assert!(
            refused(Profile::OpenAiChat, &tu).is_empty(),
            "OpenAI accepts it"
        );
        // Alternation.
        let uu = chat(
            json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]),
        );
        let r = check(p, &uu, &Memory::default()).unwrap_err();
        assert_eq!(r.status, 500);
        assert!(
            r.message()
                .contains("Jinja Exception: Conversation roles must alternate")
        );
        // Ids.
        let mut bad = calls_msg();
        bad["tool_calls"][0]["id"] = json!("call_0.t2.1");
        let ids = chat(json!([{"role": "user", "content": "u"}, bad,
            {"role": "tool", "tool_call_id": "call_0.t2.1", "content": "ok"}]));
        assert_eq!(
            refused(p, &ids),
            "Tool call id was call_0.t2.1 but must be a-z, A-Z, 0-9, with a length of 9."
        );
        // Adjacency, DeepSeek's words.
        let gap = chat(
            json!([{"role": "user", "content": "u"}, calls_msg(), {"role": "user", "content": "x"}]),
        );
        assert!(
            refused(p, &gap).ends_with("(insufficient tool messages following tool_calls message)")
        );
        let stray = chat(json!([{"role": "user", "content": "u"}, tool_msg()]));
        assert_eq!(
            refused(p, &stray),
            "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
        );
        // Null content.
        let mut no_content = calls_msg();
        no_content["content"] = Value::Null;
        let nulls = chat(json!([{"role": "user", "content": "u"}, no_content, tool_msg()]));
        assert!(refused(p, &nulls).contains("NoneType"));
        // The last message.
        let last =
            chat(json!([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]));
        assert!(refused(p, &last).starts_with("Expected last role User or Tool"));
        // Reasoning back.
        let mut memory = Memory::default();
        memory.reasoning_by_call.insert(CALL.into(), "think".into());
        let body = chat(json!([{"role": "user", "content": "u"}, calls_msg(), tool_msg()]));
        let r = check(p, &body, &memory).unwrap_err();
        assert!(r.message().starts_with(
            "Missing `reasoning_content` field in the assistant message at message index 1."
        ));
        let mut with = calls_msg();
        with["reasoning_content"] = json!("think");
        let body = chat(json!([{"role": "user", "content": "u"}, with.clone(), tool_msg()]));
        assert_eq!(check(p, &body, &memory), Ok(()));
        // Then on every assistant message.
        let body = chat(json!([{"role": "user", "content": "u"}, with, tool_msg(),
            {"role": "assistant", "content": "done"}, {"role": "user", "content": "more"}]));
        assert_eq!(
            refused(p, &body),
            "The `reasoning_content` in the thinking mode must be passed back to the API."
        );
    }
}
