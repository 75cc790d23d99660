//! `corral serve` in its own process, over workers in theirs (their token
//! shared), with the scripted model server: what the service's tests and
//! its benchmark run against.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, Result};
use corral_harness::client::{Credentials, WorkerClient};
use corral_harness::control::ControlClient;
use serde_json::json;

use crate::model::{ModelServer, Received, Reply, responses};
use crate::{WorkerProcess, binary, free_port, unique_id};

pub const TOKEN: &str = "serve-test-token-0123456789abcdef";

/// The model: the command the session's first message names, as a Bash
/// call, then, once its result is in, "Done." (also the cluster check's).
pub fn respond(req: &Received) -> Reply {
    if req.text().contains("function_call_output") {
        return responses::text("Done.");
    }
    let command = req.body["input"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["role"] == "user")
        .find_map(|i| i["content"].as_str())
        .unwrap_or("echo nothing asked")
        .to_string();
    responses::calls(&[("c1", "Bash", &json!({ "command": command }).to_string())])
}

/// A replica of `corral serve` besides a [`Setup`]'s own, killed when
/// dropped.
pub struct Replica(pub std::process::Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Workers (their token shared), a model, and `corral serve` over them.
pub struct Setup {
    pub workers: Vec<WorkerProcess>,
    _states: Vec<tempfile::TempDir>,
    pub token: PathBuf,
    pub model: ModelServer,
    pub sessions: tempfile::TempDir,
    serve_state: tempfile::TempDir,
    dir: tempfile::TempDir,
    pub serve: Option<std::process::Child>,
    pub port: u16,
    max_sessions: u32,
    withhold: bool,
    /// More flags for `corral serve`, at its next start.
    pub service_args: Vec<String>,
}

impl Setup {
    /// `workers` workers and a service hosting up to `max_sessions`, with
    /// a model that answers as [`respond`] does.
    pub async fn start(workers: usize, max_sessions: u32) -> Result<Self> {
        Self::start_with(
            workers,
            max_sessions,
            ModelServer::responding(respond).await,
            true,
            0,
        )
        .await
    }

    /// As [`Self::start`], with `model`; `withhold`: the workers and the
    /// service give every error one fixed text (clients go by reasons);
    /// `pool`: each worker keeps that many warm `corral-sandbox` members.
    pub async fn start_with(
        workers: usize,
        max_sessions: u32,
        model: ModelServer,
        withhold: bool,
        pool: u32,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let token = dir.path().join("worker-token");
        std::fs::write(&token, format!("{TOKEN}\n"))?;
        std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let mut s = Self {
            workers: Vec::new(),
            _states: Vec::new(),
            token,
            model,
            sessions: tempfile::tempdir()?,
            serve_state: tempfile::tempdir()?,
            dir,
            serve: None,
            port: free_port()?,
            max_sessions,
            withhold,
            service_args: Vec::new(),
        };
        let run = unique_id("sv");
        let pool_arg = format!("corral-sandbox:latest={pool}");
        let token = s.token.to_str().context("token path")?.to_string();
        let mut args = vec!["--max-sandboxes", "40", "--token-file", token.as_str()];
        if withhold {
            args.push("--withhold-error-text");
        }
        if pool > 0 {
            args.extend(["--pool", pool_arg.as_str()]);
        }
        for i in 0..workers {
            let state = tempfile::tempdir()?;
            let w = WorkerProcess::spawn(
                state.path(),
                &format!("{run}-w{i}"),
                free_port()?,
                &[("CORRAL_LOG", "warn")],
                &args,
            )?;
            s._states.push(state);
            s.workers.push(w);
        }
        s.start_service()?;
        Ok(s)
    }

    pub fn worker_list(&self) -> String {
        self.workers
            .iter()
            .map(|w| w.url.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts `corral serve` (again, on the same port and state).
    pub fn start_service(&mut self) -> Result<()> {
        let mut cmd = self.service_command(
            self.port,
            self.serve_state.path(),
            self.sessions.path(),
            &self.service_args,
        )?;
        self.serve = Some(crate::spawn_listening(&mut cmd, "corral serve")?);
        Ok(())
    }

    /// Another `corral serve` over the same workers and model, on `port`
    /// with its own state and sessions directories and `args`: a second
    /// replica of a front door. Killed when dropped.
    pub fn spawn_replica(
        &self,
        port: u16,
        state: &std::path::Path,
        sessions: &std::path::Path,
        args: &[String],
    ) -> Result<Replica> {
        let mut cmd = self.service_command(port, state, sessions, args)?;
        Ok(Replica(crate::spawn_listening(
            &mut cmd,
            "a second replica of corral serve",
        )?))
    }

    fn service_command(
        &self,
        port: u16,
        state: &std::path::Path,
        sessions: &std::path::Path,
        args: &[String],
    ) -> Result<std::process::Command> {
        let mut cmd = std::process::Command::new(binary("corral")?);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", self.dir.path())
            .env("OPENAI_API_KEY", "sk-test")
            .env("CORRAL_LOG", "warn")
            .args(["--worker", &self.worker_list(), "--token-file"])
            .arg(&self.token)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--serve-state-dir")
            .arg(state)
            .arg("--sessions-dir")
            .arg(sessions)
            .args([
                "--base-url",
                &self.model.url,
                "--image",
                "corral-sandbox:latest",
            ])
            .args(["--max-sessions", &self.max_sessions.to_string()])
            .args(["--heartbeat", "0"])
            // Clients may name model servers on loopback (the tests' own).
            .args(["--allow-base-url", "http://127.0.0.1"])
            // Its clients go by reasons alone (so do the workers').
            .args(self.withhold.then_some("--withhold-error-text"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        Ok(cmd)
    }

    pub fn kill_service(&mut self) {
        if let Some(mut c) = self.serve.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn service_token(&self) -> PathBuf {
        self.serve_state.path().join("token")
    }

    pub async fn client(&self) -> Result<ControlClient> {
        let token = corral_worker::process::read_token(&self.service_token())?;
        Ok(ControlClient::connect(&self.url(), &Credentials::token(Some(&token))).await?)
    }

    /// Waits (two minutes at most) until every worker's pool has `n`
    /// members ready.
    pub async fn pools_ready(&self, n: u32) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        for w in &self.workers {
            let client = self.worker(&w.url).await?;
            loop {
                let info = client.worker_info().await?;
                if info.pools.iter().any(|p| p.ready >= n) {
                    break;
                }
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "the pools never filled"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    pub async fn worker(&self, url: &str) -> Result<WorkerClient> {
        Ok(WorkerClient::connect(url, Some(TOKEN)).await?)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.kill_service();
    }
}
