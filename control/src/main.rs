//! `corral`: the control plane's command line. See the library docs.

// A binary talks to its terminal; the libraries never print.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

use corral_control::cli::Cli;
use corral_control::run::{EXIT_CORRAL_ERROR, run};

fn main() -> ExitCode {
    let cli = match corral_worker::cli::parse_args::<Cli>("corral") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    corral_worker::cli::init_logging("warn");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("corral: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_CORRAL_ERROR);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("corral: {}", corral_control::client::source_chain(&e));
            ExitCode::from(EXIT_CORRAL_ERROR)
        }
    }
}
