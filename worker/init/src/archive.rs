//! Trees in and out of the sandbox as tar streams: what `corral cp` and
//! workspaces move. Each runs in a process of its own, forked by the
//! supervisor and never exec'd ([`Helper::run_forked`]), as the sandbox's
//! user, with the archive on its stdin or stdout: the
//! supervisor's flow control carries the bytes, the sandbox's own limits
//! (its user's permissions, the workspace's size) bound them, and the
//! supervisor itself never blocks on a slow disk.
//!
//! The destination or source must resolve under the sandbox's roots.
//! Unpacking never follows a link out of the destination: every entry's
//! directories are checked one by one (a link among them must resolve
//! inside), the entry itself replaces whatever link stands at its place,
//! and names that are absolute or climb out (`..`) are refused. Packing
//! stores links as links and never follows them, a file with several hard
//! links once (the others as links to it), and leaves special files out.
//!
//! What comes out of a sandbox is hostile, whoever packed it (a command may
//! have tampered with the helper): [`Unpacking::from_sandbox`] takes only
//! the one tree the client asked for, under its own name, caps modes at
//! 0755/0644 under the local umask, makes no special file, can leave out
//! git's configuration and hooks, and stops at a size and an entry count.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

use crate::fileops::{Roots, resolve_under_roots};

/// What an archive run did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moved {
    pub entries: u64,
    pub bytes: u64,
    /// What was left out, and why, one note each (at most [`MAX_NOTES`];
    /// `left_out` counts them all).
    pub notes: Vec<String>,
    pub left_out: u64,
    /// Unpacking: the bytes of archive read, to the end of the stream.
    pub archive_bytes: u64,
}

/// What an archive helper moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelperKind {
    /// The archive on stdin, unpacked at the path.
    Put,
    /// The path, packed under its own name, to stdout.
    Get,
    /// A directory's contents, packed, to stdout.
    GetContents,
}

/// One archive helper's work: what it moves, where, and as whom.
#[derive(Debug, Clone)]
pub struct Helper {
    pub kind: HelperKind,
    pub path: String,
    /// The command user, for a sandbox whose commands are not root.
    pub uid: Option<u32>,
    pub roots: Roots,
}

impl Helper {
    /// The helper's life, in a process forked from the supervisor, with
    /// the archive's pipes as its stdin, stdout and stderr; it exits with
    /// 0 or, its reason on stderr, 1, and never returns.
    ///
    /// Forked, never exec'd: the supervisor is not dumpable from its start
    /// and a fork inherits that, so there is no moment, however short, in
    /// which a root sandbox's process could open this one's memory, as it
    /// could a freshly exec'd program's before it made itself untraceable.
    /// The caller is a single-threaded process's fork, so no lock is held.
    #[allow(unsafe_code)]
    pub fn run_forked(&self) -> ! {
        use std::os::fd::FromRawFd;
        // SAFETY: a single-threaded process's fork; descriptors 0 to 2 are
        // the pipes set for it, owned by nothing else here. Whatever else
        // it holds of the supervisor's is closed first (std's exec-error
        // pipe among them, which would keep the supervisor's spawn waiting).
        unsafe {
            if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) < 0 {
                for fd in 3..4096 {
                    libc::close(fd);
                }
            }
        }
        let done = untraceable(self.uid).and_then(|()| {
            // SAFETY: descriptor 1 is this process's stdout, used by
            // nothing else here (std's stdout is never touched).
            let stdout = unsafe { fs::File::from_raw_fd(1) };
            let out = io::BufWriter::with_capacity(256 * 1024, stdout);
            match self.kind {
                HelperKind::Put => CancellableStdin::new()
                    .map_err(|e| e.to_string())
                    .and_then(|stdin| put(&self.roots, &self.path, stdin)),
                HelperKind::Get => get(&self.roots, &self.path, out),
                HelperKind::GetContents => get_contents(&self.roots, &self.path, out),
            }
        });
        let code = match done {
            Ok(_) => 0,
            Err(e) => {
                let line = format!("{e}\n");
                // SAFETY: descriptor 2 is this process's stderr.
                let mut stderr = std::mem::ManuallyDrop::new(unsafe { fs::File::from_raw_fd(2) });
                let _ = stderr.write_all(line.as_bytes());
                1
            }
        };
        // SAFETY: ends this process without running the supervisor's exit
        // handlers or destructors, which are not its own.
        unsafe { libc::_exit(code) }
    }
}

/// Makes this process untraceable by the sandbox's user (not dumpable:
/// ptrace, `/proc/PID/mem` and `/proc/PID/fd` need `CAP_SYS_PTRACE` then,
/// which no sandbox has) and, given `uid`, makes it that user only then
/// (no supplementary group, no capability left), so there is no moment in
/// which it is both the sandbox's user and traceable; then checks that no
/// tracer attached all the same: what an archive helper does first.
pub fn untraceable(uid: Option<u32>) -> Result<(), String> {
    nix::sys::prctl::set_dumpable(false).map_err(|e| format!("prctl(PR_SET_DUMPABLE): {e}"))?;
    if let Some(uid) = uid {
        use nix::unistd::{Gid, Uid, setgid, setgroups, setuid};
        setgroups(&[]).map_err(|e| format!("setgroups: {e}"))?;
        setgid(Gid::from_raw(uid)).map_err(|e| format!("setgid({uid}): {e}"))?;
        setuid(Uid::from_raw(uid)).map_err(|e| format!("setuid({uid}): {e}"))?;
        if nix::unistd::geteuid().as_raw() != uid {
            return Err(format!("still not user {uid} after setuid"));
        }
        // A change of user leaves a process not dumpable, but say it again.
        nix::sys::prctl::set_dumpable(false).map_err(|e| format!("prctl(PR_SET_DUMPABLE): {e}"))?;
    }
    let status =
        fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    let tracer = status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .map(str::trim);
    match tracer {
        Some("0") => Ok(()),
        Some(pid) => Err(format!(
            "traced by process {pid}: the archive helper refuses to run"
        )),
        None => Err("/proc/self/status names no TracerPid".into()),
    }
}

