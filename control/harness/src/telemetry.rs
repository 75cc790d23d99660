//! Traces of session runs, in OpenTelemetry's GenAI conventions, exported
//! over OTLP/gRPC by a batch exporter; off unless an endpoint is named.
//!
//! One trace per run of a session ([`RunTrace`]): an `invoke_agent` span
//! (`gen_ai.conversation.id` = the session's id) from the runner's start
//! (before its sandbox is made or resumed) to its end (after the export
//! and the suspension); under it a `chat` span per model request (model, token counts,
//! how it ended) and an `execute_tool` span per tool call, from the call to
//! its result. Inputs, heartbeats, stops, lost and replaced sandboxes and
//! egress decisions are events of the run's span. A call's operations are
//! submitted with the W3C `traceparent` of its `execute_tool` span (see
//! [`TraceContexts`]), and the worker makes each operation's
//! span under it, so one trace holds both sides.
//!
//! The spans are made from the session's records as they are appended
//! ([`crate::agent::Core::set_observer`]), at the times the log stamps on
//! them: what a trace says is what the log says.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use corral_proto::OperationId;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span};

use crate::agent::record::{Record, StopCause, StopMode};
use crate::llm::Item;
use crate::tools::CallOutcome;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("the OTLP exporter for {endpoint}: {reason}")]
    Exporter { endpoint: String, reason: String },
}

/// A process's exporter of traces. Cheap to clone.
#[derive(Clone)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

impl Telemetry {
    /// An exporter to the OTLP/gRPC collector at `endpoint`
    /// (`http://HOST:PORT`), naming this process `service`. Must be called
    /// inside a Tokio runtime (the exporter's connection lives there).
    pub fn otlp(endpoint: &str, service: &'static str) -> Result<Self, TelemetryError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: endpoint.to_string(),
                reason: e.to_string(),
            })?;
        // Batches go out every second (and at shutdown); one the collector
        // refuses goes again a span at a time.
        let batches = opentelemetry_sdk::trace::BatchSpanProcessor::builder(Singly(exporter))
            .with_batch_config(
                opentelemetry_sdk::trace::BatchConfigBuilder::default()
                    .with_scheduled_delay(Duration::from_secs(1))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(service)
                    .build(),
            )
            .build();
        let tracer = provider.tracer("corral");
        Ok(Self { provider, tracer })
    }

    pub fn tracer(&self) -> &SdkTracer {
        &self.tracer
    }

    /// Sends what is buffered and stops the exporter (blocking: call it
    /// where blocking is allowed, once, at the end).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces not all exported");
        }
    }
}

/// An exporter that sends a batch the collector refuses again, a span at a
/// time: a collector's bound on a request (4 MiB by default) then costs the
/// span over it, never the whole trace. If the first span alone is refused
/// too, the collector is taken for unreachable and the rest is not tried
/// (each try may wait for the export's timeout).
#[derive(Debug)]
struct Singly<E>(E);

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Singly<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        if batch.len() < 2 {
            return self.0.export(batch).await;
        }
        let Err(refused) = self.0.export(batch.clone()).await else {
            return Ok(());
        };
        tracing::debug!(error = %refused, spans = batch.len(), "a batch of spans was refused; sending them one at a time");
        let mut sent = 0usize;
        let mut last = Ok(());
        for span in batch {
            match self.0.export(vec![span]).await {
                Ok(()) => sent += 1,
                Err(e) if sent == 0 => return Err(e),
                Err(e) => last = Err(e),
            }
        }
        last
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

/// Sends what is buffered when dropped (at the end of a command).
pub struct FlushOnDrop(pub Option<Telemetry>);

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        let Some(t) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            // The exporter's connection is driven by the runtime's other
            // threads meanwhile.
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| t.shutdown())
            }
            _ => t.shutdown(),
        }
    }
}

/// `00-TRACE-SPAN-FLAGS` of a span.
/// Most bytes of a span's attribute or status text: values from a model,
/// a sandbox or a server are cut there, so that no span outgrows what a
/// collector takes (4 MiB a batch, by default).
pub const MAX_ATTRIBUTE_BYTES: usize = 4096;

