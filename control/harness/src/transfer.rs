//! Trees in and out of a sandbox as tar streams, through `put_archive` and
//! `get_archive` operations: what `corral cp` and workspaces move.
//!
//! The local archive is made and unpacked on a blocking thread and moves in
//! chunks of at most 1 MiB through a small bounded channel, so the slower
//! side sets the pace (in the sandbox, the worker's input window and output
//! credit do the same). Unpacking here follows corral-init's rules: nothing
//! lands outside the destination, no link is followed out of it, and no
//! set-id bit is kept. A worker that blinks is followed across the blink
//! (input is placed by offset, events come from a cursor): nothing is lost
//! or written twice.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use corral_proto::{
    ArchiveSpec, EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream,
    SandboxId,
};
use tokio::sync::mpsc;

use crate::follow::{self, FollowError, Follower};
use crate::worker_api::WorkerApi;

/// Largest chunk of archive sent in one input call.
pub const CHUNK: usize = corral_proto::limits::MAX_INPUT_CHUNK_BYTES;
/// How long a transfer waits for a worker that went away.
pub const PATIENCE: Duration = follow::DEFAULT_PATIENCE;
/// Chunks waiting between the archive and the wire.
const QUEUED_CHUNKS: usize = 4;
/// Input calls of an upload in flight at once (the worker takes up to 8
/// MiB ahead of what the sandbox has, and orders them by offset).
const IN_FLIGHT: usize = 4;
/// Most bytes of the sandbox side's error output kept for the message.
const MAX_ERROR_BYTES: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Worker(#[from] FollowError),
    /// The sandbox's side refused or failed (its own words).
    #[error("in the sandbox: {0}")]
    Sandbox(String),
    /// The command in the sandbox exited with `code` (its own words).
    #[error("in the sandbox: {said}")]
    Exited { code: i32, said: String },
    /// This machine's side failed.
    #[error("{0}")]
    Local(String),
}

pub use corral_init::archive::{DEFAULT_MAX_ENTRIES, Unpacking, archive_name};

/// What moved: the archive's bytes, and, coming out, what was left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Moved {
    pub bytes: u64,
    /// A note per entry left out (special files, git's configuration), at
    /// most [`corral_init::archive::MAX_NOTES`]; `left_out` counts them all.
    pub notes: Vec<String>,
    pub left_out: u64,
}

impl Moved {
    fn bytes(bytes: u64) -> Self {
        Self {
            bytes,
            ..Self::default()
        }
    }
}

/// Copies the local `src` (a file, a link or a tree) to `dest` in the
/// sandbox: into `dest` when that is a directory, else as `dest`.
/// `progress` hears the archive bytes sent so far.
pub async fn upload<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &Path,
    dest: &str,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    upload_with(worker, sandbox, src, dest, false, progress).await
}

/// Copies the contents of the local directory `dir` into the sandbox's
/// directory `dest` (a project into /workspace, say).
pub async fn upload_contents<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    dir: &Path,
    dest: &str,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    upload_with(worker, sandbox, dir, dest, true, progress).await
}

async fn upload_with<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &Path,
    dest: &str,
    contents: bool,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    std::fs::symlink_metadata(src)
        .map_err(|e| TransferError::Local(format!("{}: {e}", src.display())))?;
    let (tx, rx) = mpsc::channel(QUEUED_CHUNKS);
    let src = src.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        let mut out = ChunkWriter::new(tx.clone());
        let packed = if contents {
            corral_init::archive::pack_contents(&src, &mut out)
        } else {
            corral_init::archive::pack(&src, &mut out)
        };
        if let Err(e) = packed {
            // Said before the end, so the sandbox never takes a cut archive
            // for a whole one.
            let _ = tx.blocking_send(Err(e));
        }
    });
    let sent = put(worker, sandbox, dest, rx, progress).await;
    let _ = packer.await;
    sent
}

