//! Running the `corral` binary's `run` command as a user would, with its
//! JSON events parsed.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::binary;

/// The `corral` binary beside the test executable (built by `cargo build`).
fn corral() -> std::path::PathBuf {
    binary("corral").unwrap_or_else(|e| panic!("{e:#}"))
}
use crate::model::ModelServer;

/// How a `corral run` ended: its exit code, its JSON events, its stderr.
pub struct Run {
    pub code: i32,
    pub events: Vec<Value>,
    pub stderr: String,
}

impl Run {
    /// The last event, which must be the result.
    pub fn result(&self) -> &Value {
        let Some(last) = self.events.last() else {
            panic!("no events; stderr:\n{}", self.stderr)
        };
        assert_eq!(last["type"], "result", "the last event is the result");
        last
    }

    /// The events of one type.
    pub fn of_type(&self, t: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["type"] == t).collect()
    }
}

/// `corral run --json ARGS` against `model`, on `worker` (embedded when
/// empty), with sessions kept in `sessions`.
pub fn command(
    model: &ModelServer,
    worker: &str,
    sessions: &Path,
    args: &[&str],
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(corral());
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", sessions)
        .env("OPENAI_API_KEY", "sk-test")
        .env("CORRAL_BASE_URL", &model.url)
        .env("CORRAL_SESSIONS_DIR", sessions)
        // An embedded worker (no worker given) keeps its state here.
        .env("CORRAL_STATE_DIR", sessions.join("embedded"))
        // The minimal image, for speed; `corral_run_default_image` runs
        // with the default one.
        .env("CORRAL_IMAGE", "corral-sandbox:latest")
        // Sandboxes stay for the tests to look into after a run; the
        // suspension of idle sessions has tests of its own.
        .env("CORRAL_KEEP_SANDBOX", "true")
        .arg("run")
        .arg("--json")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if !worker.is_empty() {
        cmd.env("CORRAL_WORKER", worker);
    }
    cmd
}

/// Runs `corral run --json ARGS` to its end (two minutes at most).
pub async fn corral_run(
    model: &ModelServer,
    worker: &str,
    sessions: &Path,
    args: &[&str],
) -> Result<Run> {
    corral_run_env(model, worker, sessions, args, &[]).await
}

/// As [`corral_run`], with more environment variables.
pub async fn corral_run_env(
    model: &ModelServer,
    worker: &str,
    sessions: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<Run> {
    let mut cmd = command(model, worker, sessions, args);
    cmd.envs(env.iter().copied());
    finish(cmd).await
}

/// As [`corral_run`], in the image `corral run` picks by default.
pub async fn corral_run_default_image(
    model: &ModelServer,
    worker: &str,
    sessions: &Path,
    args: &[&str],
) -> Result<Run> {
    let mut cmd = command(model, worker, sessions, args);
    cmd.env_remove("CORRAL_IMAGE");
    finish(cmd).await
}

/// Where the trajectories of the sessions the suite runs are kept:
/// `atif/` beside the binaries (the Python SDK's tests validate each one
/// against Harbor's ATIF models).
pub fn trajectories_dir() -> std::path::PathBuf {
    corral()
        .parent()
        .map_or_else(|| std::path::PathBuf::from("atif"), |d| d.join("atif"))
}

/// Exports session `id` of `sessions` as ATIF into [`trajectories_dir`],
/// as a user would (`corral session export --atif`).
pub async fn keep_trajectory(sessions: &Path, id: &str) -> Result<()> {
    let dir = trajectories_dir();
    std::fs::create_dir_all(&dir)?;
    let out = tokio::process::Command::new(corral())
        .args(["session", "export", "--atif", "--sessions-dir"])
        .arg(sessions)
        .arg(id)
        .arg(dir.join(format!("{id}.atif.json")))
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "corral session export --atif {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Runs a prepared `corral run` command to its end (two minutes at most).
pub async fn finish(mut cmd: tokio::process::Command) -> Result<Run> {
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .context("corral run did not finish")??;
    let stdout = String::from_utf8(out.stdout)?;
    let events = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).with_context(|| format!("not JSON: {l}")))
        .collect::<Result<Vec<_>>>()?;
    for e in &events {
        assert_eq!(e["v"], 1, "every event is versioned: {e}");
    }
    let sessions = cmd
        .as_std()
        .get_envs()
        .find(|(k, _)| *k == "CORRAL_SESSIONS_DIR")
        .and_then(|(_, v)| v.map(std::path::PathBuf::from));
    if let (Some(sessions), Some(id)) = (
        sessions,
        events
            .last()
            .filter(|e| e["type"] == "result")
            .and_then(|e| e["session_id"].as_str()),
    ) {
        keep_trajectory(&sessions, id).await?;
    }
    Ok(Run {
        code: out.status.code().unwrap_or(-1),
        events,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}
