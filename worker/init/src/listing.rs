//! A directory's entries, listed for a client (`list_dir`) by the
//! supervisor itself, with the sandbox user's file rights, into a memory
//! file that is then sent as the operation's output: no process of the
//! sandbox's can trace the supervisor, or reach the file, so none can
//! change what the listing says, as it could a shell's (or a helper's in
//! the moment after it starts).
//!
//! The output, for each entry by name (not `.` or `..`): its `st_mode` in
//! lower-case hex, its size and its modification time in seconds, a
//! newline, then its name and a NUL. Entries are not followed: a link is
//! listed as a link.

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use corral_proto::FileErrorKind;

use crate::fileops::Roots;

/// Why a listing failed.
#[derive(Debug)]
pub struct Failed {
    pub kind: FileErrorKind,
    pub message: String,
}

fn failed(path: &Path, e: &std::io::Error) -> Failed {
    let kind = match e.kind() {
        std::io::ErrorKind::NotFound => FileErrorKind::NotFound,
        std::io::ErrorKind::PermissionDenied => FileErrorKind::PermissionDenied,
        _ => FileErrorKind::Other,
    };
    Failed {
        kind,
        message: format!("{}: {e}", path.display()),
    }
}

/// Lists `path` (relative paths from the workspace) to `out`.
pub fn list(roots: &Roots, path: &str, mut out: impl Write) -> Result<(), Failed> {
    let dir: PathBuf = if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        roots.workspace.join(path)
    };
    let meta = std::fs::metadata(&dir).map_err(|e| failed(&dir, &e))?;
    if !meta.is_dir() {
        return Err(Failed {
            kind: FileErrorKind::Other,
            message: format!("{}: not a directory", dir.display()),
        });
    }
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(|e| failed(&dir, &e))? {
        let entry = entry.map_err(|e| failed(&dir, &e))?;
        let name = entry.file_name();
        // Gone between the read and the stat: not listed.
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        entries.push((name, meta.mode(), meta.size(), meta.mtime()));
    }
    entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut write = || -> std::io::Result<()> {
        for (name, mode, size, mtime) in &entries {
            writeln!(out, "{mode:x} {size} {mtime}")?;
            out.write_all(name.as_bytes())?;
            out.write_all(b"\0")?;
        }
        out.flush()
    };
    write().map_err(|e| Failed {
        kind: FileErrorKind::Other,
        message: format!("writing the listing: {e}"),
    })
}

/// The listing of `path` in a memory file, read from its start, and its
/// size.
pub fn into_memory(roots: &Roots, path: &str) -> Result<(std::fs::File, u64), Failed> {
    use std::io::{Seek, SeekFrom};
    let other = |e: std::io::Error| Failed {
        kind: FileErrorKind::Other,
        message: format!("the listing's memory file: {e}"),
    };
    let mut file = memfd().map_err(other)?;
    list(roots, path, &mut file)?;
    let size = file.seek(SeekFrom::End(0)).map_err(other)?;
    file.seek(SeekFrom::Start(0)).map_err(other)?;
    Ok((file, size))
}

#[allow(unsafe_code)]
fn memfd() -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name and flags; on success the descriptor
    // is new and ours alone, owned by the File made of it.
    let fd = unsafe { libc::memfd_create(c"corral-listing".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_by_name_with_mode_size_and_time_and_links_unfollowed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.txt"), b"four").unwrap();
        std::fs::create_dir(dir.path().join("a dir")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("c")).unwrap();
        std::fs::write(dir.path().join("n\nl"), b"").unwrap();
        let roots = Roots {
            workspace: dir.path().to_path_buf(),
            others: vec![],
        };
        let mut out = Vec::new();
        list(&roots, ".", &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let names: Vec<&str> = text
            .split('\0')
            .filter(|s| !s.is_empty())
            .map(|rec| rec.split_once('\n').unwrap().1)
            .collect();
        assert_eq!(names, ["a dir", "b.txt", "c", "n\nl"]);
        let b = text
            .split('\0')
            .find(|r| r.ends_with("\nb.txt"))
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>();
        assert_eq!(b[0], format!("{:x}", libc_mode(&dir.path().join("b.txt"))));
        assert_eq!(b[1], "4");
        let c = text.split('\0').find(|r| r.ends_with("\nc")).unwrap();
        let mode = u32::from_str_radix(c.split_whitespace().next().unwrap(), 16).unwrap();
        assert_eq!(mode & 0o170000, 0o120000, "a link, not what it names");
    }

    fn libc_mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode()
    }

    #[test]
    fn failures_say_which_with_their_code() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"").unwrap();
        let roots = Roots {
            workspace: dir.path().to_path_buf(),
            others: vec![],
        };
        assert_eq!(
            list(&roots, "missing", Vec::new()).unwrap_err().kind,
            FileErrorKind::NotFound
        );
        let not_dir = list(&roots, "f", Vec::new()).unwrap_err();
        assert_eq!(not_dir.kind, FileErrorKind::Other);
        assert!(
            not_dir.message.ends_with("not a directory"),
            "{}",
            not_dir.message
        );
    }
}
