//! Volumes: each one an ext4 filesystem in a sparse file of the state
//! directory (`volumes/<id>.img`), loop-mounted on the worker's host at
//! `volumes/<id>` and bind-mounted by the engine into the sandboxes that
//! name it. Its size is the filesystem's: a write past it fails with
//! ENOSPC in the sandbox and touches nothing else. Being a filesystem of
//! its own, nothing in it can name a file outside it: a symbolic link is
//! resolved in the sandbox that follows it, a hard link cannot cross
//! filesystems.
//!
//! This module owns which volumes there are (one file, `volumes.json`,
//! written before a create or a removal is answered) and which sandboxes
//! hold each one (one writer at most, any number of readers), in one lock.
//! The holds are the worker's sandboxes' own, rebuilt from their records at
//! a start. What needs the host (making a filesystem, mounting it, giving
//! its files to a sandbox's user) runs one at a time, outside that lock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::volume::VolumeMount;

/// Room a worker keeps on its state directory's disk beside its volumes.
const KEEP_FREE: u64 = 1 << 30;

/// How long making or mounting a filesystem may take.
const HOST_COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// One volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Volume {
    /// Whose it is (`None`: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub name: String,
    /// Its files' name in the state directory (never the client's words).
    pub id: String,
    pub size_bytes: u64,
    pub created_at_ms: i64,
}

/// Who holds a volume now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holders {
    pub writer: Option<SandboxId>,
    pub readers: BTreeSet<SandboxId>,
}