/// Notes kept of what a transfer left out.
pub const MAX_NOTES: usize = 20;

impl Moved {
    fn leave_out(&mut self, note: String) {
        self.left_out += 1;
        if self.notes.len() < MAX_NOTES {
            self.notes.push(note);
        }
    }
}

/// Default ceiling on the bytes a transfer out of a sandbox unpacks.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 30;
/// Default ceiling on the entries a transfer out of a sandbox unpacks.
pub const DEFAULT_MAX_ENTRIES: u64 = 1_000_000;

/// How an archive is taken. The default is what the sandbox's own side
/// does with what its client sends (modes kept but set-id bits, FIFOs
/// made); [`Unpacking::from_sandbox`] is for what comes out of one.
#[derive(Debug, Clone, Default)]
pub struct Unpacking {
    /// One tree: every entry under the first one's top name, and a top
    /// entry that is not a directory is the whole archive.
    pub one_tree: bool,
    /// The top name the tree must have (the source's own name), when it
    /// lands under its own name in an existing directory.
    pub top_name: Option<std::ffi::OsString>,
    /// Masked from every mode, as a umask is; `None` keeps the modes.
    pub mode_mask: Option<u32>,
    /// FIFOs and devices are left out with a note instead of being made.
    pub skip_special: bool,
    /// Git's configuration (`config`, `config.worktree`, `commondir`),
    /// hooks and `info/attributes` of any `.git` directory, and `.git`
    /// files that point elsewhere, are left out with a note.
    pub skip_git_config: bool,
    /// Bytes of file data (a sparse file counts at its full size).
    pub max_bytes: Option<u64>,
    pub max_entries: Option<u64>,
}

impl Unpacking {
    /// What comes out of a sandbox: one tree named `top_name` (the
    /// source's own name, see [`archive_name`]), modes at most 0755/0644
    /// under the local umask, no special file, git's configuration and
    /// hooks left out, at most the default bytes and entries.
    pub fn from_sandbox(top_name: Option<std::ffi::OsString>) -> Self {
        Self {
            one_tree: true,
            top_name,
            mode_mask: Some(local_umask() | 0o022),
            skip_special: true,
            skip_git_config: true,
            max_bytes: Some(DEFAULT_MAX_BYTES),
            max_entries: Some(DEFAULT_MAX_ENTRIES),
        }
    }

    /// [`Unpacking::from_sandbox`] for a directory's contents, unpacked
    /// into a directory of their own: every name lands under it, so there
    /// is no one tree to hold them to.
    pub fn contents_from_sandbox() -> Self {
        Self {
            one_tree: false,
            ..Self::from_sandbox(None)
        }
    }
}

/// This process's umask, read without changing it (`umask(2)` would, for
/// every thread); 022 where `/proc` does not say.
pub fn local_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// The name an archive of the sandbox path `raw` gives its top entry: the
/// last component of the path, taken lexically (a relative path is under
/// /workspace), so that the client knows it before the archive comes. `None`
/// for the root.
pub fn archive_name(raw: &str) -> Option<std::ffi::OsString> {
    crate::fileops::lexical(Path::new("/workspace"), raw)
        .file_name()
        .map(|n| n.to_os_string())
}

/// Unpacks the tar stream `input` at `dest`, which must resolve under the
/// roots (see [`unpack`]).
pub fn put(roots: &Roots, dest: &str, input: impl Read) -> Result<Moved, String> {
    let target = resolve_under_roots(roots, dest)?;
    unpack(&target, dest, input)
}

/// What becomes of an archive's top entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Top {
    /// It lands under its own name.
    Keep,
    /// It takes this name.
    Rename(std::ffi::OsString),
}

/// Unpacks the tar stream `input` at `target` (as `docker cp` does): into
/// `target` when it is a directory, else as `target` itself (the archive's
/// top entry takes its name), in its parent directory, which must exist.
/// Set-user-id, set-group-id and sticky bits are dropped. `dest` is how
/// messages name the target.
pub fn unpack(target: &Path, dest: &str, input: impl Read) -> Result<Moved, String> {
    unpack_with(target, dest, input, &Unpacking::default())
}

/// [`unpack`] under `rules`.
pub fn unpack_with(
    target: &Path,
    dest: &str,
    input: impl Read,
    rules: &Unpacking,
) -> Result<Moved, String> {
    let (base, top) = match fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => (target.to_path_buf(), Top::Keep),
        Ok(_) | Err(_) => {
            let parent = target
                .parent()
                .filter(|p| p.is_dir())
                .ok_or_else(|| format!("{dest}: no such directory"))?;
            let name = target
                .file_name()
                .ok_or_else(|| format!("{dest}: not a file name"))?;
            (parent.to_path_buf(), Top::Rename(name.to_os_string()))
        }
    };
    unpack_at(&base, top, dest, input, rules)
}

/// Unpacks an archive of a directory's contents (see [`pack_contents`])
/// into `dir`, made if missing: a whole workspace brought back, say.
pub fn unpack_contents(dir: &Path, dest: &str, input: impl Read) -> Result<Moved, String> {
    unpack_contents_with(dir, dest, input, &Unpacking::default())
}

/// [`unpack_contents`] under `rules`.
pub fn unpack_contents_with(
    dir: &Path,
    dest: &str,
    input: impl Read,
    rules: &Unpacking,
) -> Result<Moved, String> {
    fs::create_dir_all(dir).map_err(|e| format!("{dest}: {e}"))?;
    unpack_at(dir, Top::Keep, dest, input, rules)
}

