//! A sandbox's writable trees copied into another sandbox on the host:
//! what a fork does while its parent is frozen. The worker runs this as a
//! process of its own (`corral-init --copy-tree`, the host's root), which
//! first joins the memory cgroup of the sandbox it writes to: the copied
//! files are charged to that sandbox, as if it had written them itself,
//! never to the worker.
//!
//! Both sandboxes are reached through `/proc/PID/root`, each path resolved
//! with that sandbox's root as `/` (openat2 `RESOLVE_IN_ROOT`); then the
//! walk opens nothing but one entry of a directory it already holds, never
//! following a link, so a link a sandbox planted names a place inside that
//! sandbox or nothing. Copied: directories, regular files (holes kept),
//! symbolic links, hard links (as links, within one tree), FIFOs; modes
//! (set-id bits included), owners (the source sandbox's user becomes the
//! destination's, through each side's user namespace map), access and
//! modification times to the nanosecond. Sockets and device nodes are left
//! out and counted; extended attributes are not copied, nor what another
//! filesystem mounted in a tree holds (a volume: the child mounts its own). Reading changes
//! nothing in the source, not even an access time (`O_NOATIME`).

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, open, openat, openat2, readlinkat};
use nix::sys::stat::{
    FchmodatFlags, FileStat, Mode, SFlag, UtimensatFlags, fchmod, fchmodat, fstat, fstatat,
    futimens, mkdirat, mknodat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{
    Gid, Uid, UnlinkatFlags, Whence, fchown, fchownat, ftruncate, linkat, lseek, symlinkat,
    unlinkat,
};

/// Directories deeper than this are refused. Each level holds two
/// descriptors while the walk is below it: [`run`] raises its soft limit
/// of open files to the hard one, which must leave room for twice this.
pub const MAX_DEPTH: usize = 1024;

/// Notes kept of what a copy left out.
pub const MAX_NOTES: usize = 20;

/// What a copy did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Copied {
    pub entries: u64,
    /// File data copied (holes are not).
    pub bytes: u64,
    /// Entries left out (sockets, devices); at most [`MAX_NOTES`] notes.
    pub left_out: u64,
    pub notes: Vec<String>,
}

impl Copied {
    fn leave_out(&mut self, note: String) {
        self.left_out += 1;
        if self.notes.len() < MAX_NOTES {
            self.notes.push(note);
        }
    }

    /// Adds another tree's copy to this one.
    pub fn add(&mut self, other: Copied) {
        self.entries += other.entries;
        self.bytes += other.bytes;
        self.left_out += other.left_out;
        for n in other.notes {
            if self.notes.len() < MAX_NOTES {
                self.notes.push(n);
            }
        }
    }
}

/// One line of `/proc/PID/uid_map`: ids `inside..inside+count` of the
/// namespace are host ids `outside..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    inside: u32,
    outside: u32,
    count: u32,
}

fn parse_map(text: &str) -> Vec<Range> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().map(str::parse::<u32>);
            match (f.next(), f.next(), f.next()) {
                (Some(Ok(inside)), Some(Ok(outside)), Some(Ok(count))) => Some(Range {
                    inside,
                    outside,
                    count,
                }),
                _ => None,
            }
        })
        .collect()
}

fn to_inside(map: &[Range], host: u32) -> Option<u32> {
    map.iter()
        .find(|r| host >= r.outside && u64::from(host) < u64::from(r.outside) + u64::from(r.count))
        .map(|r| r.inside + (host - r.outside))
}

fn to_outside(map: &[Range], inside: u32) -> Option<u32> {
    map.iter()
        .find(|r| {
            inside >= r.inside && u64::from(inside) < u64::from(r.inside) + u64::from(r.count)
        })
        .map(|r| r.outside + (inside - r.inside))
}

/// How the owners of the source's files become the destination's: host id
/// to the source's namespace id, the source sandbox's user to the
/// destination's, then to the destination's host id. An id the maps do not
/// cover stays as it is.
#[derive(Debug, Clone, Default)]
pub struct IdMap {
    from_uids: Vec<Range>,
    to_uids: Vec<Range>,
    from_gids: Vec<Range>,
    to_gids: Vec<Range>,
    /// The source sandbox's user and the destination's, as ids inside
    /// their namespaces (a sandbox's group has its user's number).
    user: Option<(u32, u32)>,
}