/// Copies `src` of the sandbox (a file, a link or a tree) to the local
/// `dest`: into `dest` when that is a directory, else as `dest`. What comes
/// is hostile: `rules` (usually [`Unpacking::from_sandbox`] of the name
/// [`corral_init::archive::archive_name`] gives `src`) say what is taken.
/// `progress` hears the archive bytes received so far.
pub async fn download<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &str,
    dest: &Path,
    rules: Unpacking,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    download_with(
        worker,
        sandbox,
        ArchiveSpec::new(src),
        dest,
        rules,
        progress,
    )
    .await
}

/// Copies the contents of the sandbox's directory `src` into the local
/// directory `dest` (made if missing): a workspace brought back, say,
/// under `rules` (usually [`Unpacking::contents_from_sandbox`]).
pub async fn download_contents<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &str,
    dest: &Path,
    rules: Unpacking,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    download_with(
        worker,
        sandbox,
        ArchiveSpec::contents_of(src),
        dest,
        rules,
        progress,
    )
    .await
}

async fn download_with<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    spec: ArchiveSpec,
    dest: &Path,
    rules: Unpacking,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let target = absolute(dest)?;
    let shown = dest.display().to_string();
    let contents = spec.contents;
    let unpacker = tokio::task::spawn_blocking(move || {
        let input = ChunkReader::new(rx);
        if contents {
            corral_init::archive::unpack_contents_with(&target, &shown, input, &rules)
        } else {
            corral_init::archive::unpack_with(&target, &shown, input, &rules)
        }
    });
    let got = get(worker, sandbox, spec, tx, progress).await;
    let unpacked = unpacker
        .await
        .map_err(|e| TransferError::Local(format!("unpacking: {e}")))?;
    match (got, unpacked) {
        (Ok(moved), Ok(done)) if done.archive_bytes != moved.bytes => {
            Err(TransferError::Local(format!(
                "unpacking: {} of the {} bytes received were read",
                done.archive_bytes, moved.bytes
            )))
        }
        (Ok(moved), Ok(done)) => {
            let mut notes = moved.notes;
            let left_out = done.left_out + notes.len() as u64;
            notes.extend(done.notes);
            notes.truncate(corral_init::archive::MAX_NOTES);
            Ok(Moved {
                notes,
                left_out,
                bytes: moved.bytes,
            })
        }
        // The local side stopped first (the sandbox's side says only that
        // its output was no longer taken): the local error is the cause.
        (Err(TransferError::Local(_)) | Ok(_), Err(e)) => Err(TransferError::Local(e)),
        // The sandbox's side or the worker failed: the archive the local
        // side saw end early is only the consequence.
        (Err(e), _) => Err(e),
    }
}

fn absolute(p: &Path) -> Result<PathBuf, TransferError> {
    std::path::absolute(p).map_err(|e| TransferError::Local(format!("{}: {e}", p.display())))
}

/// Feeds a `put_archive` operation the chunks of `chunks` (an `Err` ends
/// it as failed) and waits for its end.
pub async fn put<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    dest: &str,
    mut chunks: mpsc::Receiver<Result<Bytes, String>>,
    mut progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    let op = OperationId::random();
    let spec = OperationSpec::PutArchive(ArchiveSpec::new(dest));
    let mut events =
        Follower::from_now(worker.clone(), sandbox.clone(), Some(op.clone()), PATIENCE).await?;
    follow::retry(worker, PATIENCE, || worker.submit(sandbox, &op, &spec)).await?;
    let mut stderr = Vec::new();
    // Up to IN_FLIGHT calls at once, each at its offset (the worker puts
    // them in order); answered in the order sent.
    let mut sending = futures_util::stream::FuturesOrdered::new();
    let mut offset = 0u64;
    let mut feeding = true;
    loop {
        tokio::select! {
            event = events.next() => match event?.kind {
                EventKind::Output { stream: OutputStream::Stderr, data } => keep(&mut stderr, &data),
                EventKind::Finished(result) => {
                    // Its end: every byte sent was taken (an answer may
                    // still be on its way).
                    return ended(&result, &stderr).map(|()| Moved::bytes(offset));
                }
                EventKind::SandboxLost { reason } => {
                    return Err(TransferError::Sandbox(format!("the sandbox was lost: {reason}")));
                }
                _ => {}
            },
            chunk = chunks.recv(), if feeding && sending.len() < IN_FLIGHT => {
                let (data, eof) = match chunk {
                    Some(Ok(data)) => (data, false),
                    Some(Err(e)) => {
                        // Best effort: the operation ends either way.
                        let _ = worker.cancel(sandbox, &op).await;
                        return Err(TransferError::Local(e));
                    }
                    None => (Bytes::new(), true),
                };
                let at = offset;
                offset += data.len() as u64;
                let end = offset;
                let op = &op;
                sending.push_back(async move {
                    follow::retry(worker, PATIENCE, || {
                        worker.write_input(sandbox, op, at, data.clone(), eof)
                    })
                    .await
                    .map(|(_, closed)| (end, closed))
                });
                // The end is sent: what is left is its answer.
                feeding = !eof;
            }
            Some(sent) = futures_util::StreamExt::next(&mut sending), if !sending.is_empty() => {
                let (end, closed) = match sent {
                    Ok(sent) => sent,
                    Err(e) => {
                        // Not left waiting for the rest (best effort).
                        let _ = worker.cancel(sandbox, &op).await;
                        return Err(e.into());
                    }
                };
                progress(end);
                // Closed early: the sandbox side stopped taking input (it
                // failed), and its end says why.
                if closed {
                    feeding = false;
                }
            }
        }
    }
}

