//! File reads and writes, confined to the sandbox's writable roots.
//!
//! A path is taken relative to the workspace unless absolute, normalized
//! lexically, and must stay under one of the roots (the workspace and /tmp).
//! Symbolic links are resolved before the check, so a link that points out
//! of the roots is refused too; and the file itself is opened with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` from its root, so no
//! link swapped in after the check, and no magic link of /proc (such as
//! `/proc/self/fd/1`, the supervisor's line to the worker), is followed out.
//! Writes go to a temporary file that is renamed into place, so a reader
//! never sees half a file.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use corral_proto::limits::MAX_FILE_BYTES;
use corral_proto::{FileErrorKind, OperationResult, Outcome, ReadFileSpec, WriteFileSpec};

/// Where file operations may read and write.
#[derive(Debug, Clone)]
pub struct Roots {
    /// Relative paths start here; it is also the first root.
    pub workspace: PathBuf,
    pub others: Vec<PathBuf>,
}

impl Roots {
    pub fn sandbox() -> Self {
        Self {
            workspace: PathBuf::from(corral_proto::limits::WORKSPACE_DIR),
            others: vec![PathBuf::from(corral_proto::limits::TMP_DIR)],
        }
    }

    fn all(&self) -> impl Iterator<Item = &PathBuf> {
        std::iter::once(&self.workspace).chain(self.others.iter())
    }
}

#[derive(Debug)]
struct FileError(FileErrorKind, String);

impl From<FileError> for OperationResult {
    fn from(FileError(kind, message): FileError) -> Self {
        OperationResult::with_outcome(Outcome::FileError { kind, message })
    }
}

fn io_error(path: &str, e: &io::Error) -> FileError {
    let kind = match e.kind() {
        io::ErrorKind::NotFound => FileErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => FileErrorKind::PermissionDenied,
        io::ErrorKind::IsADirectory => FileErrorKind::IsDirectory,
        _ => FileErrorKind::Other,
    };
    FileError(kind, format!("{path}: {e}"))
}

/// Lexical normalization: resolves `.` and `..` without touching the disk.
fn normalize(roots: &Roots, raw: &str) -> PathBuf {
    lexical(&roots.workspace, raw)
}

/// `raw` under `base` (unless absolute), its `.` and `..` taken lexically.
pub fn lexical(base: &Path, raw: &str) -> PathBuf {
    let joined = base.join(raw);
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

fn outside(raw: &str) -> FileError {
    FileError(
        FileErrorKind::OutsideSandboxRoots,
        format!("{raw}: outside the workspace, /tmp and the sandbox's volumes"),
    )
}

fn within_roots(roots: &Roots, path: &Path) -> bool {
    roots.all().any(|r| {
        let real = fs::canonicalize(r).unwrap_or_else(|_| r.clone());
        path.starts_with(&real) || path.starts_with(r)
    })
}

/// Resolves `raw` to a real path under the roots. For a path that does not
/// exist yet, the deepest existing ancestor is resolved and checked, and the
/// rest appended (it cannot contain links, since it does not exist).
fn resolve(roots: &Roots, raw: &str) -> Result<PathBuf, FileError> {
    let lexical = normalize(roots, raw);
    if !within_roots(roots, &lexical) {
        return Err(outside(raw));
    }
    let mut existing = lexical.as_path();
    let mut rest = Vec::new();
    loop {
        match fs::canonicalize(existing) {
            Ok(real) => {
                let mut full = real;
                for part in rest.iter().rev() {
                    full.push(part);
                }
                if !within_roots(roots, &full) {
                    return Err(outside(raw));
                }
                return Ok(full);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) else {
                    return Err(io_error(raw, &e));
                };
                rest.push(name.to_owned());
                existing = parent;
            }
            Err(e) => return Err(io_error(raw, &e)),
        }
    }
}

/// [`resolve`] for other modules: `raw` as a real path under the roots, or
/// why not.
pub fn resolve_under_roots(roots: &Roots, raw: &str) -> Result<PathBuf, String> {
    resolve(roots, raw).map_err(|FileError(_, message)| message)
}

