//! Spans of operations, for a worker started with `--otlp-endpoint`
//! (OpenTelemetry, OTLP over gRPC, a batch exporter).
//!
//! An operation submitted with a W3C `traceparent` in its request's
//! metadata gets a span under that parent (the control plane's
//! `execute_tool` span): from its submit to its end, with events for when
//! it was queued, started and first printed, and its exit code and end
//! cause. The parent and the submit time are kept in memory and appended
//! to one journal in the worker's state directory (`traces/pending.jsonl`:
//! a line when a traced operation is submitted, one when it ends, no file
//! per operation) and the span is made when it ends, so an operation that
//! outlives a restart of the worker still gets its span, from the worker
//! that sees it end (it reads the journal at its start).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use corral_proto::{OperationId, OperationResult, Outcome, SandboxId};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use serde::{Deserialize, Serialize};

/// Operations' spans, and where their parents wait for their ends. The
/// work (files, spans) is done by a thread of its own, in the order it
/// was asked for: a sandbox's actor only hands it over.
pub struct OpTraces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    jobs: Mutex<Option<std::sync::mpsc::SyncSender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Traced operations not ended yet, by sandbox (those the journal had
    /// pending at start too): an actor made for a sandbox (at a start, a
    /// resume) knows which of its operations' ends to report.
    open: Mutex<HashMap<SandboxId, HashSet<OperationId>>>,
}

/// What the tracing thread is asked to do (each with when it happened).
enum Job {
    Submitted {
        sandbox: SandboxId,
        op: OperationId,
        kind: &'static str,
        traceparent: String,
        at: SystemTime,
    },
    Output {
        op: OperationId,
        at: SystemTime,
    },
    Finished {
        sandbox: SandboxId,
        op: OperationId,
        outcome: Outcome,
        duration_ms: u64,
        at: SystemTime,
    },
    Forget(SandboxId),
}

/// Jobs waiting at most; past it, the asker waits its turn.
const JOBS: usize = 4096;

/// How long the tracing thread lets jobs gather once one has come: one
/// wake-up (and one journal write) for the jobs of many operations. With a
/// wake-up for each, a traced operation cost the worker 54 microseconds of
/// CPU more than an untraced one in the tracing bench (15-44 since; see
/// docs/performance.md). A traced operation's parent is in the journal at
/// most this much later; spans wait for their batch (a second) anyway.
const GATHER: std::time::Duration = std::time::Duration::from_millis(10);

/// The tracing thread's own state.
struct Writer {
    tracer: SdkTracer,
    /// The traced operations that have not ended, by id.
    pending: HashMap<(SandboxId, OperationId), Pending>,
    /// Where they are journaled.
    journal: Journal,
    /// When each traced operation running now first printed.
    first_output: HashMap<OperationId, SystemTime>,
}

/// What is kept of a traced operation until it ends.
#[derive(Clone, Serialize, Deserialize)]
struct Pending {
    sandbox: SandboxId,
    traceparent: String,
    submitted_unix_ms: i64,
    kind: String,
}

/// A line of the journal.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Line {
    Submitted { op: OperationId, pending: Pending },
    Ended { sandbox: SandboxId, op: OperationId },
    Forgot { sandbox: SandboxId },
}

/// The journal of pending parents: appended to (no sync: it must outlive
/// the worker's process, not the host), rewritten with what is pending
/// when it has grown well past that.
struct Journal {
    path: PathBuf,
    file: Option<std::fs::File>,
    /// Lines in the file, and in `buf`.
    lines: usize,
    /// Lines appended since the last [`Journal::flush`]: the tracing
    /// thread writes once for all the jobs it found waiting.
    buf: Vec<u8>,
}

/// Lines past which the journal is rewritten (if it is mostly ended
/// operations).
const JOURNAL_LINES: usize = 4096;

impl Journal {
    /// Opens `dir/pending.jsonl` and reads what is pending in it (a torn
    /// last line, or one that is not understood, is passed over), then
    /// rewrites it with that alone.
    fn open(dir: &Path) -> (Self, HashMap<(SandboxId, OperationId), Pending>) {
        let path = dir.join("pending.jsonl");
        let mut pending = HashMap::new();
        if let Ok(text) = std::fs::read_to_string(&path) {
            for line in text.lines() {
                match serde_json::from_str::<Line>(line) {
                    Ok(Line::Submitted { op, pending: p }) => {
                        pending.insert((p.sandbox.clone(), op), p);
                    }
                    Ok(Line::Ended { sandbox, op }) => {
                        pending.remove(&(sandbox, op));
                    }
                    Ok(Line::Forgot { sandbox }) => pending.retain(|_, p| p.sandbox != sandbox),
                    Err(_) => {}
                }
            }
        }
        let mut journal = Self {
            path,
            file: None,
            lines: 0,
            buf: Vec::new(),
        };
        journal.rewrite(&pending);
        (journal, pending)
    }

