//! The provider contract: the rules real servers enforce on a conversation,
//! applied to every request as it is put on the wire, so that every request
//! is valid by construction whatever order things happened in, and a
//! session recorded by an older build heals on its next request.
//!
//! [`arrange`] is provider-neutral: after the model's items of one response
//! (reasoning, text, tool calls) come exactly one result per call, in call
//! order, and only then everything else that was staged around them
//! (inputs, heartbeats, late results, images), in its own order. A result
//! with no call before it, or a second result for one call, becomes a user
//! message; a call with no result gets one that says so.
//!
//! The wire-specific rules live beside each protocol and use the helpers
//! here: Chat Completions ([`super::chat`]) sends a tool message per call
//! right after the assistant message that made the calls, never a user
//! message right after a tool message (mistral_common and the Mistral and
//! Gemma templates refuse it), call ids of nine letters and digits (the
//! strictest rule in use: Mistral's), `reasoning_content` back on the
//! assistant message it came with (DeepSeek's thinking mode needs it), and
//! `max_completion_tokens` (OpenAI's reasoning models refuse `max_tokens`).
//! The Responses API ([`super::responses`]) gets each `function_call` with
//! exactly one `function_call_output`, reasoning items only with their
//! `encrypted_content` and only when followed by an item of their own
//! response (with `store: false` nothing else can be resolved), and
//! `include: ["reasoning.encrypted_content"]` whenever the model may reason.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::model::{Item, Role, ToolOutput};

/// What a call with no recorded result gets, so that the request stays
/// valid: it happens only in a session written by an older build.
pub const NO_RESULT: &str = "[no result was recorded for this tool call]";

/// Items the model produced: they make up one assistant turn.
pub fn is_model_item(item: &Item) -> bool {
    matches!(
        item,
        Item::Reasoning { .. }
            | Item::ToolCall { .. }
            | Item::Message {
                role: Role::Assistant,
                ..
            }
    )
}

/// The conversation in an order every provider accepts (see the module
/// documentation). Idempotent; linear in the number of items.
pub fn arrange(input: &[Item]) -> Vec<Item> {
    // Where each call's results are, in order.
    let mut results: HashMap<&str, VecDeque<usize>> = HashMap::new();
    for (i, item) in input.iter().enumerate() {
        if let Item::ToolResult { call_id, .. } = item {
            results.entry(&**call_id).or_default().push_back(i);
        }
    }
    let mut used = vec![false; input.len()];
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        if used[i] {
            i += 1;
            continue;
        }
        if !is_model_item(&input[i]) {
            match &input[i] {
                Item::ToolResult { call_id, output } => {
                    // Not taken by a call before it: an orphan or a second
                    // result. The model still gets to read it.
                    out.push(result_as_user(call_id, output));
                }
                other => out.push(other.clone()),
            }
            i += 1;
            continue;
        }
        let start = i;
        while i < input.len() && !used[i] && is_model_item(&input[i]) {
            out.push(input[i].clone());
            i += 1;
        }
        for item in &input[start..i] {
            // Each call takes the first result after it that no call took
            // (sessions of older builds may repeat an id across turns).
            let Item::ToolCall { call_id, .. } = item else {
                continue;
            };
            let found = results.get_mut(&**call_id).and_then(|q| {
                while let Some(&p) = q.front() {
                    q.pop_front();
                    if p > start && !used[p] {
                        return Some(p);
                    }
                }
                None
            });
            match found {
                Some(p) => {
                    used[p] = true;
                    out.push(input[p].clone());
                }
                None => out.push(Item::ToolResult {
                    call_id: call_id.clone(),
                    output: vec![ToolOutput::Text {
                        text: NO_RESULT.into(),
                    }],
                }),
            }
        }
    }
    out
}

/// A tool result that cannot go to the model as one, as a user message.
fn result_as_user(call_id: &str, output: &[ToolOutput]) -> Item {
    let mut parts = vec![ToolOutput::Text {
        text: format!("[Output of tool call {call_id}:]").into(),
    }];
    parts.extend(output.iter().cloned());
    Item::UserContent { parts }
}

/// Call ids as the strictest servers want them: nine ASCII letters and
/// digits (Mistral's rule; OpenAI, vLLM, llama.cpp and DeepSeek accept
/// them too). An id that already has that form is kept; any other is
/// mapped to a stable digest of itself, the same in every request, so a
/// session's history never changes under the provider's prompt cache.
#[derive(Debug, Default)]
pub struct CallIds {
    map: HashMap<Arc<str>, String>,
    taken: HashSet<String>,
}