/// The parts of a git directory that make git run commands or read
/// configuration from elsewhere: what an export leaves out unless asked.
fn is_git_config(rel: &Path, kind: tar::EntryType) -> bool {
    let parts: Vec<&std::ffi::OsStr> = rel.iter().collect();
    for (i, part) in parts.iter().enumerate() {
        if *part != ".git" {
            continue;
        }
        let rest = &parts[i + 1..];
        match rest {
            // A `.git` file says where the repository is: anywhere.
            [] if kind != tar::EntryType::Directory => return true,
            [name]
                if matches!(
                    name.to_str(),
                    Some("config" | "config.worktree" | "commondir")
                ) =>
            {
                return true;
            }
            [hooks, ..] if *hooks == "hooks" => return true,
            [info, attributes] if *info == "info" && *attributes == "attributes" => return true,
            _ => {}
        }
    }
    false
}

fn unpack_at(
    base: &Path,
    top: Top,
    dest: &str,
    input: impl Read,
    rules: &Unpacking,
) -> Result<Moved, String> {
    let base = fs::canonicalize(base).map_err(|e| format!("{dest}: {e}"))?;
    let mut archive = tar::Archive::new(Tally::new(input));
    archive.set_preserve_permissions(false);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let mask = rules.mode_mask.unwrap_or(0);
    archive.set_mask(mask);
    let mut moved = Moved::default();
    // The first entry's top name, and whether it was a directory.
    let mut tree: Option<(std::ffi::OsString, bool)> = None;
    // Directories get their modes and times last: what is unpacked into
    // them would change both.
    let mut dirs: Vec<(PathBuf, u32, u64)> = Vec::new();
    let entries = archive
        .entries()
        .map_err(|e| format!("reading the archive: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("reading the archive: {e}"))?;
        let name = entry
            .path()
            .map_err(|e| format!("reading the archive: {e}"))?
            .into_owned();
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader
                | tar::EntryType::XHeader
                | tar::EntryType::GNULongName
                | tar::EntryType::GNULongLink
        ) {
            continue;
        }
        if rules.one_tree {
            one_tree(&mut tree, &name, kind, rules, &top)?;
        }
        let rel = relative(&name, &top)?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        let shown = name.display();
        if rules.skip_git_config && is_git_config(&rel, kind) {
            // One note for the hooks directory, not one per hook.
            let in_hooks = rel
                .parent()
                .and_then(Path::file_name)
                .is_some_and(|p| p == "hooks");
            if in_hooks {
                moved.left_out += 1;
            } else {
                moved.leave_out(format!("{shown}: git configuration, left out"));
            }
            continue;
        }
        if rules.skip_special
            && matches!(
                kind,
                tar::EntryType::Fifo | tar::EntryType::Char | tar::EntryType::Block
            )
        {
            moved.leave_out(format!("{shown}: a special file, left out"));
            continue;
        }
        if rules.max_entries.is_some_and(|max| moved.entries >= max) {
            return Err(format!(
                "the archive holds more than {} entries (the limit: --max-entries)",
                rules.max_entries.unwrap_or(0)
            ));
        }
        let size = match kind {
            tar::EntryType::GNUSparse => entry
                .header()
                .as_gnu()
                .and_then(|g| g.real_size().ok())
                .unwrap_or(0)
                .max(entry.size()),
            _ => entry.size(),
        };
        if let Some(max) = rules.max_bytes
            && moved.bytes.saturating_add(size) > max
        {
            return Err(format!(
                "the archive holds more than {} of file data (the limit: --max-bytes)",
                human_bytes(max)
            ));
        }
        let full = base.join(&rel);
        let parent = full.parent().unwrap_or(&base);
        make_parents(&base, parent, &name)?;
        match kind {
            tar::EntryType::Directory => {
                match fs::symlink_metadata(&full) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => fs::remove_file(&full).map_err(|e| format!("{shown}: {e}"))?,
                    Err(_) => {}
                }
                if !full.is_dir() {
                    fs::create_dir(&full).map_err(|e| format!("{shown}: {e}"))?;
                }
                let mode = entry.header().mode().unwrap_or(0o755) & !mask;
                let mtime = entry.header().mtime().unwrap_or(0);
                dirs.push((full, mode, mtime));
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(|e| format!("{shown}: {e}"))?
                    .ok_or_else(|| format!("{shown}: a hard link without a target"))?;
                if rules.one_tree {
                    same_tree(&tree, &target, &name)?;
                }
                let target = base.join(relative(&target, &top)?);
                // The file linked to must be inside the destination too: a
                // link among its directories may not lead out.
                let inside = target
                    .parent()
                    .and_then(|p| fs::canonicalize(p).ok())
                    .is_some_and(|p| p.starts_with(&base));
                if !inside {
                    return Err(format!(
                        "{shown}: a hard link to a file outside the destination"
                    ));
                }
                clear(&full, &name)?;
                fs::hard_link(&target, &full).map_err(|e| format!("{shown}: {e}"))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                clear(&full, &name)?;
                moved.bytes += size;
                // Written unnamed and named only once whole: an archive cut
                // off mid-file (a client gone, a helper killed) leaves no
                // part of it behind.
                let whole = unpack_whole(&mut entry, &full, mask)
                    .map_err(|e| format!("{shown}: {}", plain(&e)))?;
                if !whole {
                    // No unnamed files here (gVisor): a hidden name, taken
                    // away if the archive ends or the helper is canceled
                    // before the file is whole.
                    let part = full.with_file_name(format!(".corral-part.{}", std::process::id()));
                    let _ = fs::remove_file(&part);
                    match entry.unpack(&part) {
                        Ok(_) => fs::rename(&part, &full).map_err(|e| format!("{shown}: {e}"))?,
                        Err(e) => {
                            let _ = fs::remove_file(&part);
                            return Err(format!("{shown}: {}", plain(&e)));
                        }
                    }
                }
            }
            tar::EntryType::Symlink | tar::EntryType::Fifo => {
                clear(&full, &name)?;
                entry
                    .unpack(&full)
                    .map_err(|e| format!("{shown}: {}", plain(&e)))?;
            }
            other => return Err(format!("{shown}: cannot unpack a {other:?} entry")),
        }
        moved.entries += 1;
    }
    // The archive is whole only with its end: tar's reader also stops,
    // without a word, where its input ends between two entries.
    let mut input = archive.into_inner();
    input.end_of_archive()?;
    moved.archive_bytes = input.total;
    for (dir, mode, mtime) in dirs.into_iter().rev() {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&dir, fs::Permissions::from_mode(mode & 0o777))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        set_mtime(&dir, mtime);
    }
    Ok(moved)
}

