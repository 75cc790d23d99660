//! Volumes: filesystems a worker keeps for a tenant across sandboxes and
//! restarts, mounted into a sandbox at its create (`NAME:/path[:ro]`).

use crate::{ProtocolError, pb};

/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 8;
/// Most volumes one tenant (or the operator) keeps on a worker.
pub const MAX_VOLUMES: usize = 100;
/// The smallest volume (a filesystem needs room for its own records).
pub const MIN_SIZE: u64 = 8 << 20;

/// Where a volume may not be mounted: the sandbox's own mounts and the
/// kernel's, and what the worker mounts for itself.
const RESERVED: [&str; 8] = [
    "/proc",
    "/sys",
    "/dev",
    "/.corral",
    "/run/corral",
    "/run/corral-egress",
    crate::limits::WORKSPACE_DIR,
    crate::limits::TMP_DIR,
];

/// A volume's name: 1-64 characters of `[a-z0-9._-]`, first a letter or a
/// digit (so never `..`, never a `/`).
pub fn check_name(name: &str) -> Result<(), ProtocolError> {
    crate::template::check_kept_name("volume", name)
}

/// One volume mounted into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
    #[cfg_attr(feature = "serde", serde(default))]
    pub read_only: bool,
}

impl VolumeMount {
    /// `NAME:/path` or `NAME:/path:ro` (`:rw` is the default said aloud).
    pub fn parse(s: &str) -> Result<Self, ProtocolError> {
        let bad = || {
            ProtocolError::invalid(
                "volumes",
                format!(
                    "{:?}: a volume is mounted as NAME:/PATH or NAME:/PATH:ro",
                    s.chars().take(80).collect::<String>()
                ),
            )
        };
        let (name, rest) = s.split_once(':').ok_or_else(bad)?;
        let (path, read_only) = match rest.rsplit_once(':') {
            Some((path, "ro")) => (path, true),
            Some((path, "rw")) => (path, false),
            Some(_) => return Err(bad()),
            None => (rest, false),
        };
        let m = Self {
            name: name.to_string(),
            path: path.to_string(),
            read_only,
        };
        m.validate()?;
        Ok(m)
    }

    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_name(&self.name)?;
        check_path(&self.path)
    }
}

impl std::fmt::Display for VolumeMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, self.path)?;
        if self.read_only {
            f.write_str(":ro")?;
        }
        Ok(())
    }
}

/// Where a volume may be mounted: an absolute path of plain components
/// (no `.`, `..`, empty one or NUL), at most 255 bytes, outside what is
/// reserved.
pub fn check_path(path: &str) -> Result<(), ProtocolError> {
    let bad = |why: &str| {
        ProtocolError::invalid(
            "volumes",
            format!("{:?}: {why}", path.chars().take(80).collect::<String>()),
        )
    };
    if !path.starts_with('/') || path.len() > 255 {
        return Err(bad("a volume's path is absolute, at most 255 bytes"));
    }
    let parts: Vec<&str> = path[1..].split('/').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == ".." || p.contains('\0'))
    {
        return Err(bad(
            "a volume's path has no empty, '.' or '..' component and no NUL",
        ));
    }
    for r in RESERVED {
        let under = path
            .strip_prefix(r)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        // The workspace and /tmp may have a volume below them, not over them.
        let whole_only = r == crate::limits::WORKSPACE_DIR || r == crate::limits::TMP_DIR;
        if (whole_only && path == r) || (!whole_only && under) {
            return Err(bad(&format!(
                "{r} is the sandbox's own; mount a volume elsewhere"
            )));
        }
    }
    Ok(())
}

/// A sandbox's mounts: each valid, at most [`MAX_MOUNTS`], no path twice
/// nor one below another, no volume twice.
pub fn check_mounts(mounts: &[VolumeMount]) -> Result<(), ProtocolError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(ProtocolError::invalid(
            "volumes",
            format!("a sandbox mounts at most {MAX_MOUNTS} volumes"),
        ));
    }
    for (i, m) in mounts.iter().enumerate() {
        m.validate()?;
        for other in &mounts[..i] {
            if other.name == m.name {
                return Err(ProtocolError::invalid(
                    "volumes",
                    format!("volume {:?} is mounted twice", m.name),
                ));
            }
            let nested = |a: &str, b: &str| {
                a == b || b.strip_prefix(a).is_some_and(|rest| rest.starts_with('/'))
            };
            if nested(&other.path, &m.path) || nested(&m.path, &other.path) {
                return Err(ProtocolError::invalid(
                    "volumes",
                    format!("{} and {} overlap", other.path, m.path),
                ));
            }
        }
    }
    Ok(())
}

impl From<pb::VolumeMount> for VolumeMount {
    fn from(p: pb::VolumeMount) -> Self {
        Self {
            name: p.name,
            path: p.path,
            read_only: p.read_only,
        }
    }
}

impl From<VolumeMount> for pb::VolumeMount {
    fn from(m: VolumeMount) -> Self {
        Self {
            name: m.name,
            path: m.path,
            read_only: m.read_only,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_are_parsed_and_bad_ones_said() {
        let m = VolumeMount::parse("data:/data").unwrap();
        assert_eq!(
            (m.name.as_str(), m.path.as_str(), m.read_only),
            ("data", "/data", false)
        );
        let m = VolumeMount::parse("cache:/workspace/cache:ro").unwrap();
        assert!(m.read_only);
        assert_eq!(m.to_string(), "cache:/workspace/cache:ro");
        assert!(!VolumeMount::parse("d:/x:rw").unwrap().read_only);
        for bad in [
            "data",
            "../x:/data",
            "a/b:/data",
            "Data:/data",
            "data:relative",
            "data:/",
            "data:/a/../etc",
            "data:/a//b",
            "data:/a/./b",
            "data:/proc",
            "data:/proc/x",
            "data:/dev/shm",
            "data:/.corral",
            "data:/run/corral",
            "data:/run/corral-egress/x",
            "data:/workspace",
            "data:/tmp",
            "data:/data:rx",
            "data:/da\0ta",
        ] {
            assert!(VolumeMount::parse(bad).is_err(), "{bad:?} was taken");
        }
        // Below the workspace, and a name that only begins like a reserved one.
        assert!(VolumeMount::parse("d:/workspace/d").is_ok());
        assert!(VolumeMount::parse("d:/procs").is_ok());
        assert!(VolumeMount::parse("d:/run/corralx").is_ok());
    }

    #[test]
    fn a_sandboxs_mounts_do_not_overlap() {
        let m = |s: &str| VolumeMount::parse(s).unwrap();
        assert!(check_mounts(&[m("a:/a"), m("b:/b")]).is_ok());
        assert!(check_mounts(&[m("a:/a"), m("a:/b")]).is_err());
        assert!(check_mounts(&[m("a:/a"), m("b:/a")]).is_err());
        assert!(check_mounts(&[m("a:/a"), m("b:/a/b")]).is_err());
        assert!(check_mounts(&[m("a:/a/b"), m("b:/a")]).is_err());
        assert!(check_mounts(&[m("a:/ab"), m("b:/a")]).is_ok());
        let many: Vec<_> = (0..9).map(|i| m(&format!("v{i}:/v{i}"))).collect();
        assert!(check_mounts(&many).is_err());
    }
}
