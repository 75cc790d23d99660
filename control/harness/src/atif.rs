//! A session as a trajectory in ATIF, the Agent Trajectory Interchange
//! Format of Harbor (schema `ATIF-v1.7`), read from its log alone.
//!
//! - Each model answer is an `agent` step: its text, its reasoning summary,
//!   its tool calls (arguments as the JSON object the model wrote; one that
//!   is not an object is kept whole under `_raw`), its token counts, and an
//!   observation with the final result of each of its calls, tied by call
//!   id however late the result came (a placeholder the model was shown
//!   meanwhile is not a result).
//! - Inputs (and a request's user messages) are `user` steps; a request's
//!   assistant messages are `agent` steps made by no model call
//!   (`llm_call_count: 0`); heartbeats, notes of a fresh sandbox, failed
//!   model requests, stops, lost sandboxes and blocked egress are `system`
//!   steps.
//! - A fork's steps copied from its parent are marked `is_copied_context`,
//!   and its root names the parent (`extra.forked_from`); a parent names
//!   its first fork as its `continued_trajectory_ref`
//!   (`<child>.atif.json`).
//! - `final_metrics` sums the token counts; `extra` says how the last run
//!   ended.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::agent::record::{Ending, Record, StopCause, StopMode};
use crate::llm::{Item, ToolOutput};
use crate::sessions::{SessionError, Sessions};

/// The schema version written.
pub const SCHEMA_VERSION: &str = "ATIF-v1.7";

/// Session `id` of `store` as an ATIF trajectory.
pub fn trajectory(store: &Sessions, id: &str) -> Result<Value, SessionError> {
    let (mut records, mut times) = (Vec::new(), Vec::new());
    for rec in store.records(id)?.timed() {
        let rec = rec?;
        records.push(rec.record);
        times.push(rec.at_unix_ms);
    }
    let forks = forks_of(store, id);
    Ok(build(
        id,
        &records,
        &times,
        forks.first().map(String::as_str),
    ))
}

/// Sessions forked from `parent`, by id.
fn forks_of(store: &Sessions, parent: &str) -> Vec<String> {
    let Ok(listed) = store.list() else {
        return Vec::new();
    };
    let mut forks = Vec::new();
    for l in listed {
        if l.id == parent {
            continue;
        }
        let Ok(records) = store.records(&l.id) else {
            continue;
        };
        let forked_from_parent = records
            .flatten()
            .any(|(_, r)| matches!(&r, Record::Forked { parent: p, .. } if p == parent));
        if forked_from_parent {
            forks.push(l.id);
        }
    }
    forks
}