/// Most zero bytes taken after an archive's two end blocks (tar pads its
/// output to a whole record: 10 KiB by default, 1 MiB at its largest
/// blocking factor): more is refused, so that a sender cannot hold the
/// reader forever.
const MAX_PADDING: u64 = 1 << 20;

/// An archive's input, counted: the bytes read, and how many zero bytes end
/// them.
struct Tally<R> {
    inner: R,
    total: u64,
    zeros: u64,
}

impl<R: Read> Tally<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            total: 0,
            zeros: 0,
        }
    }

    /// After tar's reader stopped: checks that it stopped at the first of
    /// the two zero blocks that end an archive, reads the second, and reads
    /// what follows to the end of the stream (zeros only, a record's
    /// padding).
    fn end_of_archive(&mut self) -> Result<(), String> {
        const CUT: &str =
            "the archive ends without its end-of-archive blocks: it was cut short, and is refused";
        let read = |e: io::Error| format!("reading the archive: {e}");
        if !self.total.is_multiple_of(512) || self.zeros < 512 {
            return Err(CUT.into());
        }
        let mut block = [0u8; 512];
        match self.read_exact(&mut block) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(CUT.into()),
            Err(e) => return Err(read(e)),
        }
        if block.iter().any(|b| *b != 0) {
            return Err("the archive has an entry after its end block: it is refused".into());
        }
        let end = self.total;
        let mut buf = [0u8; 8192];
        loop {
            let n = match self.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read(e)),
            };
            if buf[..n].iter().any(|b| *b != 0) {
                return Err("the archive has data after its end: it is refused".into());
            }
            if self.total - end > MAX_PADDING {
                return Err(format!(
                    "the archive has more than {} of padding after its end: it is refused",
                    human_bytes(MAX_PADDING)
                ));
            }
        }
    }
}

impl<R: Read> Read for Tally<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let got = &buf[..n];
        match got.iter().rposition(|b| *b != 0) {
            Some(last) => self.zeros = (n - last - 1) as u64,
            None => self.zeros += n as u64,
        }
        self.total += n as u64;
        Ok(n)
    }
}

/// Checks that `name` belongs to the archive's one tree (see
/// [`Unpacking::one_tree`]), the first entry naming it.
fn one_tree(
    tree: &mut Option<(std::ffi::OsString, bool)>,
    name: &Path,
    kind: tar::EntryType,
    rules: &Unpacking,
    top: &Top,
) -> Result<(), String> {
    let first = top_of(name);
    match tree {
        None => {
            let first =
                first.ok_or_else(|| format!("{}: an entry with no name", name.display()))?;
            if let (Top::Keep, Some(want)) = (top, &rules.top_name)
                && first != *want
            {
                return Err(format!(
                    "{}: not under {}, the name asked for: the archive is refused",
                    name.display(),
                    Path::new(want).display()
                ));
            }
            *tree = Some((first, kind == tar::EntryType::Directory));
            Ok(())
        }
        Some((top_name, is_dir)) => {
            if !*is_dir {
                return Err(format!(
                    "{}: more than the one file asked for: the archive is refused",
                    name.display()
                ));
            }
            if first.as_ref() != Some(top_name) {
                return Err(format!(
                    "{}: not under {}, the tree asked for: the archive is refused",
                    name.display(),
                    Path::new(top_name).display()
                ));
            }
            Ok(())
        }
    }
}

/// A hard link's target must be in the same tree as the link.
fn same_tree(
    tree: &Option<(std::ffi::OsString, bool)>,
    target: &Path,
    name: &Path,
) -> Result<(), String> {
    match tree {
        Some((top, _)) if top_of(target).as_ref() == Some(top) => Ok(()),
        _ => Err(format!(
            "{}: a hard link out of the tree asked for: the archive is refused",
            name.display()
        )),
    }
}

/// The first component of an entry's name (`.` for `./...`).
fn top_of(name: &Path) -> Option<std::ffi::OsString> {
    match name.components().next()? {
        Component::Normal(p) => Some(p.to_os_string()),
        Component::CurDir => Some(".".into()),
        _ => None,
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n.is_multiple_of(1 << 30) => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n.is_multiple_of(1 << 20) => format!("{} MiB", n >> 20),
        n => format!("{n} bytes"),
    }
}

/// The tar stream of `src` (a file, a link or a whole tree, named by its
/// last component as given, see [`archive_name`]), written to `out`. Links are stored as links; sockets,
/// which no archive holds, are left out with a note on stderr.
pub fn get(roots: &Roots, src: &str, out: impl Write) -> Result<Moved, String> {
    let path = resolve_under_roots(roots, src)?;
    let name = archive_name(src).ok_or_else(|| format!("{src}: not a file name"))?;
    pack_named(&path, PathBuf::from(name), out)
}

/// [`get`] of a directory's contents (see [`pack_contents`]).
pub fn get_contents(roots: &Roots, src: &str, out: impl Write) -> Result<Moved, String> {
    let path = resolve_under_roots(roots, src)?;
    pack_contents(&path, out)
}

/// The tar stream of `path` (see [`get`]), written to `out`.
pub fn pack(path: &Path, out: impl Write) -> Result<Moved, String> {
    let name = path
        .file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    pack_named(path, name, out)
}

/// The tar stream of the directory `dir`'s contents (its entries named
/// `./...`): unpacked into a directory, they land in it, not under it.
pub fn pack_contents(dir: &Path, out: impl Write) -> Result<Moved, String> {
    if !dir.is_dir() {
        return Err(format!("{}: not a directory", dir.display()));
    }
    pack_named(dir, PathBuf::from("."), out)
}

