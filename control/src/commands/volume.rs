//! `corral volume`: filesystems a worker keeps across sandboxes, made,
//! listed, removed, and copied into and out of through a sandbox of their
//! own.

use std::io::Write;

use corral_proto::volume::VolumeMount;
use corral_proto::{SandboxSpec, pb};

use corral_harness::client::WorkerClient;
use corral_proto::SandboxId;

use crate::cli::{ConnArgs, CpArgs, VolumeCommand};
use crate::connect::ConnectError;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Failed(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Self::Client(s.into())
    }
}

pub async fn main(conn: &ConnArgs, cmd: VolumeCommand) -> u8 {
    match volume_command(conn, cmd).await {
        Ok(code) => code,
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) | Error::Invalid(_) => super::EXIT_USAGE,
                Error::Failed(_) => 1,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

fn to_json(v: &pb::Volume) -> serde_json::Value {
    serde_json::json!({
        "name": v.name,
        "size_bytes": v.size_bytes,
        "used_bytes": v.used_bytes,
        "created_at_unix_ms": v.created_at_unix_ms,
        "writer": (!v.writer.is_empty()).then_some(&v.writer),
        "readers": v.readers,
    })
}

/// Where a volume is mounted in the sandbox a copy goes through.
const MOUNTED_AT: &str = "/volume";

/// `VOLUME:PATH` (a relative PATH is from the volume's top), or `None`
/// for a local path (one that starts with `/` or `.`, or names no
/// volume before a colon).
fn volume_end(arg: &str) -> Option<(String, String)> {
    if arg.starts_with('/') || arg.starts_with('.') {
        return None;
    }
    let (name, path) = arg.split_once(':')?;
    corral_proto::volume::check_name(name).ok()?;
    let path = path.trim_start_matches('/');
    Some((name.to_string(), format!("{MOUNTED_AT}/{path}")))
}

async fn volume_command(conn: &ConnArgs, cmd: VolumeCommand) -> Result<u8, Error> {
    let client = crate::connect::connect(conn).await?;
    let mut raw = client.raw();
    let mut out = std::io::stdout().lock();
    match cmd {
        VolumeCommand::Create { name, size } => {
            corral_proto::volume::check_name(&name).map_err(|e| Error::Invalid(e.to_string()))?;
            let v = raw
                .create_volume(pb::CreateVolumeRequest {
                    name,
                    size_bytes: size.unwrap_or(0),
                })
                .await?
                .into_inner();
            writeln!(out, "{}", v.name)?;
            Ok(0)
        }
        VolumeCommand::Ls { json } => {
            let list = raw
                .list_volumes(pb::ListVolumesRequest {})
                .await?
                .into_inner()
                .volumes;
            if json {
                let all: Vec<_> = list.iter().map(to_json).collect();
                writeln!(out, "{}", serde_json::Value::Array(all))?;
                return Ok(0);
            }
            writeln!(out, "NAME\tSIZE\tUSED\tWRITER\tREADERS")?;
            for v in &list {
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}\t{}",
                    v.name,
                    corral_proto::units::format_size(v.size_bytes),
                    corral_proto::units::format_size(v.used_bytes),
                    if v.writer.is_empty() { "-" } else { &v.writer },
                    v.readers.len()
                )?;
            }
            Ok(0)
        }
        VolumeCommand::Rm { name } => {
            let existed = raw
                .delete_volume(pb::DeleteVolumeRequest { name: name.clone() })
                .await?
                .into_inner()
                .existed;
            if !existed {
                return Err(Error::Failed(format!("no volume {name}")));
            }
            Ok(0)
        }
        VolumeCommand::Cp(args) => {
            let (name, into) = match (volume_end(&args.src), volume_end(&args.dest)) {
                (None, Some((name, _))) => (name, true),
                (Some((name, _)), None) => (name, false),
                _ => {
                    return Err(Error::Invalid(
                        "corral volume cp LOCAL VOLUME:PATH, or VOLUME:PATH LOCAL".into(),
                    ));
                }
            };
            // As its writer, its files are the sandbox's to read; a copy
            // out while another sandbox writes mounts it read-only (a file
            // only its owner may read then stays unread).
            let spec = |read_only| through_spec(&name, read_only);
            let sandbox = match client.create_sandbox(None, spec(false)).await {
                Err(e) if !into && e.reason() == Some(corral_proto::Reason::VolumeInUse) => {
                    client.create_sandbox(None, spec(true)).await?
                }
                made => made?,
            };
            let through = |arg: &str| match volume_end(arg) {
                Some((_, path)) => format!("{}:{path}", sandbox.id),
                None => arg.to_string(),
            };
            let cp = CpArgs {
                src: through(&args.src),
                dest: through(&args.dest),
                ..args
            };
            let code = super::cp::main(conn, &cp).await;
            if let Err(e) = client.destroy_sandbox(&sandbox.id).await {
                tracing::warn!(sandbox = %sandbox.id, error = %e, "the copy's sandbox was not removed (its idle timeout will)");
            }
            Ok(code)
        }
        VolumeCommand::Move {
            name,
            to,
            to_token_file,
        } => {
            let dest_conn = ConnArgs {
                worker: Some(to.clone()),
                token_file: to_token_file.or_else(|| conn.token_file.clone()),
                ..conn.clone()
            };
            let dest = crate::connect::connect(&dest_conn).await?;
            let moved = move_volume(&client, &dest, &name, &to).await?;
            writeln!(
                out,
                "moved {name} to {to} ({} of archive)",
                corral_proto::units::format_size(moved.bytes)
            )?;
            for note in &moved.notes {
                writeln!(out, "  left out: {note}")?;
            }
            Ok(0)
        }
    }
}

