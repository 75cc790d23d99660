//! `corral worker`: what a worker says of itself, and its drain. Exits 0,
//! or 125 when it fails.

use std::io::Write;

use corral_proto::WorkerInfo;

use crate::cli::{ConnArgs, WorkerCommand};
use crate::connect::{ConnectError, connect};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn main(conn: &ConnArgs, cmd: &WorkerCommand) -> u8 {
    match worker_command(conn, cmd).await {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

async fn worker_command(conn: &ConnArgs, cmd: &WorkerCommand) -> Result<(), Error> {
    let worker = connect(conn).await?;
    let (info, json) = match cmd {
        WorkerCommand::Info { json } => (worker.worker_info().await?, *json),
        WorkerCommand::Drain => (worker.drain(true).await?, false),
        WorkerCommand::Undrain => (worker.drain(false).await?, false),
    };
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", to_json(&info))?;
    } else {
        for (k, v) in lines(&info) {
            writeln!(out, "{:<11} {v}", format!("{k}:"))?;
        }
    }
    Ok(())
}

fn drain_text(info: &WorkerInfo) -> String {
    if !info.draining {
        return "no".into();
    }
    let left = i64::try_from(info.drain_deadline_ms).unwrap_or(i64::MAX) - now_ms();
    if left <= 0 {
        "yes (deadline passed: what was left is removed)".into()
    } else {
        format!(
            "yes (what is left is removed in {})",
            humantime::format_duration(std::time::Duration::from_secs((left / 1000) as u64))
        )
    }
}

fn lines(info: &WorkerInfo) -> Vec<(&'static str, String)> {
    vec![
        ("id", info.worker_id.clone()),
        ("version", info.version.clone()),
        ("docker", info.docker_version.clone()),
        (
            "sandboxes",
            format!("{} of {}", info.sandboxes, info.max_sandboxes),
        ),
        ("running", info.running_operations.to_string()),
        ("draining", drain_text(info)),
    ]
}

fn to_json(info: &WorkerInfo) -> serde_json::Value {
    serde_json::json!({
        "worker_id": info.worker_id,
        "version": info.version,
        "docker_version": info.docker_version,
        "max_sandboxes": info.max_sandboxes,
        "sandboxes": info.sandboxes,
        "running_operations": info.running_operations,
        "draining": info.draining,
        "drain_deadline_ms": info.drain_deadline_ms,
    })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}