fn pack_named(path: &Path, name: PathBuf, out: impl Write) -> Result<Moved, String> {
    let src = path.display().to_string();
    let path = path.to_path_buf();
    let meta = fs::symlink_metadata(&path).map_err(|e| format!("{src}: {e}"))?;
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    let mut moved = Moved::default();
    // Files with several links: the name each was first packed under.
    let mut linked: std::collections::HashMap<(u64, u64), PathBuf> = Default::default();
    let mut stack = vec![(path, name, meta)];
    while let Some((path, name, meta)) = stack.pop() {
        use std::os::unix::fs::MetadataExt;
        let ft = meta.file_type();
        let shown = path.display();
        if ft.is_file() && meta.nlink() > 1 {
            if let Some(first) = linked.get(&(meta.dev(), meta.ino())) {
                let mut header = tar::Header::new_gnu();
                header.set_metadata(&meta);
                header.set_entry_type(tar::EntryType::Link);
                header.set_size(0);
                builder
                    .append_link(&mut header, &name, first)
                    .map_err(|e| format!("{shown}: {e}"))?;
                moved.entries += 1;
                continue;
            }
            linked.insert((meta.dev(), meta.ino()), name.clone());
        }
        if ft.is_dir() {
            builder
                .append_dir(&name, &path)
                .map_err(|e| format!("{shown}: {e}"))?;
            let mut children: Vec<_> = fs::read_dir(&path)
                .map_err(|e| format!("{shown}: {e}"))?
                .collect::<Result<_, _>>()
                .map_err(|e| format!("{shown}: {e}"))?;
            // Packed in name order (popped from the end).
            children.sort_by_key(|e| std::cmp::Reverse(e.file_name()));
            for child in children {
                let meta = child
                    .metadata()
                    .map_err(|e| format!("{}: {e}", child.path().display()))?;
                stack.push((child.path(), name.join(child.file_name()), meta));
            }
        } else if is_special(&meta) {
            let note = format!("{shown}: a special file, left out");
            eprintln!("corral-init: {note}");
            moved.leave_out(note);
            continue;
        } else {
            if ft.is_file() {
                moved.bytes += meta.len();
            }
            builder
                .append_path_with_name(&path, &name)
                .map_err(|e| format!("{shown}: {e}"))?;
        }
        moved.entries += 1;
    }
    builder
        .into_inner()
        .and_then(|mut w| w.flush())
        .map_err(|e| format!("writing the archive: {e}"))?;
    Ok(moved)
}

/// Sockets, FIFOs and devices: no archive needs them, and a FIFO blocks
/// whoever reads it.
fn is_special(meta: &fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let ft = meta.file_type();
    ft.is_socket() || ft.is_fifo() || ft.is_char_device() || ft.is_block_device()
}

/// An entry's name as a path under the destination: no root, no `..`, and
/// the first component renamed or dropped as `top` says.
fn relative(name: &Path, top: &Top) -> Result<PathBuf, String> {
    let mut out = PathBuf::new();
    let mut first = true;
    for c in name.components() {
        match c {
            Component::Normal(part) => {
                match (first, top) {
                    (true, Top::Rename(new)) => out.push(new),
                    _ => out.push(part),
                }
                first = false;
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) | Component::ParentDir => {
                return Err(format!(
                    "{}: names outside the destination are refused",
                    name.display()
                ));
            }
        }
    }
    Ok(out)
}

/// Makes the directories from `base` down to `dir`, one by one: a link
/// among them must lead to a directory inside `base`.
fn make_parents(base: &Path, dir: &Path, name: &Path) -> Result<(), String> {
    let rel = dir.strip_prefix(base).unwrap_or(Path::new(""));
    let mut at = base.to_path_buf();
    for part in rel.components() {
        at.push(part);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                let real = fs::canonicalize(&at).map_err(|e| format!("{}: {e}", name.display()))?;
                if !real.starts_with(base) || !real.is_dir() {
                    return Err(format!(
                        "{}: a link on its way leads out of the destination",
                        name.display()
                    ));
                }
                at = real;
            }
            Ok(_) => {
                return Err(format!(
                    "{}: {} is not a directory",
                    name.display(),
                    at.display()
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&at).map_err(|e| format!("{}: {e}", name.display()))?;
            }
            Err(e) => return Err(format!("{}: {e}", name.display())),
        }
    }
    Ok(())
}

/// Removes what stands where a non-directory entry goes (a link included:
/// it is replaced, never written through). A directory stays, and the entry
/// fails on it.
fn clear(full: &Path, name: &Path) -> Result<(), String> {
    match fs::symlink_metadata(full) {
        Ok(m) if !m.is_dir() => {
            fs::remove_file(full).map_err(|e| format!("{}: {e}", name.display()))
        }
        _ => Ok(()),
    }
}

/// The helper's standard input, which gives up with an error when SIGTERM
/// comes (its operation canceled) instead of dying mid-file: SIGTERM is
/// blocked and read from a signalfd beside stdin, so what the helper was
/// writing is taken away before it exits.
pub struct CancellableStdin {
    signals: nix::sys::signalfd::SignalFd,
}

impl CancellableStdin {
    pub fn new() -> io::Result<Self> {
        use nix::sys::signal::{SigSet, Signal};
        use nix::sys::signalfd::{SfdFlags, SignalFd};
        let mut set = SigSet::empty();
        set.add(Signal::SIGTERM);
        set.thread_block().map_err(io::Error::from)?;
        let signals = SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
            .map_err(io::Error::from)?;
        Ok(Self { signals })
    }
}