    /// Adds `line`, written at the next [`Journal::flush`].
    fn append(&mut self, line: &Line) {
        if self.file.is_none() {
            return;
        }
        if serde_json::to_writer(&mut self.buf, line).is_ok() {
            self.buf.push(b'\n');
            self.lines += 1;
        }
    }

    /// Writes what was appended since the last flush.
    fn flush(&mut self) {
        use std::io::Write;
        if self.buf.is_empty() {
            return;
        }
        if let Some(file) = self.file.as_mut()
            && let Err(e) = file.write_all(&self.buf)
        {
            tracing::warn!(error = %e, "the trace journal was not written");
        }
        self.buf.clear();
    }

    /// Makes the file hold `pending` alone (a new file, renamed over the
    /// old one).
    fn rewrite(&mut self, pending: &HashMap<(SandboxId, OperationId), Pending>) {
        use std::io::Write;
        // What is buffered is in `pending` already.
        self.buf.clear();
        let tmp = self.path.with_extension("jsonl.tmp");
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            let mut bytes = Vec::new();
            for ((_, op), p) in pending {
                serde_json::to_writer(
                    &mut bytes,
                    &Line::Submitted {
                        op: op.clone(),
                        pending: p.clone(),
                    },
                )
                .map_err(std::io::Error::other)?;
                bytes.push(b'\n');
            }
            f.write_all(&bytes)?;
            std::fs::rename(&tmp, &self.path)?;
            std::fs::OpenOptions::new().append(true).open(&self.path)
        })();
        match written {
            Ok(f) => {
                self.file = Some(f);
                self.lines = pending.len();
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "the trace journal cannot be written; parents are kept in memory only");
                self.file = None;
            }
        }
    }
}

