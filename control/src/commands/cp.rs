//! `corral cp`: files and trees into and out of a sandbox, as tar streams
//! (see `corral_harness::transfer`). Exits 0, 2 on a usage error, or 125
//! when the copy fails (the sandbox's or this machine's side says why).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use corral_harness::transfer::{self, TransferError, Unpacking};
use corral_proto::SandboxId;

use crate::cli::{ConnArgs, CpArgs};
use crate::connect::{ConnectError, connect_for};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("{0}")]
    Usage(String),
}

pub async fn main(conn: &ConnArgs, args: &CpArgs) -> u8 {
    match cp(conn, args).await {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Usage(_) | Error::Connect(ConnectError::Usage(_)) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

/// One end of a copy.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Local(PathBuf),
    Sandbox(SandboxId, String),
}

/// `SANDBOX:PATH`, or a local path (one that starts with `/` or `.`, or
/// has no colon, or whose part before the colon is no sandbox id).
fn end(arg: &str) -> End {
    if !arg.starts_with('/')
        && !arg.starts_with('.')
        && let Some((id, path)) = arg.split_once(':')
        && let Ok(id) = SandboxId::new(id)
    {
        let path = if path.is_empty() { "." } else { path };
        return End::Sandbox(id, path.to_string());
    }
    End::Local(PathBuf::from(arg))
}

async fn cp(conn: &ConnArgs, args: &CpArgs) -> Result<(), Error> {
    let (src, dest) = (end(&args.src), end(&args.dest));
    let mut meter = Meter::new(!args.quiet && std::io::stderr().is_terminal());
    let moved = match (src, dest) {
        (End::Local(src), End::Sandbox(sandbox, dest)) => {
            let worker = connect_for(conn, &sandbox).await?;
            transfer::upload(&worker, &sandbox, &src, &dest, |n| meter.show(n)).await?
        }
        // `-`: the archive itself, on stdout, as `docker cp` writes it.
        (End::Sandbox(sandbox, src), End::Local(dest)) if dest.as_os_str() == "-" => {
            if std::io::stdout().is_terminal() {
                return Err(Error::Usage(
                    "refusing to write a tar archive to a terminal: redirect it (> file.tar) or pipe it (| tar -x)".into(),
                ));
            }
            let worker = connect_for(conn, &sandbox).await?;
            let mut out = tokio::io::stdout();
            let moved =
                transfer::archive_to(&worker, &sandbox, &src, &mut out, |n| meter.show(n)).await?;
            meter.done(moved.bytes);
            return Ok(());
        }
        (End::Sandbox(sandbox, src), End::Local(dest)) => {
            let worker = connect_for(conn, &sandbox).await?;
            // Only the tree asked for, under its own name: the archive is
            // the sandbox's to forge.
            let rules = args
                .out
                .apply(Unpacking::from_sandbox(transfer::archive_name(&src)));
            let moved =
                transfer::download(&worker, &sandbox, &src, &dest, rules, |n| meter.show(n))
                    .await?;
            meter.done(moved.bytes);
            super::left_out(&moved);
            return Ok(());
        }
        (End::Local(_), End::Local(_)) => {
            return Err(Error::Usage(
                "one side must be SANDBOX:PATH (a local copy is cp's job)".into(),
            ));
        }
        (End::Sandbox(..), End::Sandbox(..)) => {
            return Err(Error::Usage(
                "one side must be local: copy out, then in".into(),
            ));
        }
    };
    meter.done(moved.bytes);
    Ok(())
}

/// Progress on a terminal: bytes so far and the rate, redrawn at most ten
/// times a second, on stderr.
struct Meter {
    on: bool,
    started: Instant,
    drawn: Option<Instant>,
}

impl Meter {
    fn new(on: bool) -> Self {
        Self {
            on,
            started: Instant::now(),
            drawn: None,
        }
    }

    fn show(&mut self, bytes: u64) {
        if !self.on
            || self
                .drawn
                .is_some_and(|d| d.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        self.draw(bytes, "");
    }

    fn draw(&self, bytes: u64, end: &str) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let mib = bytes as f64 / (1 << 20) as f64;
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{mib:.1} MiB  {:.1} MiB/s{end}", mib / secs);
        let _ = err.flush();
    }

    fn done(&mut self, bytes: u64) {
        if self.on && self.drawn.is_some() {
            self.draw(bytes, "\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths_and_local_paths_are_told_apart() {
        let sb = |id: &str, p: &str| End::Sandbox(SandboxId::new(id).unwrap(), p.into());
        assert_eq!(end("sb1:/workspace/x"), sb("sb1", "/workspace/x"));
        assert_eq!(end("sb1:out"), sb("sb1", "out"));
        assert_eq!(end("sb1:"), sb("sb1", "."));
        assert_eq!(end("./sb1:x"), End::Local("./sb1:x".into()));
        assert_eq!(end("/tmp/a:b"), End::Local("/tmp/a:b".into()));
        assert_eq!(end("plain"), End::Local("plain".into()));
        assert_eq!(end("not an id:x"), End::Local("not an id:x".into()));
    }
}