impl IdMap {
    /// No namespace on either side: host ids are the sandboxes' ids.
    pub fn identity(user: Option<(u32, u32)>) -> Self {
        let all = vec![Range {
            inside: 0,
            outside: 0,
            count: u32::MAX,
        }];
        Self {
            from_uids: all.clone(),
            to_uids: all.clone(),
            from_gids: all.clone(),
            to_gids: all,
            user,
        }
    }

    /// The maps of two processes, from `/proc`.
    pub fn of(from_pid: u32, to_pid: u32, user: Option<(u32, u32)>) -> Result<Self, String> {
        let read = |pid: u32, what: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/{what}"))
                .map(|t| parse_map(&t))
                .map_err(|e| format!("/proc/{pid}/{what}: {e}"))
        };
        Ok(Self {
            from_uids: read(from_pid, "uid_map")?,
            to_uids: read(to_pid, "uid_map")?,
            from_gids: read(from_pid, "gid_map")?,
            to_gids: read(to_pid, "gid_map")?,
            user,
        })
    }

    fn map(&self, from: &[Range], to: &[Range], host: u32) -> u32 {
        let Some(mut inside) = to_inside(from, host) else {
            return host;
        };
        if let Some((a, b)) = self.user
            && inside == a
        {
            inside = b;
        }
        to_outside(to, inside).unwrap_or(host)
    }

    pub fn uid(&self, host: u32) -> u32 {
        self.map(&self.from_uids, &self.to_uids, host)
    }

    pub fn gid(&self, host: u32) -> u32 {
        self.map(&self.from_gids, &self.to_gids, host)
    }
}

/// A directory of a process's filesystem, `path` resolved with that
/// process's root as `/` (a link on the way cannot leave it).
pub fn open_in_root(pid: u32, path: &str) -> Result<OwnedFd, String> {
    let root_path = format!("/proc/{pid}/root");
    let root = open(
        root_path.as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("{root_path}: {e}"))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    openat2(&root, path, how).map_err(|e| format!("{path} of process {pid}: {e}"))
}

/// Moves this process into the memory cgroup of process `pid` (cgroup v1's
/// memory hierarchy, or v2's one), so what it writes is charged there.
pub fn join_memory_cgroup_of(pid: u32) -> Result<PathBuf, String> {
    let file = format!("/proc/{pid}/cgroup");
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{file}: {e}"))?;
    let mut v1 = None;
    let mut v2 = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')));
        } else if id == "0" && controllers.is_empty() {
            v2 = Some(Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')));
        }
    }
    let dir = v1
        .or(v2)
        .ok_or_else(|| format!("{file} names no memory cgroup"))?;
    if dir
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(format!(
            "process {pid}'s cgroup is outside this process's cgroup namespace ({})",
            dir.display()
        ));
    }
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string())
        .map_err(|e| format!("{}: {e}", procs.display()))?;
    Ok(dir)
}

fn names_of(dir: &OwnedFd) -> Result<Vec<OsString>, Errno> {
    let mut d = Dir::from_fd(dir.try_clone().map_err(|_| Errno::EMFILE)?)?;
    let mut names = Vec::new();
    for entry in d.iter() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(OsString::from(std::ffi::OsStr::from_bytes(&name)));
        }
    }
    Ok(names)
}

fn open_dir(parent: &OwnedFd, name: &OsString, noatime: bool) -> Result<OwnedFd, Errno> {
    let mut flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    if noatime {
        flags |= OFlag::O_NOATIME;
    }
    openat(parent, name.as_os_str(), flags, Mode::empty())
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

fn perm(st: &FileStat) -> Mode {
    Mode::from_bits_truncate(st.st_mode & 0o7777)
}

fn times(st: &FileStat) -> (TimeSpec, TimeSpec) {
    (
        TimeSpec::new(st.st_atime, st.st_atime_nsec),
        TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
    )
}

/// Owner, then mode (a change of owner clears set-id bits), then times.
fn apply(fd: &OwnedFd, st: &FileStat, ids: &IdMap) -> Result<(), Errno> {
    fchown(
        fd,
        Some(Uid::from_raw(ids.uid(st.st_uid))),
        Some(Gid::from_raw(ids.gid(st.st_gid))),
    )?;
    fchmod(fd, perm(st))?;
    let (a, m) = times(st);
    futimens(fd, &a, &m)
}

/// Removes everything in `dir` (not `dir` itself).
pub fn clear(dir: &OwnedFd) -> Result<(), String> {
    clear_at(dir, 0).map_err(|e| format!("emptying the destination: {e}"))
}

fn clear_at(dir: &OwnedFd, depth: usize) -> Result<(), Errno> {
    if depth > MAX_DEPTH {
        return Err(Errno::ELOOP);
    }
    let here = fstat(dir)?.st_dev;
    for name in names_of(dir)? {
        let st = fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)?;
        // Another filesystem mounted here (the child's volume): not ours
        // to empty, and its mount point stays.
        if kind(&st) == SFlag::S_IFDIR && st.st_dev != here {
            continue;
        }
        if kind(&st) == SFlag::S_IFDIR {
            let sub = open_dir(dir, &name, false)?;
            clear_at(&sub, depth + 1)?;
            unlinkat(dir, name.as_os_str(), UnlinkatFlags::RemoveDir)?;
        } else {
            unlinkat(dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir)?;
        }
    }
    Ok(())
}