/// Copies the contents of the directory `src` of one sandbox into the
/// directory `dest` of another (on the same worker or not): a fork's
/// workspace, say. The archive streams from one to the other.
pub async fn copy_contents<A: WorkerApi, B: WorkerApi>(
    from: (&A, &SandboxId, &str),
    to: (&B, &SandboxId, &str),
) -> Result<Moved, TransferError> {
    let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let (relay_tx, relay_rx) = mpsc::channel(QUEUED_CHUNKS);
    let getting = async move {
        let got = get(from.0, from.1, ArchiveSpec::contents_of(from.2), tx, |_| {});
        tokio::pin!(got);
        let mut done = None;
        loop {
            tokio::select! {
                r = &mut got, if done.is_none() => done = Some(r),
                chunk = rx.recv() => match chunk {
                    Some(chunk) => {
                        if relay_tx.send(Ok(chunk)).await.is_err() {
                            break;
                        }
                    }
                    // The sender is gone: the get is over.
                    None => break,
                },
            }
        }
        let done = match done {
            Some(r) => r,
            None => got.await,
        };
        if let Err(e) = &done {
            // Said before the end, so the other side never takes a cut
            // archive for a whole one.
            let _ = relay_tx.send(Err(e.to_string())).await;
        }
        done
    };
    let putting = put(to.0, to.1, to.2, relay_rx, |_| {});
    let (got, put) = tokio::join!(getting, putting);
    let got = got?;
    // The bytes that went in, and what the way out left out.
    Ok(Moved {
        notes: got.notes,
        left_out: got.left_out,
        ..put?
    })
}

/// Follows a `get_archive` operation, handing its archive bytes to `out`.
pub async fn get<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    archive: ArchiveSpec,
    out: mpsc::Sender<Bytes>,
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    stdout_of(
        worker,
        sandbox,
        OperationSpec::GetArchive(archive),
        out,
        progress,
    )
    .await
}

