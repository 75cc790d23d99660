//! The audit log: one JSON line per call that changes something or reads a
//! session's or sandbox's data, in the order they were answered, each line
//! chained to the one before it by a SHA-256 digest, so that
//! [`verify`] finds a line removed, reordered or altered.
//!
//! A line holds who asked (tenant and key id, never the key), the call, the
//! session and sandbox it was about, its outcome (`ok` or the refusal's
//! reason) and the time; never an input's text, an environment value or a
//! file's contents. One task owns the file and the chain; callers queue
//! records on a bounded channel (a full queue slows the calls, it loses
//! nothing), and the task writes what is queued, flushes, and only then
//! tells each caller its record is written: a call is answered after its
//! line is in the file, so a service killed after answering has logged it.
//!
//! What a chain cannot show: lines cut from the end of the file (keep the
//! last line's digest elsewhere to catch that). A line torn by a crash is
//! cut when the log is opened again, and the cut is itself recorded.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

/// Records queued for the writer at most.
const QUEUE: usize = 4096;
/// What the first line's `prev` is: the digest of this text.
const GENESIS: &str = "corral-audit-v1";

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("audit log {path}, line {line}: {why}")]
    Broken {
        path: String,
        line: u64,
        why: String,
    },
    #[error("the audit log's writer has stopped")]
    Stopped,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> AuditError + '_ {
    move |source| AuditError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// One call, as the log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Who asked: their tenant ("-" where there are none) and key's id.
    pub tenant: String,
    pub key: String,
    /// The call (`StartSession`, ...).
    pub call: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// What an admin call was about: `key:ID` or `tenant:NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// `ok`, or the reason it was refused.
    pub outcome: String,
}

/// A line of the log: an entry with its place in the chain.
#[derive(Debug, Serialize, Deserialize)]
struct Line {
    seq: u64,
    at_ms: i64,
    #[serde(flatten)]
    entry: Entry,
    prev: String,
}

