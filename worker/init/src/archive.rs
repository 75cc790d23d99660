//! Trees in and out of the sandbox as tar streams: what `corral cp` and
//! workspaces move. Each runs in a process of its own, started by the
//! supervisor as the sandbox's user (`corral-init --put-archive` and
//! `--get-archive`), with the archive on its stdin or stdout: the
//! supervisor's flow control carries the bytes, the sandbox's own limits
//! (its user's permissions, the workspace's size) bound them, and the
//! supervisor itself never blocks on a slow disk.
//!
//! The destination or source must resolve under the sandbox's roots.
//! Unpacking never follows a link out of the destination: every entry's
//! directories are checked one by one (a link among them must resolve
//! inside), the entry itself replaces whatever link stands at its place,
//! and names that are absolute or climb out (`..`) are refused. Packing
//! stores links as links and never follows them.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

use crate::fileops::{Roots, resolve_under_roots};

/// What an archive run did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moved {
    pub entries: u64,
    pub bytes: u64,
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
    unpack_at(&base, top, dest, input)
}

/// Unpacks an archive of a directory's contents (see [`pack_contents`])
/// into `dir`, made if missing: a whole workspace brought back, say.
pub fn unpack_contents(dir: &Path, dest: &str, input: impl Read) -> Result<Moved, String> {
    fs::create_dir_all(dir).map_err(|e| format!("{dest}: {e}"))?;
    unpack_at(dir, Top::Keep, dest, input)
}

fn unpack_at(base: &Path, top: Top, dest: &str, input: impl Read) -> Result<Moved, String> {
    let base = fs::canonicalize(base).map_err(|e| format!("{dest}: {e}"))?;
    let mut archive = tar::Archive::new(input);
    archive.set_preserve_permissions(false);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let mut moved = Moved::default();
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
        let rel = relative(&name, &top)?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        let full = base.join(&rel);
        let parent = full.parent().unwrap_or(&base);
        make_parents(&base, parent, &name)?;
        let kind = entry.header().entry_type();
        let shown = name.display();
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
                let mode = entry.header().mode().unwrap_or(0o755);
                let mtime = entry.header().mtime().unwrap_or(0);
                dirs.push((full, mode, mtime));
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(|e| format!("{shown}: {e}"))?
                    .ok_or_else(|| format!("{shown}: a hard link without a target"))?;
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
            tar::EntryType::Regular
            | tar::EntryType::Continuous
            | tar::EntryType::GNUSparse
            | tar::EntryType::Symlink
            | tar::EntryType::Fifo => {
                clear(&full, &name)?;
                moved.bytes += entry.size();
                entry
                    .unpack(&full)
                    .map_err(|e| format!("{shown}: {}", plain(&e)))?;
            }
            // Extended headers are read by the entries that follow them.
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => continue,
            other => return Err(format!("{shown}: cannot unpack a {other:?} entry")),
        }
        moved.entries += 1;
    }
    for (dir, mode, mtime) in dirs.into_iter().rev() {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&dir, fs::Permissions::from_mode(mode & 0o777))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        set_mtime(&dir, mtime);
    }
    Ok(moved)
}

/// The tar stream of `src` (a file, a link or a whole tree, named by its
/// last component), written to `out`. Links are stored as links; sockets,
/// which no archive holds, are left out with a note on stderr.
pub fn get(roots: &Roots, src: &str, out: impl Write) -> Result<Moved, String> {
    let path = resolve_under_roots(roots, src)?;
    pack(&path, out)
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
    let mut stack = vec![(path, name, meta)];
    while let Some((path, name, meta)) = stack.pop() {
        let ft = meta.file_type();
        let shown = path.display();
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
        } else if is_socket(&meta) {
            eprintln!("corral-init: {shown}: a socket, left out");
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

fn is_socket(meta: &fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    meta.file_type().is_socket()
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
}
