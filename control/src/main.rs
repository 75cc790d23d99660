//! `corral`: the control plane's command line, a thin layer over the
//! harness library (`corral-harness`).
//!
//! It owns argument parsing ([`cli`]), one module per command
//! ([`commands`]), which worker a command talks to ([`connect`]), the local
//! worker that `corral` commands share when given no `--worker`
//! ([`local`]), `corral exec`'s engine ([`exec`]: live output, input and
//! terminals, resumed from a cursor across worker restarts), the views of
//! `corral run` ([`view`]), the terminal ([`terminal`]) and the stop
//! signals ([`signals`]), and `corral serve`, the control plane as a
//! service ([`serve`]: the sessions it hosts, their events, its gRPC
//! service). It does not run operations itself: that is the
//! worker's job.

mod cli;
mod commands;
mod connect;
mod exec;
mod local;
mod serve;
mod signals;
mod terminal;
mod view;

use std::process::ExitCode;

use cli::{Cli, Command};

#[allow(clippy::print_stderr)]
fn main() -> ExitCode {
    let cli = match corral_worker::process::parse_args::<Cli>("corral") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let level = if matches!(cli.command, Command::LocalWorker { .. } | Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    corral_worker::process::init_logging(level, cli.log_format);
    // The service runs many sessions whose logs are appended and synced
    // from their tasks (each sync hands its thread's other tasks over
    // first: see the session log): threads enough besides that a slow disk
    // never keeps its connections' HTTP/2 pings unanswered.
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if matches!(cli.command, Command::Serve(_)) {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        builder.worker_threads((cores * 4).max(8));
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("corral: cannot start the async runtime: {e}");
            return ExitCode::from(commands::EXIT_CORRAL_ERROR);
        }
    };
    let code = runtime.block_on(commands::run(cli));
    // Nothing may keep the process alive once the run is over (a blocking
    // stdin read, say).
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    ExitCode::from(code)
}
