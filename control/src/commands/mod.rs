//! One module per command; each reports its own errors (one line on
//! stderr) and chooses its exit code.

mod admin;
mod cp;
mod exec;
mod local_worker;
pub(crate) mod mcp;
pub(crate) mod mcp_http;
mod ops;
mod port;
mod remote;
mod run;
mod run_input;
mod sandbox;
mod serve;
mod session;
mod template;
mod volume;
mod worker;

use crate::cli::{Cli, Command};

pub use run::{DEFAULT_IMAGE, sessions};
pub use run_input::key_from;

/// Corral's own failures (as `docker run` uses 125).
pub const EXIT_CORRAL_ERROR: u8 = 125;
/// A usage error.
pub const EXIT_USAGE: u8 = 2;

/// Runs a parsed command, with the metrics endpoint up meanwhile when
/// asked for; returns the process exit code.
pub async fn run(cli: Cli) -> u8 {
    let Some(addr) = cli.metrics_listen else {
        return dispatch(cli).await;
    };
    let listener = match corral_worker::metrics::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            report(&e);
            return EXIT_CORRAL_ERROR;
        }
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(corral_worker::metrics::serve(
        listener,
        std::sync::Arc::new(|| corral_harness::metrics::control().render()),
        None,
        stop.clone().cancelled_owned(),
    ));
    let code = dispatch(cli).await;
    stop.cancel();
    match server.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "the metrics endpoint failed"),
        Err(e) => tracing::warn!(error = %e, "the metrics endpoint panicked"),
        Ok(Ok(())) => {}
    }
    code
}

async fn dispatch(mut cli: Cli) -> u8 {
    cli.conn = cli.conn.with_front_door_env();
    match cli.command {
        Command::Exec(args) => exec::main(&cli.conn, args).await,
        Command::Sandbox(cmd) => sandbox::main(&cli.conn, cmd).await,
        Command::Port(cmd) => port::main(&cli.conn, cmd).await,
        Command::Template(cmd) => template::main(&cli.conn, cmd).await,
        Command::Volume(cmd) => volume::main(&cli.conn, cmd).await,
        Command::Mcp(args) => mcp::main(&cli.conn, args).await,
        Command::Cp(args) => cp::main(&cli.conn, &args).await,
        Command::Ps { sandbox, all } => ops::ps(&cli.conn, &sandbox, all).await,
        Command::Kill { operation, sandbox } => {
            ops::kill(&cli.conn, &operation, sandbox.as_deref()).await
        }
        Command::Logs { sandbox, follow } => ops::logs(&cli.conn, &sandbox, follow).await,
        Command::Run(args) => match &args.control {
            Some(url) => remote::main(&cli.conn, &args, url).await,
            None => run::main(&cli.conn, &args).await,
        },
        Command::Serve(args) => serve::main(&cli.conn, &args).await,
        Command::Session(cmd) => session::main(&cli.conn, &cmd).await,
        Command::Worker(cmd) => worker::main(&cli.conn, &cmd).await,
        Command::Admin(cmd) => admin::main(&cli.conn, &cmd).await,
        Command::LocalWorker { idle } => local_worker::main(&cli.conn, idle).await,
    }
}

/// Says why a command failed: one line on stderr.
#[allow(clippy::print_stderr)]
fn report(e: &dyn std::error::Error) {
    eprintln!("{}", report_line(e));
}

/// The line [`report`] writes. An error may carry a sandbox's or a
/// worker's own words (a failed copy's stderr, say): their control
/// characters are shown escaped, never obeyed by the terminal.
fn report_line(e: &dyn std::error::Error) -> String {
    let text = corral_harness::client::source_chain(e);
    format!("corral: {}", crate::view::printable(&text))
}

/// Says something went wrong that did not stop the command: one line on
/// stderr.
#[allow(clippy::print_stderr)]
fn warn(text: &str) {
    eprintln!("corral: {}", crate::view::printable(text));
}

/// Says what a copy out of a sandbox left out, a line each (the names are
/// the sandbox's: their control characters are shown escaped).
#[allow(clippy::print_stderr)]
fn left_out(moved: &corral_harness::transfer::Moved) {
    for note in &moved.notes {
        eprintln!("corral: {}", crate::view::printable(note));
    }
    let more = moved.left_out.saturating_sub(moved.notes.len() as u64);
    if more > 0 {
        eprintln!("corral: and {more} more left out");
    }
    if moved.notes.iter().any(|n| n.contains("git configuration")) {
        eprintln!("corral: (git configuration is left out unless --with-git-config)");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reported_error_never_reaches_the_terminal_as_escapes() {
        // As a copy out of a hostile sandbox fails: its stderr in the error.
        let e = corral_harness::transfer::TransferError::Exited {
            code: 1,
            said: "no such file\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m".into(),
        };
        let line = super::report_line(&e);
        assert!(!line.chars().any(|c| c.is_control()), "{line:?}");
        assert_eq!(
            line,
            "corral: in the sandbox: no such file^[]0;owned^G^[[2J\\u{9b}31m"
        );
    }
}
