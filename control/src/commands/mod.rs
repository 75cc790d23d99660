//! One module per command; each reports its own errors (one line on
//! stderr) and chooses its exit code.

mod cp;
mod exec;
mod local_worker;
mod ops;
mod run;
mod sandbox;
mod session;

use crate::cli::{Cli, Command};

/// Corral's own failures (as `docker run` uses 125).
pub const EXIT_CORRAL_ERROR: u8 = 125;
/// A usage error.
pub const EXIT_USAGE: u8 = 2;

/// Runs a parsed command; returns the process exit code.
pub async fn run(cli: Cli) -> u8 {
    match cli.command {
        Command::Exec(args) => exec::main(&cli.conn, args).await,
        Command::Sandbox(cmd) => sandbox::main(&cli.conn, cmd).await,
        Command::Cp(args) => cp::main(&cli.conn, &args).await,
        Command::Ps { sandbox, all } => ops::ps(&cli.conn, &sandbox, all).await,
        Command::Kill { operation, sandbox } => {
            ops::kill(&cli.conn, &operation, sandbox.as_deref()).await
        }
        Command::Logs { sandbox, follow } => ops::logs(&cli.conn, &sandbox, follow).await,
        Command::Run(args) => run::main(&cli.conn, &args).await,
        Command::Session(cmd) => session::main(&cli.conn, &cmd).await,
        Command::LocalWorker { idle } => local_worker::main(&cli.conn, idle).await,
    }
}

/// Says why a command failed: one line on stderr.
#[allow(clippy::print_stderr)]
fn report(e: &dyn std::error::Error) {
    eprintln!("corral: {}", corral_harness::client::source_chain(e));
}
