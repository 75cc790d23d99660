//! The local worker: what `corral` uses when given no `--worker`.
//!
//! The first `corral` command on a machine starts a worker process of its
//! own (`corral local-worker`, detached, logging to `worker.log` in its
//! state directory) serving a Unix socket beside its state; every later
//! command, concurrent or not, connects to the same one. It needs nothing
//! but a local Docker engine, and nobody starts or stops it by hand: it
//! exits once no command has been connected for a while (its sandboxes
//! keep running, and the next one adopts them). The socket's directory and
//! the token file are the user's own (0700, 0600), and the token is still
//! required on every call.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use corral_worker::process::default_state_dir;
use corral_worker::{Worker, WorkerConfig, WorkerError};

use corral_harness::client::{Credentials, WorkerClient};

/// The socket's file name in the state directory.
const SOCKET: &str = "worker.sock";
/// How long a starting local worker may take to answer.
const START_PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("local worker: {0}")]
    Worker(#[from] WorkerError),
    #[error("local worker: {0}")]
    Config(#[from] corral_worker::process::ConfigError),
    #[error("local worker: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "local worker: it did not answer within {} s of starting (see {log})",
        START_PATIENCE.as_secs()
    )]
    NoAnswer { log: String },
    /// The worker process ended at once; its last words.
    #[error("{0}")]
    Failed(String),
    #[error("local worker: serving: {0}")]
    Serve(#[from] corral_worker::server::ServeError),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> LocalError + 'a {
    move |source| LocalError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// The state directory of the local worker (`--state-dir`, else the
/// user's default).
pub fn state_dir(given: Option<&Path>) -> PathBuf {
    match given {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => default_state_dir("embedded"),
    }
}

/// The address of the local worker of `state`.
pub fn url(state: &Path) -> String {
    format!("unix://{}", state.join(SOCKET).display())
}

/// Makes the local worker's state directory (and what is missing above
/// it) its owner's only, and tightens what an older version left open: the
/// directory, Corral's own directory above it (`.../corral`), and the files
/// in it (a log, a lock) become 0700 and 0600.
fn private_state(state: &Path) -> Result<(), LocalError> {
    use std::os::unix::fs::PermissionsExt;
    corral_worker::state::private_dir(state).map_err(io("creating", state))?;
    if let Some(parent) = state
        .parent()
        .filter(|p| p.file_name() == Some("corral".as_ref()))
    {
        let _ = std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700));
    }
    for name in ["worker.log", "start.lock", "token"] {
        let path = state.join(name);
        if let Ok(meta) = std::fs::symlink_metadata(&path)
            && meta.is_file()
            && meta.permissions().mode() & 0o077 != 0
        {
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
    }
    Ok(())
}

