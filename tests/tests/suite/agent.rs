//! The agent end to end: the `corral run` binary (or the harness's front
//! door in process) against a real worker with real Docker sandboxes, and a
//! scripted model endpoint on loopback speaking the Responses API or Chat
//! Completions over SSE.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use corral_e2e::model::{ModelServer, chat, responses, status};
use corral_e2e::run::{command, corral_run, corral_run_env};
use corral_e2e::{Harness, binary, run_shell};
use corral_harness::agent::{Ending, Inbox, Record, StopMode, replay};
use corral_harness::llm::Api;
use corral_harness::llm::conform::CallIds;
use corral_harness::session::SessionLog;
use corral_harness::sessions::{RunOptions, SessionHandle, Sessions};
use corral_proto::Outcome;
use serde_json::{Value, json};

/// Starts `corral run --session ID PROMPT`, waits until it has recorded a
/// tool call and `after` more (so that the command runs), then sends it
/// `signal`; returns how it ended.
async fn signal_once_the_call_runs(
    model: &ModelServer,
    worker: &str,
    sessions: &Path,
    id: &str,
    prompt: &str,
    after: Duration,
    signal: nix::sys::signal::Signal,
) -> Result<std::process::Output> {
    let child = command(model, worker, sessions, &["--session", id, prompt]).spawn()?;
    call_recorded(sessions, id).await;
    tokio::time::sleep(after).await;
    let pid = nix::unistd::Pid::from_raw(child.id().context("no pid")? as i32);
    nix::sys::signal::kill(pid, signal)?;
    Ok(tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??)
}

/// Every record of session `id`.
fn all_records(sessions: &Path, id: &str) -> anyhow::Result<Vec<(u64, Record)>> {
    Ok(SessionLog::<Record>::records(sessions, id)?.collect::<Result<_, _>>()?)
}

/// Waits until session `id` has recorded a tool call.
async fn call_recorded(sessions: &Path, id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let recorded = SessionLog::<Record>::records(sessions, id)
            .map(|mut records| {
                records.any(|r| r.is_ok_and(|(_, r)| matches!(r, Record::Call { .. })))
            })
            .unwrap_or(false);
        if recorded {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `corral ARGS [PATH]` against `worker` with sessions in `sessions`,
/// awaited: the test's worker serves from the test's own runtime.
async fn session_cmd(
    worker: &str,
    sessions: &Path,
    args: &[&str],
    path: Option<&Path>,
) -> Result<std::process::Output> {
    let mut cmd = tokio::process::Command::new(binary("corral")?);
    cmd.env("CORRAL_WORKER", worker)
        .env("CORRAL_SESSIONS_DIR", sessions)
        .args(args);
    if let Some(p) = path {
        cmd.arg(p);
    }
    Ok(cmd.output().await?)
}

fn bash(cmd: &str) -> String {
    json!({ "command": cmd }).to_string()
}

#[tokio::test]
async fn run_drives_a_bash_call_to_completion_and_a_torn_log_resumes() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[("call_1", "Bash", &bash("echo hello-$((6*7))"))]),
        responses::text("The answer is 42."),
        responses::text("Still 42."),
    ])
    .await;
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "one", "What is 6*7?"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let r = run.result();
    assert_eq!(r["status"], "done");
    assert_eq!(r["final_text"], "The answer is 42.");
    assert_eq!(
        (r["turns"].as_u64(), r["tool_calls"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(r["usage"]["input_tokens"], 200);
    assert_eq!(run.of_type("session_started")[0]["resumed"], false);
    assert_eq!(run.of_type("tool_result")[0]["text"], "hello-42");
    let got = model.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].path, "/v1/responses");
    assert_eq!(got[0].authorization.as_deref(), Some("Bearer sk-test"));
    let tools: Vec<&str> = got[0].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        tools.contains(&"Bash") && tools.contains(&"ReadFile"),
        "{tools:?}"
    );
    let output = got[1].body["input"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call_output")
        .cloned()
        .unwrap();
    assert_eq!(output["call_id"], "call_1");
    assert!(output.to_string().contains("hello-42"), "{output}");

    // A crash mid-write leaves a torn last line: the next run cuts it off
    // and goes on.
    let log = sessions.path().join("one.jsonl");
    let mut bytes = std::fs::read(&log)?;
    bytes.extend_from_slice(b"{\"seq\": 99, \"record\": {\"type\": \"inp");
    std::fs::write(&log, bytes)?;
    let again = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "one", "And again?"],
    )
    .await?;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.of_type("session_started")[0]["resumed"], true);
    assert_eq!(again.result()["final_text"], "Still 42.");
    assert!(model.received()[2].text().contains("And again?"));

    // `corral session` reads what was recorded.
    let out = tokio::process::Command::new(binary("corral")?)
        .args(["session", "show", "one", "--json", "--sessions-dir"])
        .arg(sessions.path())
        .output()
        .await?;
    assert!(out.status.success());
    let kinds: Vec<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["record"]["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        &kinds[..8],
        [
            "start",
            "stop",
            "input",
            "turn",
            "response",
            "call",
            "operation",
            "result"
        ]
    );
    let out = tokio::process::Command::new(binary("corral")?)
        .args(["session", "ls", "--sessions-dir"])
        .arg(sessions.path())
        .output()
        .await?;
    assert!(String::from_utf8(out.stdout)?.contains("one"));

    // `corral session rm`: the sandbox goes from its worker, then the log.
    let sandbox = replay(sessions.path(), "one")?.config.unwrap().sandbox_id;
    assert!(h.client.get_sandbox(&sandbox).await.is_ok());
    let rm = || {
        tokio::process::Command::new(binary("corral").unwrap())
            .env("CORRAL_WORKER", &h.url)
            .args(["session", "rm", "one", "--sessions-dir"])
            .arg(sessions.path())
            .output()
    };
    let out = rm().await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(h.client.get_sandbox(&sandbox).await.is_err());
    assert!(!sessions.path().join("one.jsonl").exists());
    assert_eq!(rm().await?.status.code(), Some(2), "no such session");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn three_parallel_calls_batch_the_fast_ones_and_the_slow_one_shows_a_placeholder()
-> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        chat::calls(&[
            ("a", "Bash", &bash("echo fast-A")),
            ("b", "Bash", &bash("echo fast-B")),
            ("slow", "Bash", &bash("sleep 5; echo slow-S")),
        ]),
        chat::text("A and B are in; waiting for the slow one."),
        chat::text("All three done."),
    ])
    .await;
    let run = corral_run_env(
        &model,
        &h.url,
        sessions.path(),
        &["--api", "chat", "run three"],
        &[("CORRAL_GRACE", "2s")],
    )
    .await?;
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    let got = model.received();
    assert_eq!(
        got.len(),
        3,
        "one turn for both fast results, one for the slow"
    );
    assert_eq!(got[0].path, "/v1/chat/completions");
    // Ids go out as nine letters and digits (see llm::conform).
    let wire = |id: &str| CallIds::default().of(&id.into());
    let tool_messages = |i: usize| -> Vec<(String, String)> {
        got[i].body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| {
                (
                    m["tool_call_id"].as_str().unwrap().to_string(),
                    m["content"].to_string(),
                )
            })
            .collect()
    };
    let second = tool_messages(1);
    assert_eq!(second.len(), 3, "{second:?}");
    // Results come in the order they finished; the placeholder last.
    let of = |id: &str| {
        second
            .iter()
            .find(|(c, _)| c == id)
            .map(|(_, t)| t.as_str())
    };
    assert!(of(&wire("a")).unwrap().contains("fast-A"), "{second:?}");
    assert!(of(&wire("b")).unwrap().contains("fast-B"), "{second:?}");
    assert_eq!(second[2].0, wire("slow"));
    assert!(second[2].1.contains("still running"), "{second:?}");
    let third = tool_messages(2);
    assert_eq!(
        third.len(),
        3,
        "one tool message per call, also for a late result"
    );
    let late = got[2].body["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(late["role"], "user");
    assert!(
        late["content"].as_str().unwrap().contains("slow-S"),
        "{late}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_heartbeat_shows_the_model_the_output_so_far() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[("c", "Bash", &bash("echo tick-1; sleep 4.5; echo tock"))]),
        responses::text("Still running; I will wait."),
        responses::text("Finished."),
    ])
    .await;
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--heartbeat", "3s", "wait for it"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let got = model.received();
    assert_eq!(got.len(), 3);
    let beat = got[1].text();
    assert!(beat.contains("[heartbeat]"), "{beat}");
    assert!(beat.contains("tick-1"), "the output so far: {beat}");
    assert!(got[2].text().contains("tock"));
    assert_eq!(run.of_type("heartbeat").len(), 1);
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn malformed_tool_arguments_go_back_to_the_model_and_the_run_goes_on() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[
            ("bad", "Bash", "{\"command\": "),
            ("gone", "Teleport", "{}"),
        ]),
        responses::text("Sorry about that."),
    ])
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["try"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let second = model.received()[1].text();
    assert!(second.contains("not valid JSON"), "{second}");
    assert!(second.contains("not available"), "{second}");
    assert_eq!(
        run.of_type("tool_call")
            .iter()
            .filter(|e| !e["error"].is_null())
            .count(),
        2
    );
    h.stop().await;
    Ok(())
}

/// Each `tool_result` says how its call ended: status, exit code and the
/// time its command ran, for a success, a failure and a refusal alike.
#[tokio::test]
async fn tool_results_carry_how_each_call_ended() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    // The commands in one turn, the refusal in the next.
    let script = || {
        vec![
            responses::calls(&[
                ("ok", "Bash", &bash("echo fine")),
                ("bad", "Bash", &bash("sleep 0.2; echo broken >&2; exit 3")),
            ]),
            responses::calls(&[("refused", "Bash", "{\"command\": ")]),
            responses::text("Done."),
        ]
    };
    let model = ModelServer::start(script()).await;
    let run = corral_run(&model, &h.url, sessions.path(), &["try"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let results = run.of_type("tool_result");
    let by = |id: &str| {
        results
            .iter()
            .find(|e| e["call_id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no tool_result for {id}: {results:?}"))
    };
    let ok = by("ok");
    assert_eq!(
        (ok["status"].as_str(), ok["exit_code"].as_i64()),
        (Some("ok"), Some(0))
    );
    let bad = by("bad");
    assert_eq!(
        (bad["status"].as_str(), bad["exit_code"].as_i64()),
        (Some("failed"), Some(3))
    );
    assert!(
        bad["duration_ms"].as_u64().is_some_and(|d| d >= 200),
        "{bad}"
    );
    let refused = by("refused");
    assert_eq!(refused["status"], "refused");
    assert!(refused.get("exit_code").is_none(), "{refused}");

    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retried_and_a_bad_request_fails_with_exit_1()
-> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        status(
            429,
            json!({"error": {"message": "slow down", "code": "rate_limit_exceeded"}}),
        )
        .header("Retry-After", "0"),
        status(500, json!({"error": {"message": "oops"}})),
        responses::text("made it"),
        status(
            400,
            json!({"error": {"message": "no such model", "code": "model_not_found"}}),
        ),
    ])
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["hi"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.result()["final_text"], "made it");
    assert_eq!(run.of_type("model_retry").len(), 2);

    let run = corral_run(&model, &h.url, sessions.path(), &["--session", "bad", "hi"]).await?;
    assert_eq!(run.code, 1, "{}", run.stderr);
    let r = run.result();
    assert_eq!(r["status"], "failed");
    assert!(
        r["error"].as_str().unwrap().contains("no such model"),
        "{r}"
    );
    let records = all_records(sessions.path(), "bad")?;
    assert!(
        records
            .iter()
            .any(|(_, r)| matches!(r, Record::ModelFailure { .. })),
        "the failure is recorded, never as an answer"
    );
    assert!(
        !records
            .iter()
            .any(|(_, r)| matches!(r, Record::Response { .. }))
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn usage_errors_exit_2_before_anything_runs() -> Result<()> {
    let model = ModelServer::start(Vec::new()).await;
    let sessions = tempfile::tempdir()?;
    let unreachable = "http://127.0.0.1:9";
    let run = corral_run(&model, unreachable, sessions.path(), &[]).await?;
    assert_eq!(run.code, 2, "no prompt for a new session: {}", run.stderr);
    let req = sessions.path().join("req.json");
    std::fs::write(&req, r#"{"prompt": "x", "temperature": 3}"#)?;
    let run = corral_run(
        &model,
        unreachable,
        sessions.path(),
        &["--request", req.to_str().unwrap()],
    )
    .await?;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("unknown field `temperature`"),
        "{}",
        run.stderr
    );
    let run = corral_run(
        &model,
        unreachable,
        sessions.path(),
        &["--heartbeat=-5m", "x"],
    )
    .await?;
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("negative"), "{}", run.stderr);
    let run = corral_run(
        &model,
        unreachable,
        sessions.path(),
        &["--session", "../up", "x"],
    )
    .await?;
    assert_eq!(run.code, 2, "a session id is a name, not a path");
    let mut no_key = command(&model, unreachable, sessions.path(), &["x"]);
    no_key
        .env_remove("OPENAI_API_KEY")
        .env_remove("CORRAL_BASE_URL");
    let out = no_key.output().await?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("OPENAI_API_KEY"));
    let run = corral_run(&model, unreachable, sessions.path(), &["x"]).await?;
    assert_eq!(run.code, 1, "a dead worker fails the run");
    assert!(
        run.stderr.contains("cannot reach the worker"),
        "{}",
        run.stderr
    );
    let last = run.events.last().unwrap();
    assert_eq!(last["type"], "error");
    assert!(
        last["message"]
            .as_str()
            .unwrap()
            .contains("cannot reach the worker")
    );
    // Several workers: what is new is placed among them (none answers
    // here), what concerns one worker needs one.
    let two = "http://127.0.0.1:9,http://127.0.0.1:10";
    let exec = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", two, "exec", "--", "true"])
        .output()
        .await?;
    let said = String::from_utf8_lossy(&exec.stderr);
    assert_eq!(exec.status.code(), Some(125), "{said}");
    assert!(
        said.contains("no worker can take it")
            && said.contains("127.0.0.1:9")
            && said.contains("127.0.0.1:10"),
        "{said}"
    );
    let drain = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", two, "worker", "drain"])
        .output()
        .await?;
    assert_eq!(drain.status.code(), Some(2), "one worker's command");
    assert!(String::from_utf8_lossy(&drain.stderr).contains("one --worker"));
    // `worker info` covers each worker: neither answers here.
    let info = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", two, "worker", "info"])
        .output()
        .await?;
    let said = String::from_utf8_lossy(&info.stderr);
    assert_eq!(info.status.code(), Some(125), "{said}");
    assert!(
        said.contains("127.0.0.1:9") && said.contains("127.0.0.1:10"),
        "{said}"
    );
    assert!(model.received().is_empty());
    Ok(())
}

