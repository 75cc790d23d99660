//! An append-only, versioned JSONL log with one writer.
//!
//! Line 1 is a header naming the format and its version; every other line is
//! one record `{"seq": N, "at": MS, "record": ...}` with `seq` counting up from 1.
//! Every append is written whole and fsynced before it returns. A crash can
//! leave a torn last line (bytes after the last newline); opening the log
//! cuts it off, and says so. Any other damage, and any version this code
//! does not know, is an explicit error: nothing is skipped silently.
//!
//! Each record line also carries `at`, the Unix time in milliseconds its
//! record was appended (a record copied by a fork keeps its own), read by
//! the session's timeline; lines written before it existed have none.
//!
//! One process writes a session at a time (an exclusive `flock` on the log,
//! held while it is open), and creating or forking never replaces an
//! existing session.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
const FORMAT_NAME: &str = "corral-session";

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("session {0} already exists")]
    AlreadyExists(String),
    #[error("session {0} does not exist")]
    NotFound(String),
    #[error("session {0} is open in another process")]
    Locked(String),
    #[error("session {id} has format version {found}; this build reads version {FORMAT_VERSION}")]
    UnknownVersion { id: String, found: u32 },
    #[error("session {id} is damaged at line {line}: {reason}")]
    Corrupt {
        id: String,
        line: u64,
        reason: String,
    },
    #[error("session id {0:?}: use 1-128 characters of A-Z a-z 0-9 _ . -")]
    BadId(String),
    #[error("fork point {upto} is past the end of session {id} ({last} records)")]
    BadForkPoint { id: String, upto: u64, last: u64 },
    #[error("session log {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("record cannot be encoded: {0}")]
    Encode(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub format: String,
    pub version: u32,
    pub session_id: String,
    pub created_at_unix_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkOrigin {
    pub session_id: String,
    /// The parent's records 1..=upto_seq were copied.
    pub upto_seq: u64,
}

#[derive(Serialize)]
struct LineOut<'a, R> {
    seq: u64,
    at: i64,
    record: &'a R,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineIn<R> {
    seq: u64,
    #[serde(default)]
    at: Option<i64>,
    record: R,
}

/// Where a log reads the time it stamps on each record (Unix
/// milliseconds): the system's clock, or a test's.
#[derive(Clone)]
pub struct Clock(std::sync::Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    pub fn system() -> Self {
        Self(std::sync::Arc::new(now_ms))
    }

    /// A clock that reads `f`.
    pub fn from_fn(f: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    pub fn now(&self) -> i64 {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// A record as a log holds it: its seq, when it was appended (none in
/// lines written before times were), the record.
#[derive(Debug, Clone, PartialEq)]
pub struct Timed<R> {
    pub seq: u64,
    pub at_unix_ms: Option<i64>,
    pub record: R,
}

/// What opening a log had to repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Bytes of a torn last line that were cut off.
    pub torn_bytes: u64,
}

/// An open session log, locked for writing.
#[derive(Debug)]
pub struct SessionLog<R> {
    id: String,
    path: PathBuf,
    file: Flock<File>,
    header: Header,
    last_seq: u64,
    clock: Clock,
    /// The time of the last record appended by this process.
    last_at: i64,
    _records: PhantomData<fn() -> R>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Session ids: 1-128 characters of `A-Z a-z 0-9 _ . -`, not starting with `.`.
pub fn check_id(id: &str) -> Result<(), LogError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(LogError::BadId(id.into()))
    }
}

/// Where session `id` lives under `dir`.
pub fn path_of(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.jsonl"))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

fn sync_dir(dir: &Path) -> Result<(), LogError> {
    durably(|| File::open(dir).and_then(|d| d.sync_all())).map_err(io(dir))
}

/// Opens session `id`'s log (for writing too, with `write`).
fn open_existing(dir: &Path, id: &str, write: bool) -> Result<(PathBuf, File), LogError> {
    check_id(id)?;
    let path = path_of(dir, id);
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => LogError::NotFound(id.into()),
            _ => io(&path)(e),
        })?;
    Ok((path, file))
}

