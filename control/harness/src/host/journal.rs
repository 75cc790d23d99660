//! A served session's events: its runs' JSON events appended, one line
//! each and numbered by their line, to a file beside its log
//! ([`Sessions::events_path`](crate::sessions::Sessions::events_path)),
//! so a watcher that joins late, or after a restart of the service, reads
//! them all from any point, then the live ones as they are written.
//!
//! One [`Journal`] writes a session's file, in the task that hosts its run;
//! watchers read the file itself, told how far it is written (and whether
//! more may come) by a `watch` channel: they never read a line being
//! written, and a slow watcher slows only itself.

use std::io::Write;
use std::path::{Path, PathBuf};

use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;

/// How far a journal is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// Lines written, all whole.
    pub count: u64,
    /// More may come (the run goes on).
    pub open: bool,
}

/// The writer of one session's events.
pub struct Journal {
    file: std::fs::File,
    path: PathBuf,
    count: u64,
    /// Bytes of whole lines.
    len: u64,
    mark: watch::Sender<Mark>,
}

impl Journal {
    /// Opens the journal at `path` (made if missing) to append to it. A
    /// line torn by a crash mid-write is cut off: what follows starts on a
    /// line of its own.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let (count, whole) = match std::fs::read(path) {
            Ok(bytes) => {
                let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
                let count = bytes[..whole].iter().filter(|b| **b == b'\n').count() as u64;
                (count, Some((whole, bytes.len())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (0, None),
            Err(e) => return Err(e),
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        if let Some((whole, len)) = whole
            && whole < len
        {
            tracing::warn!(path = %path.display(), bytes = len - whole, "the session's events ended in a torn line; it is cut off");
            file.set_len(whole as u64)?;
        }
        let len = whole.map_or(0, |(w, _)| w as u64);
        let (mark, _) = watch::channel(Mark { count, open: true });
        Ok(Self {
            file,
            path: path.to_path_buf(),
            count,
            len,
            mark,
        })
    }

    /// Lines written so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Follows how far the journal is written.
    pub fn watch(&self) -> watch::Receiver<Mark> {
        self.mark.subscribe()
    }

    /// Appends one event (a line of `corral run --json`, its newline
    /// included) and returns its number. The write is one `write` of the
    /// whole line to a file opened for appending: a watcher is told of it
    /// only once it is all there. (A page-cache write of a few KiB: it does
    /// not hold the runtime up.)
    pub fn append(&mut self, line: &str) -> std::io::Result<u64> {
        debug_assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            // Part of it may be there (a full disk): cut back to the last
            // whole line, so the next one starts on a line of its own.
            let _ = self.file.set_len(self.len);
            return Err(e);
        }
        self.len += line.len() as u64;
        self.count += 1;
        self.mark.send_replace(Mark {
            count: self.count,
            open: true,
        });
        Ok(self.count)
    }

    /// No more lines come from this run: watchers end once they have read
    /// them all.
    pub fn close(self) {
        self.mark.send_replace(Mark {
            count: self.count,
            open: false,
        });
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Why reading a journal stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The watcher's receiver is gone.
    #[error("the watcher left")]
    Left,
}

/// Whether the journal at `path` ends with a run's last event (its result,
/// or the error that ended it).
pub fn ends_a_run(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    let text = String::from_utf8_lossy(&bytes);
    let Some(last) = text.lines().last() else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(last)
        .is_ok_and(|v| v["type"] == "result" || v["type"] == "error")
}

/// Whole lines in a journal file (a torn last one not counted).
pub fn count_lines(path: &Path) -> u64 {
    std::fs::read(path)
        .map(|b| b.iter().filter(|c| **c == b'\n').count() as u64)
        .unwrap_or(0)
}

/// Sends `emit` the events of the journal at `path` after number `after`,
/// then (given the `mark` of a run that writes it) the new ones as they
/// come, until the run closes the journal (or its writer is gone) and all
/// is read, or `emit` fails (the watcher left).
pub async fn read<F, Fut>(
    path: &Path,
    after: u64,
    mut mark: Option<watch::Receiver<Mark>>,
    mut emit: F,
) -> Result<(), ReadError>
where
    F: FnMut(u64, String) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let io = |source| ReadError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    let mut lines = tokio::io::BufReader::new(file);
    let mut seq = 0u64;
    let mut line = String::new();
    loop {
        // How far the run has written (with no run: the file as it is).
        let limit = match &mut mark {
            Some(rx) => {
                let now = *rx.borrow_and_update();
                if seq >= now.count {
                    if !now.open {
                        return Ok(());
                    }
                    if rx.changed().await.is_err() {
                        // The writer is gone: what it wrote is all.
                        let last = rx.borrow().count;
                        mark = None;
                        Some(last)
                    } else {
                        continue;
                    }
                } else {
                    Some(now.count)
                }
            }
            None => None,
        };
        if limit.is_some_and(|l| seq >= l) {
            return Ok(());
        }
        line.clear();
        let n = lines.read_line(&mut line).await.map_err(io)?;
        if n == 0 || !line.ends_with('\n') {
            // The end, or a torn line (a crash mid-write) nothing follows.
            return Ok(());
        }
        seq += 1;
        if seq > after {
            line.pop();
            if !emit(seq, std::mem::take(&mut line)).await {
                return Err(ReadError::Left);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all_after(
        path: &Path,
        after: u64,
        mark: Option<watch::Receiver<Mark>>,
    ) -> Vec<(u64, String)> {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = seen.clone();
        read(path, after, mark, move |n, l| {
            s.lock().unwrap().push((n, l));
            async { true }
        })
        .await
        .unwrap();
        seen.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn a_late_watcher_reads_from_any_point_and_then_live_until_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.events");
        let mut j = Journal::open(&path).unwrap();
        j.append("{\"a\":1}\n").unwrap();
        j.append("{\"a\":2}\n").unwrap();
        let mark = j.watch();
        let reader = tokio::spawn({
            let path = path.clone();
            async move { all_after(&path, 1, Some(mark)).await }
        });
        tokio::task::yield_now().await;
        j.append("{\"a\":3}\n").unwrap();
        j.close();
        let got = reader.await.unwrap();
        assert_eq!(
            got,
            vec![(2, "{\"a\":2}".to_string()), (3, "{\"a\":3}".to_string())]
        );
        // No run: the file as it is.
        assert_eq!(all_after(&path, 0, None).await.len(), 3);
    }

    #[tokio::test]
    async fn a_torn_line_is_cut_off_and_numbering_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.events");
        std::fs::write(&path, "{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        assert_eq!(
            all_after(&path, 0, None).await.len(),
            2,
            "the torn line is not read"
        );
        let mut j = Journal::open(&path).unwrap();
        assert_eq!(j.count(), 2);
        assert_eq!(j.append("{\"a\":3}\n").unwrap(), 3);
        j.close();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n"
        );
    }

    #[tokio::test]
    async fn a_watcher_of_a_dropped_writer_reads_what_was_written_and_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.events");
        let mut j = Journal::open(&path).unwrap();
        let mark = j.watch();
        j.append("{}\n").unwrap();
        drop(j);
        assert_eq!(all_after(&path, 0, Some(mark)).await.len(), 1);
    }
}
