//! Running a parsed `corral` command: connect (or embed) a worker, do the
//! thing, and map how it ended to an exit code.

use std::io::Write;

use corral_proto::{NetworkMode, SandboxId, SandboxSpec, SandboxState, TerminalSize};

use crate::cli::{Cli, Command, ConnArgs, ExecArgs, Network, SandboxCommand};
use crate::exec::{self, ExecError, ExecRequest};
use corral_harness::client::{ClientError, ClientTls, Credentials, WorkerClient, source_chain};

/// Exit code for Corral's own failures (as `docker run` uses 125).
pub const EXIT_CORRAL_ERROR: u8 = 125;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Local(#[from] crate::local::LocalError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Config(#[from] corral_worker::cli::ConfigError),
    #[error("{0}")]
    Invalid(String),
    /// A usage error of `corral run` / `corral session` (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// An agent run failed (exit code 1).
    #[error("{0}")]
    Failed(String),
    #[error(transparent)]
    Session(#[from] corral_harness::session::LogError),
    #[error(transparent)]
    Core(#[from] corral_harness::agent::CoreError),
    #[error(transparent)]
    Lifecycle(#[from] corral_harness::sessions::SessionError),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl RunError {
    /// The exit code for this error: 2 for usage errors, 1 for a failed
    /// agent run, otherwise Corral's own failure code.
    pub fn exit_code(&self, agent: bool) -> u8 {
        match self {
            RunError::Usage(_) => crate::agent_run::EXIT_USAGE,
            RunError::Session(corral_harness::session::LogError::BadId(_))
            | RunError::Session(corral_harness::session::LogError::AlreadyExists(_))
            | RunError::Session(corral_harness::session::LogError::NotFound(_))
            | RunError::Session(corral_harness::session::LogError::BadForkPoint { .. })
                if agent =>
            {
                crate::agent_run::EXIT_USAGE
            }
            RunError::Lifecycle(corral_harness::sessions::SessionError::NoSuchTurn { .. }) => {
                crate::agent_run::EXIT_USAGE
            }
            _ if agent => crate::agent_run::EXIT_FAILED,
            _ => EXIT_CORRAL_ERROR,
        }
    }
}

pub(crate) struct Connection {
    pub(crate) client: WorkerClient,
    pub(crate) creds: Credentials,
}

fn read(path: &std::path::Path, what: &str) -> Result<Vec<u8>, RunError> {
    std::fs::read(path).map_err(|e| RunError::Invalid(format!("{what} {}: {e}", path.display())))
}

fn client_tls(conn: &ConnArgs) -> Result<Option<ClientTls>, RunError> {
    let ca_pem = conn
        .tls_ca
        .as_deref()
        .map(|p| read(p, "--tls-ca"))
        .transpose()?;
    let identity = match (&conn.tls_cert, &conn.tls_key) {
        (Some(c), Some(k)) => Some((read(c, "--tls-cert")?, read(k, "--tls-key")?)),
        (None, None) => None,
        _ => {
            return Err(RunError::Invalid(
                "--tls-cert and --tls-key go together".into(),
            ));
        }
    };
    Ok((ca_pem.is_some() || identity.is_some()).then_some(ClientTls { ca_pem, identity }))
}

/// The workers of `--worker` (a comma-separated list), with a scheme.
pub(crate) fn worker_urls(conn: &ConnArgs) -> Vec<String> {
    conn.worker
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            if u.contains("://") {
                u.to_string()
            } else {
                format!("http://{u}")
            }
        })
        .collect()
}

/// Whether `url` names this machine (a worker this user may have started).
fn is_loopback(url: &str) -> bool {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let host = rest.split('/').next().unwrap_or("");
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The token for the workers of `--worker`: `--token-file`, else, for a
/// worker on this machine, the one a worker run by this user made in its
/// default state directory (never sent anywhere else).
fn credentials(conn: &ConnArgs) -> Result<Credentials, RunError> {
    let own = corral_worker::cli::default_state_dir("worker").join("token");
    let local = worker_urls(conn).iter().all(|u| is_loopback(u));
    let token = match conn.token_file.as_deref() {
        Some(path) => Some(corral_worker::cli::read_token(path)?),
        None if local && own.exists() => Some(corral_worker::cli::read_token(&own)?),
        None => None,
    };
    Ok(Credentials {
        token,
        tls: client_tls(conn)?,
    })
}

/// Connects to the one worker of `--worker`, or embeds one.
pub(crate) async fn connect(conn: &ConnArgs) -> Result<Connection, RunError> {
    let urls = worker_urls(conn);
    if urls.len() > 1 {
        return Err(RunError::Usage(
            "several workers are for corral run (it places each session); give this command one --worker".into(),
        ));
    }
    connect_to(conn, urls.first().map(String::as_str)).await
}

/// Connects to `url`, or to the local worker when there is none.
pub(crate) async fn connect_to(conn: &ConnArgs, url: Option<&str>) -> Result<Connection, RunError> {
    match url {
        Some(url) => {
            let creds = credentials(conn)?;
            let client = WorkerClient::connect_with(url, &creds).await?;
            Ok(Connection { client, creds })
        }
        None => {
            let state = crate::local::state_dir(conn.state_dir.as_deref());
            let (client, creds) =
                crate::local::connect(&state, conn.docker_host.as_deref()).await?;
            Ok(Connection { client, creds })
        }
    }
}

/// Picks the worker for a new session: of those that answer within 5 s,
/// the one with the most free sandbox slots (then the fewest running
/// operations, then the first listed).
pub(crate) async fn place(conn: &ConnArgs, urls: &[String]) -> Result<String, RunError> {
    let creds = credentials(conn)?;
    let probes = urls.iter().map(|url| {
        let creds = creds.clone();
        async move {
            let probe = async {
                let client = WorkerClient::connect_with(url, &creds).await?;
                client.worker_info().await
            };
            let info = tokio::time::timeout(std::time::Duration::from_secs(5), probe)
                .await
                .map_err(|_| "no answer within 5 s".to_string())
                .and_then(|r| r.map_err(|e| source_chain(&e)));
            (url.clone(), info)
        }
    });
    let answers = futures_util::future::join_all(probes).await;
    let mut best: Option<(String, u32, u32)> = None;
    let mut why = Vec::new();
    for (url, info) in answers {
        match info {
            Ok(i) => {
                let free = i.max_sandboxes.saturating_sub(i.sandboxes);
                tracing::debug!(worker = %url, free, running = i.running_operations, "worker answered");
                if free == 0 {
                    why.push(format!("{url}: full ({} sandboxes)", i.sandboxes));
                    continue;
                }
                let better = best
                    .as_ref()
                    .is_none_or(|(_, f, r)| free > *f || (free == *f && i.running_operations < *r));
                if better {
                    best = Some((url, free, i.running_operations));
                }
            }
            Err(e) => why.push(format!("{url}: {e}")),
        }
    }
    best.map(|(url, _, _)| url).ok_or_else(|| {
        RunError::Failed(format!(
            "no worker can take the session: {}",
            why.join("; ")
        ))
    })
}

/// Runs the command; returns the process exit code.
pub async fn run(cli: Cli) -> Result<u8, RunError> {
    match &cli.command {
        Command::Run(args) => return crate::agent_run::run_agent(&cli.conn, args).await,
        Command::Session(cmd) => {
            return crate::agent_run::run_session_command(&cli.conn, cmd).await;
        }
        Command::LocalWorker { idle } => {
            let state = crate::local::state_dir(cli.conn.state_dir.as_deref());
            crate::local::serve(&state, cli.conn.docker_host.clone(), *idle).await?;
            return Ok(0);
        }
        Command::Exec(_) | Command::Sandbox(_) => {}
    }
    let conn = connect(&cli.conn).await?;
    match cli.command {
        Command::Exec(args) => run_exec(&conn, args).await,
        Command::Sandbox(cmd) => run_sandbox(&conn, cmd).await.map(|()| 0),
        Command::Run(_) | Command::Session(_) | Command::LocalWorker { .. } => Ok(0),
    }
}

fn sandbox_id(s: &str) -> Result<SandboxId, RunError> {
    SandboxId::new(s).map_err(|e| RunError::Invalid(e.to_string()))
}

/// The numbers of the SIGINT, SIGTERM and SIGHUP this process gets, as
/// they come.
pub(crate) fn stop_signals() -> impl futures_util::Stream<Item = i32> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    );
    futures_util::stream::unfold(handlers, |mut h| async move {
        let sig = match &mut h {
            (Ok(int), Ok(term), Ok(hup)) => tokio::select! {
                _ = int.recv() => 2,
                _ = term.recv() => 15,
                _ = hup.recv() => 1,
            },
            // No handlers (not expected on Unix): Ctrl-C alone.
            _ => {
                tokio::signal::ctrl_c().await.ok()?;
                2
            }
        };
        Some((sig, h))
    })
}

