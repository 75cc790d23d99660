//! The model clients against a real HTTP server on loopback that speaks each
//! provider's wire format (SSE included), scripted per test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use corral_e2e::model::responses::completed;
use corral_e2e::model::{ModelServer, chat, sse, status};
use corral_harness::llm::retry::RetryPolicy;
use corral_harness::llm::{
    Api, Item, LlmClient, LlmConfig, LlmError, Request, Role, StopReason, StreamDelta, Tool,
    ToolOutput,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn client(server: &ModelServer, api: Api, attempts: u32) -> LlmClient {
    let mut cfg = LlmConfig::new(server.url.clone(), api);
    cfg.api_key = Some("sk-test".into());
    cfg.retry = RetryPolicy {
        max_attempts: attempts,
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(50),
        overload_base_delay: Duration::from_millis(5),
        overload_max_delay: Duration::from_millis(50),
    };
    LlmClient::new(cfg).unwrap()
}

fn bash_tool() -> Tool {
    Tool {
        name: "Bash".into(),
        description: "Run a command".into(),
        parameters: json!({"type": "object", "properties": {"command": {"type": "string"}}}),
    }
}

fn request() -> Request {
    Request {
        model: "test-model".into(),
        input: vec![
            Item::Message {
                role: Role::System,
                text: "be brief".into(),
                provider_id: None,
            },
            Item::Message {
                role: Role::User,
                text: "list files".into(),
                provider_id: None,
            },
        ],
        tools: vec![bash_tool()],
        max_output_tokens: Some(1000),
        reasoning_effort: None,
        cache_key: Some("session-1".into()),
        tool_choice: None,
    }
}

async fn respond(
    c: &LlmClient,
    req: &Request,
) -> (
    Result<corral_harness::llm::Response, LlmError>,
    Vec<StreamDelta>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let r = c.respond(req, Some(&tx), &CancellationToken::new()).await;
    drop(tx);
    let mut deltas = Vec::new();
    while let Some(d) = rx.recv().await {
        deltas.push(d);
    }
    (r, deltas)
}

#[tokio::test]
async fn responses_streams_text_and_reports_usage() {
    let server = ModelServer::start(vec![sse(&[
        json!({"type": "response.created", "response": {"id": "resp_1"}}),
        json!({"type": "response.output_text.delta", "delta": "Hel"}),
        json!({"type": "response.output_text.delta", "delta": "lo"}),
        completed(json!([{"type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": "Hello"}]}]), "completed", json!({})),
    ])])
    .await;
    let c = client(&server, Api::Responses, 3);
    let (r, deltas) = respond(&c, &request()).await;
    let r = r.unwrap();
    assert_eq!(r.text(), "Hello");
    assert_eq!(r.stop, StopReason::Complete);
    assert_eq!(
        (
            r.usage.input_tokens,
            r.usage.cached_input_tokens,
            r.usage.output_tokens,
            r.usage.reasoning_tokens
        ),
        (100, 40, 20, 5)
    );
    assert_eq!(
        deltas,
        vec![
            StreamDelta::Text("Hel".into()),
            StreamDelta::Text("lo".into())
        ]
    );

    let got = server.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].path, "/v1/responses");
    assert_eq!(got[0].authorization.as_deref(), Some("Bearer sk-test"));
    let b = &got[0].body;
    assert_eq!(b["model"], "test-model");
    assert_eq!(
        (b["stream"].clone(), b["store"].clone()),
        (json!(true), json!(false))
    );
    assert_eq!(
        b["input"][1],
        json!({"role": "user", "content": "list files"})
    );
    assert_eq!(b["tools"][0]["strict"], json!(false));
    assert_eq!(b["tools"][0]["name"], "Bash");
    assert_eq!(b["max_output_tokens"], 1000);
    assert_eq!(b["prompt_cache_key"], "session-1");
}

