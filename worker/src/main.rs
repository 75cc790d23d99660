//! `corral-worker`: serves the worker's gRPC API. See the library docs.

// A binary talks to its terminal; the libraries never print.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use corral_worker::cli::WorkerArgs;
use corral_worker::{Worker, metrics, server};

fn main() -> ExitCode {
    let args = match corral_worker::process::parse_args::<WorkerArgs>("corral-worker") {
        Ok(args) => args,
        Err(code) => return code,
    };
    corral_worker::process::init_logging("info", args.log_format);
    if args.withhold_error_text {
        corral_proto::reason::withhold_text();
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("corral-worker: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("corral-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the open-file limit to its hard limit: every client connection,
/// watch and sandbox attachment holds descriptors, and the usual soft limit
/// of 1,024 is what a few hundred idle connections exhaust. Returns the
/// limit the process has now.
fn raise_open_file_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "cannot raise the open-file limit");
                return Some(soft);
            }
            Some(hard)
        }
        Ok((soft, _)) => Some(soft),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            None
        }
    }
}

/// Descriptors kept for what is not a client connection: the Docker
/// engine's, sandbox attachments, state files, the metrics endpoint.
const DESCRIPTORS_KEPT: u64 = 1024;

async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let nofile = raise_open_file_limit();
    let mut admission = args.admission();
    if let Some(nofile) = nofile {
        // Connections never take the descriptors the rest needs.
        let available = nofile.saturating_sub(DESCRIPTORS_KEPT) as usize;
        if admission.fit(available) {
            tracing::warn!(
                nofile,
                max_connections = admission.max_connections,
                max_pending = admission.max_pending,
                "the open-file limit is too low for the connection limits asked; lowered"
            );
        }
    }
    let token = args.token()?;
    let tls = args.tls()?;
    let config = args.worker_config()?;
    let listener = corral_worker::server::listen(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let metrics = match args.metrics_listen {
        Some(addr) => Some(metrics::bind(addr).await?),
        None => None,
    };
    let ports = match args.ports_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--ports-listen: cannot listen on {addr}"))?,
        ),
        None => None,
    };
    let worker = Worker::start(config).await?;
    let addr = listener.local_addr()?;
    // One line for whoever started it; a closed stdout is no failure.
    let _ = writeln!(
        std::io::stdout(),
        "corral-worker {} listening on {addr} (clients present the token in {})",
        worker.id(),
        args.token_path().display()
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let stalls = tokio::spawn(corral_worker::stall::watch("corral-worker", stop.clone()));
    let metrics = metrics.map(|listener| {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "serving metrics at /metrics and readiness at /readyz");
        }
        let (w, r) = (worker.clone(), worker.clone());
        let stopped = stop.clone().cancelled_owned();
        tokio::spawn(metrics::serve(
            listener,
            std::sync::Arc::new(move || w.metrics_text()),
            Some(std::sync::Arc::new(move || !r.draining())),
            stopped,
        ))
    });
    let ports = ports.map(|listener| {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "serving sandboxes' exposed ports");
            worker.ports_listening(format!("http://{addr}"));
        }
        worker.set_ports_token(Some(token.clone()));
        tokio::spawn(corral_worker::ports::http::serve(
            worker.clone(),
            listener,
            stop.clone(),
        ))
    });
    let stopping = worker.clone();
    let signalled = stop.clone();
    let shutdown = async move {
        shutdown_signal(&stopping).await;
        tracing::info!("shutting down; sandboxes keep running for the next start");
        signalled.cancel();
        // Ends the actors and the open watch streams, so the server drains.
        stopping.shutdown().await;
    };
    let served = server::serve_with(
        worker,
        listener,
        server::ServeOptions {
            token: Some(token),
            tls,
            admission,
            request_memory: Some(usize::try_from(args.max_request_memory).unwrap_or(usize::MAX)),
        },
        shutdown,
    )
    .await;
    stop.cancel();
    let _ = stalls.await;
    if let Some(task) = ports {
        let _ = task.await;
    }
    if let Some(task) = metrics {
        match task.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the metrics endpoint failed"),
            Err(e) => tracing::warn!(error = %e, "the metrics endpoint panicked"),
            Ok(Ok(())) => {}
        }
    }
    served?;
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C; meanwhile SIGUSR1 starts a drain.
async fn shutdown_signal(worker: &Worker) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut usr1)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::user_defined1()),
    ) else {
        return std::future::pending().await;
    };
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            _ = usr1.recv() => {
                tracing::info!("SIGUSR1: draining");
                if let Err(e) = worker.drain(true) {
                    tracing::error!(error = %e, "cannot start draining");
                }
            }
        }
    }
}