fn digest(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An id as a line keeps it: whole up to 128 bytes (every valid id is
/// shorter), else its first 64 characters and its length, so that no caller
/// can make the log grow by more than a line's worth per call.
pub fn bounded(id: &str) -> String {
    if id.len() <= 128 {
        return id.to_string();
    }
    let head: String = id.chars().take(64).collect();
    format!("{head}...({} bytes)", id.len())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where the chain stands: the last line's number and digest.
#[derive(Debug, Clone)]
struct Head {
    seq: u64,
    prev: String,
}

/// The sink the log writes to.
enum Sink {
    File(std::io::BufWriter<std::fs::File>),
    Stdout(std::io::BufWriter<std::io::Stdout>),
}

impl Sink {
    fn out(&mut self) -> &mut dyn Write {
        match self {
            Sink::File(f) => f,
            Sink::Stdout(s) => s,
        }
    }
}

/// A handle to the log; clones share its writer.
#[derive(Clone)]
pub struct AuditLog {
    tx: mpsc::Sender<(Entry, oneshot::Sender<()>)>,
}

/// The writer's task, to be awaited at shutdown (after every handle is
/// dropped) so that what was queued is written.
pub struct Writer(tokio::task::JoinHandle<Result<(), AuditError>>);

impl Writer {
    pub async fn finish(self) -> Result<(), AuditError> {
        self.0.await.map_err(|_| AuditError::Stopped)?
    }
}

impl AuditLog {
    /// Opens the log at `path` (`-`: stdout) for appending, continuing its
    /// chain, and starts its writer.
    pub fn open(path: &Path) -> Result<(Self, Writer), AuditError> {
        let (sink, head, cut) = if path == Path::new("-") {
            let head = Head {
                seq: 0,
                prev: digest(GENESIS.as_bytes()),
            };
            (
                Sink::Stdout(std::io::BufWriter::new(std::io::stdout())),
                head,
                0,
            )
        } else {
            let (head, cut) = resume(path)?;
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(io(path))?;
            (Sink::File(std::io::BufWriter::new(file)), head, cut)
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let path = path.to_path_buf();
        let task = tokio::task::spawn_blocking(move || write_all(path, sink, head, cut, rx));
        Ok((Self { tx }, Writer(task)))
    }

    /// Writes `entry`: returns once its line is in the file (waits while
    /// the queue is full).
    pub async fn record(&self, entry: Entry) -> Result<(), AuditError> {
        let (done, written) = oneshot::channel();
        self.tx
            .send((entry, done))
            .await
            .map_err(|_| AuditError::Stopped)?;
        written.await.map_err(|_| AuditError::Stopped)
    }
}

/// Where an existing log's chain stands; a torn last line (a crash in the
/// middle of a write) is cut off, and its length returned.
fn resume(path: &Path) -> Result<(Head, u64), AuditError> {
    let mut head = Head {
        seq: 0,
        prev: digest(GENESIS.as_bytes()),
    };
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((head, 0)),
        Err(e) => return Err(io(path)(e)),
    };
    let whole = data.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let cut = (data.len() - whole) as u64;
    if cut > 0 {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io(path))?;
        f.set_len(whole as u64).map_err(io(path))?;
    }
    if let Some(last) = data[..whole]
        .strip_suffix(b"\n")
        .and_then(|d| d.split(|b| *b == b'\n').next_back())
        .filter(|l| !l.is_empty())
    {
        let line: Line = serde_json::from_slice(last).map_err(|e| AuditError::Broken {
            path: path.display().to_string(),
            line: 0,
            why: format!("its last line is not a record ({e}): the chain cannot go on"),
        })?;
        head = Head {
            seq: line.seq,
            prev: digest(last),
        };
    }
    Ok((head, cut))
}

fn write_all(
    path: PathBuf,
    mut sink: Sink,
    mut head: Head,
    cut: u64,
    mut rx: mpsc::Receiver<(Entry, oneshot::Sender<()>)>,
) -> Result<(), AuditError> {
    let put = |sink: &mut Sink, head: &mut Head, entry: Entry| -> Result<(), AuditError> {
        let line = Line {
            seq: head.seq + 1,
            at_ms: now_ms(),
            entry,
            prev: head.prev.clone(),
        };
        let mut bytes = serde_json::to_vec(&line).map_err(|e| AuditError::Io {
            path: path.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        *head = Head {
            seq: line.seq,
            prev: digest(&bytes),
        };
        bytes.push(b'\n');
        sink.out().write_all(&bytes).map_err(io(&path))
    };
    if cut > 0 {
        put(
            &mut sink,
            &mut head,
            Entry {
                tenant: "-".into(),
                key: "-".into(),
                call: "audit_resumed".into(),
                session: None,
                sandbox: None,
                subject: None,
                outcome: format!("a torn last line of {cut} bytes was cut"),
            },
        )?;
        sink.out().flush().map_err(io(&path))?;
    }
    let mut written = Vec::new();
    while let Some((entry, done)) = rx.blocking_recv() {
        put(&mut sink, &mut head, entry)?;
        written.push(done);
        // Whatever else is queued goes with it, then one flush.
        while let Ok((entry, done)) = rx.try_recv() {
            put(&mut sink, &mut head, entry)?;
            written.push(done);
        }
        sink.out().flush().map_err(io(&path))?;
        for done in written.drain(..) {
            let _ = done.send(());
        }
    }
    Ok(())
}

/// Checks the log's chain from its first line; the number of records.
pub fn verify(path: &Path) -> Result<u64, AuditError> {
    let f = std::fs::File::open(path).map_err(io(path))?;
    let broken = |line: u64, why: String| AuditError::Broken {
        path: path.display().to_string(),
        line,
        why,
    };
    let mut head = Head {
        seq: 0,
        prev: digest(GENESIS.as_bytes()),
    };
    let mut reader = std::io::BufReader::new(f);
    let mut buf = Vec::new();
    let mut n = 0u64;
    loop {
        buf.clear();
        let read = reader.read_until(b'\n', &mut buf).map_err(io(path))?;
        if read == 0 {
            return Ok(n);
        }
        n += 1;
        let Some(text) = buf.strip_suffix(b"\n") else {
            return Err(broken(n, "a torn last line (no newline)".into()));
        };
        let line: Line =
            serde_json::from_slice(text).map_err(|e| broken(n, format!("not a record: {e}")))?;
        if line.seq != head.seq + 1 {
            return Err(broken(
                n,
                format!(
                    "record {} follows record {}: one is missing or out of order",
                    line.seq, head.seq
                ),
            ));
        }
        if line.prev != head.prev {
            return Err(broken(
                n,
                "its link to the line before does not match: that line was altered, removed or moved"
                    .into(),
            ));
        }
        head = Head {
            seq: line.seq,
            prev: digest(text),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> Entry {
        Entry {
            tenant: "t1".into(),
            key: "k1".into(),
            call: "StartSession".into(),
            session: Some(format!("s{i}")),
            sandbox: None,
            subject: None,
            outcome: "ok".into(),
        }
    }

    async fn write(path: &Path, from: u64, n: u64) {
        let (log, writer) = AuditLog::open(path).unwrap();
        for i in from..from + n {
            log.record(entry(i)).await.unwrap();
        }
        drop(log);
        writer.finish().await.unwrap();
    }

    fn lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    }

    fn put(path: &Path, lines: &[String]) {
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    }

    #[tokio::test]
    async fn a_chain_goes_on_across_opens_and_any_change_to_it_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        write(&path, 0, 50).await;
        write(&path, 50, 50).await;
        assert_eq!(verify(&path).unwrap(), 100);
        let good = lines(&path);

        let mut removed = good.clone();
        removed.remove(40);
        put(&path, &removed);
        let e = verify(&path).unwrap_err();
        assert!(matches!(e, AuditError::Broken { line: 41, .. }), "{e}");

        let mut swapped = good.clone();
        swapped.swap(10, 11);
        put(&path, &swapped);
        assert!(matches!(
            verify(&path).unwrap_err(),
            AuditError::Broken { line: 11, .. }
        ));

        let mut altered = good.clone();
        altered[70] = altered[70].replace("\"ok\"", "\"policy_denied\"");
        put(&path, &altered);
        assert!(matches!(
            verify(&path).unwrap_err(),
            AuditError::Broken { line: 72, .. }
        ));

        // A removed line whose successor's link and number are rewritten
        // to match still breaks the one after.
        let mut forged = good.clone();
        forged.remove(20);
        put(&path, &forged);
        assert!(verify(&path).is_err());

        put(&path, &good);
        assert_eq!(verify(&path).unwrap(), 100);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_cut_and_the_cut_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        write(&path, 0, 3).await;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"seq\":4,\"at_m").unwrap();
        drop(f);
        assert!(verify(&path).is_err(), "a torn line is found");
        write(&path, 3, 2).await;
        assert_eq!(verify(&path).unwrap(), 6);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("a torn last line of 14 bytes was cut"),
            "{text}"
        );
    }

    #[test]
    fn a_line_holds_what_was_asked_never_what_was_sent() {
        let line = Line {
            seq: 1,
            at_ms: 5,
            entry: entry(1),
            prev: "p".into(),
        };
        let v: serde_json::Value = serde_json::to_value(&line).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "at_ms", "call", "key", "outcome", "prev", "seq", "session", "tenant"
            ]
        );
    }
}
