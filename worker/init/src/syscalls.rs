//! Kernel surface that sandboxes do not need, closed by the supervisor for
//! itself and everything it starts, on top of the container engine's own
//! seccomp profile (filters stack, and none can be removed):
//!
//! - `io_uring_setup`, `io_uring_enter`, `io_uring_register` answer
//!   `ENOSYS`, as on a kernel without io_uring, so programs fall back to
//!   ordinary I/O (io_uring has been a steady source of kernel exploits);
//! - `socket(AF_VSOCK, ...)` answers `EAFNOSUPPORT`: a sandbox has no
//!   business talking to its host's hypervisor.
//!
//! The filters are built for the machine's own architecture; a system call
//! made through another ABI (32-bit x86 on x86_64, say) ends the process.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum RestrictError {
    #[error("cannot build the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("cannot set no_new_privs: {0}")]
    NoNewPrivs(nix::Error),
    #[error("cannot apply the seccomp filter: {0}")]
    Apply(#[from] seccompiler::Error),
    #[error("no seccomp filter for this architecture")]
    Arch,
}

fn arch() -> Result<TargetArch, RestrictError> {
    match std::env::consts::ARCH {
        "x86_64" => Ok(TargetArch::x86_64),
        "aarch64" => Ok(TargetArch::aarch64),
        "riscv64" => Ok(TargetArch::riscv64),
        _ => Err(RestrictError::Arch),
    }
}

/// The filters, in the order they are applied.
pub fn filters() -> Result<Vec<BpfProgram>, RestrictError> {
    let arch = arch()?;
    let io_uring: BTreeMap<i64, Vec<SeccompRule>> = [
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
    ]
    .into_iter()
    .map(|n| (n, Vec::new()))
    .collect();
    let io_uring = SeccompFilter::new(
        io_uring,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let vsock = SeccompFilter::new(
        [(
            libc::SYS_socket,
            vec![SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                libc::AF_VSOCK as u64,
            )?])?],
        )]
        .into_iter()
        .collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EAFNOSUPPORT as u32),
        arch,
    )?;
    Ok(vec![io_uring.try_into()?, vsock.try_into()?])
}

/// Applies the filters to this process (and so to everything it starts).
pub fn restrict() -> Result<(), RestrictError> {
    nix::sys::prctl::set_no_new_privs().map_err(RestrictError::NoNewPrivs)?;
    for f in filters()? {
        seccompiler::apply_filter(&f)?;
    }
    Ok(())
}

/// What a program in the sandbox meets: one line per restriction.
pub fn check() -> Vec<String> {
    let vsock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Vsock,
        nix::sys::socket::SockType::Stream,
        nix::sys::socket::SockFlag::empty(),
        None,
    );
    let io_uring = io_uring_setup();
    vec![
        format!("io_uring_setup: {}", describe(io_uring)),
        format!("socket(AF_VSOCK): {}", describe(vsock.map(drop))),
    ]
}

fn describe(r: nix::Result<()>) -> String {
    match r {
        Ok(()) => "allowed".into(),
        Err(e) => format!("refused ({})", e.desc()),
    }
}

/// Asks the kernel for a one-entry io_uring and closes it if it came.
#[allow(unsafe_code)]
fn io_uring_setup() -> nix::Result<()> {
    // struct io_uring_params is 120 bytes; zeroed asks for the defaults.
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup(2) reads and writes `params`, a live buffer of
    // the size of struct io_uring_params, and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(nix::errno::Errno::last());
    }
    let _ = nix::unistd::close(fd as i32);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_build_for_this_machine() {
        let f = filters().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|p| !p.is_empty()));
    }
}