impl Read for CancellableStdin {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let stdin = io::stdin();
        loop {
            let mut fds = [
                PollFd::new(stdin.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            if fds[1].revents().is_some_and(|r| !r.is_empty()) {
                return Err(io::Error::other("canceled"));
            }
            if fds[0].revents().is_some_and(|r| !r.is_empty()) {
                return match nix::unistd::read(stdin.as_fd(), buf) {
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => continue,
                    other => other.map_err(io::Error::from),
                };
            }
        }
    }
}

/// Writes a regular file's entry at `full` as a file with no name
/// (`O_TMPFILE`) that gets its name only once its data, mode (at most
/// 0777, less `mask`) and time are all written. False, with nothing done,
/// where the filesystem has no unnamed files.
fn unpack_whole<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    full: &Path,
    mask: u32,
) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = match full.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut file = match fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir)
    {
        Ok(f) => f,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) =>
        {
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    let size = entry.size();
    let written = io::copy(entry, &mut file)?;
    if written != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the archive ended {written} bytes into a file of {size}"),
        ));
    }
    let mode = entry.header().mode().unwrap_or(0o644) & 0o777 & !mask;
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    if let Ok(mtime) = entry.header().mtime() {
        let t = nix::sys::time::TimeSpec::new(mtime as i64, 0);
        let _ = nix::sys::stat::futimens(&file, &nix::sys::time::TimeSpec::UTIME_OMIT, &t);
    }
    let unnamed = format!("/proc/self/fd/{}", file.as_raw_fd());
    nix::unistd::linkat(
        nix::fcntl::AT_FDCWD,
        unnamed.as_str(),
        nix::fcntl::AT_FDCWD,
        full,
        nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
    )
    .map_err(io::Error::from)?;
    Ok(true)
}

fn set_mtime(path: &Path, mtime: u64) {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let t = TimeSpec::new(mtime as i64, 0);
    let _ = utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &TimeSpec::UTIME_OMIT,
        &t,
        UtimensatFlags::NoFollowSymlink,
    );
}