/// Why a volume cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("no volume {0:?} on this worker (make one with `corral volume create`)")]
    NoSuchVolume(String),
    #[error("volume {name:?} {why}")]
    InUse { name: String, why: String },
    #[error("volume {name:?} exists with another size ({size_bytes} bytes)")]
    OtherSize { name: String, size_bytes: u64 },
    #[error("{0}")]
    Refused(String),
    #[error("volumes are not available on this worker: {0}")]
    Unavailable(String),
    #[error("volume {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path, source: std::io::Error) -> VolumeError {
    VolumeError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The bounds of volumes (`--default-volume-size`, `--max-volume-size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeSettings {
    pub default_bytes: u64,
    pub max_bytes: u64,
    /// Most bytes of volumes one tenant (or the operator) keeps here.
    pub tenant_bytes: Option<u64>,
}

impl Default for VolumeSettings {
    fn default() -> Self {
        Self {
            default_bytes: 1 << 30,
            max_bytes: 100 << 30,
            tenant_bytes: None,
        }
    }
}

type Key = (String, String);

fn key(tenant: Option<&str>, name: &str) -> Key {
    (tenant.unwrap_or_default().to_string(), name.to_string())
}

struct Book {
    kept: BTreeMap<Key, Volume>,
    /// By volume id.
    holders: HashMap<String, Holders>,
}

/// A volume a sandbox mounts, resolved: where its files are on the host.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub mount: VolumeMount,
    pub volume: Volume,
    pub host_path: PathBuf,
}

/// The worker's volumes.
pub struct Volumes {
    dir: PathBuf,
    file: PathBuf,
    settings: VolumeSettings,
    book: Mutex<Book>,
    /// Host work (mkfs, mount, umount, chown) one at a time.
    host: tokio::sync::Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Volumes {
    /// Those kept in `state_dir` (none if there are none; an unreadable
    /// list is said and set aside, never half-read: its files stay).
    pub fn load(state_dir: &Path, settings: VolumeSettings) -> Self {
        let file = state_dir.join("volumes.json");
        let kept = match std::fs::read(&file) {
            Ok(b) => match serde_json::from_slice::<Vec<Volume>>(&b) {
                Ok(all) => all
                    .into_iter()
                    .map(|v| (key(v.tenant.as_deref(), &v.name), v))
                    .collect(),
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "unreadable volumes, set aside");
                    let _ = std::fs::rename(&file, file.with_extension("json.unreadable"));
                    BTreeMap::new()
                }
            },
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(file = %file.display(), error = %e, "volumes not read");
                }
                BTreeMap::new()
            }
        };
        Self {
            dir: state_dir.join("volumes"),
            file,
            settings,
            book: Mutex::new(Book {
                kept,
                holders: HashMap::new(),
            }),
            host: tokio::sync::Mutex::new(()),
        }
    }

    fn keep(&self, kept: &BTreeMap<Key, Volume>) -> Result<(), VolumeError> {
        let json = serde_json::to_vec_pretty(&kept.values().collect::<Vec<_>>())
            .map_err(|e| io(&self.file, std::io::Error::other(e)))?;
        crate::durable::write_synced(&self.file, &json).map_err(|e| io(&self.file, e))
    }

    fn image_of(&self, v: &Volume) -> PathBuf {
        self.dir.join(format!("{}.img", v.id))
    }

    /// Where `v`'s filesystem is mounted on the host.
    pub fn host_path(&self, v: &Volume) -> PathBuf {
        self.dir.join(&v.id)
    }

    /// A read-only view of it (`ro,nosuid,nodev`), what readers bind: the
    /// engine binds it as it is, flags and all (a read-only bind it made
    /// itself would lose `nosuid,nodev`).
    pub fn read_only_path(&self, v: &Volume) -> PathBuf {
        self.dir.join(format!("{}.ro", v.id))
    }

    fn resolved(&self, m: &VolumeMount, v: Volume) -> Resolved {
        let host_path = if m.read_only {
            self.read_only_path(&v)
        } else {
            self.host_path(&v)
        };
        Resolved {
            mount: m.clone(),
            host_path,
            volume: v,
        }
    }

    /// Makes `tenant`'s volume `name` of `size` bytes (0: the default):
    /// the volume, and whether it was made now (the same name and size
    /// again is the one there).
    pub async fn create(
        &self,
        tenant: Option<&str>,
        name: &str,
        size: u64,
        now_ms: i64,
    ) -> Result<(Volume, bool), VolumeError> {
        corral_proto::volume::check_name(name).map_err(|e| VolumeError::Refused(e.to_string()))?;
        let size = if size == 0 {
            self.settings.default_bytes
        } else {
            size
        };
        if size < corral_proto::volume::MIN_SIZE || size > self.settings.max_bytes {
            return Err(VolumeError::Refused(format!(
                "a volume is {} to {} bytes on this worker (--max-volume-size); {size} was asked",
                corral_proto::volume::MIN_SIZE,
                self.settings.max_bytes
            )));
        }
        let there = |book: &Book| -> Result<Option<Volume>, VolumeError> {
            match book.kept.get(&key(tenant, name)) {
                Some(v) if v.size_bytes == size => Ok(Some(v.clone())),
                Some(v) => Err(VolumeError::OtherSize {
                    name: name.into(),
                    size_bytes: v.size_bytes,
                }),
                None => {
                    let mine = tenant.unwrap_or_default();
                    let most = corral_proto::volume::MAX_VOLUMES;
                    if book.kept.keys().filter(|(t, _)| t == mine).count() >= most {
                        return Err(VolumeError::Refused(format!(
                            "at most {most} volumes are kept for each tenant (remove one: corral volume rm NAME)"
                        )));
                    }
                    if let Some(cap) = self.settings.tenant_bytes {
                        let have: u64 = book
                            .kept
                            .iter()
                            .filter(|((t, _), _)| t == mine)
                            .map(|(_, v)| v.size_bytes)
                            .sum();
                        if have.saturating_add(size) > cap {
                            return Err(VolumeError::Refused(format!(
                                "{size} bytes more would make {} bytes of volumes, past the {cap} each tenant may keep on this worker (--tenant-volume-bytes; {have} kept now)",
                                have.saturating_add(size)
                            )));
                        }
                    }
                    Ok(None)
                }
            }
        };
        let _host = self.host.lock().await;
        if let Some(v) = there(&lock(&self.book))? {
            return Ok((v, false));
        }
        let v = Volume {
            tenant: tenant.map(str::to_string),
            name: name.to_string(),
            id: format!("v{}", uuid::Uuid::new_v4().simple()),
            size_bytes: size,
            created_at_ms: now_ms,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        // Its blocks are taken now, so that the volumes of a worker never
        // promise more than its disk has, and some room is left for the
        // worker's own records.
        let free = nix::sys::statvfs::statvfs(&self.dir)
            .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
            .map_err(|e| io(&self.dir, e.into()))?;
        if free < size.saturating_add(KEEP_FREE) {
            return Err(VolumeError::Refused(format!(
                "{size} bytes is more than this worker's disk has free for volumes ({} bytes, keeping {KEEP_FREE} for itself)",
                free.saturating_sub(KEEP_FREE)
            )));
        }
        let image = self.image_of(&v);
        let made = async {
            let f = std::fs::File::create_new(&image).map_err(|e| io(&image, e))?;
            nix::fcntl::fallocate(
                &f,
                nix::fcntl::FallocateFlags::empty(),
                0,
                i64::try_from(size).unwrap_or(i64::MAX),
            )
            .map_err(|e| io(&image, e.into()))?;
            drop(f);
            // No blocks kept for root (the sandbox gets the size it asked
            // for); its root directory is made the sandbox user's when one
            // writes to it.
            host_command(
                "mkfs.ext4",
                &[
                    "-q".as_ref(),
                    "-F".as_ref(),
                    "-m".as_ref(),
                    "0".as_ref(),
                    "-E".as_ref(),
                    "lazy_itable_init=1,lazy_journal_init=1".as_ref(),
                    image.as_os_str(),
                ],
            )
            .await
        }
        .await;
        // Mounted now (its first sandbox is not far), and empty: without
        // mkfs's lost+found, a directory only its owner may read.
        let made = match made {
            Ok(()) => self.mount_one(&v).await.and_then(|()| {
                let lf = self.host_path(&v).join("lost+found");
                std::fs::remove_dir(&lf).map_err(|e| io(&lf, e))
            }),
            Err(e) => Err(e),
        };
        if let Err(e) = made {
            self.unmount(&v).await;
            let _ = std::fs::remove_dir(self.read_only_path(&v));
            let _ = std::fs::remove_dir(self.host_path(&v));
            let _ = std::fs::remove_file(&image);
            return Err(e);
        }
        let kept = {
            let mut book = lock(&self.book);
            book.kept.insert(key(tenant, name), v.clone());
            let kept = self.keep(&book.kept);
            if kept.is_err() {
                book.kept.remove(&key(tenant, name));
            }
            kept
        };
        if let Err(e) = kept {
            self.unmount(&v).await;
            let _ = std::fs::remove_dir(self.read_only_path(&v));
            let _ = std::fs::remove_dir(self.host_path(&v));
            let _ = std::fs::remove_file(&image);
            return Err(e);
        }
        tracing::info!(volume = %v.name, id = %v.id, size, "volume made");
        Ok((v, true))
    }

    /// `tenant`'s volumes, by name, with who holds each.
    pub fn list(&self, tenant: Option<&str>) -> Vec<(Volume, Holders)> {
        let mine = tenant.unwrap_or_default();
        let book = lock(&self.book);
        book.kept
            .iter()
            .filter(|((t, _), _)| t == mine)
            .map(|(_, v)| {
                (
                    v.clone(),
                    book.holders.get(&v.id).cloned().unwrap_or_default(),
                )
            })
            .collect()
    }

    /// What `v`'s files take now (0 while it is not mounted).
    pub fn used_bytes(&self, v: &Volume) -> u64 {
        let path = self.host_path(v);
        if !is_mounted(&path) {
            return 0;
        }
        nix::sys::statvfs::statvfs(&path)
            .map(|s| s.blocks().saturating_sub(s.blocks_free()) * s.fragment_size())
            .unwrap_or(0)
    }

    /// `tenant`'s volumes `mounts` names, as they are (held or not).
    pub fn resolve(
        &self,
        tenant: Option<&str>,
        mounts: &[VolumeMount],
    ) -> Result<Vec<Resolved>, VolumeError> {
        let book = lock(&self.book);
        mounts
            .iter()
            .map(|m| {
                let v = book
                    .kept
                    .get(&key(tenant, &m.name))
                    .ok_or_else(|| VolumeError::NoSuchVolume(m.name.clone()))?
                    .clone();
                Ok(self.resolved(m, v))
            })
            .collect()
    }

    /// Sandbox `id` of `tenant` takes `mounts`: each must be the tenant's,
    /// with no other writer (and no readers of one it writes to). All or
    /// none are taken.
    pub fn hold(
        &self,
        tenant: Option<&str>,
        id: &SandboxId,
        mounts: &[VolumeMount],
    ) -> Result<Vec<Resolved>, VolumeError> {
        let mut book = lock(&self.book);
        let mut resolved = Vec::new();
        for m in mounts {
            let v = book
                .kept
                .get(&key(tenant, &m.name))
                .ok_or_else(|| VolumeError::NoSuchVolume(m.name.clone()))?
                .clone();
            let h = book.holders.get(&v.id).cloned().unwrap_or_default();
            if let Some(w) = h.writer.as_ref().filter(|w| *w != id)
                && !m.read_only
            {
                return Err(VolumeError::InUse {
                    name: m.name.clone(),
                    why: format!(
                        "is written by sandbox {w}: one writer at a time (mount it read-only with :ro, or remove {w})"
                    ),
                });
            }
            resolved.push(self.resolved(m, v));
        }
        for r in &resolved {
            let h = book.holders.entry(r.volume.id.clone()).or_default();
            if r.mount.read_only {
                h.readers.insert(id.clone());
            } else {
                h.writer = Some(id.clone());
            }
        }
        Ok(resolved)
    }

    /// Sandbox `id` holds no volume any more.
    pub fn release(&self, id: &SandboxId) {
        let mut book = lock(&self.book);
        book.holders.retain(|_, h| {
            if h.writer.as_ref() == Some(id) {
                h.writer = None;
            }
            h.readers.remove(id);
            h.writer.is_some() || !h.readers.is_empty()
        });
    }

    /// Sandbox `id` (found at a start) holds `mounts` again, whatever
    /// else does: what it held when it was made.
    pub fn hold_again(&self, tenant: Option<&str>, id: &SandboxId, mounts: &[VolumeMount]) {
        let mut book = lock(&self.book);
        for m in mounts {
            let Some(v) = book.kept.get(&key(tenant, &m.name)).cloned() else {
                tracing::warn!(sandbox = %id, volume = %m.name, "a sandbox mounts a volume the worker no longer has");
                continue;
            };
            let h = book.holders.entry(v.id).or_default();
            if m.read_only {
                h.readers.insert(id.clone());
            } else {
                h.writer = Some(id.clone());
            }
        }
    }

    /// Each of `resolved` mounted on the host (mounted now if it is not:
    /// after the host restarted, or at first use).
    pub async fn mount(&self, resolved: &[Resolved]) -> Result<(), VolumeError> {
        if resolved.is_empty() {
            return Ok(());
        }
        let _host = self.host.lock().await;
        for r in resolved {
            self.mount_one(&r.volume).await?;
        }
        Ok(())
    }

    /// Mounts `v` on the host unless it is (the caller holds `host`).
    async fn mount_one(&self, v: &Volume) -> Result<(), VolumeError> {
        let path = self.host_path(v);
        std::fs::create_dir_all(&path).map_err(|e| io(&path, e))?;
        if !is_mounted(&path) {
            let image = self.image_of(v);
            // mount(8) sets up a loop device, or takes the one the file
            // has already (so a volume is never two filesystems at once).
            host_command(
                "mount",
                &[
                    "-o".as_ref(),
                    "loop,nodev,nosuid".as_ref(),
                    image.as_os_str(),
                    path.as_os_str(),
                ],
            )
            .await?;
            tracing::info!(volume = %v.name, path = %path.display(), "volume mounted");
        }
        let ro = self.read_only_path(v);
        std::fs::create_dir_all(&ro).map_err(|e| io(&ro, e))?;
        if !is_mounted(&ro) {
            host_command(
                "mount",
                &["--bind".as_ref(), path.as_os_str(), ro.as_os_str()],
            )
            .await?;
            host_command(
                "mount",
                &[
                    "-o".as_ref(),
                    "remount,bind,ro,nosuid,nodev".as_ref(),
                    ro.as_os_str(),
                ],
            )
            .await?;
        }
        Ok(())
    }

    /// The files of the volumes `resolved` writes to become `uid`'s (the
    /// sandbox's user), before its first command: what an earlier writer
    /// left is this one's to change. Links are not followed; nothing else
    /// writes to the volume meanwhile (one writer at a time).
    pub async fn give_to(&self, resolved: &[Resolved], uid: u32) -> Result<(), VolumeError> {
        // Not under `host`: the walk is as long as the volume is full, and
        // the hold alone keeps everything else off these files.
        for r in resolved.iter().filter(|r| !r.mount.read_only) {
            let root = r.host_path.clone();
            tokio::task::spawn_blocking(move || chown_tree(&root, uid))
                .await
                .map_err(|e| io(&r.host_path, std::io::Error::other(e)))??;
        }
        Ok(())
    }

    /// Removes `tenant`'s volume `name` and its files (refused while a
    /// sandbox holds it): whether there was one.
    pub async fn delete(&self, tenant: Option<&str>, name: &str) -> Result<bool, VolumeError> {
        corral_proto::volume::check_name(name).map_err(|e| VolumeError::Refused(e.to_string()))?;
        let _host = self.host.lock().await;
        let v = {
            let mut book = lock(&self.book);
            let Some(v) = book.kept.get(&key(tenant, name)).cloned() else {
                return Ok(false);
            };
            if let Some(h) = book.holders.get(&v.id) {
                let who = h.writer.iter().chain(&h.readers).next();
                if let Some(who) = who {
                    return Err(VolumeError::InUse {
                        name: name.into(),
                        why: format!("is mounted by sandbox {who}: remove it first"),
                    });
                }
            }
            book.kept.remove(&key(tenant, name));
            if let Err(e) = self.keep(&book.kept) {
                book.kept.insert(key(tenant, name), v);
                return Err(e);
            }
            v
        };
        if !self.unmount(&v).await {
            // Kept, as it was: its files stay until it can be unmounted.
            let mut book = lock(&self.book);
            book.kept.insert(key(tenant, name), v.clone());
            let _ = self.keep(&book.kept);
            return Err(VolumeError::Unavailable(format!(
                "volume {name:?} could not be unmounted; it is kept (the worker's log says why)"
            )));
        }
        let _ = std::fs::remove_dir(self.read_only_path(&v));
        let _ = std::fs::remove_dir(self.host_path(&v));
        let image = self.image_of(&v);
        std::fs::remove_file(&image).map_err(|e| io(&image, e))?;
        tracing::info!(volume = %v.name, id = %v.id, "volume removed");
        Ok(true)
    }

    /// Unmounts `v` (its read-only view first); whether it is unmounted.
    async fn unmount(&self, v: &Volume) -> bool {
        for path in [self.read_only_path(v), self.host_path(v)] {
            if is_mounted(&path)
                && let Err(e) = host_command("umount", &[path.as_os_str()]).await
            {
                tracing::warn!(volume = %v.name, error = %e, "could not unmount a volume");
                return false;
            }
        }
        true
    }

    /// Unmounts the volumes no sandbox holds (a worker that stops: those
    /// its sandboxes mount stay, for the next start to find).
    pub async fn unmount_idle(&self) {
        let _host = self.host.lock().await;
        let idle: Vec<Volume> = {
            let book = lock(&self.book);
            book.kept
                .values()
                .filter(|v| !book.holders.contains_key(&v.id))
                .cloned()
                .collect()
        };
        for v in idle {
            let _ = self.unmount(&v).await;
        }
    }
}

/// Whether something is mounted at `path` (its device differs from its
/// parent's).
fn is_mounted(path: &Path) -> bool {
    let (Ok(me), Some(Ok(parent))) = (
        std::fs::symlink_metadata(path),
        path.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    me.dev() != parent.dev()
}

/// Runs a program of the host's (mkfs.ext4, mount, umount): one that is
/// missing, or that fails, says so.
async fn host_command(program: &str, args: &[&std::ffi::OsStr]) -> Result<(), VolumeError> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(HOST_COMMAND_TIMEOUT, cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(VolumeError::Unavailable(format!(
                "{program} is not installed on its host (Debian: e2fsprogs and mount)"
            )));
        }
        Ok(Err(e)) => {
            return Err(VolumeError::Unavailable(format!("{program}: {e}")));
        }
        Err(_) => {
            return Err(VolumeError::Unavailable(format!(
                "{program} did not end within {HOST_COMMAND_TIMEOUT:?}"
            )));
        }
    };
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    let said: String = said.trim().chars().take(400).collect();
    Err(VolumeError::Unavailable(format!(
        "{program} failed ({}): {said} (the worker makes and mounts filesystems as root: see docs/architecture.md#volumes)",
        out.status
    )))
}

/// Gives every entry of the tree at `root` to `uid` (and its group),
/// links themselves, never what they name.
fn chown_tree(root: &Path, uid: u32) -> Result<(), VolumeError> {
    let id = Some(nix::unistd::Uid::from_raw(uid));
    let gid = Some(nix::unistd::Gid::from_raw(uid));
    let chown = |p: &Path| {
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            p,
            id,
            gid,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io(p, e.into()))
    };
    let dev = std::fs::symlink_metadata(root)
        .map_err(|e| io(root, e))?
        .dev();
    chown(root)?;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "a volume's directory was not read");
                continue;
            }
        };
        for entry in entries.flatten() {
            let p = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if meta.dev() != dev {
                continue;
            }
            if (meta.uid() != uid || meta.gid() != uid)
                && let Err(e) = chown(&p)
            {
                tracing::warn!(error = %e, "an entry of a volume was not given to its writer");
            }
            if meta.file_type().is_dir() {
                dirs.push(p);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SandboxId {
        SandboxId::new(s.to_string()).unwrap()
    }

    fn m(s: &str) -> VolumeMount {
        VolumeMount::parse(s).unwrap()
    }

    fn with(kept: &[(&str, &str)]) -> (tempfile::TempDir, Volumes) {
        let dir = tempfile::tempdir().unwrap();
        let vols = Volumes::load(dir.path(), VolumeSettings::default());
        {
            let mut book = lock(&vols.book);
            for (i, (tenant, name)) in kept.iter().enumerate() {
                let tenant = (!tenant.is_empty()).then(|| tenant.to_string());
                book.kept.insert(
                    key(tenant.as_deref(), name),
                    Volume {
                        tenant,
                        name: name.to_string(),
                        id: format!("v{i}"),
                        size_bytes: 1 << 30,
                        created_at_ms: 1,
                    },
                );
            }
        }
        (dir, vols)
    }

    #[test]
    fn one_writer_at_a_time_and_readers_beside_it() {
        let (_d, v) = with(&[("", "data")]);
        v.hold(None, &sid("a"), &[m("data:/data")]).unwrap();
        // Again by the same sandbox: the same hold.
        v.hold(None, &sid("a"), &[m("data:/data")]).unwrap();
        let e = v.hold(None, &sid("b"), &[m("data:/data")]).unwrap_err();
        assert!(matches!(e, VolumeError::InUse { .. }), "{e}");
        assert!(e.to_string().contains("sandbox a"), "{e}");
        v.hold(None, &sid("c"), &[m("data:/data:ro")]).unwrap();
        let (_, h) = &v.list(None)[0];
        assert_eq!(h.writer, Some(sid("a")));
        assert_eq!(h.readers, BTreeSet::from([sid("c")]));
        v.release(&sid("a"));
        v.hold(None, &sid("b"), &[m("data:/data")]).unwrap();
        v.release(&sid("b"));
        v.release(&sid("c"));
        assert_eq!(v.list(None)[0].1, Holders::default());
    }

    #[test]
    fn a_hold_takes_all_or_nothing_and_only_the_tenants_own() {
        let (_d, v) = with(&[("", "a"), ("", "b"), ("acme", "c")]);
        v.hold(None, &sid("w"), &[m("b:/b")]).unwrap();
        assert!(v.hold(None, &sid("x"), &[m("a:/a"), m("b:/b")]).is_err());
        assert_eq!(v.list(None)[0].1, Holders::default(), "a was not kept");
        let e = v.hold(None, &sid("x"), &[m("c:/c")]).unwrap_err();
        assert!(matches!(e, VolumeError::NoSuchVolume(_)), "{e}");
        v.hold(Some("acme"), &sid("x"), &[m("c:/c")]).unwrap();
        let e = v.hold(Some("acme"), &sid("y"), &[m("a:/a")]).unwrap_err();
        assert!(matches!(e, VolumeError::NoSuchVolume(_)), "{e}");
    }

    #[tokio::test]
    async fn a_held_volume_is_not_removed_and_bad_names_are_refused() {
        let (_d, v) = with(&[("", "data")]);
        v.hold(None, &sid("r"), &[m("data:/data:ro")]).unwrap();
        let e = v.delete(None, "data").await.unwrap_err();
        assert!(matches!(e, VolumeError::InUse { .. }), "{e}");
        assert!(!v.delete(None, "nothing").await.unwrap());
        for bad in ["../x", "a/b", "", "UP"] {
            assert!(matches!(
                v.delete(None, bad).await,
                Err(VolumeError::Refused(_))
            ));
            assert!(matches!(
                v.create(None, bad, 0, 1).await,
                Err(VolumeError::Refused(_))
            ));
        }
        let e = v.create(None, "big", 1 << 50, 1).await.unwrap_err();
        assert!(e.to_string().contains("--max-volume-size"), "{e}");
    }

    #[tokio::test]
    async fn a_tenant_keeps_no_more_volume_bytes_than_the_worker_allows() {
        let dir = tempfile::tempdir().unwrap();
        let settings = VolumeSettings {
            tenant_bytes: Some(3 << 30),
            ..VolumeSettings::default()
        };
        let v = Volumes::load(dir.path(), settings);
        {
            let mut book = lock(&v.book);
            for (i, name) in ["a", "b"].iter().enumerate() {
                book.kept.insert(
                    key(Some("acme"), name),
                    Volume {
                        tenant: Some("acme".into()),
                        name: name.to_string(),
                        id: format!("v{i}"),
                        size_bytes: 1 << 30,
                        created_at_ms: 1,
                    },
                );
            }
        }
        let e = v.create(Some("acme"), "c", 2 << 30, 1).await.unwrap_err();
        assert!(e.to_string().contains("--tenant-volume-bytes"), "{e}");
        // One that has none is bounded alike.
        let e = v.create(Some("bolt"), "c", 4 << 30, 1).await.unwrap_err();
        assert!(e.to_string().contains("--tenant-volume-bytes"), "{e}");
    }

    #[test]
    fn a_writers_files_become_its_users_and_links_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("vol");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), b"x").unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, b"y").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a/link")).unwrap();
        let before = std::fs::metadata(&outside).unwrap().uid();
        chown_tree(&root, 4242).unwrap();
        for p in ["", "a", "a/b", "a/b/f", "a/link"] {
            let meta = std::fs::symlink_metadata(root.join(p)).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (4242, 4242), "{p}");
        }
        assert_eq!(std::fs::metadata(&outside).unwrap().uid(), before);
    }
}
