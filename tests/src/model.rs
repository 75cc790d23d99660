//! A scripted model endpoint: a real HTTP/1.1 server on loopback that
//! answers each request with the next scripted reply, in the wire format
//! of the OpenAI Responses API or of Chat Completions (SSE included), and
//! records every request it got.
//!
//! It is as strict as the real servers: every request is first checked
//! against the rules of OpenAI's API on its path ([`crate::strict`]), and
//! against more profiles when a test asks; a request a real server would
//! refuse gets that server's error (and uses up no scripted reply).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

use crate::strict::{Memory, Profile, Refusal, check};

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Sent in pieces, so the client sees a real stream.
    pub chunks: Vec<String>,
    /// Waited before anything is sent.
    pub delay: Duration,
}

impl Reply {
    /// Ends the stream with `data: [DONE]`, as Chat Completions servers do.
    pub fn tap_done(mut self) -> Self {
        self.chunks.push("data: [DONE]\n\n".into());
        self
    }

    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }
}

/// A 200 with these server-sent events.
pub fn sse(events: &[Value]) -> Reply {
    Reply {
        status: 200,
        headers: vec![("Content-Type".into(), "text/event-stream".into())],
        chunks: events.iter().map(|e| format!("data: {e}\n\n")).collect(),
        delay: Duration::ZERO,
    }
}

/// A non-2xx (or plain JSON) answer.
pub fn status(code: u16, body: Value) -> Reply {
    Reply {
        status: code,
        headers: vec![("Content-Type".into(), "application/json".into())],
        chunks: vec![body.to_string()],
        delay: Duration::ZERO,
    }
}

/// Responses API streams.
pub mod responses {
    use super::*;

    /// The terminal event of a response with this output.
    pub fn completed(output: Value, status: &str, extra: Value) -> Value {
        let mut r = json!({
            "id": "resp_1", "status": status, "output": output,
            "usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 40},
                      "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 5}}
        });
        if let (Some(r), Some(e)) = (r.as_object_mut(), extra.as_object()) {
            r.extend(e.clone());
        }
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        json!({"type": kind, "response": r})
    }

    /// A text answer, streamed in two deltas.
    pub fn text(t: &str) -> Reply {
        let mid = t
            .char_indices()
            .nth(t.chars().count() / 2)
            .map_or(0, |(i, _)| i);
        sse(&[
            json!({"type": "response.created", "response": {"id": "resp_1"}}),
            json!({"type": "response.output_text.delta", "delta": &t[..mid]}),
            json!({"type": "response.output_text.delta", "delta": &t[mid..]}),
            completed(
                json!([{"type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": t}]}]),
                "completed",
                json!({}),
            ),
        ])
    }

    /// Function calls `(call_id, name, arguments)`.
    pub fn calls(list: &[(&str, &str, &str)]) -> Reply {
        let output: Vec<Value> = list
            .iter()
            .map(|(id, name, args)| {
                json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": id,
                       "name": name, "arguments": args, "status": "completed"})
            })
            .collect();
        sse(&[completed(Value::Array(output), "completed", json!({}))])
    }
}

/// Chat Completions streams.
pub mod chat {
    use super::*;

    fn chunk(delta: Value, finish: Value) -> Value {
        json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    fn usage() -> Value {
        json!({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9}})
    }

    pub fn text(t: &str) -> Reply {
        sse(&[
            chunk(json!({"role": "assistant", "content": t}), Value::Null),
            chunk(json!({}), json!("stop")),
            usage(),
        ])
        .tap_done()
    }

    /// Tool calls `(call_id, name, arguments)`, arguments split in two chunks.
    pub fn calls(list: &[(&str, &str, &str)]) -> Reply {
        let mut events = vec![chunk(json!({"role": "assistant"}), Value::Null)];
        for (i, (id, name, args)) in list.iter().enumerate() {
            let mid = args.len() / 2;
            let (a, b) = args.split_at(if args.is_char_boundary(mid) { mid } else { 0 });
            events.push(chunk(
                json!({"tool_calls": [{"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": a}}]}),
                Value::Null,
            ));
            events.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": b}}]}),
                Value::Null,
            ));
        }
        events.push(chunk(json!({}), json!("tool_calls")));
        events.push(usage());
        sse(&events).tap_done()
    }
}

#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub authorization: Option<String>,
    pub body: Value,
    /// Why the server refused it, if it did.
    pub refused: Option<Refusal>,
}

impl Received {
    /// The request body as text, for `contains` checks.
    pub fn text(&self) -> String {
        self.body.to_string()
    }
}

/// The server. Dropping it stops it.
pub struct ModelServer {
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
    /// What `GET /props` answers (llama.cpp's server settings); `None`: a
    /// 404, as OpenAI, vLLM and Ollama answer.
    props: Arc<Mutex<Option<Value>>>,
    task: JoinHandle<()>,
}

/// Where replies come from: a list in order, or a function of the request.
enum Replies {
    Script(std::vec::IntoIter<Reply>),
    Respond(Box<dyn FnMut(&Received) -> Reply + Send>),
}

/// What the server keeps between requests.
struct Script {
    replies: Replies,
    profiles: Vec<Profile>,
    memory: Memory,
}

impl Script {
    /// The refusal of the first profile that refuses `req`, or the next
    /// scripted reply.
    fn answer(&mut self, req: &Received) -> Result<Reply, Refusal> {
        for p in &self.profiles {
            if p.serves(&req.path) {
                check(*p, &req.body, &self.memory)?;
            }
        }
        let reply = match &mut self.replies {
            Replies::Script(list) => list.next().unwrap_or_else(|| {
                status(
                    500,
                    json!({"error": {"message": "the script has no more replies"}}),
                )
            }),
            Replies::Respond(f) => f(req),
        };
        self.remember(&reply);
        Ok(reply)
    }