/// `value`, cut to [`MAX_ATTRIBUTE_BYTES`] at a character's boundary (with
/// a mark that it was).
pub fn capped(value: impl AsRef<str>) -> String {
    let value = value.as_ref();
    if value.len() <= MAX_ATTRIBUTE_BYTES {
        return value.to_string();
    }
    let mut end = MAX_ATTRIBUTE_BYTES;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &value[..end], value.len())
}

pub fn traceparent(cx: &SpanContext) -> String {
    format!(
        "00-{:032x}-{:016x}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        cx.trace_flags().to_u8()
    )
}

/// A context whose parent is `parent`.
fn under(parent: &SpanContext) -> Context {
    Context::new().with_remote_span_context(parent.clone())
}

fn time_of(unix_ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms.max(0) as u64)
}

/// The trace context of each submitted operation, shared between a run's
/// [`SessionTrace`] (which writes it when the call is recorded) and its
/// operation manager (which sends it with the submit).
#[derive(Clone, Default)]
pub struct TraceContexts(Arc<Mutex<HashMap<OperationId, String>>>);

impl TraceContexts {
    pub fn get(&self, op: &OperationId) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(op)
            .cloned()
    }

    fn set(&self, op: OperationId, traceparent: String) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(op, traceparent);
    }

    fn forget(&self, op: &OperationId) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(op);
    }
}

/// The spans of one run of a session, made from its records.
pub struct SessionTrace {
    tracer: SdkTracer,
    model: String,
    run: Span,
    run_cx: SpanContext,
    chats: HashMap<u64, Span>,
    /// Open `execute_tool` spans by call id, and each call's operations.
    tools: HashMap<String, (Span, Vec<OperationId>)>,
    contexts: TraceContexts,
    ended: bool,
    /// How the run ended, once its `Finished` record says (its span ends
    /// later, once what follows the run is done: see [`RunTrace`]).
    ending: Option<&'static str>,
}

