//! `corral sandbox`: create, list, remove and reset sandboxes. Exits 0,
//! or 125 when it fails.

use std::io::Write;

use corral_proto::{NetworkMode, SandboxId, SandboxSpec, SandboxState};

use crate::cli::{ConnArgs, Network, SandboxCommand};
use crate::connect::{ConnectError, connect};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn main(conn: &ConnArgs, cmd: SandboxCommand) -> u8 {
    match sandbox_command(conn, cmd).await {
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

fn sandbox_id(s: &str) -> Result<SandboxId, Error> {
    SandboxId::new(s).map_err(|e| Error::Invalid(e.to_string()))
}

async fn sandbox_command(conn: &ConnArgs, cmd: SandboxCommand) -> Result<(), Error> {
    let conn = connect(conn).await?;
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
                return Err(Error::Invalid(format!("--cpus {c}: must be above 0")));
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
            spec.validate().map_err(|e| Error::Invalid(e.to_string()))?;
            let sb = conn.create_sandbox(id.as_ref(), spec).await?;
            writeln!(stdout, "{}", sb.id)?;
        }
        SandboxCommand::Ls => {
            let all = conn.list_sandboxes().await?;
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
            if !conn.destroy_sandbox(&id).await? {
                return Err(Error::Invalid(format!("unknown sandbox {id}")));
            }
        }
        SandboxCommand::Reset { id } => {
            let id = sandbox_id(&id)?;
            let killed = conn.reset_sandbox(&id).await?;
            writeln!(stdout, "killed {killed} processes")?;
        }
    }
    Ok(())
}
