//! `corral-worker`: serves the worker's gRPC API. See the library docs.

// A binary talks to its terminal; the libraries never print.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

use anyhow::Context;
use corral_worker::cli::WorkerArgs;
use corral_worker::{Worker, server};

fn main() -> ExitCode {
    let args = match corral_worker::cli::parse_args::<WorkerArgs>("corral-worker") {
        Ok(args) => args,
        Err(code) => return code,
    };
    corral_worker::cli::init_logging("info");
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
/// of 1,024 is what a few hundred idle connections exhaust.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
}

async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    raise_open_file_limit();
    let token = args.token()?;
    let tls = args.tls()?;
    let config = args.worker_config()?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let worker = Worker::start(config).await?;
    let addr = listener.local_addr()?;
    println!(
        "corral-worker {} listening on {addr} (clients present the token in {})",
        worker.id(),
        args.token_path().display()
    );
    let stopping = worker.clone();
    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!("shutting down; sandboxes keep running for the next start");
        // Ends the actors and the open watch streams, so the server drains.
        stopping.shutdown().await;
    };
    server::serve_with(
        worker,
        listener,
        server::ServeOptions {
            token: Some(token),
            tls,
            admission: args.admission(),
        },
        shutdown,
    )
    .await?;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
