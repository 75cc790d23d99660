//! Finding and checking the static `corral-init` binary that goes into every
//! sandbox.

use std::path::{Path, PathBuf};

use crate::error::{Result, WorkerError};

/// The supervisor binary, read into memory once.
#[derive(Debug, Clone)]
pub struct InitBinary {
    pub path: PathBuf,
    pub bytes: std::sync::Arc<Vec<u8>>,
    /// Content hash: names the Docker volume that carries this exact binary.
    pub digest: String,
}

/// Where a build puts the static binary, relative to a Cargo target dir.
pub const STATIC_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Candidate locations, in order: next to the running executable (an
/// installed layout), then the static build's output in the Cargo target dir
/// the executable lives in (a source checkout).
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(exe) = std::env::current_exe() else {
        return out;
    };
    let mut dir = exe.parent();
    // target/release/corral-worker, target/debug/deps/test-binary, ...
    for _ in 0..3 {
        let Some(d) = dir else { break };
        out.push(d.join("corral-init"));
        for profile in ["release", "debug"] {
            out.push(d.join(STATIC_TARGET).join(profile).join("corral-init"));
        }
        dir = d.parent();
    }
    out
}

impl InitBinary {
    /// Loads the binary at `path`, or the first static candidate found
    /// (a plain `cargo build` also leaves a dynamic `corral-init` around).
    pub fn locate(path: Option<&Path>) -> Result<Self> {
        if let Some(p) = path {
            return Self::load(p);
        }
        let mut rejected = Vec::new();
        for candidate in candidates().into_iter().filter(|p| p.is_file()) {
            match Self::load(&candidate) {
                Ok(found) => return Ok(found),
                Err(e) => rejected.push(e.to_string()),
            }
        }
        Err(WorkerError::InitBinary(format!(
            "no static corral-init found; build it with deploy/build.sh or pass --init-binary ({})",
            if rejected.is_empty() {
                format!(
                    "looked in: {}",
                    candidates()
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                rejected.join("; ")
            }
        )))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| WorkerError::InitBinary(format!("{}: {e}", path.display())))?;
        check_static_elf(&bytes)
            .map_err(|why| WorkerError::InitBinary(format!("{}: {why}", path.display())))?;
        Ok(Self {
            digest: format!("{:016x}", fnv1a64(&bytes)),
            path: path.to_path_buf(),
            bytes: std::sync::Arc::new(bytes),
        })
    }
}

/// FNV-1a, 64 bits: a stable content hash with no dependency.
pub fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A sandbox image may have no C library at all, so the supervisor must be a
/// static ELF: no `PT_INTERP` program header.
pub fn check_static_elf(b: &[u8]) -> Result<(), String> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return Err("not a 64-bit little-endian ELF executable".into());
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().map_err(|_| "bad header")?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let Some(ty) = b.get(at..at + 4) else {
            return Err("truncated program headers".into());
        };
        if u32::from_le_bytes([ty[0], ty[1], ty[2], ty[3]]) == 3 {
            return Err(
                "dynamically linked (it needs a C library in the image); build it static with deploy/build.sh"
                    .into(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_executable_is_refused_with_the_fix() {
        // The test binary itself is dynamically linked.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let e = check_static_elf(&me).unwrap_err();
        assert!(e.contains("deploy/build.sh"), "{e}");
        assert!(check_static_elf(b"#!/bin/sh\n").is_err());
    }
}
