//! Files of the worker's state written so that a crash leaves the old
//! content or the new, never a part, and that only the worker's user reads.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

/// Options that create a file of Corral's state readable by its owner
/// only (0600).
pub fn private_file() -> fs::OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = fs::OpenOptions::new();
    o.mode(0o600);
    o
}

/// Writes `data` to `path` whole or not at all (a file beside it renamed
/// over it), on disk when this returns.
pub fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    // A name of its own per write: two writers of one file never share
    // (nor remove) each other's.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("{}.{n}.tmp", std::process::id()));
    let written = (|| {
        let mut f = private_file()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}