    /// Reasoning streamed beside tool calls must come back with them.
    fn remember(&mut self, reply: &Reply) {
        let mut reasoning = String::new();
        let mut ids = Vec::new();
        for chunk in &reply.chunks {
            let Some(data) = chunk.trim().strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            for c in v["choices"].as_array().into_iter().flatten() {
                if let Some(r) = c["delta"]["reasoning_content"].as_str() {
                    reasoning.push_str(r);
                }
                for tc in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                    if let Some(id) = tc["id"].as_str() {
                        ids.push(id.to_string());
                    }
                }
            }
        }
        if !reasoning.is_empty() {
            for id in ids {
                self.memory.reasoning_by_call.insert(id, reasoning.clone());
            }
        }
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ModelServer {
    /// Serves `replies` in order, one per accepted request (connections are
    /// closed after each answer), checking every request as OpenAI does.
    /// Requests past the script get a 500 that says so.
    pub async fn start(replies: Vec<Reply>) -> Self {
        Self::strict(replies, &[Profile::OpenAiChat, Profile::OpenAiResponses]).await
    }

    /// As [`ModelServer::start`], checking requests against `profiles`
    /// (each applies to the requests on its own path).
    pub async fn strict(replies: Vec<Reply>, profiles: &[Profile]) -> Self {
        Self::serve(Replies::Script(replies.into_iter()), profiles).await
    }

    /// Answers each request with `respond(request)` (many sessions at
    /// once), checking every request as OpenAI does.
    pub async fn responding(respond: impl FnMut(&Received) -> Reply + Send + 'static) -> Self {
        Self::serve(
            Replies::Respond(Box::new(respond)),
            &[Profile::OpenAiChat, Profile::OpenAiResponses],
        )
        .await
    }

    async fn serve(replies: Replies, profiles: &[Profile]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let url = format!(
            "http://{}/v1",
            listener
                .local_addr()
                .unwrap_or_else(|e| panic!("addr: {e}"))
        );
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        let props: Arc<Mutex<Option<Value>>> = Arc::new(Mutex::new(None));
        let served_props = props.clone();
        let script = Arc::new(Mutex::new(Script {
            replies,
            profiles: profiles.to_vec(),
            memory: Memory::default(),
        }));
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let log = log.clone();
                let script = script.clone();
                let props = served_props.clone();
                tokio::spawn(async move {
                    let Some(mut req) = read_request(&mut sock).await else {
                        return;
                    };
                    // Not a model call (a GET of the server's settings, say):
                    // answered apart, neither scripted nor logged.
                    if !(req.path.ends_with("/chat/completions")
                        || req.path.ends_with("/responses"))
                    {
                        let settings = props.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        let (code, body) = match settings {
                            Some(v) if req.path == "/props" => ("200 OK", v),
                            _ => ("404 Not Found", json!({"error": {"message": "not found"}})),
                        };
                        let body = body.to_string();
                        let head = format!(
                            "HTTP/1.1 {code}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                            body.len()
                        );
                        let _ = sock.write_all(head.as_bytes()).await;
                        let _ = sock.write_all(body.as_bytes()).await;
                        let _ = sock.shutdown().await;
                        return;
                    }
                    let answer = script
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .answer(&req);
                    let reply = match answer {
                        Ok(r) => r,
                        Err(refusal) => {
                            req.refused = Some(refusal.clone());
                            status(refusal.status, refusal.body)
                        }
                    };
                    log.lock().unwrap_or_else(|p| p.into_inner()).push(req);
                    tokio::time::sleep(reply.delay).await;
                    let reason = if reply.status == 200 { "OK" } else { "Error" };
                    let mut head = format!(
                        "HTTP/1.1 {} {reason}\r\nConnection: close\r\n",
                        reply.status
                    );
                    for (k, v) in &reply.headers {
                        head.push_str(&format!("{k}: {v}\r\n"));
                    }
                    head.push_str("\r\n");
                    let _ = sock.write_all(head.as_bytes()).await;
                    for chunk in &reply.chunks {
                        let _ = sock.write_all(chunk.as_bytes()).await;
                        let _ = sock.flush().await;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    let _ = sock.shutdown().await;
                });
            }
        });
        Self {
            url,
            received,
            props,
            task,
        }
    }

    /// Answers `GET /props` with `settings`, as llama.cpp's own server does.
    pub fn serve_props(&self, settings: Value) {
        *self.props.lock().unwrap_or_else(|p| p.into_inner()) = Some(settings);
    }

    pub fn received(&self) -> Vec<Received> {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until `n` requests have arrived (panics after `within`).
    pub async fn wait_for(&self, n: usize, within: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let got = self.received();
            if got.len() >= n {
                return got;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "expected {n} model requests, got {}",
                got.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.lines();
    let path = lines.next()?.split(' ').nth(1)?.to_string();
    let mut len = 0;
    let mut authorization = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            match k.to_ascii_lowercase().as_str() {
                "content-length" => len = v.trim().parse().ok()?,
                "authorization" => authorization = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }
    while buf.len() < head_end + len {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some(Received {
        path,
        authorization,
        body: if len == 0 {
            Value::Null
        } else {
            serde_json::from_slice(&buf[head_end..head_end + len]).ok()?
        },
        refused: None,
    })
}