/// The trajectory of the records of session `id`, each step stamped
/// (`timestamp`, ISO 8601 UTC) with the time its record was written where
/// `times` has it; `fork`: a session forked from it.
pub fn build(id: &str, records: &[Record], times: &[Option<i64>], fork: Option<&str>) -> Value {
    // Each call's final result, by call id.
    let mut results: HashMap<&str, &[ToolOutput]> = HashMap::new();
    for r in records {
        if let Record::Result {
            call_id,
            output,
            running: false,
        } = r
        {
            results.insert(call_id.as_str(), output.as_slice());
        }
    }
    // A fork's own records begin after its `Forked` record.
    let copied_until = records
        .iter()
        .rposition(|r| matches!(r, Record::Forked { .. }));
    let mut steps: Vec<Value> = Vec::new();
    let mut agent = json!({"name": "corral", "version": env!("CARGO_PKG_VERSION")});
    let mut root_extra = Map::new();
    let mut model = String::new();
    let mut totals = (0u64, 0u64, 0u64, 0u64);
    let mut ending = None;
    for (i, r) in records.iter().enumerate() {
        let copied = copied_until.is_some_and(|end| i < end);
        let step = match r {
            Record::Start { config } => {
                model = config.model.clone();
                agent["model_name"] = json!(config.model);
                agent["tool_definitions"] = Value::Array(
                    config
                        .registry()
                        .tools()
                        .into_iter()
                        .map(|t| {
                            json!({"type": "function", "function": {
                                "name": t.name, "description": t.description,
                                "parameters": t.parameters}})
                        })
                        .collect(),
                );
                None
            }
            Record::Resume { model: m, .. } => {
                if let Some(m) = m {
                    model = m.clone();
                }
                None
            }
            Record::Forked { parent, .. } => {
                root_extra.insert("forked_from".into(), json!(parent));
                None
            }
            Record::History { role, text } => Some(match role {
                crate::llm::Role::Assistant => json!({
                    "source": "agent", "message": text, "llm_call_count": 0,
                    "extra": {"given_in_request": true}}),
                _ => json!({"source": "user", "message": text}),
            }),
            Record::Input { input_id, text } => Some(json!({
                "source": "user", "message": text, "extra": {"input_id": input_id}})),
            Record::Heartbeat { text } => Some(json!({
                "source": "system", "message": text, "extra": {"kind": "heartbeat"}})),
            Record::Placed {
                text,
                sandbox_id,
                generation,
                ..
            } => Some(json!({
                "source": "system", "message": text,
                "extra": {"kind": "sandbox_replaced", "sandbox_id": sandbox_id.as_str(),
                          "generation": generation}})),
            Record::Response { turn, response } => {
                let usage = response.usage;
                totals.0 += usage.input_tokens;
                totals.1 += usage.output_tokens;
                totals.2 += usage.cached_input_tokens;
                totals.3 += usage.reasoning_tokens;
                Some(agent_step(*turn, response, &model, &results))
            }
            Record::ModelFailure { turn, error, .. } => Some(json!({
                "source": "system", "message": format!("model request {turn} failed: {error}"),
                "extra": {"kind": "model_failure", "turn": turn}})),
            // A stop once idle is how a run that ends by itself is asked
            // to: no step of the trajectory.
            Record::Stop {
                mode: StopMode::Hard,
                cause,
            } => Some(json!({
                "source": "system",
                "message": format!("stopped: {}", stop_cause(cause)),
                "extra": {"kind": "stop"}})),
            Record::SandboxLost { reason } => Some(json!({
                "source": "system", "message": format!("sandbox lost: {reason}"),
                "extra": {"kind": "sandbox_lost"}})),
            Record::EgressUnrecorded { count } => Some(json!({
                "source": "system",
                "message": format!("{count} egress decisions came too fast to be recorded"),
                "extra": {"kind": "egress_unrecorded", "count": count}})),
            Record::Egress {
                host,
                port,
                decision,
                reason,
                unreported,
            } if *decision != corral_proto::event::EgressDecision::Allowed || *unreported > 0 => {
                let mut message = format!("egress to {host}:{port} {decision}");
                if !reason.is_empty() {
                    message.push_str(&format!(" ({reason})"));
                }
                if *unreported > 0 {
                    message.push_str(&format!(
                        "; {unreported} decisions before it were not told by the worker"
                    ));
                }
                Some(json!({
                    "source": "system",
                    "message": message,
                    "extra": {"kind": "egress", "host": host, "port": port,
                              "decision": decision, "reason": reason,
                              "unreported": unreported}}))
            }
            Record::Finished { ending: e } => {
                ending = Some(*e);
                None
            }
            _ => None,
        };
        if let Some(mut step) = step {
            step["step_id"] = json!(steps.len() + 1);
            if let Some(Some(at)) = times.get(i) {
                step["timestamp"] = json!(iso8601(*at));
            }
            if copied {
                step["is_copied_context"] = json!(true);
            }
            steps.push(step);
        }
    }
    if steps.is_empty() {
        // A trajectory has at least one step: a session that never asked
        // anything says so.
        steps.push(json!({"step_id": 1, "source": "system",
                          "message": "the session has no steps yet"}));
    }
    if let Some(e) = ending {
        root_extra.insert(
            "ending".into(),
            json!(match e {
                Ending::Done => "done",
                Ending::Failed => "failed",
                Ending::Interrupted => "interrupted",
            }),
        );
    }
    let total_steps = steps.len();
    let mut t = json!({
        "schema_version": SCHEMA_VERSION,
        "session_id": id,
        "trajectory_id": id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": totals.0,
            "total_completion_tokens": totals.1,
            "total_cached_tokens": totals.2,
            "total_steps": total_steps,
            "extra": {"total_reasoning_tokens": totals.3},
        },
    });
    if let Some(child) = fork {
        t["continued_trajectory_ref"] = json!(format!("{child}.atif.json"));
    }
    if !root_extra.is_empty() {
        t["extra"] = Value::Object(root_extra);
    }
    t
}