/// SIGKILL `corral run` while its command runs; the rerun re-attaches to
/// the command (a counter in the sandbox proves it ran once), gives its
/// result to the model, and the log replays to the same state.
#[tokio::test]
async fn a_killed_run_resumes_without_running_its_command_twice() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c",
            "Bash",
            &bash("echo ran >> /workspace/counter; sleep 4; echo finished-$(wc -l < /workspace/counter)"),
        )]),
        responses::text("Counted."),
    ])
    .await;
    let out = signal_once_the_call_runs(
        &model,
        &h.url,
        sessions.path(),
        "crash",
        "count",
        Duration::from_secs(1),
        nix::sys::signal::Signal::SIGKILL,
    )
    .await?;
    assert_eq!(out.status.code(), None, "killed by a signal");

    let run = corral_run(&model, &h.url, sessions.path(), &["--session", "crash"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.result()["final_text"], "Counted.");
    // The call of the killed run comes again, marked, after the session
    // starts and before its result.
    let kinds: Vec<&str> = run
        .events
        .iter()
        .filter_map(|e| e["type"].as_str())
        .filter(|t| ["session_started", "tool_call", "tool_result"].contains(t))
        .collect();
    assert_eq!(
        kinds,
        ["session_started", "tool_call", "tool_result"],
        "{:#?}",
        run.events
    );
    let call = run.of_type("tool_call")[0];
    assert_eq!(
        (call["call_id"].as_str(), call["replayed"].as_bool()),
        (Some("c"), Some(true))
    );
    let got = model.received();
    assert_eq!(got.len(), 2);
    assert!(got[1].text().contains("finished-1"), "{}", got[1].text());

    let state = replay(sessions.path(), "crash")?;
    let sandbox = state.config.as_ref().unwrap().sandbox_id.clone();
    let counter = h.run(&sandbox, "cat /workspace/counter").await?;
    assert_eq!(counter.outcome, Outcome::Exited { code: 0 });
    assert_eq!(
        counter.stdout.to_lossy_string(),
        "ran\n",
        "the command ran exactly once"
    );
    assert_eq!(state.running_ops().count(), 0);
    assert_eq!(state.final_text, "Counted.");
    assert_eq!(
        replay(sessions.path(), "crash")?,
        state,
        "replay is deterministic"
    );
    h.stop().await;
    Ok(())
}

/// Through the front door, in process: a new input cancels the request in
/// flight, whose answer never arrives, and the next request carries both
/// inputs.
#[tokio::test]
async fn a_new_input_steers_a_request_in_flight() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![
        responses::text("a very long essay").after(Duration::from_secs(30)),
        responses::text("short answer"),
    ])
    .await;
    let sessions = tempfile::tempdir()?;
    let store = Sessions::new(sessions.path());
    // Fed through its handle: no prompt, and it ends when told.
    let opts = RunOptions {
        base_url: Some(model.url.clone()),
        api: Some(Api::Responses),
        api_key: Some("k".into()),
        ..RunOptions::default()
    };
    let new = store.prepare("steer", opts)?;
    let SessionHandle {
        inputs,
        mut events,
        task,
        config,
        ..
    } = store.start(new, h.worker.clone()).await?;
    let drain = tokio::spawn(async move { while events.recv().await.is_some() {} });
    inputs
        .send(Inbox::Input {
            input_id: "1".into(),
            text: "write an essay".into(),
        })
        .await?;
    model.wait_for(1, Duration::from_secs(30)).await;
    inputs
        .send(Inbox::Input {
            input_id: "2".into(),
            text: "no, one line".into(),
        })
        .await?;
    inputs.send(Inbox::Stop(StopMode::WhenIdle)).await?;
    let summary = tokio::time::timeout(Duration::from_secs(30), task).await???;
    assert_eq!(summary.ending, Ending::Done);
    assert_eq!(summary.final_text, "short answer");
    let got = model.received();
    assert_eq!(got.len(), 2);
    assert!(got[1].text().contains("write an essay") && got[1].text().contains("no, one line"));
    let _ = drain.await;
    let state = replay(sessions.path(), "steer")?;
    assert_eq!(
        (state.turns(), state.final_text.as_str()),
        (2, "short answer")
    );
    h.worker.destroy_sandbox(&config.sandbox_id).await?;
    h.stop().await;
    Ok(())
}

/// A `--request` file: its messages go in one turn, its system prompt and
/// tool allow-list apply, and skills from `--skills` are offered, loaded by
/// SkillUse, and their files are in the sandbox.
#[tokio::test]
async fn a_request_file_with_messages_tools_and_skills() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let skills = tempfile::tempdir()?;
    std::fs::create_dir_all(skills.path().join("greet/data"))?;
    std::fs::write(
        skills.path().join("greet/SKILL.md"),
        "---\nname: greet\ndescription: Greets people politely.\n---\nRead data/words.txt and use its word.\n",
    )?;
    std::fs::write(skills.path().join("greet/data/words.txt"), "salutations\n")?;
    let req = sessions.path().join("request.json");
    std::fs::write(
        &req,
        json!({
            "messages": [
                {"role": "user", "content": "first message"},
                {"role": "user", "content": "second message"}
            ],
            "system_prompt": "You are terse.",
            "tools": ["ReadFile", "SkillUse"],
            "reasoning_effort": "high",
            "limits": {"max_turns": 5}
        })
        .to_string(),
    )?;
    let model = ModelServer::start(vec![
        responses::calls(&[("s", "SkillUse", r#"{"name": "greet"}"#)]),
        responses::calls(&[(
            "r",
            "ReadFile",
            r#"{"path": "/workspace/.corral/skills/greet/data/words.txt"}"#,
        )]),
        responses::text("salutations!"),
    ])
    .await;
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--session",
            "reqs",
            "--request",
            req.to_str().unwrap(),
            "--skills",
            skills.path().to_str().unwrap(),
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    let got = model.received();
    assert_eq!(got.len(), 3);
    let first = &got[0].body;
    let input = first["input"].as_array().unwrap();
    let system = input[0].to_string();
    assert!(system.contains("You are terse."), "{system}");
    assert!(system.contains("<name>greet</name>"), "{system}");
    let users: Vec<String> = input
        .iter()
        .filter(|i| i["role"] == "user")
        .map(|i| i["content"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        users,
        ["first message", "second message"],
        "one turn for both"
    );
    let mut tools: Vec<&str> = first["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    tools.sort();
    assert_eq!(tools, ["ReadFile", "SkillUse"]);
    assert_eq!(first["reasoning"]["effort"], "high");
    assert!(
        got[1].text().contains("Read data/words.txt"),
        "the skill's body"
    );
    assert!(
        got[2].text().contains("salutations"),
        "the skill's file is in the sandbox"
    );
    // The same request again: its messages were answered; nothing is asked.
    let again = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "reqs", "--request", req.to_str().unwrap()],
    )
    .await?;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.result()["final_text"], "salutations!");
    assert_eq!(model.received().len(), 3, "no new request");
    h.stop().await;
    Ok(())
}

/// Ctrl-C: the model is stopped, the running command is canceled (killed
/// in the sandbox), its end is recorded, and the exit code is 130.
#[tokio::test]
async fn an_interrupt_cancels_the_running_command_and_exits_130() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![responses::calls(&[(
        "c",
        "Bash",
        &bash("sleep 60; echo never >> /workspace/late"),
    )])])
    .await;
    let out = signal_once_the_call_runs(
        &model,
        &h.url,
        sessions.path(),
        "int",
        "wait",
        Duration::from_millis(500),
        nix::sys::signal::Signal::SIGINT,
    )
    .await?;
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last: Value = serde_json::from_str(String::from_utf8(out.stdout)?.lines().last().unwrap())?;
    assert_eq!(last["status"], "interrupted");
    let state = replay(sessions.path(), "int")?;
    assert_eq!(
        state.running_ops().count(),
        0,
        "the command's end is recorded"
    );
    let op = state.ops.values().next().unwrap();
    assert_eq!(
        op.end.as_ref().unwrap().status,
        corral_harness::ops::OpStatus::Canceled
    );
    h.stop().await;
    Ok(())
}