impl OpTraces {
    /// Exports to the OTLP/gRPC collector at `endpoint`; keeps pending
    /// parents under `state_dir/traces`. Inside a Tokio runtime.
    pub fn otlp(endpoint: &str, state_dir: &Path) -> Result<Self, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("the OTLP exporter for {endpoint}: {e}"))?;
        // Batches go out every second (and at shutdown).
        let batches = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter)
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
                    .with_service_name("corral-worker")
                    .build(),
            )
            .build();
        let tracer = provider.tracer("corral-worker");
        let dir = state_dir.join("traces");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (journal, pending) = Journal::open(&dir);
        let mut open: HashMap<SandboxId, HashSet<OperationId>> = HashMap::new();
        for (sandbox, op) in pending.keys() {
            open.entry(sandbox.clone()).or_default().insert(op.clone());
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(JOBS);
        let mut writer = Writer {
            tracer: tracer.clone(),
            pending,
            journal,
            first_output: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("corral-traces".into())
            .spawn(move || {
                // Until every sender is gone (see `shutdown`). After the
                // first job of a batch the thread lets the next gather for
                // `GATHER` (a sender wakes a thread only when it waits on
                // the channel, so jobs sent meanwhile cost their senders no
                // wake-up, and this thread one for them all), then takes
                // them and writes the journal once.
                while let Ok(job) = rx.recv() {
                    writer.run(job);
                    std::thread::sleep(GATHER);
                    while let Ok(job) = rx.try_recv() {
                        writer.run(job);
                    }
                    writer.journal.flush();
                }
            })
            .map_err(|e| format!("the tracing thread: {e}"))?;
        Ok(Self {
            provider,
            tracer,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            open: Mutex::new(open),
        })
    }

    fn send(&self, job: Job) {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.as_ref().map(|tx| tx.try_send(job)) {
            Some(Ok(())) | None => {}
            Some(Err(std::sync::mpsc::TrySendError::Full(job))) => {
                // Far behind: the asker waits its turn (order is kept).
                if let Some(tx) = jobs.as_ref() {
                    let _ = tx.send(job);
                }
            }
            Some(Err(std::sync::mpsc::TrySendError::Disconnected(_))) => {}
        }
    }

    /// Operation `op` of `sandbox` was submitted under `traceparent`:
    /// kept, and true, when it names a valid parent.
    pub fn submitted(
        &self,
        sandbox: &SandboxId,
        op: &OperationId,
        kind: &'static str,
        traceparent: &str,
    ) -> bool {
        if parse_traceparent(traceparent).is_none() {
            tracing::debug!(operation = %op, "an invalid traceparent, ignored");
            return false;
        }
        self.open_ops()
            .entry(sandbox.clone())
            .or_default()
            .insert(op.clone());
        self.send(Job::Submitted {
            sandbox: sandbox.clone(),
            op: op.clone(),
            kind,
            traceparent: traceparent.to_string(),
            at: SystemTime::now(),
        });
        true
    }

    fn open_ops(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, HashSet<OperationId>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The traced operations of `sandbox` not ended yet (some submitted
    /// before a restart): an actor made for it reports their ends.
    pub fn open_of(&self, sandbox: &SandboxId) -> HashSet<OperationId> {
        self.open_ops().get(sandbox).cloned().unwrap_or_default()
    }

    /// Operation `op` printed (its first output is what counts).
    pub fn output(&self, op: &OperationId) {
        self.send(Job::Output {
            op: op.clone(),
            at: SystemTime::now(),
        });
    }

    /// Traced operation `op` of `sandbox` ended with `result`: its span
    /// (how it ended and how long it ran; its output stays out).
    pub fn finished(&self, sandbox: &SandboxId, op: &OperationId, result: &OperationResult) {
        {
            let mut open = self.open_ops();
            if let Some(ops) = open.get_mut(sandbox) {
                ops.remove(op);
                if ops.is_empty() {
                    open.remove(sandbox);
                }
            }
        }
        self.send(Job::Finished {
            sandbox: sandbox.clone(),
            op: op.clone(),
            outcome: result.outcome.clone(),
            duration_ms: result.duration_ms,
            at: SystemTime::now(),
        });
    }

    /// A span of a sandbox's `what` (create...) from `began` to now, under
    /// `traceparent`: `how` it went (created, claimed from a warm pool,
    /// existing, failed).
    pub fn sandbox_span(
        &self,
        traceparent: &str,
        what: &'static str,
        began: SystemTime,
        how: &'static str,
        sandbox: Option<&str>,
    ) {
        let Some(parent) = parse_traceparent(traceparent) else {
            return;
        };
        let mut attrs = vec![KeyValue::new("corral.sandbox.outcome", how)];
        if let Some(s) = sandbox {
            attrs.push(KeyValue::new("corral.sandbox.id", s.to_string()));
        }
        let mut span = self
            .tracer
            .span_builder(format!("sandbox {what}"))
            .with_kind(SpanKind::Server)
            .with_start_time(began)
            .with_attributes(attrs)
            .start_with_context(
                &self.tracer,
                &Context::new().with_remote_span_context(parent),
            );
        if how == "failed" {
            span.set_status(Status::error("the sandbox could not be made"));
        }
        span.end_with_timestamp(SystemTime::now());
    }

    /// Sandbox `id` is gone: what waited for its operations goes too.
    pub fn forget_sandbox(&self, id: &SandboxId) {
        self.open_ops().remove(id);
        self.send(Job::Forget(id.clone()));
    }

    /// Does what is asked so far, then sends what is buffered (blocking).
    pub fn shutdown(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces not all exported");
        }
    }
}

impl Writer {
    /// Rewrites the journal once it is mostly ended operations.
    fn compact(&mut self) {
        if self.journal.lines > JOURNAL_LINES && self.journal.lines > 4 * self.pending.len() {
            self.journal.rewrite(&self.pending);
        }
    }

    fn run(&mut self, job: Job) {
        match job {
            Job::Submitted {
                sandbox,
                op,
                kind,
                traceparent,
                at,
            } => self.submitted(&sandbox, &op, kind, traceparent, at),
            Job::Output { op, at } => {
                self.first_output.entry(op).or_insert(at);
            }
            Job::Finished {
                sandbox,
                op,
                outcome,
                duration_ms,
                at,
            } => self.finished(&sandbox, &op, &outcome, duration_ms, at),
            Job::Forget(id) => {
                let before = self.pending.len();
                self.pending.retain(|_, p| p.sandbox != id);
                if self.pending.len() != before {
                    self.journal.append(&Line::Forgot { sandbox: id });
                    self.compact();
                }
            }
        }
    }

    fn submitted(
        &mut self,
        sandbox: &SandboxId,
        op: &OperationId,
        kind: &str,
        traceparent: String,
        at: SystemTime,
    ) {
        let pending = Pending {
            sandbox: sandbox.clone(),
            traceparent,
            submitted_unix_ms: unix_ms(at),
            kind: kind.to_string(),
        };
        self.journal.append(&Line::Submitted {
            op: op.clone(),
            pending: pending.clone(),
        });
        self.pending.insert((sandbox.clone(), op.clone()), pending);
    }

    fn finished(
        &mut self,
        sandbox: &SandboxId,
        op: &OperationId,
        outcome: &Outcome,
        duration_ms: u64,
        now: SystemTime,
    ) {
        let first_output = self.first_output.remove(op);
        let Some(pending) = self.pending.remove(&(sandbox.clone(), op.clone())) else {
            return;
        };
        self.journal.append(&Line::Ended {
            sandbox: sandbox.clone(),
            op: op.clone(),
        });
        self.compact();
        let Some(parent) = parse_traceparent(&pending.traceparent) else {
            return;
        };
        let submitted = UNIX_EPOCH + Duration::from_millis(pending.submitted_unix_ms.max(0) as u64);
        let started = now
            .checked_sub(Duration::from_millis(duration_ms))
            .unwrap_or(submitted)
            .max(submitted);
        let (cause, error) = end_cause(outcome);
        let mut span = self
            .tracer
            .span_builder(format!("operation {}", pending.kind))
            .with_kind(SpanKind::Internal)
            .with_start_time(submitted)
            .with_attributes(vec![
                KeyValue::new("corral.sandbox.id", sandbox.to_string()),
                KeyValue::new("corral.operation.id", op.to_string()),
                KeyValue::new("corral.operation.kind", pending.kind),
                KeyValue::new("corral.operation.end_cause", cause),
                KeyValue::new("process.exit.code", i64::from(outcome.exit_status())),
                KeyValue::new("corral.operation.duration_ms", duration_ms as i64),
            ])
            .start_with_context(
                &self.tracer,
                &Context::new().with_remote_span_context(parent),
            );
        span.add_event_with_timestamp("queued", submitted, vec![]);
        span.add_event_with_timestamp("started", started, vec![]);
        if let Some(t) = first_output {
            span.add_event_with_timestamp("first_output", t, vec![]);
        }
        if error {
            span.set_status(Status::error(outcome.to_string()));
        }
        span.end_with_timestamp(now);
    }
}

/// How an operation ended, as a word, and whether that is an error.
fn end_cause(o: &Outcome) -> (&'static str, bool) {
    match o {
        Outcome::Exited { code } => ("exited", *code != 0),
        Outcome::Signaled { .. } => ("signaled", true),
        Outcome::TimedOut => ("timed_out", true),
        Outcome::OutOfMemory => ("out_of_memory", true),
        Outcome::Canceled => ("canceled", false),
        Outcome::SandboxLost { .. } => ("sandbox_lost", true),
        Outcome::SpawnFailed { .. } => ("spawn_failed", true),
        Outcome::FileError { .. } => ("file_error", true),
    }
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// The span context a W3C `traceparent` names (version 00; anything else
/// is none).
pub fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let mut parts = s.trim().split('-');
    let (v, t, p, f) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if v != "00" || parts.next().is_some() || t.len() != 32 || p.len() != 16 || f.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(t).ok()?;
    let span = SpanId::from_hex(p).ok()?;
    let flags = u8::from_str_radix(f, 16).ok()?;
    if trace == TraceId::INVALID || span == SpanId::INVALID {
        return None;
    }
    Some(SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parent(sandbox: &str) -> Pending {
        Pending {
            sandbox: SandboxId::new(sandbox).unwrap(),
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            submitted_unix_ms: 1,
            kind: "shell".into(),
        }
    }

    #[test]
    fn the_journal_keeps_what_has_not_ended_across_a_restart_and_shrinks_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, none) = Journal::open(dir.path());
        assert!(none.is_empty());
        let op = |n: u32| OperationId::new(format!("op-{n}")).unwrap();
        for (n, sb) in [(1, "a"), (2, "a"), (3, "b"), (4, "c")] {
            j.append(&Line::Submitted {
                op: op(n),
                pending: parent(sb),
            });
        }
        j.append(&Line::Ended {
            sandbox: SandboxId::new("a").unwrap(),
            op: op(1),
        });
        j.append(&Line::Forgot {
            sandbox: SandboxId::new("b").unwrap(),
        });
        // Written only when flushed (once for the jobs found waiting).
        let path = dir.path().join("pending.jsonl");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        j.flush();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 6);
        // The process dies in the middle of a line.
        {
            use std::io::Write;
            j.file
                .as_mut()
                .unwrap()
                .write_all(br#"{"ended":{"sa"#)
                .unwrap();
        }
        drop(j);
        let (j, kept) = Journal::open(dir.path());
        let mut ids: Vec<String> = kept.keys().map(|(_, o)| o.to_string()).collect();
        ids.sort();
        assert_eq!(ids, ["op-2", "op-4"]);
        // Rewritten with those alone.
        assert_eq!(j.lines, 2);
        let text = std::fs::read_to_string(dir.path().join("pending.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 2);
    }

    #[test]
    fn only_well_formed_parents_are_taken() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parse_traceparent(good).unwrap();
        assert_eq!(
            format!("{:032x}", cx.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }
}
