//! `corral template`: images built on a worker from a Dockerfile and its
//! context, kept by name with what a sandbox of one starts with.

use std::io::Write;
use std::path::Path;

use corral_proto::pb;
use corral_proto::template::TemplateStart;
use futures_util::StreamExt;

use crate::cli::{ConnArgs, TemplateCommand};
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

pub async fn main(conn: &ConnArgs, cmd: TemplateCommand) -> u8 {
    match template_command(conn, cmd).await {
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

/// The most of a context sent in one message.
const PIECE: usize = 1 << 20;
/// The largest context packed (a worker takes at most its
/// --max-build-context, 512 MiB by default).
const MAX_CONTEXT: usize = 512 << 20;

/// A packed context, refused as it grows past [`MAX_CONTEXT`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_CONTEXT {
            return Err(std::io::Error::other(format!(
                "the context is over {} MiB: build from a smaller directory",
                MAX_CONTEXT >> 20
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The Dockerfile's path inside `context` (`file`, or `Dockerfile`).
fn dockerfile_in(context: &Path, file: Option<&Path>) -> Result<String, Error> {
    let Some(file) = file else {
        return Ok("Dockerfile".into());
    };
    let within = |p: &Path| {
        p.canonicalize()
            .map_err(|e| Error::Invalid(format!("{}: {e}", p.display())))
    };
    let (root, f) = (within(context)?, within(file)?);
    f.strip_prefix(&root)
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|_| {
            Error::Invalid(format!(
                "-f {}: the Dockerfile must be inside the context {}",
                file.display(),
                context.display()
            ))
        })
}

fn describe_ready(s: &Option<pb::TemplateStart>) -> String {
    use pb::template_start::Ready;
    match s.as_ref().and_then(|s| s.ready.as_ref()) {
        None => "-".into(),
        Some(Ready::Port(p)) => format!("port {p}"),
        Some(Ready::ReadyCommand(c)) => format!("cmd {c}"),
        Some(Ready::Http(h)) => format!("http {h}"),
    }
}

/// The templates the caller has.
async fn templates(conn: &ConnArgs) -> Result<Vec<pb::Template>, Error> {
    let client = crate::connect::connect(conn).await?;
    Ok(client
        .raw()
        .list_templates(pb::ListTemplatesRequest {})
        .await?
        .into_inner()
        .templates)
}

fn to_json(t: &pb::Template) -> serde_json::Value {
    let s = t.start.clone().unwrap_or_default();
    serde_json::json!({
        "name": t.name,
        "image": t.image,
        "start": (!s.command.is_empty()).then_some(&s.command),
        "ready": (s.ready.is_some()).then(|| describe_ready(&t.start)),
        "ready_timeout_ms": (s.timeout_ms > 0).then_some(s.timeout_ms),
        "created_at_unix_ms": t.created_at_unix_ms,
    })
}

async fn template_command(conn: &ConnArgs, cmd: TemplateCommand) -> Result<u8, Error> {
    match cmd {
        TemplateCommand::Build {
            name,
            context,
            file,
            start,
            ready_port,
            ready_cmd,
            ready_http,
            ready_timeout,
            timeout,
            quiet,
        } => {
            corral_proto::template::check_name(&name).map_err(|e| Error::Invalid(e.to_string()))?;
            if !context.is_dir() {
                return Err(Error::Invalid(format!(
                    "{}: the context must be a directory",
                    context.display()
                )));
            }
            let dockerfile = dockerfile_in(&context, file.as_deref())?;
            let ready = match (ready_port, ready_cmd, ready_http) {
                (Some(p), _, _) => Some(pb::template_start::Ready::Port(u32::from(p))),
                (_, Some(c), _) => Some(pb::template_start::Ready::ReadyCommand(c)),
                (_, _, Some(h)) => Some(pb::template_start::Ready::Http(h)),
                _ => None,
            };
            let start = pb::TemplateStart {
                command: start.unwrap_or_default(),
                ready,
                timeout_ms: ready_timeout.map_or(0, |t| t.as_millis() as u64),
            };
            // Checked here as the worker will: a mistake is said before
            // the context is packed and sent.
            TemplateStart::try_from(start.clone()).map_err(|e| Error::Invalid(e.to_string()))?;
            let dir = context.clone();
            let tar = tokio::task::spawn_blocking(move || {
                let mut out = Bounded(Vec::new());
                corral_init::archive::pack_contents(&dir, &mut out).map(|_| out.0)
            })
            .await
            .map_err(|e| Error::Failed(format!("packing the context: {e}")))?
            .map_err(|e| Error::Invalid(format!("packing {}: {e}", context.display())))?;
            let client = crate::connect::connect(conn).await?;
            let first = pb::BuildImageRequest {
                dockerfile,
                timeout_ms: timeout.map_or(0, |t| t.as_millis() as u64),
                data: Default::default(),
                eof: false,
                template: name.clone(),
                start: Some(start),
            };
            let pieces: Vec<pb::BuildImageRequest> = tar
                .chunks(PIECE)
                .map(|c| pb::BuildImageRequest {
                    data: bytes::Bytes::copy_from_slice(c),
                    ..Default::default()
                })
                .collect();
            let requests = futures_util::stream::iter(std::iter::once(first).chain(pieces).chain(
                std::iter::once(pb::BuildImageRequest {
                    eof: true,
                    ..Default::default()
                }),
            ));
            let mut events = client.raw().build_image(requests).await?.into_inner();
            let mut err = std::io::stderr().lock();
            while let Some(ev) = events.next().await {
                match ev?.kind {
                    Some(pb::build_image_event::Kind::Output(text)) if !quiet => {
                        write!(err, "{text}")?;
                        if !text.ends_with('\n') {
                            writeln!(err)?;
                        }
                    }
                    Some(pb::build_image_event::Kind::Done(done)) => {
                        if let Some(f) = done.failure {
                            return Err(Error::Failed(format!(
                                "template {name}: step {}/{} ({}) failed: {}",
                                f.step, f.steps, f.instruction, f.message
                            )));
                        }
                        let how = if done.cached {
                            "the same inputs as before: nothing built".to_string()
                        } else {
                            format!("built in {:.1} s", done.duration_ms as f64 / 1000.0)
                        };
                        writeln!(std::io::stdout(), "template {name}: {} ({how})", done.image)?;
                        return Ok(0);
                    }
                    Some(pb::build_image_event::Kind::Output(_)) | None => {}
                }
            }
            Err(Error::Failed("the build ended without its result".into()))
        }
        TemplateCommand::Inspect { name } => {
            let list = templates(conn).await?;
            let Some(t) = list.iter().find(|t| t.name == name) else {
                return Err(Error::Failed(format!("no template {name}")));
            };
            writeln!(std::io::stdout(), "{}", to_json(t))?;
            Ok(0)
        }
        TemplateCommand::Ls { json } => {
            let list = templates(conn).await?;
            let mut out = std::io::stdout().lock();
            if json {
                let all: Vec<serde_json::Value> = list.iter().map(to_json).collect();
                writeln!(out, "{}", serde_json::Value::Array(all))?;
            } else {
                writeln!(out, "NAME\tIMAGE\tSTART\tREADY")?;
                for t in &list {
                    let start = t.start.as_ref().map_or("", |s| s.command.as_str());
                    writeln!(
                        out,
                        "{}\t{}\t{}\t{}",
                        t.name,
                        t.image,
                        if start.is_empty() { "-" } else { start },
                        describe_ready(&t.start)
                    )?;
                }
            }
            Ok(0)
        }
        TemplateCommand::Rm { name, force } => {
            let client = crate::connect::connect(conn).await?;
            let existed = client
                .raw()
                .delete_template(pb::DeleteTemplateRequest {
                    name: name.clone(),
                    force,
                })
                .await?
                .into_inner()
                .existed;
            if !existed {
                return Err(Error::Failed(format!("no template {name}")));
            }
            Ok(0)
        }
    }
}