/// Runs `spec` and hands its stdout to `out` as it comes; fails with its
/// stderr when it does not exit 0.
async fn stdout_of<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    spec: OperationSpec,
    out: mpsc::Sender<Bytes>,
    mut progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    let op = OperationId::random();
    let mut events =
        Follower::from_now(worker.clone(), sandbox.clone(), Some(op.clone()), PATIENCE).await?;
    follow::retry(worker, PATIENCE, || worker.submit(sandbox, &op, &spec)).await?;
    let mut stderr = Vec::new();
    let mut received = 0u64;
    loop {
        match events.next().await?.kind {
            EventKind::Output {
                stream: OutputStream::Stdout,
                data,
            } => {
                received += data.len() as u64;
                if out.send(data).await.is_err() {
                    // The local side gave up (and says why).
                    let _ = worker.cancel(sandbox, &op).await;
                    return Err(TransferError::Local(
                        "this side stopped taking the output".into(),
                    ));
                }
                progress(received);
            }
            EventKind::Output { data, .. } => keep(&mut stderr, &data),
            EventKind::Finished(result) => {
                ended(&result, &stderr)?;
                // Every byte the sandbox's side wrote came, or the
                // transfer failed: never a short one taken for whole.
                let wrote = result.stdout.total_bytes;
                if received != wrote {
                    return Err(TransferError::Sandbox(format!(
                        "the output came short: {received} of the {wrote} bytes written in the sandbox"
                    )));
                }
                return Ok(Moved {
                    notes: sandbox_notes(&stderr),
                    ..Moved::bytes(received)
                });
            }
            EventKind::SandboxLost { reason } => {
                return Err(TransferError::Sandbox(format!(
                    "the sandbox was lost: {reason}"
                )));
            }
            EventKind::Gap { from, to } => {
                let _ = worker.cancel(sandbox, &op).await;
                return Err(TransferError::Sandbox(format!(
                    "events {from}..={to} of the output were dropped by the worker's journal"
                )));
            }
            EventKind::Started { .. } | EventKind::Egress(_) | EventKind::Port(_) => {}
        }
    }
}

/// What the sandbox side said it left out (a special file, say): its
/// lines, without the helper's name, at most the usual number of notes.
fn sandbox_notes(stderr: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stderr)
        .lines()
        .map(|l| {
            l.strip_prefix("corral-init: ")
                .unwrap_or(l)
                .trim()
                .to_string()
        })
        .filter(|l| !l.is_empty())
        .take(corral_init::archive::MAX_NOTES)
        .map(|l| format!("in the sandbox: {l}"))
        .collect()
}

fn keep(stderr: &mut Vec<u8>, data: &[u8]) {
    let room = MAX_ERROR_BYTES.saturating_sub(stderr.len());
    stderr.extend_from_slice(&data[..data.len().min(room)]);
}

/// Success, or the sandbox side's own words for what failed.
fn ended(result: &OperationResult, stderr: &[u8]) -> Result<(), TransferError> {
    if result.outcome == (Outcome::Exited { code: 0 }) {
        return Ok(());
    }
    let said = String::from_utf8_lossy(stderr).trim().to_string();
    let said = if said.is_empty() {
        String::from_utf8_lossy(&result.stderr.head)
            .trim()
            .to_string()
    } else {
        said
    };
    let said = if said.is_empty() {
        result.outcome.to_string()
    } else {
        said
    };
    Err(match result.outcome {
        Outcome::Exited { code } => TransferError::Exited { code, said },
        _ => TransferError::Sandbox(said),
    })
}

