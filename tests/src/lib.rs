//! corral-e2e: test and benchmark harness across Corral's crates.
//!
//! Everything here is real: a real Docker engine, real sandboxes built from
//! the `corral-sandbox:latest` image (`deploy/images/build.sh`), a real gRPC
//! server on `127.0.0.1:0`, and, for restart tests, the real `corral-worker`
//! and `corral` binaries in separate processes. Every worker gets its own id
//! and state directory, so tests run in parallel without touching each
//! other's sandboxes, and each harness removes its containers when dropped,
//! even after a failed assertion. Two fakes serve what a real part cannot
//! in a test's time: `fake`, a gRPC worker that only answers how full it
//! is (placement against a thousand workers), and `fake_api`, a scripted
//! worker behind the harness's `WorkerApi` for waiting logic with paused
//! time (deadlines of a minute in milliseconds).

pub mod egress;
pub mod fake;
pub mod fake_api;
pub mod fake_model;
pub mod model;
pub mod otlp;
pub mod run;
pub mod serve;
pub mod strict;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use corral_harness::client::WorkerClient;
use corral_proto::{
    Event, EventKind, OperationId, OperationResult, OperationSpec, SandboxId, SandboxSpec,
    ShellSpec,
};
use corral_worker::{Worker, WorkerConfig};
use futures_util::StreamExt;
use tokio::task::JoinHandle;

/// A session's settings for tests: `model` in `sandbox`, ten turns a run,
/// everything else the defaults.
pub fn session_config(model: &str, sandbox: SandboxId) -> corral_harness::agent::SessionConfig {
    corral_harness::agent::SessionConfig {
        model: model.into(),
        system_prompt: String::new(),
        tools: None,
        sandbox_id: sandbox,
        image: None,
        template: None,
        budget: corral_harness::context::Budget::default(),
        max_output_tokens: None,
        reasoning_effort: None,
        max_turns: 10,
        skills: Vec::new(),
        worker: None,
        endpoint: None,
        tool_choice: None,
        keep_tool_choice: false,
        workspace: None,
        worker_id: None,
        on_sandbox_lost: Default::default(),
        generation: 0,
        egress: Vec::new(),
        tenant: None,
    }
}

/// How the tests run Chromium: headless, no sandbox of its own (root in
/// CI), nothing fetched on its own, its console on stderr.
pub const CHROMIUM_HEADLESS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--enable-logging=stderr",
    "--v=0",
];

/// Debian's Chromium (or another Chrome on PATH), for the tests that open
/// pages in a real browser.
pub fn chromium() -> Result<PathBuf> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!("no chromium on PATH (apt-get install chromium)")
}

