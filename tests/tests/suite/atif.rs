//! `corral session export --atif`: a session with parallel calls, one of
//! them slow (its result late, after a placeholder), and a fork, as ATIF
//! trajectories. (Every session the suite runs through `corral run` is also
//! exported, and the Python SDK's tests validate them all with Harbor's
//! own ATIF models.)

use anyhow::{Context, Result, ensure};
use corral_e2e::model::{ModelServer, Received, Reply, responses};
use corral_e2e::{WorkerProcess, free_port, unique_id};
use serde_json::{Value, json};

/// Two calls at once, one slow; "Waiting." while it runs, "Done." once its
/// result is in.
fn respond(req: &Received) -> Reply {
    let text = req.text();
    if text.contains("slow-result") {
        return responses::text("Done.");
    }
    if text.contains("function_call_output") {
        return responses::text("Waiting.");
    }
    responses::calls(&[
        (
            "c1",
            "Bash",
            &json!({"command": "echo fast-result"}).to_string(),
        ),
        (
            "c2",
            "Bash",
            &json!({"command": "sleep 3; echo slow-result"}).to_string(),
        ),
    ])
}

async fn export(worker: &WorkerProcess, sessions: &std::path::Path, id: &str) -> Result<Value> {
    let out = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(worker.token_file())
        .args(["session", "export", "--atif", "--sessions-dir"])
        .arg(sessions)
        .args([id, "-"])
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// What every trajectory holds to: steps numbered from 1, each result tied
/// to a call of its own step, every call answered.
fn check_shape(t: &Value) -> Result<()> {
    ensure!(t["schema_version"] == "ATIF-v1.7", "{t}");
    let steps = t["steps"].as_array().context("no steps")?;
    for (i, s) in steps.iter().enumerate() {
        ensure!(s["step_id"] == i + 1, "step {i}: {s}");
        let calls: Vec<&str> = s["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["tool_call_id"].as_str())
            .collect();
        let answered: Vec<&str> = s["observation"]["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["source_call_id"].as_str())
            .collect();
        ensure!(
            calls == answered,
            "step {}: calls {calls:?}, results {answered:?}",
            i + 1
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_session_with_parallel_late_calls_and_a_fork_exports_as_trajectories() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("atf"), free_port()?, &[], &[])?;
    let model = ModelServer::responding(respond).await;
    let sessions = tempfile::tempdir()?;
    let token = worker.token_file();
    let env = [("CORRAL_TOKEN_FILE", token.to_str().context("path")?)];
    let id = unique_id("atif-");
    let run = corral_e2e::run::corral_run_env(
        &model,
        &worker.url,
        sessions.path(),
        &["--session", &id, "Run both."],
        &env,
    )
    .await?;
    ensure!(run.result()["status"] == "done", "{}", run.stderr);

    let parent = export(&worker, sessions.path(), &id).await?;
    check_shape(&parent)?;
    ensure!(parent["session_id"] == id.as_str() && parent["agent"]["name"] == "corral");
    let steps = parent["steps"].as_array().context("steps")?;
    ensure!(
        steps[0]["source"] == "user" && steps[0]["message"] == "Run both.",
        "{}",
        steps[0]
    );
    let calling = steps
        .iter()
        .find(|s| s["tool_calls"].is_array())
        .context("no step with calls")?;
    let results = calling["observation"]["results"]
        .as_array()
        .context("results")?;
    ensure!(results.len() == 2, "{calling}");
    // The slow call's result is its final one, tied to it, however late.
    ensure!(
        results[0]["content"]
            .as_str()
            .is_some_and(|c| c.contains("fast-result"))
    );
    ensure!(
        results[1]["content"]
            .as_str()
            .is_some_and(|c| c.contains("slow-result")),
        "{}",
        results[1]
    );
    ensure!(calling["tool_calls"][1]["arguments"]["command"] == "sleep 3; echo slow-result");
    let agent_steps: Vec<&Value> = steps.iter().filter(|s| s["source"] == "agent").collect();
    let prompt: u64 = agent_steps
        .iter()
        .map(|s| s["metrics"]["prompt_tokens"].as_u64().unwrap_or(0))
        .sum();
    ensure!(
        parent["final_metrics"]["total_prompt_tokens"] == prompt && prompt > 0,
        "{}",
        parent["final_metrics"]
    );
    ensure!(parent["extra"]["ending"] == "done");
    ensure!(parent.get("continued_trajectory_ref").is_none());

    // A fork at turn 1 goes on from there.
    let child = unique_id("atif-child-");
    let fork = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(&token)
        .args(["session", "fork", "--sessions-dir"])
        .arg(sessions.path())
        .args([&id, &child, "--turn", "1"])
        .output()
        .await?;
    ensure!(
        fork.status.success(),
        "{}",
        String::from_utf8_lossy(&fork.stderr)
    );
    let run = corral_e2e::run::corral_run_env(
        &model,
        &worker.url,
        sessions.path(),
        &["--session", &child, "And now?"],
        &env,
    )
    .await?;
    ensure!(run.result()["status"] == "done", "{}", run.stderr);
    let forked = export(&worker, sessions.path(), &child).await?;
    check_shape(&forked)?;
    ensure!(
        forked["extra"]["forked_from"] == id.as_str(),
        "{}",
        forked["extra"]
    );
    let fsteps = forked["steps"].as_array().context("steps")?;
    ensure!(fsteps[0]["is_copied_context"] == true, "{}", fsteps[0]);
    let own = fsteps
        .iter()
        .find(|s| s["is_copied_context"].is_null())
        .context("no step of its own")?;
    ensure!(
        own["source"] == "user" && own["message"] == "And now?",
        "{own}"
    );
    // The parent now names its continuation.
    let parent = export(&worker, sessions.path(), &id).await?;
    ensure!(
        parent["continued_trajectory_ref"] == format!("{child}.atif.json"),
        "{}",
        parent["continued_trajectory_ref"]
    );
    Ok(())
}