/// Removes a sandbox of the embedded worker kept under `sessions`, even
/// when the test fails.
struct EmbeddedSandbox {
    state: std::path::PathBuf,
    id: String,
}

impl EmbeddedSandbox {
    fn run(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(binary("corral").unwrap())
            .env("CORRAL_STATE_DIR", &self.state)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for EmbeddedSandbox {
    fn drop(&mut self) {
        let _ = self.run(&["sandbox", "rm", &self.id]);
    }
}

/// Without `--worker`, `corral run` embeds a worker (the local manager),
/// and that default mode survives a SIGKILL too: the next run's embedded
/// worker adopts the sandbox and follows the command without running it
/// again.
#[tokio::test]
async fn run_without_a_worker_embeds_one_and_survives_a_kill() -> Result<()> {
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c",
            "Bash",
            &bash("echo ran >> /workspace/counter; sleep 3; echo embedded-$(wc -l < /workspace/counter)"),
        )]),
        responses::text("ok"),
    ])
    .await;
    let killed = signal_once_the_call_runs(
        &model,
        "",
        sessions.path(),
        "emb",
        "go",
        Duration::from_secs(1),
        nix::sys::signal::Signal::SIGKILL,
    )
    .await?;
    let sandbox = EmbeddedSandbox {
        state: sessions.path().join("embedded"),
        id: replay(sessions.path(), "emb")?
            .config
            .unwrap()
            .sandbox_id
            .to_string(),
    };
    assert_eq!(killed.status.code(), None);
    let run = corral_run(&model, "", sessions.path(), &["--session", "emb"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(model.received()[1].text().contains("embedded-1"));
    let counter = sandbox.run(&[
        "exec",
        "--sandbox",
        &sandbox.id,
        "--",
        "cat",
        "/workspace/counter",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&counter.stdout),
        "ran\n",
        "ran once"
    );
    Ok(())
}

/// The sandbox disappears while `corral run` is down: the rerun gets a new
/// sandbox, and the command that may have run is reported lost, never run
/// again behind the model's back.
#[tokio::test]
async fn a_lost_sandbox_is_reported_and_its_command_not_run_again() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c",
            "Bash",
            &bash("echo ran >> /workspace/counter; sleep 30"),
        )]),
        responses::text("It was lost."),
    ])
    .await;
    signal_once_the_call_runs(
        &model,
        &h.url,
        sessions.path(),
        "lost",
        "go",
        Duration::from_millis(500),
        nix::sys::signal::Signal::SIGKILL,
    )
    .await?;
    let sandbox = replay(sessions.path(), "lost")?.config.unwrap().sandbox_id;
    assert!(h.client.destroy_sandbox(&sandbox).await?);

    let run = corral_run(&model, &h.url, sessions.path(), &["--session", "lost"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let second = model.received()[1].text();
    assert!(second.contains("sandbox was lost"), "{second}");
    let counter = h.run(&sandbox, "cat /workspace/counter").await?;
    assert_ne!(
        counter.outcome,
        Outcome::Exited { code: 0 },
        "not run in the new sandbox"
    );
    h.stop().await;
    Ok(())
}

/// The reader of `corral run --json` goes away mid-run: the run stops with
/// exit 1, and a rerun of the session finishes it without repeating the
/// input or the command.
#[tokio::test]
async fn a_run_whose_output_fails_resumes_without_duplicates() -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c",
            "Bash",
            &bash("echo ran >> /workspace/counter; sleep 2"),
        )]),
        responses::text("done"),
        responses::text("done"),
    ])
    .await;
    let mut child = command(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "pipe", "go"],
    )
    .spawn()?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next_line().await? {
        if line.contains("\"tool_call\"") {
            break;
        }
    }
    drop(lines);
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
    assert_eq!(status.code(), Some(141), "stopped quietly as on SIGPIPE");

    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "pipe", "go"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let records = all_records(sessions.path(), "pipe")?;
    let count = |f: fn(&Record) -> bool| records.iter().filter(|(_, r)| f(r)).count();
    assert_eq!(
        count(|r| matches!(r, Record::Input { .. })),
        1,
        "the same prompt is not asked twice"
    );
    assert_eq!(count(|r| matches!(r, Record::Call { .. })), 1);
    let sandbox = replay(sessions.path(), "pipe")?.config.unwrap().sandbox_id;
    let counter = h.run(&sandbox, "cat /workspace/counter").await?;
    assert_eq!(counter.stdout.to_lossy_string(), "ran\n");
    h.stop().await;
    Ok(())
}

/// A sandbox that cannot be made (an image that does not exist) fails the
/// run before anything is recorded: the same session id can be used again.
#[tokio::test]
async fn a_sandbox_that_cannot_be_made_records_no_session() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![responses::text("hello")]).await;
    let bad = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--session",
            "img",
            "--image",
            "corral-no-such-image:0",
            "hi",
        ],
    )
    .await?;
    assert_eq!(bad.code, 1, "{}", bad.stderr);
    assert!(
        bad.stderr.contains("corral-no-such-image"),
        "{}",
        bad.stderr
    );
    assert!(!sessions.path().join("img.jsonl").exists());
    let good = corral_run(&model, &h.url, sessions.path(), &["--session", "img", "hi"]).await?;
    assert_eq!(good.code, 0, "{}", good.stderr);
    assert_eq!(good.result()["final_text"], "hello");
    h.stop().await;
    Ok(())
}