/// A `Write` that hands full chunks to a channel (blocking when it is
/// full): the packing thread's end of an upload.
struct ChunkWriter {
    tx: mpsc::Sender<Result<Bytes, String>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn new(tx: mpsc::Sender<Result<Bytes, String>>) -> Self {
        Self {
            tx,
            buf: Vec::with_capacity(CHUNK),
        }
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload stopped"))
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// A `Read` over chunks from a channel (blocking while it is empty): the
/// unpacking thread's end of a download.
struct ChunkReader {
    rx: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl ChunkReader {
    fn new(rx: mpsc::Receiver<Bytes>) -> Self {
        Self {
            rx,
            current: Bytes::new(),
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// Writes the archive of the sandbox's `src` (a tar stream, as `docker cp`
/// writes one to `-`) to `out` as it comes, untouched: nothing is unpacked
/// here, so the sandbox's names are the reader's to check.
pub async fn archive_to<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &str,
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
    progress: impl FnMut(u64),
) -> Result<Moved, TransferError> {
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let getting = get(worker, sandbox, ArchiveSpec::new(src), tx, progress);
    written_out(getting, rx, out).await
}

/// Writes what `producing` hands to `rx` to `out` as it comes; the local
/// side's error, if it stopped first, is the cause.
async fn written_out(
    producing: impl std::future::Future<Output = Result<Moved, TransferError>>,
    mut rx: mpsc::Receiver<Bytes>,
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
) -> Result<Moved, TransferError> {
    use tokio::io::AsyncWriteExt;
    let writing = async {
        while let Some(chunk) = rx.recv().await {
            out.write_all(&chunk).await?;
        }
        out.flush().await
    };
    let (produced, written) = tokio::join!(producing, writing);
    match written {
        Err(e) => Err(TransferError::Local(e.to_string())),
        Ok(()) => produced,
    }
}

/// Runs `command` in the sandbox and writes its whole stdout to `out`, as it
/// comes (any size: it is streamed, not kept in the result). Fails with the
/// command's stderr when it exits non-zero.
pub async fn stream_stdout<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    command: &str,
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
) -> Result<Moved, TransferError> {
    let (tx, rx) = mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let spec = OperationSpec::Shell(corral_proto::ShellSpec::new(command));
    let running = stdout_of(worker, sandbox, spec, tx, |_| {});
    written_out(running, rx, out).await
}

/// Saves the contents of the sandbox's directory `src` as a tar file at
/// `file` (written beside it, synced, then renamed into place: a file
/// there is always whole).
pub async fn save_contents<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    src: &str,
    file: &Path,
) -> Result<Moved, TransferError> {
    use tokio::io::AsyncWriteExt;
    let local = |e: std::io::Error| TransferError::Local(format!("{}: {e}", file.display()));
    let tmp = file.with_extension("tar.partial");
    // The sandbox's files, beside the session's log: its owner's only.
    let mut out = tokio::fs::File::from_std(
        crate::session::log::private_file()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(local)?,
    );
    let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUED_CHUNKS);
    let getting = get(worker, sandbox, ArchiveSpec::contents_of(src), tx, |_| {});
    let writing = async {
        while let Some(chunk) = rx.recv().await {
            out.write_all(&chunk).await?;
        }
        out.flush().await?;
        out.sync_all().await
    };
    let (got, written) = tokio::join!(getting, writing);
    let saved = got.and_then(|moved| written.map(|()| moved).map_err(local));
    match saved {
        Ok(moved) => {
            tokio::fs::rename(&tmp, file).await.map_err(local)?;
            Ok(moved)
        }
        Err(e) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            Err(e)
        }
    }
}

/// Puts a tar file of a directory's contents (see [`save_contents`]) into
/// the sandbox's directory `dest`.
pub async fn restore_contents<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    file: &Path,
    dest: &str,
) -> Result<Moved, TransferError> {
    use tokio::io::AsyncReadExt;
    let mut input = tokio::fs::File::open(file)
        .await
        .map_err(|e| TransferError::Local(format!("{}: {e}", file.display())))?;
    let (tx, rx) = mpsc::channel(QUEUED_CHUNKS);
    let shown = file.display().to_string();
    let reading = async move {
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n = match input.read(&mut buf).await {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) => {
                    let _ = tx.send(Err(format!("{shown}: {e}"))).await;
                    return;
                }
            };
            buf.truncate(n);
            if tx.send(Ok(Bytes::from(buf))).await.is_err() {
                return;
            }
        }
    };
    let (_, put) = tokio::join!(reading, put(worker, sandbox, dest, rx, |_| {}));
    put
}

/// Unpacks a tar file of a directory's contents (see [`save_contents`])
/// into the local directory `dest`, made if missing, under `rules` (it
/// came out of a sandbox).
pub async fn unpack_saved(
    file: &Path,
    dest: &Path,
    rules: Unpacking,
) -> Result<Moved, TransferError> {
    let (file, dest) = (file.to_path_buf(), absolute(dest)?);
    tokio::task::spawn_blocking(move || {
        let input = std::fs::File::open(&file)
            .map_err(|e| TransferError::Local(format!("{}: {e}", file.display())))?;
        let bytes = input.metadata().map_or(0, |m| m.len());
        corral_init::archive::unpack_contents_with(
            &dest,
            &dest.display().to_string(),
            input,
            &rules,
        )
        .map(|done| Moved {
            bytes,
            notes: done.notes,
            left_out: done.left_out,
        })
        .map_err(TransferError::Local)
    })
    .await
    .map_err(|e| TransferError::Local(format!("unpacking: {e}")))?
}