/// That `raw` names something under the roots (a file, a directory, a
/// link), as an archive of it needs: else why not (`NotFound`, outside the
/// roots, not reachable by the caller).
pub fn must_exist(roots: &Roots, raw: &str) -> Result<(), Refusal> {
    let path = resolve(roots, raw)?;
    fs::symlink_metadata(&path)
        .map(|_| ())
        .map_err(|e| io_error(raw, &e).into())
}

/// Opens `path` (resolved under the roots) from the root it is under, so
/// that the kernel refuses any step out of that root and any magic link.
/// Kernels without openat2 (before 5.6) get a plain open that follows no
/// final symlink.
fn open_beneath(
    roots: &Roots,
    path: &Path,
    flags: nix::fcntl::OFlag,
    mode: u32,
    raw: &str,
) -> Result<fs::File, FileError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
    let Some((root, rel)) = roots.all().find_map(|r| {
        let real = fs::canonicalize(r).unwrap_or_else(|_| r.clone());
        path.strip_prefix(&real)
            .or_else(|_| path.strip_prefix(r))
            .ok()
            .map(|rel| (real, rel.to_path_buf()))
    }) else {
        return Err(outside(raw));
    };
    if rel.as_os_str().is_empty() {
        return Err(FileError(
            FileErrorKind::IsDirectory,
            format!("{raw}: is a directory"),
        ));
    }
    let dir = fs::File::open(&root).map_err(|e| io_error(raw, &e))?;
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(nix::sys::stat::Mode::from_bits_truncate(mode))
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match openat2(&dir, rel.as_path(), how) {
        Ok(fd) => Ok(fs::File::from(fd)),
        Err(nix::errno::Errno::EXDEV | nix::errno::Errno::ELOOP) => Err(outside(raw)),
        Err(nix::errno::Errno::ENOSYS) => {
            let mut o = fs::OpenOptions::new();
            // OpenOptions sets the access mode itself.
            o.custom_flags((flags | OFlag::O_NOFOLLOW).bits() & !OFlag::O_ACCMODE.bits())
                .mode(mode);
            let acc = flags & OFlag::O_ACCMODE;
            o.read(acc == OFlag::O_RDONLY || acc == OFlag::O_RDWR)
                .write(acc == OFlag::O_WRONLY || acc == OFlag::O_RDWR);
            o.open(path).map_err(|e| match e.raw_os_error() {
                // The final component is a link: refused, as openat2 would.
                Some(code) if code == nix::errno::Errno::ELOOP as i32 => outside(raw),
                _ => io_error(raw, &e),
            })
        }
        Err(e) => Err(io_error(raw, &io::Error::from(e))),
    }
}

/// Why a file operation failed; its result says so.
#[derive(Debug)]
pub struct Refusal(FileError);

impl From<FileError> for Refusal {
    fn from(e: FileError) -> Self {
        Self(e)
    }
}

impl From<Refusal> for OperationResult {
    fn from(Refusal(e): Refusal) -> Self {
        e.into()
    }
}

/// Refuses anything but a regular file: a FIFO, a device or a socket could
/// block the supervisor or reach outside the sandbox.
fn regular(file: &fs::File, raw: &str) -> Result<u64, FileError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = file.metadata().map_err(|e| io_error(raw, &e))?;
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(meta.len());
    }
    let what = if ft.is_dir() {
        return Err(FileError(
            FileErrorKind::IsDirectory,
            format!("{raw}: is a directory"),
        ));
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else {
        "not a file"
    };
    Err(not_regular(raw, what))
}

fn not_regular(raw: &str, what: &str) -> FileError {
    FileError(
        FileErrorKind::NotRegular,
        format!("{raw}: not a regular file ({what}); only regular files are read or written"),
    )
}

/// Opens `path` for reading without blocking (a FIFO opens at once and is
/// then refused) and seeks to `offset`. Returns the file and its size.
pub fn open_read(roots: &Roots, spec: &ReadFileSpec) -> Result<(fs::File, u64), Refusal> {
    open_for_read(roots, spec).map_err(Into::into)
}

fn open_for_read(roots: &Roots, spec: &ReadFileSpec) -> Result<(fs::File, u64), FileError> {
    use nix::fcntl::OFlag;
    let path = resolve(roots, &spec.path)?;
    let mut file = open_beneath(
        roots,
        &path,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
        0,
        &spec.path,
    )?;
    let size = regular(&file, &spec.path)?;
    file.seek(SeekFrom::Start(spec.offset))
        .map_err(|e| io_error(&spec.path, &e))?;
    Ok((file, size))
}

