//! `corral port`: a sandbox's ports reached from outside, through its
//! worker's port listener (`corral-worker --ports-listen`).

use std::io::Write;
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::pb::{PortAccess, PortExposure};

use crate::cli::{ConnArgs, PortAccessArg, PortCommand};
use crate::connect::ConnectError;

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

pub async fn main(conn: &ConnArgs, cmd: PortCommand) -> u8 {
    match port_command(conn, cmd).await {
        Ok(code) => code,
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) | Error::Invalid(_) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

fn sandbox_id(s: &str) -> Result<SandboxId, Error> {
    SandboxId::new(s).map_err(|e| Error::Invalid(e.to_string()))
}

fn access_name(a: PortAccess) -> &'static str {
    match a {
        PortAccess::Unspecified | PortAccess::Private => "private",
        PortAccess::Signed => "signed",
        PortAccess::Public => "public",
    }
}

fn to_json(e: &PortExposure) -> serde_json::Value {
    let mut v = serde_json::json!({
        "sandbox_id": e.sandbox_id,
        "port": e.port,
        "access": access_name(e.access()),
        "url": e.url,
        "expires_at_unix_ms": (e.expires_at_unix_ms > 0).then_some(e.expires_at_unix_ms),
    });
    if !e.token.is_empty() {
        v["token"] = e.token.clone().into();
    }
    v
}

async fn port_command(conn: &ConnArgs, cmd: PortCommand) -> Result<u8, Error> {
    let mut stdout = std::io::stdout().lock();
    match cmd {
        PortCommand::Expose {
            id,
            port,
            access,
            ttl,
            json,
        } => {
            let id = sandbox_id(&id)?;
            let access = match access {
                PortAccessArg::Private => PortAccess::Private,
                PortAccessArg::Signed => PortAccess::Signed,
                PortAccessArg::Public => PortAccess::Public,
            };
            let c = crate::connect::connect_for(conn, &id).await?;
            let e = c.expose_port(&id, port, access, ttl).await?;
            if json {
                writeln!(stdout, "{}", to_json(&e))?;
            } else if e.token.is_empty() {
                writeln!(stdout, "{}", e.url)?;
            } else {
                // A URL a browser opens as it is: the token comes once in
                // it, then as a cookie.
                writeln!(stdout, "{}?token={}", e.url, e.token)?;
            }
        }
        PortCommand::Ls { id, json } => {
            let id = sandbox_id(&id)?;
            let c = crate::connect::connect_for(conn, &id).await?;
            let all = c.list_exposures(&id).await?;
            for e in &all {
                if json {
                    writeln!(stdout, "{}", to_json(e))?;
                } else {
                    let until = if e.expires_at_unix_ms > 0 {
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                        let left = (e.expires_at_unix_ms - now).max(0);
                        format!(
                            "{} left",
                            humantime::format_duration(Duration::from_secs(
                                u64::try_from(left / 1000).unwrap_or(0)
                            ))
                        )
                    } else {
                        "until revoked".into()
                    };
                    writeln!(
                        stdout,
                        "{}\t{}\t{}\t{until}",
                        e.port,
                        access_name(e.access()),
                        e.url
                    )?;
                }
            }
        }
        PortCommand::Revoke { id, port } => {
            let id = sandbox_id(&id)?;
            let c = crate::connect::connect_for(conn, &id).await?;
            if !c.revoke_access(&id, port).await? {
                super::warn(&format!("port {port} of {id} was not exposed"));
                return Ok(1);
            }
        }
    }
    Ok(0)
}
