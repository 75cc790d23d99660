//! The HTTP side: one reqwest client, streaming, attempts and backoff.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::model::{LlmError, Request, Response, StreamDelta};
use super::retry::{RetryPolicy, is_retryable, parse_retry_after};
use super::sse::SseParser;
use super::{chat, responses};

/// The endpoint of a session that names none.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// Which wire protocol the endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST {base}/responses`
    Responses,
    /// `POST {base}/chat/completions`
    Chat,
}

impl Api {
    /// Its name on the wire and in flags: responses | chat.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Responses => "responses",
            Api::Chat => "chat",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Api::Responses => "responses",
            Api::Chat => "chat completions",
        }
    }
}

#[derive(Debug, Clone)]
pub struct LlmConfig {
    /// E.g. `https://api.openai.com/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub api: Api,
    pub retry: RetryPolicy,
    /// Longest silence tolerated inside a stream (reasoning can be quiet).
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
}

impl LlmConfig {
    pub fn new(base_url: impl Into<String>, api: Api) -> Self {
        Self {
            base_url: base_url.into(),
            api_key: None,
            api,
            retry: RetryPolicy::default(),
            idle_timeout: Duration::from_secs(30 * 60),
            connect_timeout: Duration::from_secs(30),
        }
    }
}

/// Largest error body read from a failed request.
const MAX_ERROR_BODY: usize = 1 << 20;
/// Largest single server-sent event.
const MAX_EVENT_BYTES: usize = 64 << 20;

pub struct LlmClient {
    http: reqwest::Client,
    config: LlmConfig,
}

/// What answers a session's requests: a model server over HTTP
/// ([`LlmClient`]), or a test's own script (driven with paused time, where
/// no socket may wait).
pub trait Model: Send + Sync {
    /// The complete response to `req` (see [`LlmClient::respond`]).
    fn respond<'a>(
        &'a self,
        req: &'a Request,
        deltas: Option<&'a mpsc::Sender<StreamDelta>>,
        cancel: &'a CancellationToken,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response, LlmError>> + Send + 'a>>;
}

impl Model for LlmClient {
    fn respond<'a>(
        &'a self,
        req: &'a Request,
        deltas: Option<&'a mpsc::Sender<StreamDelta>>,
        cancel: &'a CancellationToken,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response, LlmError>> + Send + 'a>>
    {
        Box::pin(LlmClient::respond(self, req, deltas, cancel))
    }
}

/// Makes the model a session's requests go to, from its endpoint.
pub type MakeModel = dyn Fn(LlmConfig) -> Result<std::sync::Arc<dyn Model>, LlmError> + Send + Sync;

/// The model of an endpoint: its server, over HTTP.
pub fn http_model(config: LlmConfig) -> Result<std::sync::Arc<dyn Model>, LlmError> {
    Ok(std::sync::Arc::new(LlmClient::new(config)?))
}

enum Interp {
    Responses(responses::StreamState),
    Chat(Box<chat::StreamState>),
}

impl Interp {
    fn on_data(
        &mut self,
        data: &str,
        delta: &mut dyn FnMut(StreamDelta),
    ) -> Result<Option<Response>, LlmError> {
        match self {
            Interp::Responses(s) => s.on_data(data, delta),
            Interp::Chat(s) => s.on_data(data, delta),
        }
    }

    fn at_eof(&mut self, api: &'static str) -> Result<Response, LlmError> {
        match self {
            Interp::Chat(s) => s.finish(),
            Interp::Responses(_) => Err(LlmError::Protocol {
                api,
                message: "stream ended without a terminal response".into(),
            }),
        }
    }
}

/// The context window a local server says it serves, where it says it:
/// llama.cpp's own server answers `GET /props` (beside its `/v1`) with
/// `default_generation_settings.n_ctx`. `None` for any other answer, or
/// none within two seconds (OpenAI, vLLM and Ollama answer 404).
pub async fn served_context_window(base_url: &str, api_key: Option<&str>) -> Option<u64> {
    let base = base_url.trim_end_matches('/');
    let root = base.strip_suffix("/v1").unwrap_or(base);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .ok()?;
    let mut req = http.get(format!("{root}/props"));
    if let Some(key) = api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    // Read up to 1 MiB: the settings are a few KiB.
    let mut resp = resp;
    let mut bytes = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        bytes.extend_from_slice(&chunk);
        if bytes.len() > 1 << 20 {
            return None;
        }
    }
    let body: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let n_ctx = body
        .pointer("/default_generation_settings/n_ctx")
        .or_else(|| body.get("n_ctx"))?
        .as_u64()?;
    (n_ctx >= 256).then_some(n_ctx)
}

fn jitter() -> f64 {
    (uuid::Uuid::new_v4().as_u128() % 1_000_000) as f64 / 1_000_000.0
}

impl LlmClient {
    pub fn new(config: LlmConfig) -> Result<Self, LlmError> {
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .build()
            .map_err(|e| LlmError::Request(e.to_string()))?;
        Ok(Self { http, config })
    }

    pub fn config(&self) -> &LlmConfig {
        &self.config
    }