/// A sandbox of the worker's default image with volume `name` mounted at
/// [`MOUNTED_AT`], through which its files are copied (removed after).
fn through_spec(name: &str, read_only: bool) -> SandboxSpec {
    SandboxSpec {
        image: std::env::var("CORRAL_IMAGE").ok().filter(|i| !i.is_empty()),
        volumes: vec![VolumeMount {
            name: name.to_string(),
            path: MOUNTED_AT.into(),
            read_only,
        }],
        idle_timeout_ms: Some(10 * 60 * 1000),
        ..SandboxSpec::default()
    }
}

/// Removes the sandboxes of a move (their idle timeout does, if this
/// cannot).
async fn remove_all(of: &[(&WorkerClient, &SandboxId)]) {
    for (client, id) in of {
        if let Err(e) = client.destroy_sandbox(id).await {
            tracing::warn!(sandbox = %id, error = %e, "a sandbox of the move was not removed (its idle timeout will)");
        }
    }
}

/// Volume `name` of `src` made on `dest` with the same size and files,
/// then removed from `src`. While its files stream across, a sandbox of
/// the move is the volume's one writer: nobody changes what is copied.
/// What fails before the end leaves the source as it was (and nothing on
/// `dest`).
async fn move_volume(
    src: &WorkerClient,
    dest: &WorkerClient,
    name: &str,
    to: &str,
) -> Result<corral_harness::transfer::Moved, Error> {
    corral_proto::volume::check_name(name).map_err(|e| Error::Invalid(e.to_string()))?;
    let listed = |c: &WorkerClient| {
        let mut raw = c.raw();
        async move {
            Ok::<_, Error>(
                raw.list_volumes(pb::ListVolumesRequest {})
                    .await?
                    .into_inner()
                    .volumes,
            )
        }
    };
    let Some(vol) = listed(src).await?.into_iter().find(|v| v.name == name) else {
        return Err(Error::Failed(format!("no volume {name}")));
    };
    if listed(dest).await?.iter().any(|v| v.name == name) {
        return Err(Error::Failed(format!(
            "{to} has a volume {name} already: remove it there first (a move never merges two)"
        )));
    }
    let from = match src.create_sandbox(None, through_spec(name, false)).await {
        Ok(s) => s.id,
        Err(e) if e.reason() == Some(corral_proto::Reason::VolumeInUse) => {
            return Err(Error::Failed(format!(
                "volume {name} is being written by a sandbox: it moves once nobody writes to it ({e})"
            )));
        }
        Err(e) => return Err(e.into()),
    };
    let made = dest
        .raw()
        .create_volume(pb::CreateVolumeRequest {
            name: name.to_string(),
            size_bytes: vol.size_bytes,
        })
        .await;
    if let Err(e) = made {
        remove_all(&[(src, &from)]).await;
        return Err(e.into());
    }
    let undo = |e: Error| async move {
        // Nothing of it stays on `dest`; the source is as it was.
        let _ = dest
            .raw()
            .delete_volume(pb::DeleteVolumeRequest {
                name: name.to_string(),
            })
            .await;
        e
    };
    let into = match dest.create_sandbox(None, through_spec(name, false)).await {
        Ok(s) => s.id,
        Err(e) => {
            remove_all(&[(src, &from)]).await;
            return Err(undo(e.into()).await);
        }
    };
    let copied = corral_harness::transfer::copy_contents(
        (src, &from, MOUNTED_AT),
        (dest, &into, MOUNTED_AT),
    )
    .await;
    remove_all(&[(src, &from), (dest, &into)]).await;
    let moved = match copied {
        Ok(m) => m,
        Err(e) => {
            return Err(undo(Error::Failed(format!(
                "copying volume {name} to {to} failed (it stays where it was): {e}"
            )))
            .await);
        }
    };
    let removed = src
        .raw()
        .delete_volume(pb::DeleteVolumeRequest {
            name: name.to_string(),
        })
        .await;
    if let Err(e) = removed {
        return Err(Error::Failed(format!(
            "volume {name} is on {to} now, but its old copy here was not removed ({}): remove it with corral volume rm {name} once nobody reads it",
            e.message()
        )));
    }
    Ok(moved)
}