fn lock(file: File, id: &str) -> Result<Flock<File>, LogError> {
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|_| LogError::Locked(id.into()))
}

impl<R: Serialize + DeserializeOwned> SessionLog<R> {
    /// Creates a new session; fails if one with this id exists.
    pub fn create(dir: &Path, id: &str) -> Result<Self, LogError> {
        Self::create_with(dir, id, None, Clock::system())
    }

    /// [`SessionLog::create`], its times read from `clock`.
    pub fn create_clocked(dir: &Path, id: &str, clock: Clock) -> Result<Self, LogError> {
        Self::create_with(dir, id, None, clock)
    }

    fn create_with(
        dir: &Path,
        id: &str,
        forked_from: Option<ForkOrigin>,
        clock: Clock,
    ) -> Result<Self, LogError> {
        check_id(id)?;
        private_dir(dir).map_err(io(dir))?;
        let path = path_of(dir, id);
        let file = private_file()
            .write(true)
            .read(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => LogError::AlreadyExists(id.into()),
                _ => io(&path)(e),
            })?;
        let mut file = lock(file, id)?;
        let header = Header {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            session_id: id.into(),
            created_at_unix_ms: clock.now(),
            forked_from,
        };
        let mut line = serde_json::to_vec(&header).map_err(|e| LogError::Encode(e.to_string()))?;
        line.push(b'\n');
        durably(|| file.write_all(&line).and_then(|()| file.sync_all())).map_err(io(&path))?;
        sync_dir(dir)?;
        Ok(Self {
            id: id.into(),
            path,
            file,
            header,
            last_seq: 0,
            clock,
            last_at: 0,
            _records: PhantomData,
        })
    }

    /// Opens an existing session for writing: checks its version, verifies
    /// every record, and cuts off a torn last line.
    pub fn open(dir: &Path, id: &str) -> Result<(Self, Recovery), LogError> {
        Self::open_with(dir, id, |_, _| {})
    }

    /// [`SessionLog::open`], handing every record to `each` as it is
    /// verified: a session is read once when it starts.
    pub fn open_with(
        dir: &Path,
        id: &str,
        mut each: impl FnMut(u64, R),
    ) -> Result<(Self, Recovery), LogError> {
        let (path, file) = open_existing(dir, id, true)?;
        let mut file = lock(file, id)?;
        let (header, last_seq, good_len) = scan::<R>(&mut file, id, &path, |seq, rec| {
            each(seq, rec);
            true
        })?;
        let total = file.metadata().map_err(io(&path))?.len();
        let torn_bytes = total - good_len;
        if torn_bytes > 0 {
            durably(|| file.set_len(good_len).and_then(|()| file.sync_all())).map_err(io(&path))?;
        }
        file.seek(SeekFrom::End(0)).map_err(io(&path))?;
        Ok((
            Self {
                id: id.into(),
                path,
                file,
                header,
                last_seq,
                clock: Clock::system(),
                last_at: 0,
                _records: PhantomData,
            },
            Recovery { torn_bytes },
        ))
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The time by this log's clock.
    pub fn now(&self) -> i64 {
        self.clock.now()
    }

    /// The time stamped on the last record this process appended.
    pub fn last_at(&self) -> i64 {
        self.last_at
    }

    /// Reads the times of the records appended from now on from `clock`.
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }

    /// Appends one record durably; returns its seq.
    pub fn append(&mut self, record: &R) -> Result<u64, LogError> {
        let at = self.clock.now();
        self.append_at(record, at)
    }

    fn append_at(&mut self, record: &R, at: i64) -> Result<u64, LogError> {
        let seq = self.last_seq + 1;
        let mut line = serde_json::to_vec(&LineOut { seq, at, record })
            .map_err(|e| LogError::Encode(e.to_string()))?;
        line.push(b'\n');
        let file = &mut self.file;
        durably(|| file.write_all(&line).and_then(|()| file.sync_data()))
            .map_err(io(&self.path))?;
        self.last_seq = seq;
        self.last_at = at;
        Ok(seq)
    }

    /// Every record of session `id`, in order, read as a stream (no lock
    /// needed; a torn last line is not part of the log). The header is
    /// checked before this returns.
    pub fn records(dir: &Path, id: &str) -> Result<Records<R>, LogError> {
        let (path, mut file) = open_existing(dir, id, false)?;
        file.seek(SeekFrom::Start(0)).map_err(io(&path))?;
        let mut reader = Reader {
            lines: BufReader::new(file),
            id: id.into(),
            path,
            buf: Vec::new(),
            line_no: 0,
            last: 0,
        };
        let (header, _) = reader.header()?;
        Ok(Records {
            reader,
            header,
            done: false,
            _records: PhantomData,
        })
    }

    /// Creates session `child` from `parent`'s records 1..=`upto_seq`,
    /// followed by `then` (e.g. results that close calls the fork cuts
    /// off). Fails if `child` exists.
    pub fn fork(
        dir: &Path,
        parent: &str,
        child: &str,
        upto_seq: u64,
        then: &[R],
    ) -> Result<Self, LogError> {
        Self::fork_clocked(dir, parent, child, upto_seq, then, Clock::system())
    }

    /// [`SessionLog::fork`], its times read from `clock` (the copied
    /// records keep the parent's).
    pub fn fork_clocked(
        dir: &Path,
        parent: &str,
        child: &str,
        upto_seq: u64,
        then: &[R],
        clock: Clock,
    ) -> Result<Self, LogError> {
        let (path, mut file) = open_existing(dir, parent, false)?;
        let mut copied: Vec<(R, Option<i64>)> = Vec::new();
        let (_, last, _) = scan_timed::<R>(&mut file, parent, &path, |seq, at, rec| {
            if seq <= upto_seq {
                copied.push((rec, at));
            }
            seq < upto_seq
        })?;
        if last < upto_seq {
            return Err(LogError::BadForkPoint {
                id: parent.into(),
                upto: upto_seq,
                last,
            });
        }
        let mut log = Self::create_with(
            dir,
            child,
            Some(ForkOrigin {
                session_id: parent.into(),
                upto_seq,
            }),
            clock,
        )?;
        let now = log.clock.now();
        for (r, at) in &copied {
            log.append_at(r, at.unwrap_or(now))?;
        }
        for r in then {
            log.append(r)?;
        }
        Ok(log)
    }
}