    /// Sends `req` and returns the complete response, retrying what is worth
    /// retrying. Text deltas go to `deltas` as they stream (display only; a
    /// full channel drops them). `cancel` ends everything at once, also a
    /// backoff wait.
    pub async fn respond(
        &self,
        req: &Request,
        deltas: Option<&mpsc::Sender<StreamDelta>>,
        cancel: &CancellationToken,
    ) -> Result<Response, LlmError> {
        let api = self.config.api;
        let body = match api {
            Api::Responses => responses::request_body(req)?,
            Api::Chat => {
                let mut body = chat::request_body(req)?;
                chat::adapt_to_endpoint(&mut body, &self.config.base_url);
                body
            }
        };
        let body = serde_json::to_vec(&body).map_err(|e| LlmError::Request(e.to_string()))?;
        let max = self.config.retry.max_attempts.max(1);
        let mut attempt = 1;
        let mut last_protocol: Option<String> = None;
        loop {
            let result = tokio::select! {
                r = self.attempt(&body, deltas) => r,
                () = cancel.cancelled() => return Err(LlmError::Canceled),
            };
            let err = match result {
                Ok(resp) => return Ok(resp),
                Err(e) => e,
            };
            if !is_retryable(&err) {
                return Err(err);
            }
            // The same request broken the same way twice is the server's
            // answer to it, not a hiccup: not sent a third time.
            let repeated = if let LlmError::Protocol { .. } = &err {
                let text = err.to_string();
                let same = last_protocol.as_deref() == Some(text.as_str());
                last_protocol = Some(text);
                same
            } else {
                last_protocol = None;
                false
            };
            if attempt >= max || repeated {
                return Err(LlmError::GaveUp {
                    attempts: attempt,
                    last: Box::new(err),
                });
            }
            let wait = self.config.retry.delay(attempt, &err, jitter());
            tracing::warn!(api = api.name(), attempt, wait_ms = wait.as_millis() as u64, error = %err, "model request failed; retrying");
            if let Some(tx) = deltas {
                let _ = tx.try_send(StreamDelta::Retrying {
                    attempt: attempt + 1,
                    reason: err.to_string(),
                });
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = cancel.cancelled() => return Err(LlmError::Canceled),
            }
            attempt += 1;
        }
    }

    async fn attempt(
        &self,
        body: &[u8],
        deltas: Option<&mpsc::Sender<StreamDelta>>,
    ) -> Result<Response, LlmError> {
        let api = self.config.api;
        let path = match api {
            Api::Responses => "responses",
            Api::Chat => "chat/completions",
        };
        let url = format!("{}/{path}", self.config.base_url.trim_end_matches('/'));
        let mut http = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body.to_vec());
        if let Some(key) = &self.config.api_key {
            http = http.bearer_auth(key);
        }
        let resp = http
            .send()
            .await
            .map_err(|e| LlmError::Transport(crate::client::source_chain(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(http_error(api.name(), resp).await);
        }
        let mut interp = match api {
            Api::Responses => Interp::Responses(responses::StreamState::default()),
            Api::Chat => Interp::Chat(Box::default()),
        };
        let mut on_delta = |d: StreamDelta| {
            if let Some(tx) = deltas {
                let _ = tx.try_send(d);
            }
        };
        let mut sse = SseParser::new(MAX_EVENT_BYTES);
        let mut stream = resp.bytes_stream();
        loop {
            let chunk = tokio::time::timeout(self.config.idle_timeout, stream.next())
                .await
                .map_err(|_| {
                    LlmError::Transport(format!("no data for {:?}", self.config.idle_timeout))
                })?;
            let events = match chunk {
                Some(Ok(bytes)) => sse.push(&bytes).map_err(|e| LlmError::Protocol {
                    api: api.name(),
                    message: e.to_string(),
                })?,
                Some(Err(e)) => return Err(LlmError::Transport(crate::client::source_chain(&e))),
                None => {
                    if let Some(ev) = sse.finish()
                        && let Some(r) = interp.on_data(&ev.data, &mut on_delta)?
                    {
                        return Ok(r);
                    }
                    return interp.at_eof(api.name());
                }
            };
            for ev in events {
                if let Some(r) = interp.on_data(&ev.data, &mut on_delta)? {
                    return Ok(r);
                }
            }
        }
    }
}

/// A non-2xx answer as an error: the provider's code and message when its
/// body says them, and `Retry-After` when given.
async fn http_error(api: &'static str, resp: reqwest::Response) -> LlmError {
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after);
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_ERROR_BODY {
            body.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    let parsed: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
    let err = parsed
        .as_ref()
        .map(|v| v.get("error").filter(|e| e.is_object()).unwrap_or(v));
    let code = err
        .and_then(|e| e.get("code").or_else(|| e.get("type")))
        .and_then(|c| c.as_str().map(String::from));
    let message = err
        .and_then(|e| e.get("message"))
        .and_then(|m| m.as_str())
        .map(String::from)
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(&body);
            let text = text.trim();
            if text.is_empty() {
                "no details".to_string()
            } else {
                text.chars().take(500).collect()
            }
        });
    LlmError::Http {
        api,
        status,
        code,
        message,
        retry_after,
    }
}
