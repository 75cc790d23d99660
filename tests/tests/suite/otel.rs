//! Traces: `corral run` and a worker both export to a real OTLP/gRPC
//! receiver of the test's own (the collector's trace service, served by
//! tonic on loopback). One session with a tool call whose worker is
//! SIGKILLed and started again while the call runs: the run's
//! `invoke_agent` span, its `chat` spans with token counts, the call's
//! `execute_tool` span and, under it, the worker's span of the operation
//! (made by the worker that saw it end) all arrive in one trace.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::model::{ModelServer, Received, Reply, responses};
use corral_e2e::otlp::{Got, Receiver};
use corral_e2e::{WorkerProcess, free_port, unique_id};
use serde_json::json;

/// One slow call, then the answer.
fn respond(req: &Received) -> Reply {
    if req.text().contains("function_call_output") {
        return responses::text("Done.");
    }
    responses::calls(&[(
        "c1",
        "Bash",
        &json!({"command": "sleep 8; echo traced"}).to_string(),
    )])
}

/// Waits for `worker`'s pool to hold a ready member.
async fn pool_ready(worker: &WorkerProcess) -> Result<()> {
    let client = worker.client().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !client
        .worker_info()
        .await?
        .pools
        .iter()
        .any(|p| p.ready >= 1)
    {
        if tokio::time::Instant::now() > deadline {
            bail!("the pool never filled");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The trace parents the worker's journal in its state directory keeps:
/// traced operations submitted that have not ended (sandbox, operation).
fn kept(state: &std::path::Path) -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(state.join("traces").join("pending.jsonl")).unwrap_or_default();
    let mut kept: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        if let Some(x) = v.get("submitted") {
            kept.push((s(&x["pending"]["sandbox"]), s(&x["op"])));
        } else if let Some(x) = v.get("ended") {
            kept.retain(|k| *k != (s(&x["sandbox"]), s(&x["op"])));
        } else if let Some(x) = v.get("forgot") {
            kept.retain(|k| k.0 != s(&x["sandbox"]));
        }
    }
    kept
}

/// Whether the worker keeps a trace parent: a traced operation was
/// submitted and has not ended.
fn pending(state: &std::path::Path) -> bool {
    !kept(state).is_empty()
}

/// Waits until [`pending`].
async fn pending_parent(state: &std::path::Path) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if pending(state) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no traced operation was submitted");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_run_and_its_workers_operation_make_one_trace_across_a_worker_restart() -> Result<()> {
    let receiver = Receiver::default();
    let endpoint = receiver.serve().await?;
    let state = tempfile::tempdir()?;
    let worker_id = unique_id("otel");
    let port = free_port()?;
    // A warm pool: the session's sandbox is claimed from it.
    let worker_args = [
        "--otlp-endpoint",
        endpoint.as_str(),
        "--pool",
        "corral-sandbox:latest=1",
    ];
    let mut worker = WorkerProcess::spawn(state.path(), &worker_id, port, &[], &worker_args)?;
    pool_ready(&worker).await?;
    let model = ModelServer::responding(respond).await;
    let sessions = tempfile::tempdir()?;
    let token = worker.token_file();
    let id = unique_id("otel-");
    let mut cmd = corral_e2e::run::command(
        &model,
        &worker.url,
        sessions.path(),
        &["--session", &id, "--otlp-endpoint", &endpoint, "Run it."],
    );
    // The sandbox is suspended at the run's end, and resumed by the next.
    cmd.env("CORRAL_TOKEN_FILE", &token)
        .env("CORRAL_KEEP_SANDBOX", "false");
    let run = tokio::spawn(corral_e2e::run::finish(cmd));
    // The call runs (8 s, time enough under load): the worker goes, without
    // warning, and comes back, once its span of the sandbox's create has
    // left (spans in a batch not yet sent die with a killed process, unlike
    // operations', which are made from what the worker keeps).
    pending_parent(state.path()).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !receiver.spans().iter().any(|s| s.name == "sandbox create") {
        if tokio::time::Instant::now() > deadline {
            bail!("no span of the sandbox's create: {:#?}", receiver.spans());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        pending(state.path()),
        "the call ended before the worker could be killed under it"
    );
    worker.kill9();
    let worker = WorkerProcess::spawn(state.path(), &worker_id, port, &[], &worker_args)?;
    let run = run.await??;
    ensure!(run.result()["status"] == "done", "{}", run.stderr);

    // Everything arrives within a few batches.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = receiver.spans();
        let op = spans.iter().any(|s| s.name.starts_with("operation "));
        let run_span = spans.iter().any(|s| s.name == "invoke_agent corral");
        if op && run_span {
            break spans;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("spans missing: {spans:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let one = |name: &str| -> Result<&Got> {
        let all: Vec<&Got> = spans.iter().filter(|s| s.name == name).collect();
        ensure!(
            all.len() == 1,
            "{} spans named {name}: {spans:#?}",
            all.len()
        );
        Ok(all[0])
    };
    let root = one("invoke_agent corral")?;
    ensure!(
        root.service == "corral" && root.parent.is_empty(),
        "{root:?}"
    );
    ensure!(root.attrs["gen_ai.operation.name"] == "invoke_agent");
    ensure!(root.attrs["gen_ai.conversation.id"] == id, "{root:?}");
    ensure!(root.attrs["corral.ending"] == "done", "{root:?}");
    for e in ["sandbox_created", "input", "finished", "sandbox_suspended"] {
        ensure!(root.events.iter().any(|x| x == e), "no {e}: {root:?}");
    }
    let chats: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name.starts_with("chat "))
        .collect();
    ensure!(chats.len() == 2, "{chats:#?}");
    for c in &chats {
        ensure!(
            c.parent == root.span_id && c.trace_id == root.trace_id,
            "{c:?}"
        );
        ensure!(c.attrs["gen_ai.operation.name"] == "chat");
        ensure!(c.attrs.contains_key("gen_ai.request.model"), "{c:?}");
        ensure!(
            c.attrs["gen_ai.usage.input_tokens"].parse::<u64>()? > 0,
            "{c:?}"
        );
        ensure!(c.attrs.contains_key("gen_ai.usage.output_tokens"), "{c:?}");
    }
    // The worker's span of the sandbox's making: claimed from its pool.
    let created = spans
        .iter()
        .find(|s| s.name == "sandbox create" && s.trace_id == root.trace_id)
        .context("no span of the sandbox's create")?;
    ensure!(
        created.service == "corral-worker" && created.parent == root.span_id,
        "{created:?}"
    );
    ensure!(
        created.attrs["corral.sandbox.outcome"] == "claimed",
        "{created:?}"
    );
    let tool = one("execute_tool Bash")?;
    ensure!(
        tool.parent == root.span_id && tool.trace_id == root.trace_id,
        "{tool:?}"
    );
    ensure!(tool.attrs["gen_ai.tool.name"] == "Bash" && tool.attrs["gen_ai.tool.call.id"] == "c1");
    ensure!(
        tool.events.iter().any(|e| e == "operation_ended"),
        "{tool:?}"
    );
    // The worker's span of the operation, under the call's, in the same
    // trace: made by the second worker process, from what the first kept.
    let op = one("operation shell")?;
    ensure!(op.service == "corral-worker", "{op:?}");
    ensure!(
        op.trace_id == root.trace_id && op.parent == tool.span_id,
        "not under the call: {op:?} / {tool:?}"
    );
    ensure!(op.attrs["process.exit.code"] == "0", "{op:?}");
    ensure!(op.attrs["corral.operation.end_cause"] == "exited", "{op:?}");
    for e in ["queued", "started"] {
        ensure!(op.events.iter().any(|x| x == e), "no {e}: {op:?}");
    }
    // Nothing waits in the state directory any more.
    let left = kept(state.path());
    ensure!(left.is_empty(), "{left:?}");

    // The next run of the session resumes its suspended sandbox: a trace of
    // its own, which says so.
    let mut cmd = corral_e2e::run::command(
        &model,
        &worker.url,
        sessions.path(),
        &["--session", &id, "--otlp-endpoint", &endpoint, "Again."],
    );
    cmd.env("CORRAL_TOKEN_FILE", &token)
        .env("CORRAL_KEEP_SANDBOX", "false");
    let again = corral_e2e::run::finish(cmd).await?;
    ensure!(again.result()["status"] == "done", "{}", again.stderr);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let second = loop {
        let spans = receiver.spans();
        if let Some(s) = spans
            .iter()
            .find(|s| s.name == "invoke_agent corral" && s.trace_id != root.trace_id)
        {
            break s.clone();
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no span of the second run: {spans:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(second.attrs["gen_ai.conversation.id"] == id, "{second:?}");
    for e in ["sandbox_resumed", "sandbox_suspended"] {
        ensure!(second.events.iter().any(|x| x == e), "no {e}: {second:?}");
    }

    // A fork is a trace of its own: the suspended parent's saved files go
    // into the child's new sandbox.
    let child = unique_id("otel-child-");
    let fork = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(&token)
        .args(["session", "fork", "--sessions-dir"])
        .arg(sessions.path())
        .args([&id, &child, "--otlp-endpoint", &endpoint])
        .output()
        .await?;
    ensure!(
        fork.status.success(),
        "{}",
        String::from_utf8_lossy(&fork.stderr)
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let forked = loop {
        if let Some(s) = receiver
            .spans()
            .into_iter()
            .find(|s| s.name == "fork_session corral")
        {
            break s;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no span of the fork");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        forked.attrs["corral.forked_from"] == id && forked.attrs["gen_ai.conversation.id"] == child,
        "{forked:?}"
    );
    for e in ["log_forked", "workspace_restored"] {
        ensure!(forked.events.iter().any(|x| x == e), "no {e}: {forked:?}");
    }

    // An operation submitted (by any client) under a trace context gets
    // its span there, with when it first printed.
    let client = worker.client().await?;
    let sandbox = corral_proto::SandboxId::random();
    let spec = corral_proto::SandboxSpec {
        image: Some("corral-sandbox:latest".into()),
        ..corral_proto::SandboxSpec::default()
    };
    client.create_sandbox(Some(&sandbox), spec).await?;
    let op = corral_proto::OperationId::random();
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    client
        .submit_traced(
            &sandbox,
            &op,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new(
                "echo first; sleep 1; exit 3",
            )),
            Some(parent),
        )
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let span = loop {
        if let Some(s) = receiver
            .spans()
            .into_iter()
            .find(|s| s.attrs.get("corral.operation.id") == Some(&op.to_string()))
        {
            break s;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no span of the directly submitted operation");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        span.parent == [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
            && span.trace_id.first() == Some(&0x4b),
        "{span:?}"
    );
    ensure!(span.attrs["process.exit.code"] == "3", "{span:?}");
    for e in ["queued", "started", "first_output"] {
        ensure!(span.events.iter().any(|x| x == e), "no {e}: {span:?}");
    }
    client.destroy_sandbox(&sandbox).await?;
    drop(worker);
    Ok(())
}

/// Without an endpoint nothing is exported and nothing is kept: the
/// default.
#[tokio::test]
async fn a_worker_without_an_endpoint_keeps_no_trace_parents() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("notr"), free_port()?, &[], &[])?;
    let client = worker.client().await?;
    let sandbox = corral_proto::SandboxId::random();
    let spec = corral_proto::SandboxSpec {
        image: Some("corral-sandbox:latest".into()),
        ..corral_proto::SandboxSpec::default()
    };
    client.create_sandbox(Some(&sandbox), spec).await?;
    let op = corral_proto::OperationId::random();
    client
        .submit_traced(
            &sandbox,
            &op,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true")),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        )
        .await
        .context("a traced submit to a worker that does not trace")?;
    ensure!(!state.path().join("traces").exists());
    client.destroy_sandbox(&sandbox).await?;
    Ok(())
}

/// A collector that refuses a request over its bound (one span here; 4 MiB
/// by default) loses only the span over it, never the trace: a refused
/// batch goes again a span at a time.
#[tokio::test]
async fn a_batch_the_collector_refuses_goes_again_a_span_at_a_time() -> Result<()> {
    let receiver = Receiver::refusing_more_than(1);
    let endpoint = receiver.serve().await?;
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("otel1"), free_port()?, &[], &[])?;
    let model = ModelServer::responding(|req: &Received| {
        if req.text().contains("function_call_output") {
            return responses::text("Done.");
        }
        responses::calls(&[("c1", "Bash", &json!({"command": "echo traced"}).to_string())])
    })
    .await;
    let sessions = tempfile::tempdir()?;
    let mut cmd = corral_e2e::run::command(
        &model,
        &worker.url,
        sessions.path(),
        &["--otlp-endpoint", &endpoint, "Run it."],
    );
    cmd.env("CORRAL_TOKEN_FILE", worker.token_file());
    let run = corral_e2e::run::finish(cmd).await?;
    ensure!(run.code == 0, "{}", run.stderr);
    let spans = receiver.spans();
    ensure!(receiver.refused() > 0, "no batch was refused: {spans:#?}");
    for name in ["invoke_agent corral", "execute_tool Bash"] {
        ensure!(
            spans.iter().any(|s| s.name == name),
            "no {name} span: {:#?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
    }
    ensure!(
        spans.iter().filter(|s| s.name.starts_with("chat ")).count() >= 2,
        "{:#?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    Ok(())
}