/// A file's data, holes left as holes; the bytes copied.
fn copy_data(src: &OwnedFd, dst: &OwnedFd, size: i64) -> Result<u64, Errno> {
    let mut copied = 0u64;
    let mut at = 0i64;
    while at < size {
        let data = match lseek(src, at, Whence::SeekData) {
            Ok(d) => d,
            // Nothing but a hole from here on.
            Err(Errno::ENXIO) => break,
            Err(e) => return Err(e),
        };
        let end = lseek(src, data, Whence::SeekHole)?.min(size);
        let mut pos = data;
        lseek(dst, pos, Whence::SeekSet)?;
        while pos < end {
            let want = usize::try_from(end - pos)
                .unwrap_or(usize::MAX)
                .min(1 << 30);
            let mut off: libc::off64_t = pos;
            let n = match nix::sys::sendfile::sendfile64(dst, src, Some(&mut off), want) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                break;
            }
            pos += n as i64;
            copied += n as u64;
        }
        at = end;
    }
    ftruncate(dst, size)?;
    Ok(copied)
}

struct Frame {
    src: OwnedFd,
    dst: OwnedFd,
    names: std::vec::IntoIter<OsString>,
    stat: FileStat,
    /// Where it is, from the tree's top.
    at: PathBuf,
}

/// Copies the tree in `src` into `dst` (emptied first), then gives `dst`
/// the mode, owner and times of `src`.
pub fn copy(src: OwnedFd, dst: OwnedFd, ids: &IdMap) -> Result<Copied, String> {
    clear(&dst)?;
    let mut out = Copied::default();
    let top = dst.try_clone().map_err(|e| format!("dup: {e}"))?;
    // The first place each multiply-linked file was copied to.
    let mut linked: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let stat = fstat(&src).map_err(|e| format!("the source's top: {e}"))?;
    let names = names_of(&src).map_err(|e| format!("the source's top: {e}"))?;
    let mut stack = vec![Frame {
        src,
        dst,
        names: names.into_iter(),
        stat,
        at: PathBuf::new(),
    }];
    loop {
        let depth = stack.len();
        let Some(frame) = stack.last_mut() else { break };
        let Some(name) = frame.names.next() else {
            if let Some(done) = stack.pop() {
                apply(&done.dst, &done.stat, ids)
                    .map_err(|e| format!("{}: {e}", shown(&done.at)))?;
            }
            continue;
        };
        let at = frame.at.join(&name);
        let fail = |e: Errno| format!("{}: {e}", shown(&at));
        let st =
            fstatat(&frame.src, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(fail)?;
        match kind(&st) {
            // Another filesystem mounted in the tree (a volume): the
            // child has its own mount there; nothing of it is copied.
            SFlag::S_IFDIR if st.st_dev != frame.stat.st_dev => {
                out.leave_out(format!("{}: a mount (a volume), not copied", shown(&at)));
            }
            SFlag::S_IFDIR => {
                if depth >= MAX_DEPTH {
                    return Err(format!(
                        "{}: deeper than {MAX_DEPTH} directories",
                        shown(&at)
                    ));
                }
                mkdirat(
                    &frame.dst,
                    name.as_os_str(),
                    Mode::from_bits_truncate(0o700),
                )
                .map_err(fail)?;
                let s = open_dir(&frame.src, &name, true).map_err(fail)?;
                let d = open_dir(&frame.dst, &name, false).map_err(fail)?;
                let names = names_of(&s).map_err(fail)?;
                out.entries += 1;
                stack.push(Frame {
                    src: s,
                    dst: d,
                    names: names.into_iter(),
                    stat: st,
                    at,
                });
            }
            SFlag::S_IFREG => {
                out.entries += 1;
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1 {
                    if let Some(first) = linked.get(&key) {
                        linkat(
                            &top,
                            first.as_path(),
                            &frame.dst,
                            name.as_os_str(),
                            AtFlags::empty(),
                        )
                        .map_err(fail)?;
                        continue;
                    }
                    linked.insert(key, at.clone());
                }
                let s = openat(
                    &frame.src,
                    name.as_os_str(),
                    OFlag::O_RDONLY
                        | OFlag::O_NOFOLLOW
                        | OFlag::O_NOATIME
                        | OFlag::O_NOCTTY
                        | OFlag::O_NONBLOCK
                        | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(fail)?;
                // The entry opened is the one looked at.
                let again = fstat(&s).map_err(fail)?;
                if kind(&again) != SFlag::S_IFREG || again.st_ino != st.st_ino {
                    return Err(format!("{}: changed during the copy", shown(&at)));
                }
                let d = openat(
                    &frame.dst,
                    name.as_os_str(),
                    OFlag::O_WRONLY
                        | OFlag::O_CREAT
                        | OFlag::O_EXCL
                        | OFlag::O_NOFOLLOW
                        | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(fail)?;
                out.bytes += copy_data(&s, &d, again.st_size).map_err(fail)?;
                apply(&d, &again, ids).map_err(fail)?;
            }
            SFlag::S_IFLNK => {
                out.entries += 1;
                let target = readlinkat(&frame.src, name.as_os_str()).map_err(fail)?;
                symlinkat(target.as_os_str(), &frame.dst, name.as_os_str()).map_err(fail)?;
                set_at(&frame.dst, &name, &st, ids, false).map_err(fail)?;
            }
            SFlag::S_IFIFO => {
                out.entries += 1;
                mknodat(
                    &frame.dst,
                    name.as_os_str(),
                    SFlag::S_IFIFO,
                    Mode::from_bits_truncate(0o600),
                    0,
                )
                .map_err(fail)?;
                set_at(&frame.dst, &name, &st, ids, true).map_err(fail)?;
            }
            _ => out.leave_out(format!("{}: a socket or device node, left out", shown(&at))),
        }
    }
    Ok(out)
}

/// Owner, mode (not a link's: it has none) and times of an entry made by
/// name.
fn set_at(
    dir: &OwnedFd,
    name: &OsString,
    st: &FileStat,
    ids: &IdMap,
    with_mode: bool,
) -> Result<(), Errno> {
    fchownat(
        dir,
        name.as_os_str(),
        Some(Uid::from_raw(ids.uid(st.st_uid))),
        Some(Gid::from_raw(ids.gid(st.st_gid))),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    if with_mode {
        fchmodat(
            dir,
            name.as_os_str(),
            perm(st),
            FchmodatFlags::NoFollowSymlink,
        )
        .or_else(|e| match e {
            // Some kernels refuse the no-follow form outright; the
            // entry is a FIFO just made, not a link.
            Errno::EOPNOTSUPP => fchmodat(
                dir,
                name.as_os_str(),
                perm(st),
                FchmodatFlags::FollowSymlink,
            ),
            e => Err(e),
        })?;
    }
    let (a, m) = times(st);
    utimensat(
        dir,
        name.as_os_str(),
        &a,
        &m,
        UtimensatFlags::NoFollowSymlink,
    )
}

fn shown(at: &Path) -> String {
    if at.as_os_str().is_empty() {
        ".".into()
    } else {
        at.display().to_string()
    }
}

/// The helper's whole run: joins the destination's memory cgroup, then
/// copies each path of process `from` to the same path of process `to`.
pub fn run(
    from: u32,
    to: u32,
    user: Option<(u32, u32)>,
    paths: &[String],
) -> Result<Copied, String> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit: {e}"))?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|e| format!("setrlimit: {e}"))?;
    }
    let need = 2 * MAX_DEPTH as u64 + 64;
    if hard < need {
        return Err(format!(
            "this process may open {hard} files; a copy {MAX_DEPTH} directories deep needs {need}"
        ));
    }
    join_memory_cgroup_of(to)?;
    let ids = IdMap::of(from, to, user)?;
    let mut all = Copied::default();
    for p in paths {
        let src = open_in_root(from, p)?;
        let dst = open_in_root(to, p)?;
        let done = copy(src, dst, &ids).map_err(|e| format!("{p}: {e}"))?;
        all.add(done);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn dir_fd(p: &Path) -> OwnedFd {
        open(
            p,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    #[test]
    fn id_maps_translate_through_both_namespaces() {
        let from = parse_map("0 100000 65536\n");
        let to = parse_map("0 200000 65536\n");
        let m = IdMap {
            from_uids: from.clone(),
            to_uids: to.clone(),
            from_gids: from,
            to_gids: to,
            user: Some((1000, 2000)),
        };
        assert_eq!(m.uid(100_000), 200_000, "root stays root");
        assert_eq!(
            m.uid(101_000),
            202_000,
            "the sandbox user becomes the other's"
        );
        assert_eq!(m.uid(100_005), 200_005);
        assert_eq!(m.uid(7), 7, "an id the map does not cover stays");
        let id = IdMap::identity(Some((5, 6)));
        assert_eq!((id.uid(5), id.gid(5), id.uid(0)), (6, 6, 0));
    }

    #[test]
    fn a_tree_keeps_its_links_modes_times_and_holes() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        std::fs::create_dir_all(src.join("a/b")).unwrap();
        std::fs::create_dir(&dst).unwrap();
        std::fs::write(dst.join("stale"), b"left by someone").unwrap();
        std::fs::write(src.join("a/b/f"), b"hello").unwrap();
        std::fs::set_permissions(src.join("a/b/f"), std::fs::Permissions::from_mode(0o4751))
            .unwrap();
        std::fs::hard_link(src.join("a/b/f"), src.join("h")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("out")).unwrap();
        nix::unistd::mkfifo(&src.join("fifo"), Mode::from_bits_truncate(0o640)).unwrap();
        let sparse = std::fs::File::create(src.join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        std::os::unix::fs::FileExt::write_at(&sparse, b"end", (1 << 30) - 3).unwrap();
        drop(sparse);
        let _sock = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();
        let old = TimeSpec::new(1_000_000_000, 123_456_789);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &src.join("a"),
            &old,
            &old,
            UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();

        let done = copy(dir_fd(&src), dir_fd(&dst), &IdMap::identity(None)).unwrap();
        assert_eq!(done.left_out, 1, "{done:?}");
        assert!(done.notes[0].contains("sock"), "{done:?}");
        assert!(!dst.join("stale").exists());
        assert_eq!(std::fs::read(dst.join("a/b/f")).unwrap(), b"hello");
        let f = std::fs::metadata(dst.join("a/b/f")).unwrap();
        assert_eq!(f.mode() & 0o7777, 0o4751);
        assert_eq!(f.ino(), std::fs::metadata(dst.join("h")).unwrap().ino());
        assert_eq!(
            std::fs::read_link(dst.join("out")).unwrap(),
            Path::new("/etc/passwd")
        );
        let fifo = std::fs::symlink_metadata(dst.join("fifo")).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
        assert_eq!(fifo.mode() & 0o777, 0o640);
        let a = std::fs::metadata(dst.join("a")).unwrap();
        assert_eq!((a.mtime(), a.mtime_nsec()), (1_000_000_000, 123_456_789));
        let s = std::fs::metadata(dst.join("sparse")).unwrap();
        assert_eq!(s.len(), 1 << 30);
        assert!(
            s.blocks() < 1024,
            "the hole stayed a hole: {} blocks",
            s.blocks()
        );
        assert!(done.bytes < 1 << 20, "{done:?}");
    }

    #[test]
    fn a_link_in_the_way_is_not_followed_out_of_the_root() {
        // A sandbox whose /workspace is a link to the host's /etc: resolved
        // in its root, it names the sandbox's own /etc.
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("workspace")).unwrap();
        let fd = dir_fd(root);
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let ws = openat2(&fd, "workspace", how).unwrap();
        assert!(
            names_of(&ws).unwrap().is_empty(),
            "the sandbox's empty /etc"
        );
    }

    #[test]
    fn too_deep_a_tree_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir(&dst).unwrap();
        let mut fd = dir_fd(&src);
        for _ in 0..=MAX_DEPTH {
            mkdirat(&fd, "d", Mode::from_bits_truncate(0o700)).unwrap();
            fd = open_dir(&fd, &OsString::from("d"), false).unwrap();
        }
        let e = copy(dir_fd(&src), dir_fd(&dst), &IdMap::identity(None)).unwrap_err();
        assert!(e.contains("deeper than"), "{e}");
    }
}