impl SessionTrace {
    /// A run of session `session_id` starts now (its model and sandbox
    /// are set once known).
    fn start(telemetry: &Telemetry, session_id: &str) -> Self {
        let tracer = telemetry.tracer().clone();
        let attrs = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.agent.name", "corral"),
            KeyValue::new("gen_ai.conversation.id", session_id.to_string()),
        ];
        let run = tracer
            .span_builder("invoke_agent corral")
            .with_kind(SpanKind::Internal)
            .with_attributes(attrs)
            // A run is a trace of its own.
            .start_with_context(&tracer, &Context::new());
        let run_cx = run.span_context().clone();
        Self {
            tracer,
            model: String::new(),
            run,
            run_cx,
            chats: HashMap::new(),
            tools: HashMap::new(),
            contexts: TraceContexts::default(),
            ended: false,
            ending: None,
        }
    }

    /// The model of the run, once it is known (a resumed session's).
    pub fn set_model(&mut self, model: &str) {
        self.model = model.to_string();
        self.run
            .set_attribute(KeyValue::new("gen_ai.request.model", model.to_string()));
    }

    /// An attribute of the run's span.
    pub fn set_attribute(&mut self, key: &'static str, value: String) {
        self.run.set_attribute(KeyValue::new(key, value));
    }

    /// Something that happened to the run (its sandbox made, suspended,
    /// its files exported...), now.
    pub fn note(&mut self, name: &'static str, attrs: Vec<KeyValue>) {
        if !self.ended {
            self.run
                .add_event_with_timestamp(name, SystemTime::now(), attrs);
        }
    }

    /// Where the run's operations find their trace context.
    pub fn contexts(&self) -> TraceContexts {
        self.contexts.clone()
    }

    /// The `traceparent` of the run's span.
    pub fn traceparent(&self) -> String {
        traceparent(&self.run_cx)
    }

    fn event(&mut self, name: &'static str, at: SystemTime, attrs: Vec<KeyValue>) {
        self.run.add_event_with_timestamp(name, at, attrs);
    }

    fn end_chat(&mut self, turn: u64, at: SystemTime, outcome: &'static str) {
        if let Some(mut span) = self.chats.remove(&turn) {
            span.set_attribute(KeyValue::new("corral.request.outcome", outcome));
            span.end_with_timestamp(at);
        }
    }

    fn end_open_chats(&mut self, at: SystemTime, outcome: &'static str) {
        let turns: Vec<u64> = self.chats.keys().copied().collect();
        for t in turns {
            self.end_chat(t, at, outcome);
        }
    }

    /// A record was appended at `at_unix_ms`.
    pub fn on_record(&mut self, at_unix_ms: i64, record: &Record) {
        if self.ended {
            return;
        }
        let at = time_of(at_unix_ms);
        match record {
            Record::Turn { turn } => {
                self.end_open_chats(at, "superseded");
                let span = self
                    .tracer
                    .span_builder(format!("chat {}", self.model))
                    .with_kind(SpanKind::Client)
                    .with_start_time(at)
                    .with_attributes(vec![
                        KeyValue::new("gen_ai.operation.name", "chat"),
                        KeyValue::new("gen_ai.request.model", self.model.clone()),
                        KeyValue::new("corral.turn", *turn as i64),
                    ])
                    .start_with_context(&self.tracer, &under(&self.run_cx));
                self.chats.insert(*turn, span);
            }
            Record::Response { turn, response } => {
                if let Some(span) = self.chats.get_mut(turn) {
                    let u = &response.usage;
                    span.set_attribute(KeyValue::new(
                        "gen_ai.usage.input_tokens",
                        u.input_tokens as i64,
                    ));
                    span.set_attribute(KeyValue::new(
                        "gen_ai.usage.output_tokens",
                        u.output_tokens as i64,
                    ));
                    span.set_attribute(KeyValue::new(
                        "gen_ai.usage.cache_read.input_tokens",
                        u.cached_input_tokens as i64,
                    ));
                    if let Some(id) = &response.id {
                        span.set_attribute(KeyValue::new("gen_ai.response.id", capped(id)));
                    }
                    let calls = response
                        .output
                        .iter()
                        .filter(|i| matches!(i, Item::ToolCall { .. }))
                        .count();
                    span.set_attribute(KeyValue::new(
                        "gen_ai.response.finish_reasons",
                        if calls > 0 { "tool_calls" } else { "stop" },
                    ));
                }
                self.end_chat(*turn, at, "answered");
            }
            Record::ModelFailure { turn, error, code } => {
                if let Some(span) = self.chats.get_mut(turn) {
                    span.set_attribute(KeyValue::new(
                        "error.type",
                        code.clone().unwrap_or_else(|| "model_failure".into()),
                    ));
                    span.set_status(Status::error(capped(error)));
                }
                self.end_chat(*turn, at, "failed");
            }
            Record::Call {
                call_id,
                tool,
                outcome,
                operations,
                ..
            } => {
                let mut span = self
                    .tracer
                    .span_builder(format!("execute_tool {tool}"))
                    .with_kind(SpanKind::Internal)
                    .with_start_time(at)
                    .with_attributes(vec![
                        KeyValue::new("gen_ai.operation.name", "execute_tool"),
                        KeyValue::new("gen_ai.tool.name", capped(tool)),
                        KeyValue::new("gen_ai.tool.call.id", capped(call_id)),
                        KeyValue::new("gen_ai.tool.type", "function"),
                    ])
                    .start_with_context(&self.tracer, &under(&self.run_cx));
                match outcome {
                    CallOutcome::Submit => {
                        let parent = traceparent(span.span_context());
                        let ops: Vec<OperationId> =
                            operations.iter().map(|o| o.id.clone()).collect();
                        for op in &ops {
                            self.contexts.set(op.clone(), parent.clone());
                        }
                        self.tools.insert(call_id.clone(), (span, ops));
                    }
                    CallOutcome::Error { text } => {
                        span.set_attribute(KeyValue::new("error.type", "refused"));
                        span.set_status(Status::error(capped(text)));
                        span.end_with_timestamp(at);
                    }
                    CallOutcome::Done { .. } => span.end_with_timestamp(at),
                }
            }
            Record::Operation { snapshot } => {
                let owner = self
                    .tools
                    .iter_mut()
                    .find(|(_, (_, ops))| ops.contains(&snapshot.id));
                if let Some((_, (span, _))) = owner {
                    let mut attrs = vec![
                        KeyValue::new("corral.operation.id", snapshot.id.to_string()),
                        KeyValue::new(
                            "corral.operation.status",
                            format!("{:?}", snapshot.status).to_lowercase(),
                        ),
                    ];
                    if let Some(r) = &snapshot.result {
                        attrs.push(KeyValue::new(
                            "process.exit.code",
                            i64::from(r.outcome.exit_status()),
                        ));
                    }
                    span.add_event_with_timestamp("operation_ended", at, attrs);
                }
                self.contexts.forget(&snapshot.id);
            }
            Record::Result {
                call_id, running, ..
            } => {
                if *running {
                    if let Some((span, _)) = self.tools.get_mut(call_id) {
                        span.add_event_with_timestamp("placeholder_shown", at, vec![]);
                    }
                } else if let Some((mut span, _)) = self.tools.remove(call_id) {
                    span.end_with_timestamp(at);
                }
            }
            Record::Input { input_id, .. } => {
                let steering = !self.chats.is_empty();
                self.event(
                    "input",
                    at,
                    vec![
                        KeyValue::new("corral.input.id", capped(input_id)),
                        KeyValue::new("corral.input.steering", steering),
                    ],
                );
            }
            Record::Heartbeat { .. } => self.event("heartbeat", at, vec![]),
            Record::Stop { mode, cause } => {
                let mode = match mode {
                    StopMode::WhenIdle => "when_idle",
                    StopMode::Hard => "hard",
                };
                let cause = match cause {
                    StopCause::Requested => "requested",
                    StopCause::TurnLimit => "turn_limit",
                };
                if mode == "hard" {
                    self.end_open_chats(at, "canceled");
                }
                self.event(
                    "stop",
                    at,
                    vec![
                        KeyValue::new("corral.stop.mode", mode),
                        KeyValue::new("corral.stop.cause", cause),
                    ],
                );
            }
            Record::SandboxLost { reason } => {
                self.end_open_chats(at, "canceled");
                self.event(
                    "sandbox_lost",
                    at,
                    vec![KeyValue::new("corral.reason", capped(reason))],
                );
            }
            Record::Placed {
                worker,
                sandbox_id,
                generation,
                ..
            } => self.event(
                "sandbox_replaced",
                at,
                vec![
                    KeyValue::new("corral.sandbox.id", sandbox_id.to_string()),
                    KeyValue::new("corral.sandbox.generation", *generation as i64),
                    KeyValue::new("corral.worker", worker.clone().unwrap_or_default()),
                ],
            ),
            Record::Egress {
                host,
                port,
                decision,
                reason,
                unreported,
            } => {
                let mut attrs = vec![
                    KeyValue::new("server.address", capped(host)),
                    KeyValue::new("server.port", i64::from(*port)),
                    KeyValue::new("corral.egress.decision", decision.as_str()),
                    KeyValue::new("corral.egress.reason", capped(reason)),
                ];
                if *unreported > 0 {
                    attrs.push(KeyValue::new(
                        "corral.egress.unreported",
                        i64::try_from(*unreported).unwrap_or(i64::MAX),
                    ));
                }
                self.event("egress", at, attrs)
            }
            Record::EgressUnrecorded { count } => self.event(
                "egress_unrecorded",
                at,
                vec![KeyValue::new(
                    "corral.egress.unrecorded",
                    i64::try_from(*count).unwrap_or(i64::MAX),
                )],
            ),
            Record::Shrink {
                context_window_tokens,
                ..
            } => self.event(
                "context_shrunk",
                at,
                vec![KeyValue::new(
                    "corral.context_window_tokens",
                    *context_window_tokens as i64,
                )],
            ),
            Record::Resume { .. } => self.event("resume", at, vec![]),
            Record::Finished { ending } => {
                // The run's span goes on until its owner ends it.
                let word = ending.as_str();
                self.ending = Some(word);
                self.end_open_chats(at, "canceled");
                self.event("finished", at, vec![KeyValue::new("corral.ending", word)]);
            }
            Record::Start { .. } | Record::History { .. } | Record::Forked { .. } => {}
        }
    }

    /// Ends the run's span and whatever is open under it.
    fn finish(&mut self, at: SystemTime, ending: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.end_open_chats(at, "canceled");
        for (_, (mut span, ops)) in self.tools.drain() {
            // Still running: the worker's span ends it; this one says the
            // run did not wait.
            span.set_attribute(KeyValue::new("corral.call.unfinished", true));
            span.end_with_timestamp(at);
            for op in ops {
                self.contexts.forget(&op);
            }
        }
        self.run
            .set_attribute(KeyValue::new("corral.ending", ending.to_string()));
        if ending == "failed" {
            self.run.set_status(Status::error("the run failed"));
        }
        self.run.end_with_timestamp(at);
    }
}

