//! `corral`: the control plane's command line. See the library docs.

// A binary talks to its terminal; the libraries never print.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

use corral_control::cli::{Cli, Command};
use corral_control::run::{EXIT_CORRAL_ERROR, run};

fn main() -> ExitCode {
    let cli = match corral_worker::cli::parse_args::<Cli>("corral") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let level = if matches!(cli.command, Command::LocalWorker { .. }) {
        "info"
    } else {
        "warn"
    };
    corral_worker::cli::init_logging(level);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("corral: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_CORRAL_ERROR);
        }
    };
    let agent = matches!(cli.command, Command::Run(_) | Command::Session(_));
    let code = match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("corral: {}", corral_harness::client::source_chain(&e));
            ExitCode::from(e.exit_code(agent))
        }
    };
    // Nothing may keep the process alive once the run is over (a blocking
    // stdin read, say).
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}