/// Where a reading of a log stopped (see [`SessionLog::fold_on`]): which
/// file it was (its header, device and inode), the bytes of whole records
/// read, the last seq.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    header: Header,
    dev: u64,
    ino: u64,
    /// The file's birth time, where the file system keeps one.
    born: Option<std::time::SystemTime>,
    bytes: u64,
    seq: u64,
}

impl<R: DeserializeOwned> SessionLog<R> {
    /// Folds the records of session `id` into a state: those after
    /// `cached`'s mark into its state, when that mark is of this log as it
    /// is now (the same file, not shorter); else every record into
    /// `init()`'s (a log removed and made again, or never read). Returns
    /// the state and where this reading stopped, to be passed again: a
    /// log is read once however often it is asked about. A torn last line
    /// is not read (it is read once whole).
    pub fn fold_on<S>(
        dir: &Path,
        id: &str,
        cached: Option<(Mark, S)>,
        init: impl FnOnce() -> S,
        mut each: impl FnMut(&mut S, u64, R),
    ) -> Result<(Mark, S), LogError> {
        use std::os::unix::fs::MetadataExt;
        let (path, mut file) = open_existing(dir, id, false)?;
        let meta = file.metadata().map_err(io(&path))?;
        let clone = file.try_clone().map_err(io(&path))?;
        file.seek(SeekFrom::Start(0)).map_err(io(&path))?;
        let mut reader = Reader {
            lines: BufReader::new(clone),
            id: id.into(),
            path: path.clone(),
            buf: Vec::new(),
            line_no: 0,
            last: 0,
        };
        let (header, header_bytes) = reader.header()?;
        let (mut state, mut bytes) = match cached {
            Some((m, state))
                if m.header == header
                    && m.dev == meta.dev()
                    && m.ino == meta.ino()
                    && m.born == meta.created().ok()
                    && m.bytes <= meta.len() =>
            {
                reader
                    .lines
                    .seek(SeekFrom::Start(m.bytes))
                    .map_err(io(&path))?;
                reader.last = m.seq;
                (state, m.bytes)
            }
            _ => (init(), header_bytes),
        };
        while let Some((line, n)) = reader.record::<R>()? {
            bytes += n;
            each(&mut state, line.seq, line.record);
        }
        let mark = Mark {
            header,
            dev: meta.dev(),
            ino: meta.ino(),
            born: meta.created().ok(),
            bytes,
            seq: reader.last,
        };
        Ok((mark, state))
    }
}