impl Drop for SessionTrace {
    fn drop(&mut self) {
        // A run left before its end (its process asked to go): its span
        // still goes out.
        let ending = self.ending.unwrap_or("left");
        self.finish(SystemTime::now(), ending);
    }
}

/// The trace of a session's fork (no run: a trace of its own), its
/// moments as events: the parent's sandbox forked live, or its workspace
/// copied or restored. Ended when dropped.
pub struct ForkTrace {
    span: Span,
}

impl ForkTrace {
    pub fn start(telemetry: &Telemetry, parent: &str, child: &str, turn: Option<u64>) -> Self {
        let tracer = telemetry.tracer();
        let mut attrs = vec![
            KeyValue::new("gen_ai.conversation.id", child.to_string()),
            KeyValue::new("corral.forked_from", parent.to_string()),
        ];
        if let Some(t) = turn {
            attrs.push(KeyValue::new("corral.fork.turn", t as i64));
        }
        let span = tracer
            .span_builder("fork_session corral")
            .with_kind(SpanKind::Internal)
            .with_attributes(attrs)
            .start_with_context(tracer, &Context::new());
        Self { span }
    }

    /// Something that happened to the fork, now.
    pub fn note(&mut self, name: &'static str, attrs: Vec<KeyValue>) {
        self.span
            .add_event_with_timestamp(name, SystemTime::now(), attrs);
    }