/// Reads up to `spec.limit` bytes (at most [`MAX_FILE_BYTES`]) into the result.
pub fn read_file(roots: &Roots, spec: &ReadFileSpec) -> OperationResult {
    read(roots, spec).unwrap_or_else(Into::into)
}

fn read(roots: &Roots, spec: &ReadFileSpec) -> Result<OperationResult, FileError> {
    let (file, size) = open_for_read(roots, spec)?;
    let limit = spec.limit.min(MAX_FILE_BYTES);
    let mut data = Vec::new();
    file.take(limit)
        .read_to_end(&mut data)
        .map_err(|e| io_error(&spec.path, &e))?;
    let mut result = OperationResult::with_outcome(Outcome::Exited { code: 0 });
    result.file_size = size;
    result.file_data = Bytes::from(data);
    Ok(result)
}

pub fn write_file(roots: &Roots, spec: &WriteFileSpec) -> OperationResult {
    write_file_as(roots, spec, None)
}

/// As [`write_file`], the file and the directories made for it given to
/// `owner` (the sandbox user, when the supervisor writes as root: under
/// runtimes that ignore its switch of filesystem user, gVisor's).
pub fn write_file_as(roots: &Roots, spec: &WriteFileSpec, owner: Option<u32>) -> OperationResult {
    let mut w = match FileWriter::open(roots, spec, owner) {
        Ok(w) => w,
        Err(refusal) => return refusal.into(),
    };
    if let Err(refusal) = w.write(&spec.data) {
        w.abort();
        return refusal.into();
    }
    w.finish()
}

/// A write in progress: to a temporary file renamed over the target at the
/// end (a reader never sees half a file), or, appending, to the file itself.
pub struct FileWriter {
    file: fs::File,
    /// The temporary file, when replacing.
    tmp: Option<PathBuf>,
    path: PathBuf,
    raw: String,
    mode: u32,
    written: u64,
}

impl FileWriter {
    pub fn open(roots: &Roots, spec: &WriteFileSpec, owner: Option<u32>) -> Result<Self, Refusal> {
        Self::open_inner(roots, spec, owner).map_err(Into::into)
    }

