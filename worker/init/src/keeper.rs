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
//!
//! A command's keeper is a fresh `corral-init --keep` ([`KEEP_FLAG`]),
//! spawned by the supervisor with `posix_spawn` (a vfork: what it costs
//! does not grow with the supervisor's memory, as a fork of it would),
//! told what to run through a memory file ([`Orders`], on [`ORDERS_FD`];
//! never in its arguments or its environment, which anyone may read or
//! which its C library would act on as root). It does the session setup,
//! forks the command from its own small image and says through
//! [`REPORT_FD`] why the command could not start, if it could not (the
//! supervisor waits for that word or for the command's exec). An archive
//! helper's keeper is still forked inside the supervisor's `pre_exec`
//! hook (the helper is the supervisor's own code; the supervisor is
//! single-threaded, so the fork holds no lock).

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

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

/// The argument that makes `corral-init` a command's keeper.
pub const KEEP_FLAG: &str = "--keep";
/// Where a keeper reads its [`Orders`] (a memory file, read to its end).
pub const ORDERS_FD: libc::c_int = 3;
/// Where a keeper (or the command it forked, before its exec) writes the
/// errno that stopped the command from starting, as 4 little-endian
/// bytes; closed without a word once the command runs.
pub const REPORT_FD: libc::c_int = 4;

/// What a keeper starts: the command, where, as whom, in what session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orders {
    pub keep_background: bool,
    /// Descriptor 0 is a terminal that becomes the session's.
    pub terminal: bool,
    /// The command's user (its group too); None: the keeper's own.
    pub uid: Option<u32>,
    /// The supplementary group of the operation (`procs::tag`).
    pub tag: Option<u32>,
    pub workdir: OsString,
    /// Run as it is (an absolute path: no search of PATH).
    pub program: OsString,
    /// After `program` as `argv[0]`.
    pub args: Vec<OsString>,
    /// `NAME=VALUE` each: the command's whole environment.
    pub env: Vec<OsString>,
}

/// The first field of every [`Orders`]: a keeper of another version
/// refuses them rather than guess.
const ORDERS_VERSION: &[u8] = b"corral-keep-1";

impl Orders {
    /// NUL-terminated fields: the version, the flags, uid, tag (empty:
    /// none), workdir, program, the count of args and each, the count of
    /// environment entries and each. Text with a NUL byte cannot be a
    /// program's argument or environment: refused here.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut field = |b: &[u8], what: &str| {
            if b.contains(&0) {
                return Err(format!("the {what} holds a NUL byte"));
            }
            out.extend_from_slice(b);
            out.push(0);
            Ok(())
        };
        let num = |n: Option<u32>| n.map(|n| n.to_string()).unwrap_or_default();
        field(ORDERS_VERSION, "version")?;
        field(if self.keep_background { b"1" } else { b"0" }, "flag")?;
        field(if self.terminal { b"1" } else { b"0" }, "flag")?;
        field(num(self.uid).as_bytes(), "user")?;
        field(num(self.tag).as_bytes(), "tag")?;
        field(self.workdir.as_bytes(), "working directory")?;
        field(self.program.as_bytes(), "program")?;
        field(self.args.len().to_string().as_bytes(), "count")?;
        for a in &self.args {
            field(a.as_bytes(), "command")?;
        }
        field(self.env.len().to_string().as_bytes(), "count")?;
        for e in &self.env {
            field(e.as_bytes(), "environment")?;
        }
        Ok(out)
    }

    /// The orders [`Self::encode`] wrote; anything else is `None`.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let body = bytes.strip_suffix(&[0])?;
        let mut fields = body.split(|b| *b == 0);
        let mut next = || fields.next();
        let flag = |f: &[u8]| match f {
            b"1" => Some(true),
            b"0" => Some(false),
            _ => None,
        };
        let num = |f: &[u8]| -> Option<Option<u32>> {
            if f.is_empty() {
                return Some(None);
            }
            std::str::from_utf8(f).ok()?.parse().ok().map(Some)
        };
        let count = |f: &[u8]| -> Option<usize> { std::str::from_utf8(f).ok()?.parse().ok() };
        let text = |f: &[u8]| OsString::from_vec(f.to_vec());
        if next()? != ORDERS_VERSION {
            return None;
        }
        let keep_background = flag(next()?)?;
        let terminal = flag(next()?)?;
        let uid = num(next()?)?;
        let tag = num(next()?)?;
        let workdir = text(next()?);
        let program = text(next()?);
        let n = count(next()?)?;
        let mut args = Vec::new();
        for _ in 0..n {
            args.push(text(next()?));
        }
        let n = count(next()?)?;
        let mut env = Vec::new();
        for _ in 0..n {
            env.push(text(next()?));
        }
        if next().is_some() {
            return None;
        }
        Some(Self {
            keep_background,
            terminal,
            uid,
            tag,
            workdir,
            program,
            args,
            env,
        })
    }
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Says why the command could not start, and ends this process.
#[allow(unsafe_code)]
fn fail(e: &io::Error) -> ! {
    let errno = e.raw_os_error().unwrap_or(libc::EINVAL).to_le_bytes();
    // SAFETY: write(2) of a local buffer to the report descriptor (gone
    // already: nothing is said, the supervisor sees the exit); `_exit`.
    unsafe {
        libc::write(REPORT_FD, errno.as_ptr().cast(), errno.len());
        libc::_exit(127)
    }
}