pub fn unique_id(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// Removes every container of a worker id (through the docker CLI, so it
/// works from `Drop`, outside any async runtime).
pub fn remove_containers_of(worker_id: &str) {
    let list = || -> Vec<String> {
        let out = Command::new("docker")
            .args([
                "ps",
                "-aq",
                "--filter",
                &format!("label=corral.worker={worker_id}"),
            ])
            .output();
        let Ok(out) = out else { return Vec::new() };
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    // A create the worker sent just before it was stopped (a pool's
    // refill, say) may still land: looked for until none is found twice in
    // a row.
    let mut quiet = 0;
    for _ in 0..20 {
        let ids = list();
        if ids.is_empty() {
            quiet += 1;
            if quiet >= 2 {
                return;
            }
        } else {
            quiet = 0;
            let _ = Command::new("docker")
                .arg("rm")
                .arg("-f")
                .args(&ids)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// The default image of the workers tests start: Corral's small busybox
/// one, quick to start (every client's default, `corral-debian`, is named
/// where a test needs python3 or checks the default itself).
pub const TEST_IMAGE: &str = "corral-sandbox:latest";

/// An in-process worker served on a loopback port, with a client.
pub struct Harness {
    pub worker: Worker,
    pub client: WorkerClient,
    pub url: String,
    pub worker_id: String,
    stop: tokio::sync::watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
    _state: tempfile::TempDir,
}

impl Harness {
    pub async fn start() -> Result<Self> {
        Self::start_with(|_| {}).await
    }

    /// Starts with a configuration adjusted by `tweak`.
    pub async fn start_with(tweak: impl FnOnce(&mut WorkerConfig)) -> Result<Self> {
        let state = tempfile::tempdir()?;
        let worker_id = unique_id("t");
        let mut config = WorkerConfig::new(state.path().to_path_buf());
        config.worker_id = Some(worker_id.clone());
        // `CORRAL_RUNTIME=runsc deploy/test.sh` runs the suite under gVisor
        // (worker processes read the same variable).
        config.defaults.runtime = std::env::var("CORRAL_RUNTIME").ok();
        // The small image, for speed (the real default has tests of its own).
        config.defaults.image = TEST_IMAGE.into();
        tweak(&mut config);
        let worker = Worker::start(config).await.context("starting the worker")?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let w = worker.clone();
        let server = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            let _ = corral_worker::server::serve(w, listener, None, shutdown).await;
        });
        let client = WorkerClient::connect(&url, None).await?;
        Ok(Self {
            worker,
            client,
            url,
            worker_id,
            stop,
            server: Some(server),
            _state: state,
        })
    }

    pub async fn sandbox(&self) -> Result<SandboxId> {
        self.sandbox_with(SandboxSpec::default()).await
    }

    pub async fn sandbox_with(&self, spec: SandboxSpec) -> Result<SandboxId> {
        let id = SandboxId::new(unique_id("sb"))?;
        self.client.create_sandbox(Some(&id), spec).await?;
        Ok(id)
    }

    /// Runs a shell command to its end; returns every event and the result.
    pub async fn run(&self, sandbox: &SandboxId, command: &str) -> Result<OperationResult> {
        Ok(self
            .run_spec(sandbox, OperationSpec::Shell(ShellSpec::new(command)))
            .await?
            .1)
    }

    pub async fn run_spec(
        &self,
        sandbox: &SandboxId,
        spec: OperationSpec,
    ) -> Result<(Vec<Event>, OperationResult)> {
        let op = OperationId::random();
        let after = self.client.get_sandbox(sandbox).await?.last_seq;
        self.client.submit(sandbox, &op, spec).await?;
        collect(&self.client, sandbox, &op, after).await
    }

    /// Stops serving and destroys every sandbox.
    pub async fn stop(mut self) {
        self.worker.destroy_all_and_shutdown().await;
        let _ = self.stop.send(true);
        if let Some(s) = self.server.take() {
            let _ = s.await;
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        remove_containers_of(&self.worker_id);
    }
}

/// Watches one operation from `after` until it finishes.
pub async fn collect(
    client: &WorkerClient,
    sandbox: &SandboxId,
    op: &OperationId,
    after: u64,
) -> Result<(Vec<Event>, OperationResult)> {
    let stream = client.watch(sandbox, after, Some(op)).await?;
    collect_from(stream).await
}

/// An operation's events on `stream`, to its end, and its result.
pub async fn collect_from(
    mut stream: corral_harness::client::EventStream,
) -> Result<(Vec<Event>, OperationResult)> {
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next())
            .await
            .context("operation did not finish within 120 s")?;
        let Some(event) = next else {
            bail!("event stream ended before the operation finished");
        };
        let event = event?;
        if let EventKind::Finished(result) = &event.kind {
            let result = (**result).clone();
            events.push(event);
            return Ok((events, result));
        }
        events.push(event);
    }
}

/// Runs `command` in `sandbox` to its end, in one call (`RunOperation`);
/// its stdout.
pub async fn run_shell(
    client: &WorkerClient,
    sandbox: &SandboxId,
    command: &str,
) -> Result<String> {
    let op = OperationId::random();
    let (_, stream) = client
        .run(
            sandbox,
            &op,
            OperationSpec::Shell(ShellSpec::new(command)),
            None,
        )
        .await?;
    let (events, _) = collect_from(stream).await?;
    Ok(String::from_utf8_lossy(&stdout_of(&events)).into_owned())
}

/// [`run_shell`] as three calls: the sandbox's last event, the submit,
/// and a watch of the operation from there.
pub async fn run_shell_in_three(
    client: &WorkerClient,
    sandbox: &SandboxId,
    command: &str,
) -> Result<String> {
    let op = OperationId::random();
    let after = client.get_sandbox(sandbox).await?.last_seq;
    client
        .submit(sandbox, &op, OperationSpec::Shell(ShellSpec::new(command)))
        .await?;
    let (events, _) = collect(client, sandbox, &op, after).await?;
    Ok(String::from_utf8_lossy(&stdout_of(&events)).into_owned())
}

/// The stdout bytes carried by output events.
pub fn stdout_of(events: &[Event]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        if let EventKind::Output {
            stream: corral_proto::OutputStream::Stdout,
            data,
        } = &e.kind
        {
            out.extend_from_slice(data);
        }
    }
    out
}

/// A workspace binary (`corral`, `corral-worker`), found next to the test
/// executable's target directory.
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent();
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent();
    }
    bail!(
        "binary {name} not found above {}; run `cargo build --workspace` first",
        exe.display()
    )
}