/// A request refused as longer than the model's window (vLLM's words) is
/// cut down and sent again; the run goes on.
#[tokio::test]
async fn a_request_refused_as_too_long_is_cut_down_and_the_run_goes_on() -> Result<()> {
    refused_as_too_long(
        status(400, json!({"object": "error", "message": "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.", "type": "BadRequestError", "code": 400})),
        "maximum context length",
    )
    .await
}

/// A llama.cpp server answers a request over its window with a 200 and an
/// empty stream: taken as a context overflow (cut down and sent again at
/// once), never retried as it is.
#[tokio::test]
async fn an_empty_answer_is_taken_as_a_context_overflow() -> Result<()> {
    refused_as_too_long(corral_e2e::model::sse(&[]), "empty stream").await
}

/// A run whose second request gets `refusal`: cut down and sent once more
/// (three requests in all, the third shorter), the retry saying `reason`,
/// and the run done.
async fn refused_as_too_long(refusal: corral_e2e::model::Reply, reason: &str) -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        chat::calls(&[("c", "Bash", &bash("head -c 30000 /dev/zero | tr '\\0' y"))]),
        refusal,
        chat::text("fits now"),
    ])
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["--api", "chat", "go"]).await?;
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    assert_eq!(run.result()["final_text"], "fits now");
    let retry = run.of_type("model_retry");
    assert!(
        retry[0]["reason"].as_str().unwrap_or("").contains(reason),
        "{retry:?}"
    );
    let got = model.received();
    assert_eq!(got.len(), 3, "not sent again as it was");
    assert!(
        got[2].text().len() < got[1].text().len(),
        "the resent request is shorter"
    );
    h.stop().await;
    Ok(())
}

/// `--context-window` and `--max-output-tokens` (a local server's small
/// window): the answer's bound is sent, and a 30,000-byte result is cut to
/// fit a 4,096-token window at once instead of being refused.
#[tokio::test]
async fn the_window_and_the_output_bound_are_flags() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        chat::calls(&[("c", "Bash", &bash("head -c 30000 /dev/zero | tr '\\0' y"))]),
        chat::text("done"),
    ])
    .await;
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--api",
            "chat",
            "--context-window",
            "4096",
            "--max-output-tokens",
            "512",
            "go",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    let got = model.received();
    assert_eq!(got.len(), 2);
    let bound = got[0]
        .body
        .get("max_completion_tokens")
        .or(got[0].body.get("max_tokens"));
    assert_eq!(bound, Some(&json!(512)), "{}", got[0].body);
    // 4,096 tokens less 512 for the answer, about four characters a
    // token (the body's JSON adds its quoting): the 30,000 bytes were cut.
    assert!(
        got[1].text().len() < 20_000,
        "{} bytes sent to a 4,096-token window",
        got[1].text().len()
    );
    h.stop().await;
    Ok(())
}

/// The disk fills up mid-run (a file-size limit makes appends to the
/// session log fail): the run stops with exit 1 and a clear error before
/// anything it could not record takes effect; a rerun repairs the torn
/// log and finishes, running the command once.
#[tokio::test]
async fn a_log_that_cannot_be_written_stops_the_run_and_loses_nothing() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    // A long answer with a call: its record is far over the limit below.
    let long_answer_with_call = || {
        corral_e2e::model::sse(&[responses::completed(
            json!([
                {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "z".repeat(40_000)}]},
                {"type": "function_call", "id": "fc", "call_id": "c", "name": "Bash",
                 "arguments": bash("echo ran >> /workspace/counter"), "status": "completed"}
            ]),
            "completed",
            json!({}),
        )])
    };
    let model = ModelServer::start(vec![
        long_answer_with_call(),
        long_answer_with_call(),
        responses::text("done"),
    ])
    .await;
    let corral = binary("corral")?;
    let script = format!(
        "trap '' XFSZ; ulimit -f 16; exec {} run --json --session full go",
        corral.display()
    );
    let out = tokio::process::Command::new("sh")
        .args(["-c", &script])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("OPENAI_API_KEY", "sk-test")
        .env("CORRAL_BASE_URL", &model.url)
        .env("CORRAL_WORKER", &h.url)
        .env("CORRAL_SESSIONS_DIR", sessions.path())
        .stdin(Stdio::null())
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("session log"), "{stderr}");
    let stdout = String::from_utf8(out.stdout)?;
    let last: Value = serde_json::from_str(stdout.lines().last().unwrap())?;
    assert_eq!(last["type"], "error");
    assert_eq!(
        model.received().len(),
        1,
        "the turn was recorded and sent; its answer could not be recorded"
    );

    let run = corral_run(&model, &h.url, sessions.path(), &["--session", "full"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.result()["final_text"], "done");
    let state = replay(sessions.path(), "full")?;
    let counter = h
        .run(&state.config.unwrap().sandbox_id, "cat /workspace/counter")
        .await?;
    assert_eq!(
        counter.stdout.to_lossy_string(),
        "ran\n",
        "run once, after the repair"
    );
    h.stop().await;
    Ok(())
}

/// `--inputs-from-stdin`: a line typed while the model is answering steers
/// the run (the request is canceled and asked again with the new input).
#[tokio::test]
async fn inputs_from_stdin_steer_the_run() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::text("a very long essay").after(Duration::from_secs(30)),
        responses::text("one line"),
    ])
    .await;
    let mut cmd = command(
        &model,
        &h.url,
        sessions.path(),
        &["--inputs-from-stdin", "write an essay"],
    );
    cmd.stdin(Stdio::piped());
    let mut child = cmd.spawn()?;
    model.wait_for(1, Duration::from_secs(30)).await;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(b"no, one line\n").await?;
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    let stdout = String::from_utf8(out.stdout)?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("\"steered\""), "{stdout}");
    let last: Value = serde_json::from_str(stdout.lines().last().unwrap())?;
    assert_eq!(last["final_text"], "one line");
    let second = model.received()[1].text();
    assert!(second.contains("write an essay") && second.contains("no, one line"));
    h.stop().await;
    Ok(())
}

/// With several workers, a new session goes to the one with the most room
/// (a dead one is skipped), and a resumed session goes back to its worker
/// however full it has become.
#[tokio::test]
async fn sessions_are_placed_on_the_worker_with_room_and_stay_there() -> Result<()> {
    let a = Harness::start().await?;
    let b = Harness::start().await?;
    a.sandbox().await?;
    a.sandbox().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![responses::text("one"), responses::text("two")]).await;
    let list = format!("{},http://127.0.0.1:9,{}", a.url, b.url);
    let run = corral_run(&model, &list, sessions.path(), &["--session", "p", "hi"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.of_type("session_started")[0]["worker"], b.url.as_str());
    let sandbox = replay(sessions.path(), "p")?.config.unwrap().sandbox_id;
    assert!(b.client.get_sandbox(&sandbox).await.is_ok());
    assert!(a.client.get_sandbox(&sandbox).await.is_err());
    for _ in 0..3 {
        b.sandbox().await?;
    }
    let again = corral_run(&model, &list, sessions.path(), &["--session", "p", "more"]).await?;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(
        again.of_type("session_started")[0]["worker"],
        b.url.as_str()
    );
    assert_eq!(again.result()["final_text"], "two");
    a.stop().await;
    b.stop().await;
    Ok(())
}