/// Nine letters and digits.
pub fn is_strict_call_id(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// FNV-1a: a stable hash (unlike std's, it never changes between builds).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const ALNUM: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

fn base62_9(mut n: u64) -> String {
    let mut s = String::with_capacity(9);
    for _ in 0..9 {
        s.push(ALNUM[(n % 62) as usize] as char);
        n /= 62;
    }
    s
}

impl CallIds {
    /// The wire form of `id`.
    pub fn of(&mut self, id: &Arc<str>) -> String {
        if let Some(m) = self.map.get(id) {
            return m.clone();
        }
        let mut wire = if is_strict_call_id(id) {
            id.to_string()
        } else {
            base62_9(fnv1a(id.as_bytes()))
        };
        let mut salt = 0u64;
        while self.taken.contains(&wire) {
            salt += 1;
            let mut bytes = id.as_bytes().to_vec();
            bytes.extend_from_slice(&salt.to_le_bytes());
            wire = base62_9(fnv1a(&bytes));
        }
        self.taken.insert(wire.clone());
        self.map.insert(id.clone(), wire.clone());
        wire
    }
}

/// The reasoning text a Chat Completions server streamed
/// (`reasoning_content`), kept so that it goes back with its message.
pub fn chat_reasoning(text: &str) -> Item {
    Item::Reasoning {
        summary: vec![text.to_string()],
        raw: serde_json::json!({ "type": "reasoning_content", "text": text }),
    }
}

/// The text of a reasoning item that came from Chat Completions.
pub fn chat_reasoning_text(raw: &serde_json::Value) -> Option<&str> {
    (raw["type"] == "reasoning_content")
        .then(|| raw["text"].as_str())
        .flatten()
}

/// A Responses API reasoning item that can be sent back with `store: false`:
/// one that carries its encrypted content.
pub fn replayable_reasoning(raw: &serde_json::Value) -> bool {
    raw["type"] == "reasoning"
        && raw["encrypted_content"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
}

/// Whether `model` may reason (and so whether its reasoning must be asked
/// for in a form that can be sent back, and whether Chat Completions must
/// say `max_completion_tokens`). Names of OpenAI's reasoning families,
/// less their chat variants (`gpt-5-chat-latest` does not reason and
/// refuses the ask); any other model reasons when an effort is set.
pub fn may_reason(model: &str) -> bool {
    let m = model
        .rsplit('/')
        .next()
        .unwrap_or(model)
        .to_ascii_lowercase();
    ["o1", "o3", "o4", "gpt-5", "codex", "gpt-oss"]
        .iter()
        .any(|p| m.starts_with(p))
        && !m.contains("-chat")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::fixtures::{call, result, user};

    fn kinds(items: &[Item]) -> Vec<String> {
        items
            .iter()
            .map(|i| match i {
                Item::Message { role, text, .. } => format!("{}:{text}", role.as_str()),
                Item::ToolCall { call_id, .. } => format!("call:{call_id}"),
                Item::ToolResult { call_id, output } => {
                    format!("result:{call_id}:{}", ToolOutput::text_of(output))
                }
                Item::Reasoning { .. } => "reasoning".into(),
                Item::UserContent { parts } => format!("user+:{}", ToolOutput::text_of(parts)),
            })
            .collect()
    }

    #[test]
    fn results_follow_their_calls_and_what_was_staged_between_comes_after() {
        let input = vec![
            user("go"),
            call("a"),
            call("b"),
            user("heartbeat"),
            result("b", "B"),
            user("typed"),
            result("a", "A"),
        ];
        assert_eq!(
            kinds(&arrange(&input)),
            [
                "user:go",
                "call:a",
                "call:b",
                "result:a:A",
                "result:b:B",
                "user:heartbeat",
                "user:typed"
            ]
        );
        assert_eq!(arrange(&arrange(&input)), arrange(&input), "idempotent");
    }

    #[test]
    fn a_missing_result_is_said_and_a_stray_or_second_one_becomes_a_user_message() {
        let input = vec![
            result("x", "orphan"),
            call("a"),
            result("a", "first"),
            result("a", "second"),
            call("b"),
        ];
        assert_eq!(
            kinds(&arrange(&input)),
            [
                "user+:[Output of tool call x:]\norphan",
                "call:a",
                "result:a:first",
                "user+:[Output of tool call a:]\nsecond",
                "call:b",
                &format!("result:b:{NO_RESULT}"),
            ]
        );
    }

    #[test]
    fn call_ids_become_nine_alphanumerics_stably_and_without_collisions() {
        let mut ids = CallIds::default();
        let a: Arc<str> = "call_0.t2.1".into();
        let b: Arc<str> = "abcDEF123".into();
        let wa = ids.of(&a);
        assert!(is_strict_call_id(&wa), "{wa}");
        assert_eq!(ids.of(&a), wa);
        assert_eq!(ids.of(&b), "abcDEF123");
        let mut again = CallIds::default();
        assert_eq!(again.of(&a), wa, "the same in every request");
        let mut many = CallIds::default();
        let all: HashSet<String> = (0..5000)
            .map(|n| many.of(&Arc::from(format!("call_{n}"))))
            .collect();
        assert_eq!(all.len(), 5000);
    }
}