/// Runs `f`, which waits on the disk (a write and its sync), so that it
/// holds up no other task: on a multi-threaded tokio runtime the thread
/// hands its other tasks over first (`block_in_place`); anywhere else it
/// just runs. A service hosting many sessions would otherwise have its
/// runtime's threads all waiting on syncs while its clients' connections
/// go unanswered.
pub fn durably<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// The records of a log, one at a time (see [`SessionLog::records`]).
pub struct Records<R> {
    reader: Reader,
    header: Header,
    done: bool,
    _records: PhantomData<fn() -> R>,
}

impl<R> Records<R> {
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The same records with the times they were appended.
    pub fn timed(self) -> TimedRecords<R> {
        TimedRecords(self)
    }
}

/// The records of a log with their times (see [`Records::timed`]).
pub struct TimedRecords<R>(Records<R>);

impl<R> TimedRecords<R> {
    pub fn header(&self) -> &Header {
        &self.0.header
    }
}

impl<R: DeserializeOwned> Iterator for TimedRecords<R> {
    type Item = Result<Timed<R>, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.next_timed()
    }
}

impl<R: DeserializeOwned> Records<R> {
    fn next_timed(&mut self) -> Option<Result<Timed<R>, LogError>> {
        if self.done {
            return None;
        }
        match self.reader.record::<R>() {
            Ok(Some((line, _))) => Some(Ok(Timed {
                seq: line.seq,
                at_unix_ms: line.at,
                record: line.record,
            })),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

impl<R: DeserializeOwned> Iterator for Records<R> {
    type Item = Result<(u64, R), LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_timed().map(|r| r.map(|t| (t.seq, t.record)))
    }
}

/// Lines of a log file, checked as they are read.
struct Reader {
    lines: BufReader<File>,
    id: String,
    path: PathBuf,
    buf: Vec<u8>,
    line_no: u64,
    /// The seq of the last record read.
    last: u64,
}

impl Reader {
    fn corrupt(&self, reason: String) -> LogError {
        LogError::Corrupt {
            id: self.id.clone(),
            line: self.line_no,
            reason,
        }
    }

    /// The header line, and its length in bytes.
    fn header(&mut self) -> Result<(Header, u64), LogError> {
        self.buf.clear();
        let n = self
            .lines
            .read_until(b'\n', &mut self.buf)
            .map_err(io(&self.path))?;
        self.line_no = 1;
        if n == 0 || self.buf.last() != Some(&b'\n') {
            return Err(self.corrupt("no complete header line".into()));
        }
        // Check the version before anything else, with a lenient read, so a
        // newer format is reported as such rather than as damage.
        let loose: serde_json::Value = serde_json::from_slice(&self.buf)
            .map_err(|e| self.corrupt(format!("header is not JSON: {e}")))?;
        if loose["format"] != FORMAT_NAME {
            return Err(self.corrupt("not a Corral session log".into()));
        }
        let version = loose["version"].as_u64().unwrap_or(0) as u32;
        if version != FORMAT_VERSION {
            return Err(LogError::UnknownVersion {
                id: self.id.clone(),
                found: version,
            });
        }
        let header: Header =
            serde_json::from_value(loose).map_err(|e| self.corrupt(format!("header: {e}")))?;
        Ok((header, n as u64))
    }

    /// The next complete record and its length in bytes; `None` at the
    /// end of the file or at a torn last line (not part of the log).
    fn record<R: DeserializeOwned>(&mut self) -> Result<Option<(LineIn<R>, u64)>, LogError> {
        self.buf.clear();
        let n = self
            .lines
            .read_until(b'\n', &mut self.buf)
            .map_err(io(&self.path))?;
        if n == 0 || self.buf.last() != Some(&b'\n') {
            return Ok(None);
        }
        self.line_no += 1;
        let line: LineIn<R> =
            serde_json::from_slice(&self.buf).map_err(|e| self.corrupt(e.to_string()))?;
        if line.seq != self.last + 1 {
            return Err(self.corrupt(format!("seq {} follows {}", line.seq, self.last)));
        }
        self.last = line.seq;
        Ok(Some((line, n as u64)))
    }
}

/// Reads the header and every complete record line, handing each record to
/// `each` until it returns false. Returns the header, the last seq read and
/// the byte length of the valid prefix (everything before a torn tail).
fn scan<R: DeserializeOwned>(
    file: &mut File,
    id: &str,
    path: &Path,
    mut each: impl FnMut(u64, R) -> bool,
) -> Result<(Header, u64, u64), LogError> {
    scan_timed(file, id, path, |seq, _, rec| each(seq, rec))
}

/// [`scan`], with each record's time.
fn scan_timed<R: DeserializeOwned>(
    file: &mut File,
    id: &str,
    path: &Path,
    mut each: impl FnMut(u64, Option<i64>, R) -> bool,
) -> Result<(Header, u64, u64), LogError> {
    file.seek(SeekFrom::Start(0)).map_err(io(path))?;
    let clone = file.try_clone().map_err(io(path))?;
    let mut reader = Reader {
        lines: BufReader::new(clone),
        id: id.into(),
        path: path.to_path_buf(),
        buf: Vec::new(),
        line_no: 0,
        last: 0,
    };
    let (header, mut good) = reader.header()?;
    while let Some((line, n)) = reader.record::<R>()? {
        good += n;
        if !each(line.seq, line.at, line.record) {
            break;
        }
    }
    Ok((header, reader.last, good))
}

/// Makes `dir` (and what is missing above it) readable by its owner
/// only: 0700, the leaf made so even when it existed (as a worker makes
/// its state directory).
pub(crate) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Options that create a file readable by its owner only (0600).
pub fn private_file() -> std::fs::OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.mode(0o600);
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Rec {
        text: String,
    }

    fn rec(s: &str) -> Rec {
        Rec { text: s.into() }
    }

    fn all(dir: &Path, id: &str) -> Vec<(u64, Rec)> {
        SessionLog::<Rec>::records(dir, id)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    fn texts(records: &[(u64, Rec)]) -> Vec<(u64, String)> {
        records.iter().map(|(s, r)| (*s, r.text.clone())).collect()
    }

    #[test]
    fn session_logs_are_their_owners_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let sessions = dir.path().join("sessions");
        let mut log = SessionLog::<Rec>::create(&sessions, "s1").unwrap();
        log.append(&rec("secret")).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&sessions), 0o700);
        assert_eq!(mode(&path_of(&sessions, "s1")), 0o600);
    }

    #[test]
    fn append_reopen_and_read_as_a_stream() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SessionLog::<Rec>::create(dir.path(), "s1").unwrap();
        for i in 1..=5 {
            assert_eq!(log.append(&rec(&format!("r{i}\nwith newline"))).unwrap(), i);
        }
        drop(log);
        let (mut log, rec_) = SessionLog::<Rec>::open(dir.path(), "s1").unwrap();
        assert_eq!(rec_, Recovery::default());
        assert_eq!(log.last_seq(), 5);
        log.append(&rec("r6")).unwrap();
        let records = all(dir.path(), "s1");
        assert_eq!(records.len(), 6);
        assert_eq!(
            texts(&records[4..]),
            vec![(5, "r5\nwith newline".into()), (6, "r6".into())]
        );
        // Opening hands over every record in the same pass.
        drop(log);
        let mut seen = Vec::new();
        let (log, _) =
            SessionLog::<Rec>::open_with(dir.path(), "s1", |seq, r| seen.push((seq, r))).unwrap();
        assert_eq!(seen, records);
        assert_eq!(log.last_seq(), 6);
    }

    #[test]
    fn a_fold_reads_each_record_once_and_a_log_made_again_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let fixed = Clock::from_fn(|| 1_000);
        let mut log = SessionLog::<Rec>::create_clocked(dir.path(), "s1", fixed.clone()).unwrap();
        log.append(&rec("a")).unwrap();
        log.append(&rec("b")).unwrap();
        // The state: every text read, in order.
        let fold = |cached| {
            SessionLog::<Rec>::fold_on(dir.path(), "s1", cached, Vec::new, |seen, seq, r| {
                seen.push((seq, r.text))
            })
            .unwrap()
        };
        let (mark, seen) = fold(None);
        assert_eq!(seen, vec![(1, "a".into()), (2, "b".into())]);
        // Nothing new: nothing read.
        let (mark, seen) = fold(Some((mark, Vec::new())));
        assert!(seen.is_empty());
        // A record and a torn line: the record is read, the torn line not
        // until it is whole.
        log.append(&rec("c")).unwrap();
        let path = path_of(dir.path(), "s1");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"seq":4,"at":1000,"record":{"te"#).unwrap();
        let (mark, seen) = fold(Some((mark, Vec::new())));
        assert_eq!(seen, vec![(3, "c".into())]);
        f.write_all(b"xt\":\"d\"}}\n").unwrap();
        let (mark, seen) = fold(Some((mark, Vec::new())));
        assert_eq!(seen, vec![(4, "d".into())]);
        // Removed and made again under the same id (at the same instant):
        // read from its start, whatever was cached.
        drop((log, f));
        fs::remove_file(&path).unwrap();
        let mut log = SessionLog::<Rec>::create_clocked(dir.path(), "s1", fixed).unwrap();
        log.append(&rec("new")).unwrap();
        let (_, seen) = fold(Some((mark, vec![(9, "stale".into())])));
        assert_eq!(seen, vec![(1, "new".into())]);
    }

    #[test]
    fn a_torn_last_line_is_cut_and_the_log_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SessionLog::<Rec>::create(dir.path(), "s").unwrap();
        log.append(&rec("a")).unwrap();
        log.append(&rec("b")).unwrap();
        drop(log);
        let path = path_of(dir.path(), "s");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"seq":3,"record":{"te"#).unwrap();
        drop(f);
        // Readers ignore the torn tail.
        assert_eq!(all(dir.path(), "s").len(), 2);
        let (mut log, recovery) = SessionLog::<Rec>::open(dir.path(), "s").unwrap();
        assert_eq!(recovery.torn_bytes, 22);
        assert_eq!(log.append(&rec("c")).unwrap(), 3);
        drop(log);
        assert_eq!(
            texts(&all(dir.path(), "s")),
            vec![(1, "a".into()), (2, "b".into()), (3, "c".into())]
        );
    }

    #[test]
    fn damage_and_unknown_versions_are_explicit_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SessionLog::<Rec>::create(dir.path(), "s").unwrap();
        log.append(&rec("a")).unwrap();
        drop(log);
        let path = path_of(dir.path(), "s");
        let text = fs::read_to_string(&path).unwrap();
        fs::write(&path, text.replace("\"version\":1", "\"version\":9")).unwrap();
        let e = SessionLog::<Rec>::open(dir.path(), "s").unwrap_err();
        assert_eq!(
            e.to_string(),
            "session s has format version 9; this build reads version 1"
        );
        fs::write(&path, format!("{text}not json\n")).unwrap();
        let e = SessionLog::<Rec>::open(dir.path(), "s").unwrap_err();
        assert!(matches!(e, LogError::Corrupt { line: 3, .. }), "{e}");
        let mut records = SessionLog::<Rec>::records(dir.path(), "s").unwrap();
        assert!(records.next().unwrap().is_ok());
        let e = records.next().unwrap().unwrap_err();
        assert!(matches!(e, LogError::Corrupt { line: 3, .. }), "{e}");
        assert!(records.next().is_none(), "nothing after damage");
        fs::write(&path, text.replace("\"seq\":1", "\"seq\":2")).unwrap();
        let e = SessionLog::<Rec>::open(dir.path(), "s").unwrap_err();
        assert!(e.to_string().contains("seq 2 follows 0"), "{e}");
    }

    #[test]
    fn one_writer_and_nothing_is_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let log = SessionLog::<Rec>::create(dir.path(), "s").unwrap();
        assert!(matches!(
            SessionLog::<Rec>::open(dir.path(), "s"),
            Err(LogError::Locked(_))
        ));
        assert!(matches!(
            SessionLog::<Rec>::create(dir.path(), "s"),
            Err(LogError::AlreadyExists(_))
        ));
        drop(log);
        assert!(SessionLog::<Rec>::open(dir.path(), "s").is_ok());
        assert!(matches!(
            SessionLog::<Rec>::open(dir.path(), "nope"),
            Err(LogError::NotFound(_))
        ));
        assert!(matches!(
            SessionLog::<Rec>::create(dir.path(), "../x"),
            Err(LogError::BadId(_))
        ));
    }

    #[test]
    fn fork_copies_a_prefix_then_appends_and_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SessionLog::<Rec>::create(dir.path(), "p").unwrap();
        for s in ["a", "b", "c", "d"] {
            log.append(&rec(s)).unwrap();
        }
        let child = SessionLog::<Rec>::fork(dir.path(), "p", "c", 2, &[rec("interrupted by fork")])
            .unwrap();
        assert_eq!(child.last_seq(), 3);
        assert_eq!(
            child.header().forked_from,
            Some(ForkOrigin {
                session_id: "p".into(),
                upto_seq: 2
            })
        );
        drop(child);
        assert_eq!(
            texts(&all(dir.path(), "c")),
            vec![
                (1, "a".into()),
                (2, "b".into()),
                (3, "interrupted by fork".into())
            ]
        );
        assert!(matches!(
            SessionLog::<Rec>::fork(dir.path(), "p", "c", 1, &[]),
            Err(LogError::AlreadyExists(_))
        ));
        assert!(matches!(
            SessionLog::<Rec>::fork(dir.path(), "p", "c2", 9, &[]),
            Err(LogError::BadForkPoint { .. })
        ));
        // The parent is untouched and still being written.
        log.append(&rec("e")).unwrap();
        assert_eq!(all(dir.path(), "p").len(), 5);
    }

    #[test]
    fn each_record_keeps_its_time_and_a_fork_keeps_the_parents() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicI64, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let now = Arc::new(AtomicI64::new(1_000));
        let at = Arc::clone(&now);
        let clock = Clock::from_fn(move || at.load(Ordering::SeqCst));
        let mut log = SessionLog::<Rec>::create_clocked(dir.path(), "p", clock.clone()).unwrap();
        assert_eq!(log.header().created_at_unix_ms, 1_000);
        log.append(&rec("a")).unwrap();
        now.store(2_000, Ordering::SeqCst);
        log.append(&rec("b")).unwrap();
        now.store(9_000, Ordering::SeqCst);
        SessionLog::<Rec>::fork_clocked(dir.path(), "p", "c", 2, &[rec("own")], clock).unwrap();
        let times = |id: &str| -> Vec<(u64, Option<i64>)> {
            SessionLog::<Rec>::records(dir.path(), id)
                .unwrap()
                .timed()
                .map(|r| r.map(|t| (t.seq, t.at_unix_ms)).unwrap())
                .collect()
        };
        assert_eq!(times("p"), [(1, Some(1_000)), (2, Some(2_000))]);
        assert_eq!(
            times("c"),
            [(1, Some(1_000)), (2, Some(2_000)), (3, Some(9_000))]
        );
        // A line written before lines had times is read without one.
        let mut f = OpenOptions::new()
            .append(true)
            .open(path_of(dir.path(), "p"))
            .unwrap();
        f.write_all(b"{\"seq\":3,\"record\":{\"text\":\"old\"}}\n")
            .unwrap();
        assert_eq!(times("p")[2], (3, None));
    }
}
