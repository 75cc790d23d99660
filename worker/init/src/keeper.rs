//! The keeper of one operation's processes: a process between the
//! supervisor and the command, with the supervisor's user (root in a
//! sandbox, so no command may signal or trace it), that is the *subreaper*
//! of everything the command starts. A process that leaves the command's
//! session (`setsid`) or its process group, or whose parent dies, is
//! reparented to the keeper, not to PID 1: when the command's main process
//! exits (unless the operation keeps its background), or when the
//! supervisor says so, the keeper kills every descendant it has, down to
//! the last, then exits as the command did. Nothing an operation starts
//! escapes it by leaving its session.
//!
//! The supervisor talks to it with two signals, which only it can send:
//! [`KILL_ALL`] (kill everything now) and [`ENDING`] (the operation is
//! ending: do not leave its background behind when its command exits).
//! The keeper is forked inside the supervisor's `pre_exec` hook (the
//! supervisor is single-threaded, so the fork holds no lock) and never
//! returns there; the command is its child, and execs.

use std::io;

/// Kill every process of the operation now.
pub const KILL_ALL: libc::c_int = libc::SIGUSR1;
/// The operation is ending (timed out, canceled): its background goes
/// with its command, whatever it asked.
pub const ENDING: libc::c_int = libc::SIGUSR2;

/// In the forked child, before exec: makes this process the keeper and
/// forks the command. Returns `Ok` in the command's process only (with
/// every signal blocked: the caller restores the mask); the keeper never
/// returns. An `Err` means no command was forked (the process limit,
/// say): the caller fails the spawn with it.
#[allow(unsafe_code)]
pub fn fork(keep_background: bool) -> io::Result<()> {
    // SAFETY: plain system calls on values owned here, in a process that
    // has a single thread (forked from the single-threaded supervisor).
    unsafe {
        // gVisor lets only PID 1 be a subreaper (EINVAL for any other):
        // there the keeper still kills the command's whole tree, and the
        // supervisor its session and its tag (`procs`), which a process
        // that both leaves the session and is orphaned (to PID 1) still
        // carries.
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0
            && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
        {
            return Err(io::Error::last_os_error());
        }
        // Blocked before the fork, so no word from the supervisor is lost
        // between the fork and the keeper's first wait.
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        match libc::fork() {
            -1 => Err(io::Error::last_os_error()),
            0 => Ok(()),
            command => keep(command, keep_background),
        }
    }
}

/// The keeper's life: reap, and kill when it is time; exit as the command
/// did once nothing of the operation is left (or, keeping its background,
/// once the command itself is gone).
#[allow(unsafe_code)]
fn keep(command: libc::pid_t, mut keep_background: bool) -> ! {
    // SAFETY: as in `fork`: a single thread, system calls on owned values.
    unsafe {
        // Nothing of the command's is held here: its pipes would stay open
        // past its end, and std's exec-error pipe would keep the spawn
        // waiting for the keeper.
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) < 0 {
            for fd in 0..4096 {
                libc::close(fd);
            }
        }
        for sig in [libc::SIGCHLD, KILL_ALL, ENDING] {
            libc::signal(sig, libc::SIG_DFL);
        }
        let mut wanted: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut wanted);
        for sig in [libc::SIGCHLD, KILL_ALL, ENDING] {
            libc::sigaddset(&mut wanted, sig);
        }
        let me = libc::getpid();
        let mut status: Option<libc::c_int> = None;
        let mut killing = false;
        loop {
            // What the supervisor said, before deciding anything.
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            loop {
                match libc::sigtimedwait(&wanted, std::ptr::null_mut(), &zero) {
                    KILL_ALL => killing = true,
                    ENDING => keep_background = false,
                    -1 => break,
                    _ => {}
                }
            }
            let mut any_left = true;
            loop {
                let mut st = 0;
                match libc::waitpid(-1, &mut st, libc::WNOHANG) {
                    0 => break,
                    -1 if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
                    -1 => {
                        any_left = false;
                        break;
                    }
                    pid if pid == command => status = Some(st),
                    _ => {}
                }
            }
            match status {
                Some(st) if !any_left || (keep_background && !killing) => exit_as(st),
                Some(_) => killing = true,
                None => {}
            }
            if killing {
                kill_children(me);
            }
            let wait = libc::timespec {
                tv_sec: if killing { 0 } else { 1 },
                tv_nsec: if killing { 10_000_000 } else { 0 },
            };
            match libc::sigtimedwait(&wanted, std::ptr::null_mut(), &wait) {
                KILL_ALL => killing = true,
                ENDING => keep_background = false,
                _ => {}
            }
        }
    }
}

/// SIGKILL to every descendant of `me`, the whole tree in one round
/// (where the keeper is not a subreaper, what a killed child started goes
/// to PID 1, not here). What is started meanwhile comes to the keeper as
/// its parent dies, and is killed on the next round.
fn kill_children(me: libc::pid_t) {
    for pid in crate::procs::descendants(me) {
        // SAFETY: kill(2) on a pid; a wrong one fails with ESRCH.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Ends the keeper as the command ended: its exit code, or its signal.
#[allow(unsafe_code)]
fn exit_as(status: libc::c_int) -> ! {
    // SAFETY: system calls on owned values; `_exit` ends the process.
    unsafe {
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            // No core of the keeper (it is not dumpable anyway).
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &none);
            libc::signal(sig, libc::SIG_DFL);
            let mut only: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
            libc::_exit(128 + sig);
        }
        libc::_exit(libc::WEXITSTATUS(status))
    }
}