#[tokio::test]
async fn responses_function_calls_and_the_output_item_fallback() {
    // The terminal event carries no output: items come from output_item.done.
    let call = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "Bash",
                      "arguments": "{\"command\":\"ls\"}", "status": "completed"});
    let server = ModelServer::start(vec![sse(&[
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "function_call", "name": "Bash"}}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": call}),
        completed(json!([]), "completed", json!({})),
    ])])
    .await;
    let c = client(&server, Api::Responses, 3);
    let (r, deltas) = respond(&c, &request()).await;
    let r = r.unwrap();
    assert_eq!(
        r.output,
        vec![Item::ToolCall {
            call_id: "call_1".into(),
            name: "Bash".into(),
            arguments: "{\"command\":\"ls\"}".into(),
            provider_id: Some("fc_1".into()),
        }]
    );
    assert_eq!(
        deltas,
        vec![StreamDelta::ToolCallStarted {
            name: "Bash".into()
        }]
    );
}

#[tokio::test]
async fn responses_replays_history_with_images_and_malformed_arguments() {
    let server =
        ModelServer::start(vec![sse(&[completed(json!([]), "completed", json!({}))])]).await;
    let c = client(&server, Api::Responses, 1);
    let mut req = request();
    req.input.push(Item::ToolCall {
        call_id: "c1".into(),
        name: "Bash".into(),
        arguments: "{not json".into(),
        provider_id: None,
    });
    req.input.push(Item::ToolResult {
        call_id: "c1".into(),
        output: vec![
            ToolOutput::Text {
                text: "see image".into(),
            },
            ToolOutput::Image {
                data_url: "data:image/png;base64,AAAA".into(),
            },
        ],
    });
    respond(&c, &req).await.0.unwrap();
    let b = &server.received()[0].body;
    assert_eq!(
        b["input"][2],
        json!({"type": "function_call", "call_id": "c1", "name": "Bash", "arguments": "{\"invalid_arguments\":\"{not json\"}"})
    );
    assert_eq!(
        b["input"][3],
        json!({"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "see image"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]})
    );
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retried_then_succeed() {
    let ok = sse(&[completed(
        json!([{"type": "message", "content": [{"type": "output_text", "text": "done"}]}]),
        "completed",
        json!({}),
    )]);
    let mut limited = status(
        429,
        json!({"error": {"message": "slow down", "code": "rate_limit_exceeded"}}),
    );
    limited.headers.push(("Retry-After".into(), "0".into()));
    let server = ModelServer::start(vec![
        limited,
        status(500, json!({"error": {"message": "boom"}})),
        // A stream that breaks off before its terminal event.
        sse(&[json!({"type": "response.output_text.delta", "delta": "do"})]),
        ok,
    ])
    .await;
    let c = client(&server, Api::Responses, 5);
    let (r, deltas) = respond(&c, &request()).await;
    assert_eq!(r.unwrap().text(), "done");
    assert_eq!(server.received().len(), 4);
    let retries: Vec<u32> = deltas
        .iter()
        .filter_map(|d| match d {
            StreamDelta::Retrying { attempt, .. } => Some(*attempt),
            _ => None,
        })
        .collect();
    assert_eq!(retries, vec![2, 3, 4]);
}

#[tokio::test]
async fn a_bad_request_fails_at_once_with_the_providers_words() {
    let server = ModelServer::start(vec![status(400, json!({"error": {"message": "Unknown parameter: 'x'", "type": "invalid_request_error", "code": "unknown_parameter"}}))]).await;
    let c = client(&server, Api::Responses, 5);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert_eq!(server.received().len(), 1, "a 400 is not retried");
    assert_eq!(
        err.to_string(),
        "responses request failed with status 400 (unknown_parameter): Unknown parameter: 'x'"
    );
}

#[tokio::test]
async fn in_band_failures_are_errors_not_answers() {
    let failed = json!({"type": "response.failed", "response": {"id": "r", "status": "failed",
        "error": {"code": "context_length_exceeded", "message": "Your input exceeds the context window of this model."}}});
    let server = ModelServer::start(vec![sse(&[failed])]).await;
    let c = client(&server, Api::Responses, 5);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(err.is_context_length_exceeded(), "{err}");
    assert_eq!(server.received().len(), 1, "never retried");

    // A retryable in-band error, every time: a clear error after the last attempt.
    let error_event =
        json!({"type": "error", "code": "server_error", "message": "The server had an error"});
    let server = ModelServer::start(vec![
        sse(std::slice::from_ref(&error_event)),
        sse(std::slice::from_ref(&error_event)),
        sse(&[error_event]),
    ])
    .await;
    let c = client(&server, Api::Responses, 3);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert_eq!(
        err.to_string(),
        "gave up after 3 attempts: responses reported a failure (server_error): The server had an error"
    );
}

#[tokio::test]
async fn refusals_and_token_limits_are_stop_reasons() {
    let refusal = completed(
        json!([{"type": "message", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]),
        "completed",
        json!({}),
    );
    let cut = completed(
        json!([{"type": "message", "content": [{"type": "output_text", "text": "partial"}]}]),
        "incomplete",
        json!({"incomplete_details": {"reason": "max_output_tokens"}}),
    );
    let server = ModelServer::start(vec![sse(&[refusal]), sse(&[cut])]).await;
    let c = client(&server, Api::Responses, 1);
    let r = respond(&c, &request()).await.0.unwrap();
    assert_eq!(
        (r.stop, r.text()),
        (StopReason::Refused, "I can't help with that.".to_string())
    );
    let r = respond(&c, &request()).await.0.unwrap();
    assert_eq!(
        (r.stop, r.text()),
        (StopReason::MaxOutputTokens, "partial".to_string())
    );
}

#[tokio::test]
async fn chat_completions_streams_text_tool_calls_and_usage() {
    let chunk = |delta: Value, finish: Value| json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let server = ModelServer::start(vec![sse(&[
        chunk(json!({"role": "assistant", "content": "Let me look"}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": "{\"comm"}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "and\":\"ls\"}"}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "Bash", "arguments": "{}"}}]}), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 10}}}),
    ])
    .tap_done()])
    .await;
    let c = client(&server, Api::Chat, 2);
    let mut req = request();
    req.input.push(Item::ToolCall {
        call_id: "c0".into(),
        name: "Bash".into(),
        arguments: "{\"command\":\"pwd\"}".into(),
        provider_id: None,
    });
    req.input.push(Item::ToolResult {
        call_id: "c0".into(),
        output: vec![
            ToolOutput::Text {
                text: "/workspace".into(),
            },
            ToolOutput::Image {
                data_url: "data:image/png;base64,AA".into(),
            },
        ],
    });
    let (r, deltas) = respond(&c, &req).await;
    let r = r.unwrap();
    assert_eq!(r.stop, StopReason::Complete);
    assert_eq!(r.text(), "Let me look");
    let calls: Vec<(String, String)> = r
        .tool_calls()
        .map(|i| match i {
            Item::ToolCall {
                call_id, arguments, ..
            } => (call_id.to_string(), arguments.to_string()),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        calls,
        vec![
            ("call_a".into(), "{\"command\":\"ls\"}".into()),
            ("call_b".into(), "{}".into())
        ]
    );
    assert_eq!(
        (
            r.usage.input_tokens,
            r.usage.cached_input_tokens,
            r.usage.output_tokens
        ),
        (50, 10, 9)
    );
    assert!(deltas.contains(&StreamDelta::Text("Let me look".into())));

    let got = server.received();
    assert_eq!(got[0].path, "/v1/chat/completions");
    let m = &got[0].body["messages"];
    assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
    assert_eq!(m[2]["role"], "assistant");
    assert_eq!(
        m[2]["tool_calls"][0]["function"]["arguments"],
        "{\"command\":\"pwd\"}"
    );
    // Call ids go out as nine letters and digits (the strictest servers'
    // rule), the same for the call and its result.
    let id = m[2]["tool_calls"][0]["id"].as_str().unwrap();
    assert!(corral_harness::llm::conform::is_strict_call_id(id), "{id}");
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": id, "content": "/workspace"})
    );
    // The image cannot go in a tool message: it follows as a user message,
    // after an assistant line, since the strictest servers refuse a user
    // message right after a tool message.
    assert_eq!(m[4]["role"], "assistant");
    assert_eq!(m[5]["role"], "user");
    assert_eq!(
        m[5]["content"][1]["image_url"]["url"],
        "data:image/png;base64,AA"
    );
    assert_eq!(got[0].body["tools"][0]["function"]["name"], "Bash");
    assert_eq!(got[0].body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn chat_completions_errors_and_limits() {
    let error = json!({"error": {"message": "This model's maximum context length is 8192 tokens", "code": 400}});
    let cut = json!({"id": "x", "choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": "length"}]});
    let server = ModelServer::start(vec![
        status(400, json!({"object": "error", "message": "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.", "type": "BadRequestError", "code": 400})),
        sse(&[error]),
        sse(&[cut]).tap_done(),
    ])
    .await;
    let c = client(&server, Api::Chat, 1);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(err.is_context_length_exceeded(), "{err}");
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(matches!(err, LlmError::InBand { .. }), "{err}");
    let r = respond(&c, &request()).await.0.unwrap();
    assert_eq!(
        (r.stop, r.text()),
        (StopReason::MaxOutputTokens, "par".to_string())
    );
}