/// An unpack error in its own words (the tar crate wraps it in one that
/// names the paths; the caller names the entry).
fn plain(e: &io::Error) -> String {
    let mut said = e.to_string();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = e
        .get_ref()
        .map(|inner| inner as &(dyn std::error::Error + 'static));
    while let Some(c) = cause.and_then(std::error::Error::source) {
        said = c.to_string();
        cause = Some(c);
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roots(dir: &Path) -> Roots {
        fs::create_dir_all(dir.join("ws")).unwrap();
        fs::create_dir_all(dir.join("tmp")).unwrap();
        Roots {
            workspace: fs::canonicalize(dir.join("ws")).unwrap(),
            others: vec![fs::canonicalize(dir.join("tmp")).unwrap()],
        }
    }

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind, data, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o640);
            h.set_mtime(1_000_000);
            h.set_size(data.len() as u64);
            if let Some(l) = link {
                h.set_link_name(l).unwrap();
            }
            // Names set raw, as a hostile archive would.
            let raw = &mut h.as_old_mut().name;
            raw[..name.len()].copy_from_slice(name.as_bytes());
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn a_tree_goes_out_and_back_with_modes_times_and_links() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let src = r.workspace.join("proj");
        fs::create_dir_all(src.join("sub")).unwrap();
        fs::write(src.join("sub/a.sh"), b"#!/bin/sh\necho a\n").unwrap();
        fs::set_permissions(src.join("sub/a.sh"), fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("out")).unwrap();
        set_mtime(&src.join("sub/a.sh"), 1_234_567);
        let mut tar = Vec::new();
        let out = get(&r, "proj", &mut tar).unwrap();
        assert_eq!(out.entries, 4);
        let back = put(&r, "/tmp/copy", tar.as_slice());
        // /tmp here is the test's own tmp root, reached by its real path.
        assert!(back.is_err(), "absolute /tmp is outside these test roots");
        put(
            &r,
            r.others[0].join("copy").to_str().unwrap(),
            tar.as_slice(),
        )
        .unwrap();
        let copy = r.others[0].join("copy");
        let a = fs::metadata(copy.join("sub/a.sh")).unwrap();
        assert_eq!(a.mode() & 0o7777, 0o751);
        assert_eq!(a.mtime(), 1_234_567);
        assert_eq!(
            fs::read(copy.join("sub/a.sh")).unwrap(),
            b"#!/bin/sh\necho a\n"
        );
        assert_eq!(
            fs::read_link(copy.join("out")).unwrap(),
            Path::new("/etc/passwd")
        );
        // Into an existing directory: under its own name.
        put(&r, r.others[0].to_str().unwrap(), tar.as_slice()).unwrap();
        assert!(r.others[0].join("proj/sub/a.sh").is_file());
    }

    #[test]
    fn contents_go_into_a_directory_and_come_back_out_of_one() {
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let src = dir.path().join("project");
        fs::create_dir_all(src.join("src")).unwrap();
        fs::write(src.join("src/main.rs"), b"fn main() {}\n").unwrap();
        fs::write(src.join("README"), b"hi\n").unwrap();
        let mut tar = Vec::new();
        pack_contents(&src, &mut tar).unwrap();
        // Into the workspace itself, not under a directory of its own.
        put(&r, ".", tar.as_slice()).unwrap();
        assert_eq!(
            fs::read(r.workspace.join("src/main.rs")).unwrap(),
            b"fn main() {}\n"
        );
        assert!(!r.workspace.join("project").exists());
        // And a whole workspace back out, into a directory of any name.
        let mut out = Vec::new();
        get_contents(&r, ".", &mut out).unwrap();
        let back = dir.path().join("exported");
        unpack_contents(&back, "exported", out.as_slice()).unwrap();
        assert_eq!(fs::read(back.join("README")).unwrap(), b"hi\n");
        assert!(back.join("src/main.rs").is_file());
    }

    #[test]
    fn names_that_climb_out_and_links_on_the_way_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let outside = dir.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        let ws = r.workspace.to_str().unwrap().to_string();
        let climb = tar_of(&[("../../outside/x", tar::EntryType::Regular, b"x", None)]);
        assert!(
            put(&r, &ws, climb.as_slice())
                .unwrap_err()
                .contains("outside the destination")
        );
        let out = outside.to_str().unwrap().to_string();
        let via_link = tar_of(&[
            ("l", tar::EntryType::Symlink, b"", Some(&out)),
            ("l/x", tar::EntryType::Regular, b"x", None),
        ]);
        let err = put(&r, &ws, via_link.as_slice()).unwrap_err();
        assert!(err.contains("leads out of the destination"), "{err}");
        // A link in the place of a file is replaced, not written through.
        std::os::unix::fs::symlink(outside.join("victim"), r.workspace.join("f")).unwrap();
        let over = tar_of(&[("f", tar::EntryType::Regular, b"new", None)]);
        put(&r, &ws, over.as_slice()).unwrap();
        assert!(!outside.join("victim").exists());
        assert_eq!(fs::read(r.workspace.join("f")).unwrap(), b"new");
        // A hard link may not reach out through a link either.
        let secret = outside.join("secret");
        fs::write(&secret, b"s").unwrap();
        let hard = tar_of(&[
            ("way", tar::EntryType::Symlink, b"", Some(&out)),
            ("h", tar::EntryType::Link, b"", Some("way/secret")),
        ]);
        let err = put(&r, &ws, hard.as_slice()).unwrap_err();
        assert!(err.contains("outside the destination"), "{err}");
        assert!(!r.workspace.join("h").exists());
        // One inside is made.
        let fine = tar_of(&[
            ("a", tar::EntryType::Regular, b"x", None),
            ("b", tar::EntryType::Link, b"", Some("a")),
        ]);
        put(&r, &ws, fine.as_slice()).unwrap();
        assert_eq!(fs::read(r.workspace.join("b")).unwrap(), b"x");
        // A destination outside the roots is refused before anything.
        assert!(put(&r, out.as_str(), over.as_slice()).is_err());
        assert!(get(&r, out.as_str(), Vec::new()).is_err());
    }

    #[test]
    fn what_comes_out_of_a_sandbox_is_one_tree_under_the_name_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        fs::create_dir_all(&home).unwrap();
        fs::write(home.join(".bashrc"), b"mine\n").unwrap();
        let rules = Unpacking::from_sandbox(archive_name("/workspace/report.txt"));
        // A forged second entry beside the file asked for.
        let forged = tar_of(&[
            ("report.txt", tar::EntryType::Regular, b"ok", None),
            (".bashrc", tar::EntryType::Regular, b"evil", None),
        ]);
        let err = unpack_with(&home, "home", forged.as_slice(), &rules).unwrap_err();
        assert!(err.contains("more than the one file"), "{err}");
        assert_eq!(fs::read(home.join(".bashrc")).unwrap(), b"mine\n");
        // Another name than the one asked for.
        let other = tar_of(&[(".bashrc", tar::EntryType::Regular, b"evil", None)]);
        let err = unpack_with(&home, "home", other.as_slice(), &rules).unwrap_err();
        assert!(err.contains("the name asked for"), "{err}");
        assert_eq!(fs::read(home.join(".bashrc")).unwrap(), b"mine\n");
        // A tree that holds another tree beside it.
        let rules = Unpacking::from_sandbox(archive_name("proj"));
        let two = tar_of(&[
            ("proj", tar::EntryType::Directory, b"", None),
            ("proj/a", tar::EntryType::Regular, b"a", None),
            ("other/b", tar::EntryType::Regular, b"b", None),
        ]);
        let err = unpack_with(&home, "home", two.as_slice(), &rules).unwrap_err();
        assert!(err.contains("the tree asked for"), "{err}");
        assert!(!home.join("other").exists());
        // A hard link out of the tree.
        let link = tar_of(&[
            ("proj", tar::EntryType::Directory, b"", None),
            ("proj/h", tar::EntryType::Link, b"", Some(".bashrc")),
        ]);
        let err = unpack_with(&home, "home", link.as_slice(), &rules).unwrap_err();
        assert!(err.contains("hard link out of the tree"), "{err}");
        // What was asked for lands.
        let fine = tar_of(&[("report.txt", tar::EntryType::Regular, b"ok", None)]);
        let rules = Unpacking::from_sandbox(archive_name("report.txt"));
        unpack_with(&home, "home", fine.as_slice(), &rules).unwrap();
        assert_eq!(fs::read(home.join("report.txt")).unwrap(), b"ok");
    }

    #[test]
    fn modes_special_files_git_configuration_and_size_are_bounded_on_the_way_out() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |name: &str, kind: tar::EntryType, mode: u32, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, name, data).unwrap();
        };
        add("./", tar::EntryType::Directory, 0o777, b"");
        add("./open", tar::EntryType::Directory, 0o777, b"");
        add("./open/run.sh", tar::EntryType::Regular, 0o777, b"x");
        add("./open/data", tar::EntryType::Regular, 0o666, b"x");
        add("./pipe", tar::EntryType::Fifo, 0o644, b"");
        add(
            "./.git/config",
            tar::EntryType::Regular,
            0o644,
            b"[core]\nfsmonitor = evil\n",
        );
        add(
            "./.git/hooks/pre-commit",
            tar::EntryType::Regular,
            0o755,
            b"evil",
        );
        add(
            "./.git/info/attributes",
            tar::EntryType::Regular,
            0o644,
            b"* filter=x",
        );
        add(
            "./.git/HEAD",
            tar::EntryType::Regular,
            0o644,
            b"ref: refs/heads/main\n",
        );
        add(
            "./sub/.git",
            tar::EntryType::Regular,
            0o644,
            b"gitdir: /elsewhere\n",
        );
        let tar = b.into_inner().unwrap();
        let mut rules = Unpacking::contents_from_sandbox();
        rules.mode_mask = Some(0o022);
        let moved = unpack_contents_with(&out, "out", tar.as_slice(), &rules).unwrap();
        let mode = |p: &str| fs::metadata(out.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode("open"), 0o755);
        assert_eq!(mode("open/run.sh"), 0o755);
        assert_eq!(mode("open/data"), 0o644);
        assert!(!out.join("pipe").exists());
        assert!(!out.join(".git/config").exists());
        assert!(!out.join(".git/hooks/pre-commit").exists());
        assert!(!out.join(".git/info/attributes").exists());
        assert!(!out.join("sub/.git").exists());
        assert!(out.join(".git/HEAD").is_file());
        assert_eq!(moved.left_out, 5, "{:?}", moved.notes);
        assert!(
            moved
                .notes
                .iter()
                .any(|n| n.contains("pipe: a special file"))
        );
        // The same archive, asked with git's configuration.
        rules.skip_git_config = false;
        let again = dir.path().join("again");
        unpack_contents_with(&again, "again", tar.as_slice(), &rules).unwrap();
        assert!(again.join(".git/config").is_file());
        // Past the byte ceiling: a clear error.
        rules.max_bytes = Some(1);
        let err =
            unpack_contents_with(&dir.path().join("x"), "x", tar.as_slice(), &rules).unwrap_err();
        assert!(err.contains("--max-bytes"), "{err}");
        rules.max_bytes = None;
        rules.max_entries = Some(3);
        let err =
            unpack_contents_with(&dir.path().join("y"), "y", tar.as_slice(), &rules).unwrap_err();
        assert!(err.contains("--max-entries"), "{err}");
    }

    #[test]
    fn an_archive_cut_between_entries_or_followed_by_more_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let src = r.workspace.join("tree");
        fs::create_dir_all(&src).unwrap();
        for i in 0..50 {
            fs::write(src.join(format!("f{i:02}")), b"").unwrap();
        }
        let mut tar = Vec::new();
        get(&r, "tree", &mut tar).unwrap();
        let fresh = |name: &str| {
            let out = dir.path().join(name);
            fs::create_dir_all(&out).unwrap();
            out
        };
        // Whole: every entry, and every byte read.
        let moved = unpack(&fresh("whole"), "whole", tar.as_slice()).unwrap();
        assert_eq!(moved.entries, 51);
        assert_eq!(moved.archive_bytes, tar.len() as u64);
        // Cut at any header boundary (tar's reader would stop there as if
        // the archive ended): refused, whatever came before.
        let end = tar.len() - 1024;
        for at in [512, end / 2 / 512 * 512, end, end + 512] {
            let cut = unpack(&fresh(&format!("cut{at}")), "cut", &tar[..at]);
            let e = cut.unwrap_err();
            assert!(e.contains("cut short"), "{at}: {e}");
        }
        // Padded to a record with zeros: whole.
        let mut padded = tar.clone();
        padded.resize(padded.len().next_multiple_of(10240), 0);
        unpack(&fresh("padded"), "padded", padded.as_slice()).unwrap();
        // An entry after the end block, or other data after the end.
        let mut smuggled = tar[..end + 512].to_vec();
        smuggled.extend_from_slice(&tar[..512]);
        let e = unpack(&fresh("smuggled"), "s", smuggled.as_slice()).unwrap_err();
        assert!(e.contains("after its end block"), "{e}");
        let mut trailing = tar.clone();
        trailing.extend_from_slice(b"junk");
        let e = unpack(&fresh("trailing"), "t", trailing.as_slice()).unwrap_err();
        assert!(e.contains("data after its end"), "{e}");
        // Endless zeros after the end are not read forever.
        let endless = io::Read::chain(tar.as_slice(), io::repeat(0));
        let e = unpack(&fresh("endless"), "e", endless).unwrap_err();
        assert!(e.contains("padding"), "{e}");
    }

    #[test]
    fn an_archive_cut_off_mid_file_leaves_no_part_of_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let src = r.workspace.join("tree");
        fs::create_dir_all(&src).unwrap();
        fs::write(src.join("a-first"), b"whole").unwrap();
        fs::set_permissions(src.join("a-first"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(src.join("b-big"), vec![9u8; 1 << 20]).unwrap();
        let mut tar = Vec::new();
        get(&r, "tree", &mut tar).unwrap();
        // Cut in the middle of the big file's data.
        let at = tar
            .windows(4096)
            .position(|w| w.iter().all(|b| *b == 9))
            .unwrap()
            + (512 << 10);
        let out = dir.path().join("out");
        fs::create_dir_all(&out).unwrap();
        let cut = unpack(&out, "out", &tar[..at]);
        assert!(cut.is_err(), "{cut:?}");
        let mut left: Vec<String> = fs::read_dir(out.join("tree"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // Whichever came before the cut is whole; the cut one is not there.
        assert!(!left.iter().any(|n| n == "b-big"), "{left:?}");
        if left.iter().any(|n| n == "a-first") {
            assert_eq!(fs::read(out.join("tree/a-first")).unwrap(), b"whole");
            let mode = fs::metadata(out.join("tree/a-first"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o640);
        }
        // Whole, it unpacks whole, with its mode.
        unpack(&out, "out", tar.as_slice()).unwrap();
        assert_eq!(fs::read(out.join("tree/b-big")).unwrap().len(), 1 << 20);
    }

    #[test]
    fn hard_links_travel_as_links_and_special_files_are_left_out() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let src = r.workspace.join("bomb");
        fs::create_dir_all(&src).unwrap();
        fs::write(src.join("big"), vec![7u8; 1 << 20]).unwrap();
        for i in 0..100 {
            fs::hard_link(src.join("big"), src.join(format!("l{i}"))).unwrap();
        }
        nix::unistd::mkfifo(
            &src.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        let mut tar = Vec::new();
        let packed = get(&r, "bomb", &mut tar).unwrap();
        assert!(tar.len() < 2 << 20, "100 links made {} bytes", tar.len());
        assert_eq!(packed.left_out, 1);
        let out = dir.path().join("out");
        fs::create_dir_all(&out).unwrap();
        let moved = unpack_with(
            &out,
            "out",
            tar.as_slice(),
            &Unpacking::from_sandbox(archive_name("bomb")),
        )
        .unwrap();
        assert!(moved.bytes <= 1 << 20, "{moved:?}");
        let big = fs::metadata(out.join("bomb/big")).unwrap();
        assert_eq!(big.nlink(), 101);
        assert_eq!(fs::read(out.join("bomb/l99")).unwrap().len(), 1 << 20);
        assert!(!out.join("bomb/fifo").exists());
    }
}