/// ViewImage end to end: a PNG made in the sandbox reaches the model as an
/// image input of the Responses API.
#[tokio::test]
async fn view_image_sends_the_picture_to_the_model() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "b",
            "Bash",
            &bash(&format!("echo {png} | base64 -d > /workspace/dot.png")),
        )]),
        responses::calls(&[("v", "ViewImage", r#"{"path": "/workspace/dot.png"}"#)]),
        responses::text("a dot"),
    ])
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["look"]).await?;
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    let third = &model.received()[2].body;
    let output = third["input"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call_output" && i["call_id"] == "v")
        .cloned()
        .context("no ViewImage output")?;
    let parts = output["output"]
        .as_array()
        .context("image output is a list")?;
    let image = parts
        .iter()
        .find(|p| p["type"] == "input_image")
        .context("no image")?;
    assert!(
        image["image_url"]
            .as_str()
            .unwrap()
            .starts_with("data:image/png;base64,"),
        "{image}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_stopped_run_leaves_within_its_patience_when_its_worker_hangs() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = corral_e2e::WorkerProcess::spawn(
        state.path(),
        &corral_e2e::unique_id("w"),
        corral_e2e::free_port()?,
        &[],
        &[],
    )?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[("c1", "Bash", &bash("sleep 300"))]),
        responses::text("never asked"),
    ])
    .await;
    let mut cmd = command(
        &model,
        &worker.url,
        sessions.path(),
        &["--session", "wedged", "go"],
    );
    cmd.env("CORRAL_TOKEN_FILE", worker.token_file());
    let child = cmd.spawn()?;
    model.wait_for(1, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The worker freezes: its connections stay open and nothing answers, so
    // the cancel of the running call never comes back.
    let worker_pid = nix::unistd::Pid::from_raw(worker.child.id() as i32);
    nix::sys::signal::kill(worker_pid, nix::sys::signal::Signal::SIGSTOP)?;
    let stopped = std::time::Instant::now();
    let pid = nix::unistd::Pid::from_raw(child.id().context("pid")? as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    let took = stopped.elapsed();
    nix::sys::signal::kill(worker_pid, nix::sys::signal::Signal::SIGCONT)?;
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        took < corral_harness::sessions::STOP_PATIENCE + Duration::from_secs(5),
        "left {took:?} after SIGTERM"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"interrupted\""), "{stdout}");
    Ok(())
}

/// `corral run --workspace DIR` starts the session's /workspace with DIR's
/// contents, once (a resume does not copy them again); `--export` and
/// `session export` bring /workspace back; a fork's sandbox starts with a
/// copy of its parent's workspace.
#[tokio::test]
async fn a_workspace_goes_in_once_comes_back_out_and_is_copied_into_a_fork() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let local = tempfile::tempdir()?;
    let project = local.path().join("project");
    std::fs::create_dir_all(project.join("src"))?;
    std::fs::write(project.join("src/lib.txt"), "one\n")?;
    std::fs::write(project.join("notes"), "keep me\n")?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c1",
            "Bash",
            &bash("cat src/lib.txt && echo two >> src/lib.txt"),
        )]),
        responses::text("Edited."),
        responses::text("Nothing to do."),
        responses::calls(&[("c2", "Bash", &bash("cat src/lib.txt; ls"))]),
        responses::text("The fork sees it."),
    ])
    .await;
    let exported = local.path().join("exported");
    let dir = project.to_str().unwrap_or_default();
    let out = exported.to_str().unwrap_or_default();
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--session",
            "ws",
            "--workspace",
            dir,
            "--export",
            out,
            "edit it",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let result = run.of_type("tool_result");
    assert!(
        result[0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("one"),
        "{result:?}"
    );
    assert_eq!(
        std::fs::read_to_string(exported.join("src/lib.txt"))?,
        "one\ntwo\n"
    );
    assert_eq!(
        std::fs::read_to_string(exported.join("notes"))?,
        "keep me\n"
    );
    let state = replay(sessions.path(), "ws")?;
    assert_eq!(
        state.config.as_ref().and_then(|c| c.workspace.as_deref()),
        Some(dir)
    );

    // A resume copies nothing again: the sandbox keeps its own edits.
    std::fs::write(project.join("src/lib.txt"), "changed locally\n")?;
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "ws", "--workspace", dir, "anything else?"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let again = local.path().join("again");
    let export = session_cmd(
        &h.url,
        sessions.path(),
        &["session", "export", "ws"],
        Some(again.as_ref()),
    )
    .await?;
    assert!(
        export.status.success(),
        "{}",
        String::from_utf8_lossy(&export.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(again.join("src/lib.txt"))?,
        "one\ntwo\n"
    );
    // A patch needs git: this image has none, and says so, as a usage
    // error (the caller is to export it whole), not a failure of Corral.
    let patch = local.path().join("p.patch");
    let diff = session_cmd(
        &h.url,
        sessions.path(),
        &["session", "export", "--diff", "ws"],
        Some(patch.as_ref()),
    )
    .await?;
    assert_eq!(diff.status.code(), Some(2));
    let err = String::from_utf8_lossy(&diff.stderr);
    assert!(err.contains("git is not in this sandbox's image"), "{err}");
    assert!(!patch.exists(), "no half patch is left");

    // A fork starts with the parent's files, in a sandbox of its own: a
    // live fork of the parent's sandbox (its /tmp comes too, which a copy
    // of the workspace would not bring).
    let parents = h.client.list_sandboxes().await?;
    assert_eq!(parents.len(), 1, "{parents:?}");
    run_shell(
        &h.client,
        &parents[0].id,
        "echo from-the-parent > /tmp/marker",
    )
    .await?;
    let fork = session_cmd(
        &h.url,
        sessions.path(),
        &["session", "fork", "ws", "ws-fork"],
        None,
    )
    .await?;
    assert!(
        fork.status.success(),
        "{}",
        String::from_utf8_lossy(&fork.stderr)
    );
    let state_of = |listing: &str, id: &str| -> Option<String> {
        listing
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
    };
    let child = h
        .client
        .list_sandboxes()
        .await?
        .into_iter()
        .find(|s| s.id != parents[0].id)
        .context("the fork made no sandbox")?;
    assert_eq!(
        run_shell(&h.client, &child.id, "cat /tmp/marker").await?,
        "from-the-parent\n"
    );
    let listed = session_cmd(&h.url, sessions.path(), &["session", "ls"], None).await?;
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert_eq!(
        state_of(&listed, "ws-fork").as_deref(),
        Some("forked"),
        "{listed}"
    );
    let run = corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "ws-fork", "--max-turns", "7", "what is there?"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let listed = session_cmd(&h.url, sessions.path(), &["session", "ls"], None).await?;
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert_eq!(
        state_of(&listed, "ws-fork").as_deref(),
        Some("done"),
        "{listed}"
    );
    // Each resume line says what it changed.
    let shown = session_cmd(
        &h.url,
        sessions.path(),
        &["session", "show", "ws-fork"],
        None,
    )
    .await?;
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    let resumes: Vec<&str> = shown.lines().filter(|l| l.contains(" resume")).collect();
    assert!(
        resumes.iter().any(|l| l.ends_with("nothing changed"))
            && resumes
                .iter()
                .any(|l| l.ends_with("at most 7 turns this run")),
        "{shown}"
    );
    let seen = run.of_type("tool_result")[0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        seen.contains("one\ntwo") && seen.contains("notes"),
        "{seen}"
    );
    let (parent, child) = (
        replay(sessions.path(), "ws")?.config.map(|c| c.sandbox_id),
        replay(sessions.path(), "ws-fork")?
            .config
            .map(|c| c.sandbox_id),
    );
    assert_ne!(parent, child);
    h.stop().await;
    Ok(())
}

/// `session rm` reaches the worker the session was placed on: an embedded
/// session's sandbox is removed from the local worker even while
/// CORRAL_WORKER names another one.
#[tokio::test]
async fn session_rm_removes_an_embedded_sessions_sandbox_whatever_corral_worker_says() -> Result<()>
{
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![responses::text("hello")]).await;
    let run = corral_run(&model, "", sessions.path(), &["--session", "local", "hi"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let sandbox = replay(sessions.path(), "local")?
        .config
        .map(|c| c.sandbox_id.to_string())
        .unwrap_or_default();
    let state = sessions.path().join("embedded");
    let local = |args: &[&str]| {
        let mut c = tokio::process::Command::new(binary("corral").unwrap_or_default());
        c.env("CORRAL_STATE_DIR", &state)
            .env("CORRAL_SESSIONS_DIR", sessions.path())
            .args(args);
        c
    };
    let listed = local(&["sandbox", "ls", "-q"])
        .env_remove("CORRAL_WORKER")
        .output()
        .await?;
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&sandbox));
    let rm = local(&["session", "rm", "local"])
        .env("CORRAL_WORKER", &h.url)
        .output()
        .await?;
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    let listed = local(&["sandbox", "ls", "-q"])
        .env_remove("CORRAL_WORKER")
        .output()
        .await?;
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains(&sandbox),
        "the embedded session's sandbox is still there"
    );
    h.stop().await;
    Ok(())
}