/// Resolves with the first of [`stop_signals`]. The handlers are in place
/// when this returns (not when the future is first polled), so a signal
/// that comes at once is not the default death.
pub(crate) fn stop_signal() -> impl std::future::Future<Output = i32> + Send + 'static {
    use futures_util::StreamExt;
    let signals = stop_signals();
    async move {
        let mut signals = std::pin::pin!(signals);
        signals.next().await.unwrap_or(2)
    }
}

async fn run_exec(conn: &Connection, args: ExecArgs) -> Result<u8, RunError> {
    let terminal = args
        .tty
        .then(|| crate::terminal::current_size().unwrap_or(TerminalSize { rows: 24, cols: 80 }));
    let req = ExecRequest {
        sandbox: args.sandbox.as_deref().map(sandbox_id).transpose()?,
        image: args.image.clone(),
        timeout: args.timeout,
        env: args.env_map(),
        workdir: args.workdir.clone(),
        use_bash: args.bash,
        argv: args.argv.clone(),
        keep_background: args.keep_background,
        stdin: args.interactive,
        terminal,
        idle_timeout: args.idle_timeout,
    };
    let mut controls = exec::Controls::stop_on(stop_signal());
    if args.interactive {
        controls.input = Some(Box::pin(tokio::io::stdin()));
    }
    // Keys go to the remote terminal as typed (Ctrl-C included) while it
    // runs; the local modes come back when this guard goes.
    let _raw = (args.tty && args.interactive)
        .then(crate::terminal::RawMode::enable)
        .flatten();
    if args.tty {
        controls.resize = crate::terminal::resizes()
            .ok()
            .map(|s| Box::pin(s) as std::pin::Pin<Box<_>>);
    }
    let mut out = tokio::io::stdout();
    let mut err = tokio::io::stderr();
    let ended = exec::exec(
        conn.client.clone(),
        &conn.creds,
        req,
        &mut out,
        &mut err,
        controls,
    )
    .await?;
    drop(_raw);
    use corral_proto::Outcome;
    let outcome = &ended.result.outcome;
    if ended.output_closed {
        // As a shell reports a command killed by SIGPIPE, and silently.
        return Ok(141);
    }
    match (outcome, ended.stopped_by) {
        (Outcome::Exited { .. } | Outcome::Signaled { .. }, _) => {}
        (Outcome::Canceled, Some(sig)) => {
            let name = match sig {
                1 => "SIGHUP",
                2 => "SIGINT",
                15 => "SIGTERM",
                _ => "a signal",
            };
            let line = format!("corral: command canceled ({name})\n");
            tokio::io::AsyncWriteExt::write_all(&mut err, line.as_bytes()).await?;
            return Ok(128 + sig as u8);
        }
        (other, _) => {
            let line = format!("corral: command {other}\n");
            tokio::io::AsyncWriteExt::write_all(&mut err, line.as_bytes()).await?;
        }
    }
    Ok(outcome.exit_status().clamp(0, 255) as u8)
}