/// `corral-init --keep`: reads its orders, becomes the operation's
/// keeper and forks the command, which execs. Never returns; a failure
/// before the command's exec is written to [`REPORT_FD`].
#[allow(unsafe_code)]
pub fn run() -> ! {
    // As the supervisor is: no one traces the keeper or reads its memory.
    let _ = nix::sys::prctl::set_dumpable(false);
    // Named for what it is (exec'd from /proc/self/exe, it would be `exe`).
    let _ = nix::sys::prctl::set_name(c"corral-keeper");
    let orders = {
        use std::io::Read;
        // SAFETY: descriptor 3 is the memory file the supervisor passed,
        // owned by nothing else in this process; closed when dropped.
        let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(ORDERS_FD) };
        let mut bytes = Vec::new();
        match file.read_to_end(&mut bytes) {
            Ok(_) => Orders::decode(&bytes),
            Err(e) => fail(&e),
        }
    };
    let Some(orders) = orders else {
        fail(&io::Error::from_raw_os_error(libc::EINVAL))
    };
    let prepared = (|| -> io::Result<_> {
        let program = c_string(&orders.program)?;
        let mut argv = vec![program.clone()];
        for a in &orders.args {
            argv.push(c_string(a)?);
        }
        let envp = orders
            .env
            .iter()
            .map(|e| c_string(e))
            .collect::<io::Result<Vec<_>>>()?;
        Ok((program, argv, envp, c_string(&orders.workdir)?))
    })();
    let (program, argv, envp, workdir) = prepared.unwrap_or_else(|e| fail(&e));
    let argv_ptrs: Vec<*const libc::c_char> = argv
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp_ptrs: Vec<*const libc::c_char> = envp
        .iter()
        .map(|e| e.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    // SAFETY: system calls on values owned here, in a process with one
    // thread; the pointer arrays end with NULL and outlive the exec.
    unsafe {
        // The command's exec closes the report: its silence says it runs.
        libc::fcntl(REPORT_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        if libc::chdir(workdir.as_ptr()) < 0 {
            fail(&io::Error::last_os_error());
        }
    }
    if let Err(e) = crate::supervisor::session_setup(orders.terminal) {
        fail(&e);
    }
    if let Err(e) = fork(orders.keep_background) {
        fail(&e);
    }
    // The command's process, every signal blocked: first of the OOM
    // killer's choices, not PID 1 (written while still root: a process
    // that changed user cannot write its own proc files; the score is
    // kept across the change and the exec), then set up, then exec (which
    // makes it dumpable again, as its user's).
    let _ = std::fs::write("/proc/self/oom_score_adj", b"1000");
    if let Err(e) = crate::supervisor::command_setup(orders.uid, orders.tag) {
        fail(&e);
    }
    // SAFETY: as above.
    unsafe {
        libc::execve(program.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr());
    }
    fail(&io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn orders() -> Orders {
        Orders {
            keep_background: true,
            terminal: false,
            uid: Some(1000),
            tag: None,
            workdir: "/workspace".into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo é; true".into(), "".into()],
            env: vec!["A=1".into(), "EMPTY=".into()],
        }
    }

    #[test]
    fn orders_come_back_as_they_were_sent() {
        let o = orders();
        assert_eq!(Orders::decode(&o.encode().unwrap()), Some(o));
        let none = Orders {
            args: vec![],
            env: vec![],
            uid: None,
            ..orders()
        };
        assert_eq!(Orders::decode(&none.encode().unwrap()), Some(none));
    }

    #[test]
    fn a_nul_byte_is_refused_and_torn_or_foreign_orders_are_not_read() {
        let bad = Orders {
            args: vec!["-c".into(), "a\0b".into()],
            ..orders()
        };
        assert!(bad.encode().unwrap_err().contains("NUL"));
        let good = orders().encode().unwrap();
        for cut in 0..good.len() {
            assert_eq!(Orders::decode(&good[..cut]), None, "cut at {cut}");
        }
        let mut extra = good.clone();
        extra.extend_from_slice(b"more\0");
        assert_eq!(Orders::decode(&extra), None);
        let foreign = [b"corral-keep-2".as_slice(), &good[ORDERS_VERSION.len()..]].concat();
        assert_eq!(Orders::decode(&foreign), None);
    }
}