/// The README's first agent example works in the image `corral run` uses by
/// default: the model writes fizzbuzz.py and runs it with python3.
#[tokio::test]
async fn the_default_image_runs_the_readme_fizzbuzz() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let program = "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\n";
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "w",
            "WriteFile",
            &json!({"path": "fizzbuzz.py", "content": program}).to_string(),
        )]),
        responses::calls(&[("r", "Bash", &bash("python3 fizzbuzz.py | tail -1"))]),
        responses::text("It prints FizzBuzz at 15."),
    ])
    .await;
    let run = corral_e2e::run::corral_run_default_image(
        &model,
        &h.url,
        sessions.path(),
        &["Write fizzbuzz.py in the workspace and run it"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let ran = run
        .of_type("tool_result")
        .into_iter()
        .find(|e| e["call_id"] == "r")
        .cloned()
        .unwrap_or_default();
    assert_eq!(ran["status"], "ok", "{ran}");
    assert!(
        ran["text"]
            .as_str()
            .unwrap_or_default()
            .contains("FizzBuzz"),
        "{ran}"
    );
    let started = run.of_type("session_started");
    let sandbox = started[0]["sandbox_id"].as_str().unwrap_or_default();
    let info = h
        .client
        .get_sandbox(&corral_proto::SandboxId::new(sandbox)?)
        .await?;
    assert_eq!(info.image, "corral-debian:latest");
    // Removed by its worker if no run comes back to it within the hour.
    assert_eq!(info.spec.idle_timeout_ms, Some(3_600_000));
    h.stop().await;
    Ok(())
}

/// A git repository given as the workspace comes back as a patch: the
/// model's edits, a new file and a deletion, which `git apply` puts on a
/// clone of the original.
#[tokio::test]
async fn a_git_workspace_exports_as_a_patch_that_applies_to_the_original() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let local = tempfile::tempdir()?;
    let repo = local.path().join("repo");
    std::fs::create_dir_all(repo.join("src"))?;
    std::fs::write(repo.join("src/lib.txt"), "one\ntwo\n")?;
    std::fs::write(repo.join("notes"), "old notes\n")?;
    let git = |args: &[&str], dir: &Path| -> Result<()> {
        let out = std::process::Command::new("git")
            .args(["-c", "user.email=t@example.com", "-c", "user.name=t"])
            .args(args)
            .current_dir(dir)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    git(&["init", "-q"], &repo)?;
    git(&["add", "."], &repo)?;
    git(&["commit", "-qm", "start"], &repo)?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "e",
            "Bash",
            &bash("sed -i s/one/ONE/ src/lib.txt && printf 'new\\n' > added.txt && rm notes"),
        )]),
        responses::text("Edited."),
    ])
    .await;
    let run = corral_e2e::run::corral_run_default_image(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--session",
            "git",
            "--workspace",
            repo.to_str().unwrap_or_default(),
            "edit",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let patch = local.path().join("changes.patch");
    let out = session_cmd(
        &h.url,
        sessions.path(),
        &["session", "export", "--diff", "git"],
        Some(patch.as_ref()),
    )
    .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let copy = local.path().join("copy");
    git(
        &[
            "clone",
            "-q",
            repo.to_str().unwrap_or_default(),
            copy.to_str().unwrap_or_default(),
        ],
        local.path(),
    )?;
    git(&["apply", patch.to_str().unwrap_or_default()], &copy)?;
    assert_eq!(
        std::fs::read_to_string(copy.join("src/lib.txt"))?,
        "ONE\ntwo\n"
    );
    assert_eq!(std::fs::read_to_string(copy.join("added.txt"))?, "new\n");
    assert!(!copy.join("notes").exists());
    // `-` is stdout: the same patch, and no file named `-`.
    let out = tokio::process::Command::new(binary("corral")?)
        .env("CORRAL_WORKER", &h.url)
        .env("CORRAL_SESSIONS_DIR", sessions.path())
        .args(["session", "export", "--diff", "git", "-"])
        .current_dir(local.path())
        .output()
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, std::fs::read(&patch)?);
    assert!(!local.path().join("-").exists());
    h.stop().await;
    Ok(())
}