async fn run_sandbox(conn: &Connection, cmd: SandboxCommand) -> Result<(), RunError> {
    let mut stdout = std::io::stdout().lock();
    match cmd {
        SandboxCommand::Create {
            id,
            image,
            network,
            memory,
            cpus,
            pids,
            workspace_size,
            tmp_size,
            root,
            writable_rootfs,
            cap_add,
            env,
            runtime,
            idle_timeout,
        } => {
            let id = id.as_deref().map(sandbox_id).transpose()?;
            if let Some(c) = cpus
                && !(c > 0.0 && c <= 1024.0)
            {
                return Err(RunError::Invalid(format!("--cpus {c}: must be above 0")));
            }
            let spec = SandboxSpec {
                image,
                network: match network {
                    Network::None => NetworkMode::None,
                    Network::Bridge => NetworkMode::Bridge,
                },
                memory_bytes: memory,
                cpu_millis: cpus.map(|c| (c * 1000.0).round() as u32),
                pids_limit: pids,
                workspace_bytes: workspace_size,
                tmp_bytes: tmp_size,
                run_as_root: root,
                writable_rootfs,
                add_capabilities: cap_add,
                env: env.into_iter().collect(),
                runtime,
                idle_timeout_ms: idle_timeout.map(|d| d.as_millis() as u64),
            };
            spec.validate()
                .map_err(|e| RunError::Invalid(e.to_string()))?;
            let sb = conn.client.create_sandbox(id.as_ref(), spec).await?;
            writeln!(stdout, "{}", sb.id)?;
        }
        SandboxCommand::Ls => {
            let all = conn.client.list_sandboxes().await?;
            writeln!(
                stdout,
                "{:<38} {:<8} {:<24} {:>7} CONTAINER",
                "ID", "STATE", "IMAGE", "RUNNING"
            )?;
            for sb in all {
                let state = match &sb.state {
                    SandboxState::Ready => "ready",
                    SandboxState::Starting => "starting",
                    SandboxState::Lost(_) => "lost",
                };
                let image = sb.spec.image.as_deref().unwrap_or("(default)");
                writeln!(
                    stdout,
                    "{:<38} {:<8} {:<24} {:>7} {}",
                    sb.id,
                    state,
                    image,
                    sb.running_operations,
                    &sb.container_id[..sb.container_id.len().min(12)]
                )?;
            }
        }
        SandboxCommand::Rm { id } => {
            let id = sandbox_id(&id)?;
            if !conn.client.destroy_sandbox(&id).await? {
                return Err(RunError::Invalid(format!("unknown sandbox {id}")));
            }
        }
        SandboxCommand::Reset { id } => {
            let id = sandbox_id(&id)?;
            let killed = conn.client.reset_sandbox(&id).await?;
            writeln!(stdout, "killed {killed} processes")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_token_goes_only_to_workers_on_this_machine() {
        for url in [
            "http://127.0.0.1:7070",
            "http://localhost:1",
            "https://[::1]:7070",
            "127.0.0.2:9",
        ] {
            assert!(is_loopback(url), "{url}");
        }
        for url in [
            "http://10.0.0.1:7070",
            "https://example.com",
            "http://127.0.0.1.evil.org:1",
        ] {
            assert!(!is_loopback(url), "{url}");
        }
    }
}