    /// The fork failed with `error`.
    pub fn failed(&mut self, error: &str) {
        self.span.set_status(Status::error(capped(error)));
    }
}

impl Drop for ForkTrace {
    fn drop(&mut self) {
        self.span.end();
    }
}

/// A run's trace shared by its runner (which makes, resumes, suspends and
/// exports its sandbox) and its session's core (which appends its
/// records): the run's span lasts from the runner's start to its end.
#[derive(Clone)]
pub struct RunTrace(Arc<Mutex<SessionTrace>>);

impl RunTrace {
    /// A run of session `session_id` starts now.
    pub fn start(telemetry: &Telemetry, session_id: &str) -> Self {
        Self(Arc::new(Mutex::new(SessionTrace::start(
            telemetry, session_id,
        ))))
    }

    pub fn with<T>(&self, f: impl FnOnce(&mut SessionTrace) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The `traceparent` of the run's span.
    pub fn traceparent(&self) -> String {
        self.with(|t| t.traceparent())
    }

    /// Ends the run's span now (once; dropping the last handle does too).
    pub fn end(&self) {
        self.with(|t| {
            let ending = t.ending.unwrap_or("left");
            t.finish(SystemTime::now(), ending);
        });
    }
}

impl crate::agent::core::RecordObserver for RunTrace {
    fn on_record(&mut self, at_unix_ms: i64, record: &Record) {
        self.with(|t| t.on_record(at_unix_ms, record));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_values_are_capped_at_a_character_boundary() {
        assert_eq!(capped("short"), "short");
        let long = "é".repeat(3000);
        let c = capped(&long);
        assert!(c.len() < MAX_ATTRIBUTE_BYTES + 32, "{}", c.len());
        assert!(c.ends_with("... (6000 bytes)"), "{c}");
        assert!(c.starts_with("éé"));
    }
}
