//! A scripted model behind the harness's `Model`, for tests of the session
//! runner with paused time (no socket, so no timer jumps past a request
//! in flight). It answers from its script in order, then with a final
//! text; it is as strict as a provider where the harness relies on it: a
//! request in which a tool call has no result, or two, or a result names
//! no call, is refused with a 400 as OpenAI refuses it. Every request is
//! kept for the test to read.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use corral_harness::llm::model::{Item, Request, Response, Role, StopReason, Usage};
use corral_harness::llm::{LlmConfig, LlmError, MakeModel, Model, StreamDelta};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A model that answers from a script.
#[derive(Default)]
pub struct ScriptedModel {
    script: Mutex<VecDeque<Response>>,
    requests: Mutex<Vec<Request>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An answer of text only: the run's end.
pub fn text(t: &str) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output: vec![Item::Message {
            role: Role::Assistant,
            text: t.into(),
            provider_id: None,
        }],
        usage: Usage {
            input_tokens: 10,
            output_tokens: 2,
            ..Usage::default()
        },
    }
}

/// An answer of Bash calls: (call id, command).
pub fn bash_calls(list: &[(&str, &str)]) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output: list
            .iter()
            .map(|(id, cmd)| Item::ToolCall {
                call_id: (*id).into(),
                name: "Bash".into(),
                arguments: serde_json::json!({ "command": cmd }).to_string().into(),
                provider_id: None,
            })
            .collect(),
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            ..Usage::default()
        },
    }
}

/// Why a provider would refuse `req`, if it would.
fn refusal(req: &Request) -> Option<String> {
    let mut results: HashMap<&str, usize> = HashMap::new();
    let mut calls = Vec::new();
    for item in &req.input {
        match item {
            Item::ToolCall { call_id, .. } => calls.push(&**call_id),
            Item::ToolResult { call_id, .. } => {
                if !calls.contains(&&**call_id) {
                    return Some(format!("a tool result for no call: {call_id}"));
                }
                *results.entry(&**call_id).or_default() += 1;
            }
            _ => {}
        }
    }
    calls
        .iter()
        .find(|c| results.get(*c).copied() != Some(1))
        .map(|c| {
            format!(
                "tool call {c} has {} results",
                results.get(c).copied().unwrap_or(0)
            )
        })
}

impl ScriptedModel {
    /// A model that gives `script`'s answers in order, then `text("done")`.
    pub fn new(script: Vec<Response>) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(script.into()),
            requests: Mutex::default(),
        })
    }

    /// The requests it was sent, in order.
    pub fn requests(&self) -> Vec<Request> {
        lock(&self.requests).clone()
    }

    /// What makes this model every session's (see `Sessions::with_models`).
    pub fn maker(self: &Arc<Self>) -> Arc<MakeModel> {
        let me = Arc::clone(self);
        Arc::new(move |_: LlmConfig| Ok(Arc::clone(&me) as Arc<dyn Model>))
    }
}

impl Model for ScriptedModel {
    fn respond<'a>(
        &'a self,
        req: &'a Request,
        _deltas: Option<&'a mpsc::Sender<StreamDelta>>,
        cancel: &'a CancellationToken,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response, LlmError>> + Send + 'a>>
    {
        Box::pin(async move {
            if cancel.is_cancelled() {
                return Err(LlmError::Canceled);
            }
            lock(&self.requests).push(req.clone());
            if let Some(why) = refusal(req) {
                return Err(LlmError::Http {
                    api: "responses",
                    status: 400,
                    code: Some("invalid_request_error".into()),
                    message: why,
                    retry_after: None,
                });
            }
            let answer = lock(&self.script)
                .pop_front()
                .unwrap_or_else(|| text("done"));
            // A model calls only the tools it is offered: a script that
            // calls another is the test's mistake, said as such.
            for item in &answer.output {
                if let Item::ToolCall { name, .. } = item
                    && !req.tools.iter().any(|t| t.name == **name)
                {
                    return Err(LlmError::Request(format!(
                        "the script calls {name}, which the request does not offer"
                    )));
                }
            }
            Ok(answer)
        })
    }
}