    fn open_inner(
        roots: &Roots,
        spec: &WriteFileSpec,
        owner: Option<u32>,
    ) -> Result<Self, FileError> {
        use nix::fcntl::OFlag;
        if spec.data.len() as u64 > MAX_FILE_BYTES {
            return Err(FileError(
                FileErrorKind::TooLarge,
                format!(
                    "{} bytes is above the limit of {MAX_FILE_BYTES} in one message (stream larger files)",
                    spec.data.len()
                ),
            ));
        }
        let path = resolve(roots, &spec.path)?;
        if roots.all().any(|r| r == &path) || path.is_dir() {
            return Err(FileError(
                FileErrorKind::IsDirectory,
                format!("{}: is a directory", spec.path),
            ));
        }
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(outside(&spec.path));
        };
        // Whatever is there now must be a regular file (or nothing): never
        // opened for I/O otherwise.
        if let Ok(meta) = fs::symlink_metadata(&path)
            && !meta.file_type().is_file()
            && !meta.file_type().is_symlink()
        {
            use std::os::unix::fs::FileTypeExt;
            let ft = meta.file_type();
            let what = if ft.is_fifo() {
                "a FIFO"
            } else if ft.is_socket() {
                "a socket"
            } else {
                "a device"
            };
            return Err(not_regular(&spec.path, what));
        }
        let existing = dir.ancestors().find(|a| a.exists()).map(Path::to_path_buf);
        fs::create_dir_all(dir).map_err(|e| io_error(&spec.path, &e))?;
        // A directory swapped for a link since the check is caught here
        // (and the file itself is opened beneath its root below).
        if !fs::canonicalize(dir).is_ok_and(|real| within_roots(roots, &real)) {
            return Err(outside(&spec.path));
        }
        if let Some(uid) = owner {
            for made in dir
                .ancestors()
                .take_while(|a| Some(*a) != existing.as_deref())
            {
                // Never through a link: only what was made here changes owner.
                nix::unistd::fchownat(
                    nix::fcntl::AT_FDCWD,
                    made,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(uid)),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| io_error(&spec.path, &io::Error::from(e)))?;
            }
        }
        let (target, tmp, flags) = if spec.append {
            (
                path.clone(),
                None,
                OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_APPEND,
            )
        } else {
            let tmp = dir.join(format!(
                ".{}.corral-{}",
                name.to_string_lossy(),
                &corral_proto::ids::random_uuid()[..8]
            ));
            (
                tmp.clone(),
                Some(tmp),
                OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            )
        };
        let opened = open_beneath(
            roots,
            &target,
            flags | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
            spec.mode,
            &spec.path,
        );
        let file = match opened {
            Ok(f) => f,
            // A FIFO without a reader, opened for writing without blocking.
            Err(FileError(_, _)) if spec.append && is_fifo(&path) => {
                return Err(not_regular(&spec.path, "a FIFO"));
            }
            Err(e) => return Err(e),
        };
        let mut w = Self {
            file,
            tmp,
            path,
            raw: spec.path.clone(),
            mode: spec.mode,
            written: 0,
        };
        let checked = regular(&w.file, &spec.path).and_then(|_| {
            if let Some(uid) = owner {
                std::os::unix::fs::fchown(&w.file, Some(uid), Some(uid))
                    .map_err(|e| io_error(&spec.path, &e))?;
            }
            Ok(())
        });
        if let Err(e) = checked {
            w.remove_tmp();
            return Err(e);
        }
        Ok(w)
    }

    pub fn write(&mut self, data: &[u8]) -> Result<(), Refusal> {
        match self.file.write_all(data) {
            Ok(()) => {
                self.written += data.len() as u64;
                Ok(())
            }
            Err(e) => Err(io_error(&self.raw, &e).into()),
        }
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// Puts the file in place and says how much was written.
    pub fn finish(mut self) -> OperationResult {
        let done = (|| {
            if let Some(tmp) = &self.tmp {
                self.file
                    .set_permissions(fs::Permissions::from_mode(self.mode))?;
                self.file.sync_data()?;
                fs::rename(tmp, &self.path)?;
            }
            Ok::<(), io::Error>(())
        })();
        if let Err(e) = done {
            self.remove_tmp();
            return io_error(&self.raw, &e).into();
        }
        self.tmp = None;
        let mut result = OperationResult::with_outcome(Outcome::Exited { code: 0 });
        result.bytes_written = self.written;
        result
    }

    /// Gives up: a replaced file stays as it was.
    pub fn abort(mut self) {
        self.remove_tmp();
    }

    fn remove_tmp(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = fs::remove_file(tmp);
        }
    }
}

fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roots(dir: &Path) -> Roots {
        let ws = dir.join("ws");
        let tmp = dir.join("tmp");
        fs::create_dir_all(&ws).unwrap();
        fs::create_dir_all(&tmp).unwrap();
        Roots {
            workspace: ws,
            others: vec![tmp],
        }
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "corral-fileops-{}",
            corral_proto::ids::random_uuid()
        ));
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn write_spec(path: &str, data: &'static [u8]) -> WriteFileSpec {
        WriteFileSpec::new(path, Bytes::from_static(data))
    }

    fn read_spec(path: &str) -> ReadFileSpec {
        ReadFileSpec::new(path)
    }

    fn kind(r: &OperationResult) -> Option<FileErrorKind> {
        match &r.outcome {
            Outcome::FileError { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    #[test]
    fn a_magic_link_in_the_workspace_is_never_followed() {
        let d = tempdir();
        let r = roots(&d);
        std::os::unix::fs::symlink("/proc/self/fd/1", r.workspace.join("fd1")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc/hostname", r.workspace.join("root"))
            .unwrap();
        for name in ["fd1", "root"] {
            let got = read_file(&r, &read_spec(name));
            assert_eq!(
                kind(&got),
                Some(FileErrorKind::OutsideSandboxRoots),
                "{name}: {got:?}"
            );
            let w = write_file(&r, &write_spec(&format!("{name}/x"), b"forged"));
            assert!(kind(&w).is_some(), "{name}: {w:?}");
        }
    }

    #[test]
    fn writes_then_reads_with_offset_and_limit() {
        let d = tempdir();
        let r = roots(&d);
        let w = write_file(&r, &write_spec("sub/dir/a.txt", b"hello world"));
        assert_eq!(w.outcome, Outcome::Exited { code: 0 }, "{w:?}");
        assert_eq!(w.bytes_written, 11);
        let got = read_file(&r, &read_spec("sub/dir/a.txt"));
        assert_eq!(&got.file_data[..], b"hello world");
        let got = read_file(
            &r,
            &ReadFileSpec {
                offset: 6,
                limit: 3,
                ..ReadFileSpec::new(format!("{}/sub/dir/a.txt", r.workspace.display()))
            },
        );
        assert_eq!((&got.file_data[..], got.file_size), (&b"wor"[..], 11));
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn traversal_is_refused() {
        let d = tempdir();
        let r = roots(&d);
        fs::write(d.join("secret"), b"s").unwrap();
        for p in [
            "../secret",
            "a/../../secret",
            "/etc/passwd",
            "../../../../etc/passwd",
        ] {
            let got = read_file(&r, &read_spec(p));
            assert_eq!(
                kind(&got),
                Some(FileErrorKind::OutsideSandboxRoots),
                "{p}: {got:?}"
            );
            let got = write_file(&r, &write_spec(p, b"x"));
            assert_eq!(
                kind(&got),
                Some(FileErrorKind::OutsideSandboxRoots),
                "{p}: {got:?}"
            );
        }
        // A link inside the workspace that points out of it.
        std::os::unix::fs::symlink(&d, r.workspace.join("escape")).unwrap();
        let got = read_file(&r, &read_spec("escape/secret"));
        assert_eq!(
            kind(&got),
            Some(FileErrorKind::OutsideSandboxRoots),
            "{got:?}"
        );
        let got = write_file(&r, &write_spec("escape/new", b"x"));
        assert_eq!(
            kind(&got),
            Some(FileErrorKind::OutsideSandboxRoots),
            "{got:?}"
        );
        assert!(!d.join("new").exists());
        // The other root is fine.
        let tmp = r.others[0].join("t");
        let got = write_file(&r, &write_spec(tmp.to_str().unwrap(), b"x"));
        assert_eq!(got.outcome, Outcome::Exited { code: 0 });
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn fifos_are_refused_without_blocking() {
        let d = tempdir();
        let r = roots(&d);
        let fifo = r.workspace.join("pipe");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let got = read_file(&r, &read_spec("pipe"));
        assert_eq!(kind(&got), Some(FileErrorKind::NotRegular), "{got:?}");
        assert!(got.outcome.to_string().contains("a FIFO"), "{got:?}");
        let append = WriteFileSpec {
            append: true,
            ..write_spec("pipe", b"x")
        };
        assert_eq!(
            kind(&write_file(&r, &append)),
            Some(FileErrorKind::NotRegular)
        );
        assert_eq!(
            kind(&write_file(&r, &write_spec("pipe", b"x"))),
            Some(FileErrorKind::NotRegular)
        );
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn appends_add_to_the_end() {
        let d = tempdir();
        let r = roots(&d);
        let append = |data: &'static [u8]| WriteFileSpec {
            append: true,
            ..write_spec("log.txt", data)
        };
        for part in [&b"one "[..], b"two"] {
            let w = write_file(&r, &append(part));
            assert_eq!(w.outcome, Outcome::Exited { code: 0 }, "{w:?}");
        }
        assert_eq!(fs::read(r.workspace.join("log.txt")).unwrap(), b"one two");
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn missing_and_directory_errors_are_typed() {
        let d = tempdir();
        let r = roots(&d);
        assert_eq!(
            kind(&read_file(&r, &read_spec("nope"))),
            Some(FileErrorKind::NotFound)
        );
        fs::create_dir(r.workspace.join("dir")).unwrap();
        assert_eq!(
            kind(&read_file(&r, &read_spec("dir"))),
            Some(FileErrorKind::IsDirectory)
        );
        assert_eq!(
            kind(&write_file(&r, &write_spec("dir", b"x"))),
            Some(FileErrorKind::IsDirectory)
        );
        assert_eq!(
            kind(&write_file(&r, &write_spec(".", b"x"))),
            Some(FileErrorKind::IsDirectory)
        );
        fs::remove_dir_all(d).unwrap();
    }
}