/// A connection to the local worker of `state`, started first if none
/// answers. Starts are serialized by a lock file, so commands started
/// together share one worker.
pub async fn connect(state: &Path, docker_host: Option<&str>) -> Result<WorkerClient, LocalError> {
    private_state(state)?;
    let token_path = state.join("token");
    let token = corral_worker::process::token_or_new(&token_path)?;
    let creds = Credentials::token(Some(&token));
    let url = url(state);
    if let Some(client) = answers(&url, &creds).await {
        return Ok(client);
    }
    let lock_path = state.join("start.lock");
    let lock_file = corral_worker::state::private_file()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io("opening", &lock_path))?;
    let lock = tokio::task::spawn_blocking(move || {
        nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
    })
    .await
    .map_err(|e| LocalError::Io {
        what: "locking",
        path: lock_path.display().to_string(),
        source: std::io::Error::other(e),
    })?
    .map_err(|(_, e)| LocalError::Io {
        what: "locking",
        path: lock_path.display().to_string(),
        source: e.into(),
    })?;
    // Someone else may have started it while we waited for the lock.
    if let Some(client) = answers(&url, &creds).await {
        drop(lock);
        return Ok(client);
    }
    let log_path = state.join("worker.log");
    let mut child = start_process(state, docker_host, &log_path)?;
    let deadline = tokio::time::Instant::now() + START_PATIENCE;
    loop {
        if let Some(client) = answers(&url, &creds).await {
            drop(lock);
            return Ok(client);
        }
        if let Ok(Some(status)) = child.try_wait() {
            // It could not start (no Docker engine, say): what it said last.
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let last = log
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.trim_start_matches("corral: ").to_string())
                .unwrap_or_else(|| format!("local worker: exited with {status}"));
            return Err(LocalError::Failed(last));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(LocalError::NoAnswer {
                log: log_path.display().to_string(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client of the worker at `url`, if it answers.
async fn answers(url: &str, creds: &Credentials) -> Option<WorkerClient> {
    let client = WorkerClient::connect_with(url, creds).await.ok()?;
    let info = tokio::time::timeout(Duration::from_secs(5), client.worker_info()).await;
    matches!(info, Ok(Ok(_))).then_some(client)
}

/// Starts `corral local-worker` detached: its own process group (a Ctrl-C
/// at the terminal is not for it), no terminal, its log in the state
/// directory.
fn start_process(
    state: &Path,
    docker_host: Option<&str>,
    log: &Path,
) -> Result<std::process::Child, LocalError> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(io("finding", Path::new("corral")))?;
    let log_file = corral_worker::state::private_file()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io("opening", log))?;
    let err_file = log_file.try_clone().map_err(io("opening", log))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("local-worker")
        .arg("--state-dir")
        .arg(state)
        .stdin(std::process::Stdio::null())
        .stdout(log_file)
        .stderr(err_file)
        // The command's own endpoint, not the worker's (whose port it
        // would take).
        .env_remove("CORRAL_METRICS_LISTEN")
        .process_group(0);
    if let Some(host) = docker_host {
        cmd.arg("--docker-host").arg(host);
    }
    // Waited for only while it starts: it outlives this command by design.
    cmd.spawn().map_err(io("starting", log))
}

/// `corral local-worker`: serves the state directory's socket until no
/// command has been connected for `idle` (and no sandbox waits for its idle
/// timeout), or until SIGTERM / SIGINT.
pub async fn serve(
    state: &Path,
    docker_host: Option<String>,
    idle: Duration,
) -> Result<(), LocalError> {
    let mut config = WorkerConfig::new(state.to_path_buf());
    config.docker_host = docker_host;
    // The user runs their own Docker engine: what they ask for is theirs to
    // ask (still never a capability that reaches the host).
    config.policy = corral_worker::policy::permissive();
    // As `docker build` does: steps that download packages can.
    config.build.network = "bridge".into();
    // A worker that just decided to exit may still hold the state
    // directory for a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let worker = loop {
        match Worker::start(config.clone()).await {
            Err(WorkerError::StateLocked(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other?,
        }
    };
    // The state directory is ours now (the worker holds its lock): a socket
    // file left there is stale.
    let socket = state.join(SOCKET);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).map_err(io("listening on", &socket))?;
    let token = corral_worker::process::token_or_new(&state.join("token"))?;
    let connections = Arc::new(AtomicUsize::new(0));
    tracing::info!(socket = %socket.display(), "local worker serving");
    let stop = tokio_util::sync::CancellationToken::new();
    let served = {
        let stop = stop.clone();
        corral_worker::server::serve_unix(
            worker.clone(),
            listener,
            Some(token),
            connections.clone(),
            async move { stop.cancelled().await },
        )
    };
    let watch = async {
        let mut quiet_since = tokio::time::Instant::now();
        let mut signals = std::pin::pin!(crate::signals::stop_signals());
        loop {
            tokio::select! {
                Some(sig) = futures_util::StreamExt::next(&mut signals) => {
                    // A hangup is not for a detached worker.
                    if sig != 1 {
                        break;
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            let busy =
                connections.load(Ordering::SeqCst) > 0 || worker.sandboxes_with_idle_timeout() > 0;
            if busy {
                quiet_since = tokio::time::Instant::now();
            } else if quiet_since.elapsed() >= idle {
                tracing::info!(idle = ?idle, "no command connected: the local worker exits");
                break;
            }
        }
        stop.cancel();
    };
    let (served, ()) = tokio::join!(served, watch);
    let _ = std::fs::remove_file(&socket);
    worker.shutdown().await;
    served?;
    Ok(())
}