#[tokio::test]
async fn cancel_ends_a_backoff_wait() {
    let server = ModelServer::start(vec![status(503, json!({})), status(503, json!({}))]).await;
    let mut cfg = LlmConfig::new(server.url.clone(), Api::Responses);
    cfg.retry.base_delay = Duration::from_secs(3600);
    cfg.retry.max_delay = Duration::from_secs(3600);
    let c = LlmClient::new(cfg).unwrap();
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.cancel();
    });
    let err = c.respond(&request(), None, &cancel).await.unwrap_err();
    assert_eq!(err, LlmError::Canceled);
}

#[tokio::test]
async fn an_unreachable_endpoint_is_a_clear_error() {
    let mut server = ModelServer::start(Vec::new()).await;
    server.url = "http://127.0.0.1:1/v1".into();
    let c = client(&server, Api::Chat, 2);
    let err = respond(&c, &request()).await.0.unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("gave up after 2 attempts: cannot reach the model endpoint"),
        "{text}"
    );
}

/// llama.cpp reports a chat template that refuses the conversation as a
/// 500; sending the same request again cannot help, so it is not retried.
#[tokio::test]
async fn a_template_error_reported_as_500_is_not_retried() {
    let body = json!({"error": {"code": 500, "type": "server_error",
        "message": "\n------------\nWhile executing CallExpression at line 1, column 1 in source:\nError: Jinja Exception: Conversation roles must alternate user/assistant/user/assistant/..."}});
    let server = ModelServer::start(vec![status(500, body), chat::text("never asked")]).await;
    let c = client(&server, Api::Chat, 5);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(err.to_string().contains("roles must alternate"), "{err}");
    assert_eq!(server.received().len(), 1, "not retried");
}

/// The same malformed answer twice is the server's answer to the request,
/// not a hiccup: not sent a third time (of five attempts allowed).
#[tokio::test]
async fn the_same_malformed_stream_twice_is_not_retried_again() {
    let bad = || sse(&[json!({"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]})]);
    let server = ModelServer::start(vec![bad(), bad(), bad(), bad(), bad()]).await;
    let c = client(&server, Api::Chat, 5);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(err.to_string().contains("without a finish reason"), "{err}");
    assert_eq!(server.received().len(), 2);
}

/// An empty 200 stream (llama.cpp past its window) is an overflow, and not
/// retried by the client.
#[tokio::test]
async fn an_empty_stream_is_a_context_overflow() {
    let server = ModelServer::start(vec![sse(&[]), sse(&[])]).await;
    let c = client(&server, Api::Chat, 5);
    let err = respond(&c, &request()).await.0.unwrap_err();
    assert!(err.is_context_length_exceeded(), "{err}");
    assert_eq!(server.received().len(), 1);
}