/// One model answer: its text, reasoning, calls and their results.
fn agent_step(
    turn: u64,
    response: &crate::llm::Response,
    model: &str,
    results: &HashMap<&str, &[ToolOutput]>,
) -> Value {
    let mut text = Vec::new();
    let mut reasoning = Vec::new();
    let mut calls = Vec::new();
    let mut observed = Vec::new();
    for item in &response.output {
        match item {
            Item::Message { text: t, .. } => text.push(t.to_string()),
            Item::Reasoning { summary, .. } => reasoning.extend(summary.iter().cloned()),
            Item::ToolCall {
                call_id,
                name,
                arguments,
                ..
            } => {
                let args = match serde_json::from_str::<Value>(arguments) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => json!({"_raw": arguments.to_string()}),
                };
                calls.push(json!({"tool_call_id": call_id.as_ref(),
                                  "function_name": name.as_ref(), "arguments": args}));
                let content = match results.get(call_id.as_ref()) {
                    Some(output) => content_of(output),
                    None => json!("(no result was recorded: the call was left running)"),
                };
                observed.push(json!({"source_call_id": call_id.as_ref(), "content": content}));
            }
            Item::ToolResult { .. } | Item::UserContent { .. } => {}
        }
    }
    let usage = response.usage;
    let mut step = json!({
        "source": "agent",
        "model_name": model,
        "message": text.join("\n"),
        "llm_call_count": 1,
        "metrics": {
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "cached_tokens": usage.cached_input_tokens,
            "extra": {"reasoning_tokens": usage.reasoning_tokens},
        },
        "extra": {"turn": turn},
    });
    if !reasoning.is_empty() {
        step["reasoning_content"] = json!(reasoning.join("\n"));
    }
    if !calls.is_empty() {
        step["tool_calls"] = Value::Array(calls);
        step["observation"] = json!({"results": observed});
    }
    step
}

/// A result as ATIF content: its text, or its parts when it has images.
fn content_of(output: &[ToolOutput]) -> Value {
    if output.iter().all(|o| matches!(o, ToolOutput::Text { .. })) {
        return json!(ToolOutput::text_of(output));
    }
    Value::Array(
        output
            .iter()
            .map(|o| match o {
                ToolOutput::Text { text } => json!({"type": "text", "text": text.as_ref()}),
                ToolOutput::Image { data_url } => match media_type(data_url) {
                    Some(mt) => json!({"type": "image",
                                       "source": {"media_type": mt, "path": data_url.as_ref()}}),
                    None => json!({"type": "text", "text": "(an image of another type)"}),
                },
            })
            .collect(),
    )
}

/// The media type of a `data:` URL, when ATIF knows it.
fn media_type(data_url: &str) -> Option<&'static str> {
    let mt = data_url.strip_prefix("data:")?.split(';').next()?;
    ["image/jpeg", "image/png", "image/gif", "image/webp"]
        .into_iter()
        .find(|k| *k == mt)
}

fn stop_cause(c: &StopCause) -> &'static str {
    match c {
        StopCause::Requested => "asked to stop",
        StopCause::TurnLimit => "the turn limit was reached",
    }
}

/// `2026-12-05T09:00:00.000Z`.
fn iso8601(unix_ms: i64) -> String {
    crate::timeline::text::utc(unix_ms).replacen(' ', "T", 1) + "Z"
}