/// A free loopback port (bound then released), outside the ephemeral range.
pub fn free_port() -> Result<u16> {
    // Below the kernel's ephemeral range: a port the kernel hands out (as
    // `:0` would) is also the local end of other tests' outgoing
    // connections, so between this check and the bind by the process it
    // is for, one of them could take it. A port here is taken only by an
    // explicit bind, and it is drawn at random among thousands.
    const FROM: u16 = 20_000;
    let below = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if below > FROM + 1_000 {
        for _ in 0..200 {
            let draw = (uuid::Uuid::new_v4().as_u128() % u128::from(below - FROM)) as u16;
            let port = FROM + draw;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `cmd` (its stdout piped) and waits for its first line, which
/// must say it is `listening on` its address; killed if it says anything
/// else.
pub fn spawn_listening(cmd: &mut Command, what: &str) -> Result<Child> {
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    if !line.contains("listening on") {
        let _ = child.kill();
        bail!("{what} did not start: {line:?}");
    }
    Ok(child)
}

/// A `corral-worker` in its own process.
pub struct WorkerProcess {
    pub child: Child,
    pub port: u16,
    pub url: String,
    pub worker_id: String,
    pub state_dir: PathBuf,
}

impl WorkerProcess {
    /// Starts the worker binary and waits until it listens.
    pub fn spawn(
        state_dir: &Path,
        worker_id: &str,
        port: u16,
        extra: &[(&str, &str)],
        args: &[&str],
    ) -> Result<Self> {
        Self::spawn_on("127.0.0.1", state_dir, worker_id, port, extra, args)
    }

    /// [`Self::spawn`] on address `host` (one of 127/8, say).
    pub fn spawn_on(
        host: &str,
        state_dir: &Path,
        worker_id: &str,
        port: u16,
        extra: &[(&str, &str)],
        args: &[&str],
    ) -> Result<Self> {
        let mut cmd = Command::new(binary("corral-worker")?);
        cmd.arg("--listen")
            .arg(format!("{host}:{port}"))
            .arg("--state-dir")
            .arg(state_dir)
            .arg("--worker-id")
            .arg(worker_id)
            .args(args)
            // The small image, for speed, unless a test names another.
            .env("CORRAL_DEFAULT_IMAGE", TEST_IMAGE)
            .envs(extra.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let child = spawn_listening(&mut cmd, "worker")?;
        Ok(Self {
            child,
            port,
            url: format!("http://{host}:{port}"),
            worker_id: worker_id.to_string(),
            state_dir: state_dir.to_path_buf(),
        })
    }

    /// The token the worker made in its state directory (unless it was
    /// given one with --token-file).
    pub fn token_file(&self) -> PathBuf {
        self.state_dir.join("token")
    }

    /// The token clients present.
    pub fn token(&self) -> String {
        corral_worker::process::read_token(&self.token_file()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A client with the worker's token.
    pub async fn client(&self) -> Result<WorkerClient> {
        Ok(WorkerClient::connect(&self.url, Some(&self.token())).await?)
    }

    /// SIGKILL: no cleanup, no goodbye.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait (up to `within`) for a clean exit; returns the code.
    pub fn terminate(&mut self, within: Duration) -> Result<Option<i32>> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.code());
            }
            if std::time::Instant::now() > deadline {
                bail!("the worker did not exit within {within:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Peak resident memory (VmHWM) in bytes.
    pub fn peak_rss(&self) -> Result<u64> {
        self.status_bytes("VmHWM:")
    }

    /// Resident memory now (VmRSS) in bytes.
    pub fn rss(&self) -> Result<u64> {
        self.status_bytes("VmRSS:")
    }

    fn status_bytes(&self, field: &str) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no {field}"))?;
        Ok(kb * 1024)
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_containers_of(&self.worker_id);
    }
}