/// When a run ends, its session holds nothing on the worker: the sandbox
/// is gone, its workspace saved beside the log; the next run brings the
/// files back in a new sandbox, and an export needs no sandbox at all.
#[tokio::test]
async fn an_idle_session_holds_nothing_and_its_files_come_back_on_resume() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "w",
            "Bash",
            &bash("mkdir -p d && echo kept > d/f && chmod 640 d/f; sleep 1000 &"),
        )]),
        responses::text("Written."),
        responses::calls(&[("r", "Bash", &bash("cat d/f; stat -c %a d/f"))]),
        responses::text("Read."),
    ])
    .await;
    let suspend = [("CORRAL_KEEP_SANDBOX", "false")];
    let run = corral_run_env(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "idle", "write"],
        &suspend,
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let sandbox = replay(sessions.path(), "idle")?
        .config
        .map(|c| c.sandbox_id)
        .ok_or_else(|| anyhow::anyhow!("no config"))?;
    assert!(
        h.client.get_sandbox(&sandbox).await.is_err(),
        "the sandbox of an idle session is still there"
    );
    assert!(h.client.list_sandboxes().await?.is_empty());
    let saved = sessions.path().join("idle.workspace.tar");
    assert!(saved.is_file());

    // Exported from what was saved.
    let out = tempfile::tempdir()?;
    let export = session_cmd(
        "http://127.0.0.1:1",
        sessions.path(),
        &["session", "export", "idle"],
        Some(out.path().join("ws").as_ref()),
    )
    .await?;
    assert!(
        export.status.success(),
        "{}",
        String::from_utf8_lossy(&export.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("ws/d/f"))?,
        "kept\n"
    );

    let run = corral_run_env(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "idle", "read"],
        &suspend,
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let read = run
        .of_type("tool_result")
        .into_iter()
        .find(|e| e["call_id"] == "r")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        read["text"].as_str().map(str::trim),
        Some("kept\n640"),
        "{read}"
    );
    assert!(
        h.client.list_sandboxes().await?.is_empty(),
        "suspended again"
    );
    h.stop().await;
    Ok(())
}

/// `corral run | head -1`: the reader goes after one line. The run stops
/// as on SIGTERM (its command canceled, the session recorded and
/// suspended, its sandbox removed) and exits 141 quietly.
#[tokio::test]
async fn a_closed_stdout_stops_the_run_as_sigterm_does() -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[("s", "Bash", &bash("sleep 300"))]),
        responses::text("never asked"),
    ])
    .await;
    let mut cmd = corral_e2e::run::command(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "pipe", "go"],
    );
    cmd.env("CORRAL_KEEP_SANDBOX", "false");
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // Read up to the call, then go away.
    loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await??
            .context("the stream ended")?;
        if line.contains("\"tool_call\"") {
            break;
        }
    }
    drop(lines);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.to_lowercase().contains("broken pipe"), "{stderr}");
    assert!(
        h.client.list_sandboxes().await?.is_empty(),
        "the session's sandbox was left running"
    );
    let show = tokio::process::Command::new(binary("corral")?)
        .env("CORRAL_SESSIONS_DIR", sessions.path())
        .args(["session", "show", "pipe", "--json"])
        .output()
        .await?;
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        text.contains("stop") || text.contains("interrupted"),
        "{text}"
    );
    h.stop().await;
    Ok(())
}

/// A running command's newest line comes as `tool_progress` events, at most
/// one a second, before its result.
#[tokio::test]
async fn a_running_command_shows_its_newest_line() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "slow",
            "Bash",
            &bash("for i in 1 2 3 4 5; do echo step$i; sleep 0.6; done"),
        )]),
        responses::text("Done."),
    ])
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["count"]).await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let progress = run.of_type("tool_progress");
    assert!(!progress.is_empty(), "no progress: {:?}", run.events);
    assert!(progress.len() <= 4, "more than one a second: {progress:?}");
    for p in &progress {
        assert_eq!(p["call_id"], "slow");
        assert_eq!(p["tool"], "Bash");
        assert!(
            p["line"].as_str().is_some_and(|l| l.starts_with("step")),
            "{p}"
        );
    }
    let order: Vec<&str> = run
        .events
        .iter()
        .filter_map(|e| e["type"].as_str())
        .filter(|t| *t == "tool_progress" || *t == "tool_result")
        .collect();
    assert_eq!(order.last(), Some(&"tool_result"), "{order:?}");
    h.stop().await;
    Ok(())
}

/// `timeout 300 corral run ...`: timeout(1) sends its SIGTERM to the command
/// and then to the command's whole process group, so the run gets it twice;
/// the first may be taken before the second arrives, while the stop waits
/// for a command to end. That is one interrupt: the run stops as asked (its
/// command canceled, not left to run until the idle sweep), and the result
/// has the session's own totals.
#[tokio::test]
async fn a_signal_from_timeout_is_one_interrupt_with_the_sessions_totals() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        // A command that takes its time to end: the stop waits for it.
        responses::calls(&[("c1", "Bash", &bash("trap '' TERM; sleep 300"))]),
        responses::text("never asked"),
    ])
    .await;
    let mut cmd = command(
        &model,
        &h.url,
        sessions.path(),
        &["--session", "timed", "go"],
    );
    // A group of its own, as timeout(1) makes.
    cmd.process_group(0);
    let child = cmd.spawn()?;
    let pid = nix::unistd::Pid::from_raw(child.id().context("pid")? as i32);
    model.wait_for(1, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // As timeout(1) signals: the command, then its group; the first taken
    // before the second comes.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGTERM)?;
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let result: Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .rfind(|e| e["type"] == "result")
        .context("no result")?;
    assert_eq!(result["status"], "interrupted", "{result}");
    assert!(
        !result.to_string().contains("twice"),
        "one signal taken for two: {result}"
    );
    assert_eq!(
        (result["turns"].as_u64(), result["tool_calls"].as_u64()),
        (Some(1), Some(1)),
        "{result}"
    );
    // Nothing of the session still runs in its sandbox.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut running = 0;
        for sb in h.client.list_sandboxes().await? {
            let ops = h.client.list_operations(&sb.id).await?;
            running += ops.iter().filter(|o| o.result.is_none()).count();
        }
        if running == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{running} operations still run after the interrupt"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    h.stop().await;
    Ok(())
}

/// A llama.cpp-like server that answers any request over its window with a
/// 200 and an empty stream (and says nothing of its window): the run cuts
/// the request down and goes on, within the shrinks it allows itself.
#[tokio::test]
async fn an_over_long_request_to_a_llama_like_server_is_cut_until_it_fits() -> Result<()> {
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    const WINDOW_CHARS: usize = 16_000;
    let model = ModelServer::responding(|r| {
        let text = r.text();
        if text.len() > WINDOW_CHARS {
            corral_e2e::model::sse(&[])
        } else if text.contains("yyyy") {
            chat::text("seen")
        } else {
            chat::calls(&[("c", "Bash", &bash("head -c 60000 /dev/zero | tr '\\0' y"))])
        }
    })
    .await;
    let run = corral_run(&model, &h.url, sessions.path(), &["--api", "chat", "go"]).await?;
    let got = model.received();
    let sizes: Vec<usize> = got.iter().map(|r| r.text().len()).collect();
    assert_eq!(run.code, 0, "{}\n{:#?}", run.stderr, run.events);
    assert_eq!(run.result()["final_text"], "seen", "{sizes:?}");
    assert!(
        got.len() <= 2 + corral_harness::agent::core::MAX_SHRINKS as usize,
        "{} requests: {sizes:?}",
        got.len()
    );
    h.stop().await;
    Ok(())
}
