//! The supervisor: one thread, one `poll` loop, no async runtime.
//!
//! It multiplexes the worker's frames on stdin, a signalfd (SIGCHLD and
//! termination signals), and the output pipes of running operations. Output
//! pipes are read only while the worker has granted credit, so a slow
//! consumer back-pressures the commands instead of losing their output.
//! Every event goes into the [`Journal`] first and to stdout second: a
//! worker that was away re-attaches and replays what it missed.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest, OperationRecord, WELCOME_PAGE_BYTES, Welcome};
use corral_proto::{
    EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream, ShellSpec,
    TerminalSize, pb,
};
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal, killpg};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use crate::capture::HeadTail;
use crate::fileops::{self, FileWriter, Roots};
use crate::journal::Journal;
use crate::procs;

/// Time between SIGTERM and SIGKILL when a command times out or is canceled.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// After a command's main process exits, how long its pipes may stay open
/// (held by background children) before the operation ends anyway.
pub const LINGER: Duration = Duration::from_millis(200);
/// After the linger, how long a kept background child may keep a finished
/// command's pipes busy before they are handed to the drain anyway.
const OVERDUE: Duration = Duration::from_secs(1);
/// Finished operations remembered for re-attaching workers.
pub const MAX_FINISHED: usize = 1024;
/// Bytes of finished operations (results and specs) remembered: the
/// supervisor lives in the sandbox's memory budget, so what it keeps is
/// bounded by size as well as by count.
pub const MAX_FINISHED_BYTES: usize = corral_proto::limits::MAX_FINISHED_BYTES;
/// Largest read from an output pipe (and so the largest output event).
const READ_CHUNK: usize = 256 * 1024;
/// Pipe buffer asked for (the unprivileged maximum by default): fewer,
/// larger reads when a command writes fast.
const PIPE_BYTES: i32 = 1 << 20;
/// Input of one operation held here, not yet written on: the worker keeps
/// what it sends within half of it, so a frame past it is refused.
pub const MAX_INPUT_BUFFER: usize = 4 << 20;
/// Most input bytes written to a file in one turn of the loop.
const WRITE_CHUNK: usize = 1 << 20;
/// End of input on a terminal: its EOF character (^D).
const TERMINAL_EOF: u8 = 0x04;
/// How long a reset keeps killing (a fork bomb refills between two kills).
const RESET_FOR: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct Config {
    pub roots: Roots,
    pub kill_grace: Duration,
    pub linger: Duration,
    pub journal_budget_bytes: usize,
    /// See [`MAX_FINISHED_BYTES`].
    pub finished_budget_bytes: usize,
    /// The user (and group) commands run as, when the supervisor runs as
    /// root: then nothing a command does can signal, trace or read the
    /// supervisor. File operations are done with this user's rights too.
    pub command_uid: Option<u32>,
    /// This binary, run (as the command user) for archives in and out.
    pub helper: Option<PathBuf>,
    /// Serve the egress proxy on the sandbox's loopback (see
    /// [`crate::relay`]): the worker mounted its socket.
    pub egress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            roots: Roots::sandbox(),
            kill_grace: KILL_GRACE,
            linger: LINGER,
            journal_budget_bytes: crate::journal::DEFAULT_BUDGET_BYTES,
            finished_budget_bytes: MAX_FINISHED_BYTES,
            command_uid: None,
            helper: std::env::current_exe().ok(),
            egress: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("setting up signals: {0}")]
    Signals(Errno),
    #[error("setting up stdio: {0}")]
    Stdio(io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    TimedOut,
    Canceled,
}

/// An output pipe (or a terminal's master side), read without blocking.
struct Pipe(File);

impl Pipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.read(buf) {
            // A terminal whose last slave closed says EIO: its end.
            Err(e) if e.raw_os_error() == Some(Errno::EIO as i32) => Ok(0),
            other => other,
        }
    }
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// An operation's input: what the worker sent, placed by offset, held
/// until it is written on (a command's stdin or terminal, or a file).
#[derive(Default)]
struct Input {
    pending: VecDeque<Bytes>,
    pending_bytes: usize,
    /// Bytes taken from the worker (the next offset).
    received: u64,
    /// Bytes written on.
    consumed: u64,
    /// The worker said the input ends after what it sent.
    eof: bool,
    /// No more input is taken (written out after `eof`, or the reader is gone).
    closed: bool,
    /// The worker should hear how far the input got.
    ack_due: bool,
    /// A terminal's end-of-file character is queued.
    eof_sent: bool,
}

impl Input {
    fn close(&mut self) {
        if !self.closed {
            self.closed = true;
            self.pending.clear();
            self.pending_bytes = 0;
            self.ack_due = true;
        }
    }

    /// Writes what is pending on `fd` until it would block.
    fn pump(&mut self, fd: &File) {
        while let Some(chunk) = self.pending.front_mut() {
            match (&*fd).write(chunk) {
                Ok(n) => {
                    let _ = chunk.split_to(n);
                    self.pending_bytes -= n;
                    // The terminal's ^D is ours, not the worker's input.
                    self.consumed = (self.consumed + n as u64).min(self.received);
                    self.ack_due = true;
                    if chunk.is_empty() {
                        self.pending.pop_front();
                    }
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    return;
                }
                // The command closed its stdin (EPIPE), or it is gone.
                Err(_) => {
                    self.close();
                    return;
                }
            }
        }
    }
}

struct Running {
    pgid: Pid,
    /// The supplementary group its command and all it starts carry
    /// (`procs::tag`), where the command runs as the sandbox's user.
    tag: Option<u32>,
    started: Instant,
    deadline: Instant,
    ending: Option<Ending>,
    /// Next SIGKILL of the group, once a timeout or cancel began (or its
    /// main process exited, and the background goes with it).
    kill_at: Option<Instant>,
    keep_background: bool,
    pipes: [Option<Pipe>; 2],
    captures: [HeadTail; 2],
    exit: Option<WaitStatus>,
    linger_until: Option<Instant>,
    oom_kills_at_start: Option<u64>,
    /// Where input goes: the stdin pipe, or the terminal's master side.
    stdin: Option<File>,
    input: Option<Input>,
    /// The terminal's master side (for window sizes).
    terminal: Option<File>,
}

/// A file operation that goes on over several turns of the loop.
enum FileTask {
    /// Sends the file as output events, under credit.
    Read {
        file: File,
        left: Option<u64>,
        sent: u64,
        size: u64,
        started: Instant,
    },
    /// Writes the operation's input into the file.
    Write {
        writer: Box<FileWriter>,
        input: Input,
        started: Instant,
    },
}

struct Op {
    /// As the worker sent it, a write's bytes left out (see `data_digest`).
    spec: OperationSpec,
    /// Digest of a write's bytes: a retry must bring the same ones.
    data_digest: u64,
    first_seq: u64,
    running: Option<Box<Running>>,
    file: Option<FileTask>,
    result: Option<OperationResult>,
}

impl Op {
    fn input(&self) -> Option<&Input> {
        match (&self.running, &self.file) {
            (Some(run), _) => run.input.as_ref(),
            (None, Some(FileTask::Write { input, .. })) => Some(input),
            _ => None,
        }
    }

    fn input_mut(&mut self) -> Option<&mut Input> {
        match (&mut self.running, &mut self.file) {
            (Some(run), _) => run.input.as_mut(),
            (None, Some(FileTask::Write { input, .. })) => Some(input),
            _ => None,
        }
    }
}

/// FNV-1a: tells a retried write from a different one.
fn digest(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn spec_digest(spec: &OperationSpec) -> u64 {
    match spec {
        OperationSpec::WriteFile(w) => digest(&w.data),
        _ => 0,
    }
}

const STREAMS: [OutputStream; 2] = [OutputStream::Stdout, OutputStream::Stderr];

pub struct Supervisor {
    config: Config,
    boot_id: String,
    base_env: Vec<(OsString, OsString)>,
    ops: HashMap<OperationId, Op>,
    /// Finished operations, oldest first, with what each one weighs.
    finished: VecDeque<(OperationId, usize)>,
    finished_bytes: usize,
    pids: HashMap<i32, OperationId>,
    journal: Journal,
    credit: u64,
    decoder: FrameDecoder,
    stdin_open: bool,
    out: File,
    out_broken: bool,
    signals: SignalFd,
    shutdown: bool,
    /// Output pipes of finished operations still held open by background
    /// children: drained and discarded, so those children never see EPIPE.
    orphans: Vec<Pipe>,
    /// Commands started so far: the next one's tag.
    launched: u64,
    /// The egress relay, when the sandbox has egress.
    relay: Option<Relay>,
}

/// The egress relay process and the listening socket it serves: bound by
/// the supervisor, so the port stays the relay's across restarts.
struct Relay {
    listener: std::net::TcpListener,
    pid: Option<i32>,
    /// When to start it again after it died (not at once: a relay that
    /// dies at start must not spin).
    restart_at: Option<Instant>,
}

/// How long a dead relay waits before it is started again.
const RELAY_RESTART: Duration = Duration::from_millis(100);

impl Relay {
    fn bind() -> io::Result<Self> {
        Ok(Self {
            listener: std::net::TcpListener::bind(crate::relay::PROXY_ADDR)?,
            pid: None,
            restart_at: Some(Instant::now()),
        })
    }

    /// Starts the relay process if it is due: this binary with
    /// `--egress-relay`, the listener as its descriptor 3, stdout not the
    /// worker's channel.
    #[allow(unsafe_code)]
    fn start_if_due(&mut self, helper: Option<&Path>, now: Instant) {
        if self.pid.is_some() || self.restart_at.is_none_or(|t| now < t) {
            return;
        }
        let Some(helper) = helper else { return };
        let fd = self.listener.as_raw_fd();
        let mut cmd = Command::new(helper);
        cmd.arg("--egress-relay")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: runs in the forked child before exec; the supervisor is
        // single-threaded, and dup2 is async-signal-safe. The copy on fd 3
        // is not close-on-exec: the relay gets the listener, nothing else.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => {
                self.pid = Some(child.id() as i32);
                self.restart_at = None;
            }
            Err(e) => {
                eprintln!("corral-init: starting the egress relay: {e}");
                self.restart_at = Some(now + RELAY_RESTART);
            }
        }
    }

    /// The relay `pid` ended: started again soon.
    fn reaped(&mut self, pid: i32, now: Instant) -> bool {
        if self.pid != Some(pid) {
            return false;
        }
        self.pid = None;
        self.restart_at = Some(now + RELAY_RESTART);
        true
    }
}

/// Most orphaned pipes kept draining; past it the oldest are closed.
const MAX_ORPHAN_PIPES: usize = 256;

/// Runs the supervisor until a termination signal. Returns the exit code.
pub fn run(config: Config) -> Result<i32, InitError> {
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        mask.add(s);
    }
    mask.thread_block().map_err(InitError::Signals)?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(InitError::Signals)?;
    // Processes in the sandbox run as our uid: keep them from ptracing us or
    // opening our stdio through /proc.
    let _ = nix::sys::prctl::set_dumpable(false);
    let stdin = io::stdin();
    set_nonblocking(stdin.as_fd()).map_err(|e| InitError::Stdio(e.into()))?;
    let out = File::from(
        io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .map_err(InitError::Stdio)?,
    );
    let mut sup = Supervisor {
        journal: Journal::new(
            config.journal_budget_bytes,
            crate::journal::DEFAULT_MAX_EVENTS,
        ),
        base_env: base_env(&config.roots.workspace),
        config,
        boot_id: corral_proto::ids::random_uuid(),
        ops: HashMap::new(),
        finished: VecDeque::new(),
        finished_bytes: 0,
        pids: HashMap::new(),
        credit: 0,
        decoder: FrameDecoder::new(),
        stdin_open: true,
        out,
        out_broken: false,
        signals,
        shutdown: false,
        orphans: Vec::new(),
        launched: 0,
        relay: None,
    };
    if sup.config.egress {
        // Bound before any command runs: none can take the port.
        sup.start_relay();
    }
    sup.main_loop();
    Ok(0)
}

fn set_nonblocking(fd: std::os::fd::BorrowedFd<'_>) -> Result<(), Errno> {
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// The environment every command starts from: the container's own (the
/// image's and the sandbox's variables; nothing of the worker's), with
/// defaults that keep tools from waiting on a terminal.
fn base_env(workspace: &Path) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os().collect();
    let mut set = |k: &str, v: &str, force: bool| {
        let present = env.iter().position(|(ek, _)| ek == k);
        match (present, force) {
            (Some(i), true) => env[i].1 = v.into(),
            (None, _) => env.push((k.into(), v.into())),
            (Some(_), false) => {}
        }
    };
    set(
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        false,
    );
    set("HOME", &workspace.to_string_lossy(), false);
    set("LANG", "C.UTF-8", false);
    for (k, v) in [
        ("PAGER", "cat"),
        ("GIT_PAGER", "cat"),
        ("GIT_TERMINAL_PROMPT", "0"),
        ("DEBIAN_FRONTEND", "noninteractive"),
        ("TERM", "dumb"),
    ] {
        set(k, v, true);
    }
    env
}

/// The sandbox's cgroup OOM-kill counter (cgroup v2 or v1), if readable.
/// File operations with the command user's rights (its filesystem uid and
/// gid), for as long as this guard lives.
struct AsCommandUser(Option<u32>);

impl AsCommandUser {
    fn new(uid: Option<u32>) -> Self {
        if let Some(uid) = uid {
            nix::unistd::setfsgid(nix::unistd::Gid::from_raw(uid));
            nix::unistd::setfsuid(nix::unistd::Uid::from_raw(uid));
        }
        Self(uid)
    }
}

impl Drop for AsCommandUser {
    fn drop(&mut self) {
        if self.0.is_some() {
            nix::unistd::setfsuid(nix::unistd::getuid());
            nix::unistd::setfsgid(nix::unistd::getgid());
        }
    }
}

fn oom_kills() -> Option<u64> {
    for path in [
        "/sys/fs/cgroup/memory.events",
        "/sys/fs/cgroup/memory/memory.oom_control",
    ] {
        if let Ok(text) = std::fs::read_to_string(path) {
            for line in text.lines() {
                if let Some(n) = line.strip_prefix("oom_kill ") {
                    return n.trim().parse().ok();
                }
            }
        }
    }
    None
}

/// What a finished operation costs to remember.
fn op_weight(op: &Op) -> usize {
    corral_proto::init::weight(&op.spec, op.result.as_ref())
}

/// What the process of an operation runs: a shell command, or this binary
/// as an archive helper.
struct Launch<'a> {
    program: PathBuf,
    args: Vec<OsString>,
    workdir: Option<&'a str>,
    env: Option<&'a std::collections::BTreeMap<String, String>>,
    stdin: bool,
    terminal: Option<TerminalSize>,
    timeout: Duration,
    /// Bytes of stdout and stderr the result keeps.
    limits: [u64; 2],
    keep_background: bool,
    /// Whether the program switches to the command user itself (an
    /// archive helper, told `--as UID`: it starts as the supervisor's user
    /// and makes itself not dumpable first, so no command of the sandbox
    /// can trace it from its first instruction on any runtime), or is
    /// switched before exec (a command).
    switches_itself: bool,
}

impl<'a> Launch<'a> {
    fn shell(shell: PathBuf, spec: &'a ShellSpec) -> Self {
        Self {
            program: shell,
            args: vec!["-c".into(), spec.command.clone().into()],
            workdir: spec.workdir.as_deref(),
            env: Some(&spec.env),
            stdin: spec.stdin,
            terminal: spec.terminal,
            timeout: spec.timeout(),
            limits: [spec.output_limit(); 2],
            keep_background: spec.keep_background,
            switches_itself: false,
        }
    }
}

fn find_shell(use_bash: bool) -> Result<PathBuf, String> {
    if !use_bash {
        let sh = PathBuf::from("/bin/sh");
        return if sh.exists() {
            Ok(sh)
        } else {
            Err("/bin/sh is not present in this image".into())
        };
    }
    ["/bin/bash", "/usr/bin/bash", "/usr/local/bin/bash"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| "bash is not installed in this image".into())
}

/// Sets a terminal's window size (the kernel tells its foreground
/// process group with SIGWINCH).
#[allow(unsafe_code)]
fn set_window_size(fd: &impl AsRawFd, size: TerminalSize) {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the pointer, which lives
    // for the call.
    unsafe {
        libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws);
    }
}

/// `struct sigaction` as the kernel takes it (x86_64, aarch64).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// In the forked child, before exec, as the keeper to be: a session of
/// the operation's own, on its terminal if it has one (the command, forked
/// from it, is in both).
///
/// Only async-signal-safe calls: setsid, ioctl.
#[allow(unsafe_code)]
fn session_setup(terminal: bool) -> io::Result<()> {
    // SAFETY: plain libc calls; no allocation, no lock.
    unsafe {
        if libc::setsid() < 0 {
            return Err(io::Error::last_os_error());
        }
        if terminal && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// In the command's process, before exec: it starts as on a fresh
/// machine, with no signal blocked and every disposition the default (the
/// supervisor's signalfd mask, the keeper's and ignored signals must not
/// leak), as the command user with its operation's tag (`procs::tag`)
/// as its one supplementary group.
///
/// Only async-signal-safe calls: sigprocmask, rt_sigaction, setgroups,
/// setgid, setuid.
#[allow(unsafe_code)]
fn command_setup(uid: Option<u32>, tag: Option<u32>) -> io::Result<()> {
    // SAFETY: plain libc calls on values owned here; no allocation, no lock.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        // The raw system call: glibc's signal() refuses the real-time
        // signals it keeps for itself, and an ignored one is inherited.
        let default = KernelSigaction {
            handler: libc::SIG_DFL,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    &default as *const KernelSigaction,
                    std::ptr::null_mut::<KernelSigaction>(),
                    8usize,
                );
            }
        }
        if let Some(uid) = uid {
            // The operation's tag as the one supplementary group; where
            // the engine maps too few gids into the sandbox (a user
            // namespace), none, and the keeper alone holds the operation.
            let groups = tag.map_or(0, |t| t as libc::gid_t);
            if (tag.is_none() || libc::setgroups(1, &groups) < 0)
                && libc::setgroups(0, std::ptr::null()) < 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::setgid(uid) < 0 || libc::setuid(uid) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

impl Supervisor {
    fn main_loop(&mut self) {
        let mut buf = vec![0u8; READ_CHUNK];
        while !self.shutdown {
            let now = Instant::now();
            self.reap();
            if let Some(relay) = self.relay.as_mut() {
                relay.start_if_due(self.config.helper.as_deref(), now);
            }
            self.enforce_deadlines(now);
            self.pump_inputs();
            self.stream_files(&mut buf);
            self.finish_ready(now);
            self.send_acks();
            let timeout = self.poll_timeout(Instant::now());

            // Which fds to watch: stdin, signals, (with credit) output
            // pipes, and stdin pipes with input waiting.
            let mut targets: Vec<(OperationId, usize)> = Vec::new();
            let mut writers: Vec<OperationId> = Vec::new();
            let ready: Vec<bool> = {
                let stdin = io::stdin();
                let mut fds = Vec::new();
                if self.stdin_open {
                    fds.push(PollFd::new(stdin.as_fd(), PollFlags::POLLIN));
                }
                fds.push(PollFd::new(self.signals.as_fd(), PollFlags::POLLIN));
                for p in &self.orphans {
                    fds.push(PollFd::new(p.fd(), PollFlags::POLLIN));
                }
                for (id, op) in &self.ops {
                    let Some(run) = &op.running else { continue };
                    if let (Some(fd), Some(input)) = (&run.stdin, &run.input)
                        && !input.pending.is_empty()
                    {
                        fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLOUT));
                        writers.push(id.clone());
                    }
                }
                if self.credit > 0 {
                    for (id, op) in &self.ops {
                        let Some(run) = &op.running else { continue };
                        for (i, pipe) in run.pipes.iter().enumerate() {
                            if let Some(p) = pipe {
                                fds.push(PollFd::new(p.fd(), PollFlags::POLLIN));
                                targets.push((id.clone(), i));
                            }
                        }
                    }
                }
                match poll(&mut fds, timeout) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => {
                        eprintln!("corral-init: poll: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                fds.iter()
                    .map(|f| {
                        f.revents().is_some_and(|r| {
                            r.intersects(
                                PollFlags::POLLIN
                                    | PollFlags::POLLOUT
                                    | PollFlags::POLLHUP
                                    | PollFlags::POLLERR,
                            )
                        })
                    })
                    .collect()
            };
            let mut ready = ready.into_iter();
            if self.stdin_open && ready.next() == Some(true) {
                self.read_stdin(&mut buf);
            }
            if ready.next() == Some(true) {
                self.read_signals();
            }
            let orphans_ready: Vec<bool> = ready.by_ref().take(self.orphans.len()).collect();
            self.drain_orphans(&orphans_ready, &mut buf);
            // Writers became ready: `pump_inputs` at the top of the loop
            // writes on them.
            let _ = ready.by_ref().take(writers.len()).count();
            for ((id, stream), is_ready) in targets.into_iter().zip(ready) {
                if is_ready {
                    self.read_pipe(&id, stream, &mut buf);
                }
            }
        }
        self.kill_everything();
    }

    fn poll_timeout(&self, now: Instant) -> PollTimeout {
        let mut next: Option<Instant> = None;
        for op in self.ops.values() {
            // A file read with credit goes on at once.
            if matches!(op.file, Some(FileTask::Read { .. })) && self.credit > 0 {
                return PollTimeout::ZERO;
            }
            if let Some(FileTask::Write { input, .. }) = &op.file
                && (!input.pending.is_empty() || input.eof)
            {
                return PollTimeout::ZERO;
            }
            let Some(run) = &op.running else { continue };
            // Lingering ends only with credit to read what is left (new
            // credit wakes the loop through stdin).
            let linger = run
                .linger_until
                .filter(|_| self.credit > 0)
                .map(|t| if t <= now { t + OVERDUE } else { t });
            let candidates = [
                run.ending.is_none().then_some(run.deadline),
                run.kill_at,
                linger,
            ];
            for t in candidates.into_iter().flatten() {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        if let Some(t) = self.relay.as_ref().and_then(|r| r.restart_at) {
            next = Some(next.map_or(t, |n| n.min(t)));
        }
        match next {
            None => PollTimeout::NONE,
            Some(t) => {
                let ms = t.saturating_duration_since(now).as_millis() + 1;
                PollTimeout::try_from(ms.min(60_000)).unwrap_or(PollTimeout::MAX)
            }
        }
    }

    fn send(&mut self, msg: InitMessage) {
        if self.out_broken {
            return;
        }
        let bytes = frame::encode(&pb::InitMessage::from(msg));
        if let Err(e) = self.out.write_all(&bytes) {
            // Nobody can read us any more; the journal still has everything.
            eprintln!("corral-init: writing to the worker: {e}");
            self.out_broken = e.kind() == io::ErrorKind::BrokenPipe;
        }
    }

    fn emit(&mut self, id: &OperationId, kind: EventKind) -> u64 {
        let event = self.journal.push(Some(id.clone()), kind);
        let seq = event.seq;
        self.send(InitMessage::Event(event));
        seq
    }

    fn reject(&mut self, operation_id: Option<OperationId>, reason: String) {
        eprintln!("corral-init: rejected frame: {reason}");
        self.send(InitMessage::Rejected {
            operation_id,
            reason,
        });
    }

    fn read_stdin(&mut self, buf: &mut [u8]) {
        loop {
            match nix::unistd::read(io::stdin().as_fd(), buf) {
                Ok(0) => {
                    self.stdin_open = false;
                    break;
                }
                Ok(n) => self.decoder.extend(&buf[..n]),
                Err(Errno::EAGAIN | Errno::EINTR) => break,
                Err(e) => {
                    eprintln!("corral-init: reading stdin: {e}");
                    self.stdin_open = false;
                    break;
                }
            }
        }
        loop {
            match self.decoder.next_message::<pb::InitRequest>() {
                Ok(None) => break,
                Ok(Some(msg)) => match InitRequest::try_from(msg) {
                    Ok(req) => self.handle(req),
                    Err(e) => self.reject(None, format!("invalid request: {e}")),
                },
                Err(e) => self.reject(None, format!("malformed frame: {e}")),
            }
        }
    }

    fn handle(&mut self, req: InitRequest) {
        match req {
            InitRequest::Attach {
                after_seq,
                window_bytes,
                attach,
            } => {
                self.credit = window_bytes;
                self.out_broken = false;
                let operations = self
                    .ops
                    .iter()
                    .map(|(id, op)| OperationRecord {
                        id: id.clone(),
                        spec: op.spec.clone(),
                        result: op.result.clone(),
                        first_seq: op.first_seq,
                        input_bytes: op.input().map_or(0, |i| i.received),
                    })
                    .collect();
                // In pages: what init remembers may exceed one frame.
                for page in Welcome::paged(
                    crate::VERSION,
                    &self.boot_id,
                    self.journal.last_seq(),
                    attach,
                    operations,
                    WELCOME_PAGE_BYTES,
                ) {
                    self.send(InitMessage::Welcome(page));
                }
                for event in self.journal.read_after(after_seq, usize::MAX) {
                    self.send(InitMessage::Event(event));
                }
                // Where every input stands, for the worker's windows.
                for op in self.ops.values_mut() {
                    if let Some(input) = op.input_mut() {
                        input.ack_due = true;
                    }
                }
            }
            InitRequest::Credit { bytes } => {
                self.credit = self.credit.saturating_add(bytes);
            }
            InitRequest::Cancel { operation_id } => self.cancel(&operation_id),
            InitRequest::Signal {
                operation_id,
                signal,
            } => self.signal(&operation_id, signal),
            InitRequest::Run { operation_id, spec } => {
                if let Some(op) = self.ops.get(&operation_id) {
                    if op.spec != spec.without_data() || op.data_digest != spec_digest(&spec) {
                        self.reject(
                            Some(operation_id),
                            "operation id already used with a different spec".into(),
                        );
                    }
                    // Same id, same spec: a retry. It runs at most once.
                    return;
                }
                self.start(operation_id, spec);
            }
            InitRequest::Input {
                operation_id,
                offset,
                data,
                eof,
            } => self.on_input(operation_id, offset, data, eof),
            InitRequest::Resize { operation_id, size } => {
                if let Some(term) = self
                    .ops
                    .get(&operation_id)
                    .and_then(|op| op.running.as_ref())
                    .and_then(|run| run.terminal.as_ref())
                {
                    set_window_size(term, size);
                }
            }
            InitRequest::Reset => {
                let killed = self.reset();
                self.send(InitMessage::ResetDone { killed });
            }
            InitRequest::Egress(e) => {
                let event = self.journal.push(None, EventKind::Egress(e));
                self.send(InitMessage::Event(event));
            }
            // A pool member claimed with egress: its first command comes
            // after this, so none can take the port first either.
            InitRequest::StartRelay => self.start_relay(),
        }
    }

    /// Binds the egress proxy's port, for the relay the loop starts (and
    /// starts again if it dies); nothing if it is bound already.
    fn start_relay(&mut self) {
        if self.relay.is_some() {
            return;
        }
        match Relay::bind() {
            Ok(r) => self.relay = Some(r),
            Err(e) => eprintln!(
                "corral-init: binding the egress proxy on {}: {e}",
                crate::relay::PROXY_ADDR
            ),
        }
    }

    /// Takes input for an operation, placed by offset: what was taken
    /// already is skipped, a gap or an overfull buffer is refused.
    fn on_input(&mut self, id: OperationId, offset: u64, data: Bytes, eof: bool) {
        let Some(op) = self.ops.get_mut(&id) else {
            self.reject(Some(id), "input for an unknown operation".into());
            return;
        };
        let takes = op.spec.takes_input();
        let Some(input) = op.input_mut() else {
            if takes {
                // Finished, or never started: nothing more is taken.
                self.send(InitMessage::InputAck {
                    operation_id: id,
                    received: 0,
                    consumed: 0,
                    closed: true,
                });
            } else {
                self.reject(Some(id), "the operation takes no input".into());
            }
            return;
        };
        input.ack_due = true;
        if input.closed || input.eof {
            return;
        }
        if offset > input.received {
            let reason = format!(
                "input at offset {offset}, but only {} bytes were taken",
                input.received
            );
            self.reject(Some(id), reason);
            return;
        }
        let skip = usize::try_from(input.received - offset).unwrap_or(usize::MAX);
        let data = if skip >= data.len() {
            Bytes::new()
        } else {
            data.slice(skip..)
        };
        if input.pending_bytes + data.len() > MAX_INPUT_BUFFER {
            let reason = format!("input buffer full ({} bytes waiting)", input.pending_bytes);
            self.reject(Some(id), reason);
            return;
        }
        input.received += data.len() as u64;
        input.pending_bytes += data.len();
        if !data.is_empty() {
            input.pending.push_back(data);
        }
        if eof {
            input.eof = true;
        }
    }

    /// Writes waiting input: on stdin pipes and terminals as far as they
    /// take it without blocking, into files a chunk at a time.
    fn pump_inputs(&mut self) {
        let mut finished = Vec::new();
        for (id, op) in &mut self.ops {
            if let Some(run) = op.running.as_mut() {
                let (Some(input), Some(fd)) = (run.input.as_mut(), run.stdin.as_ref()) else {
                    continue;
                };
                if input.closed {
                    continue;
                }
                if input.eof && run.terminal.is_some() && !input.eof_sent {
                    // A terminal gets its end-of-file character (written
                    // like any input); it stays open for the output.
                    input.eof_sent = true;
                    input.pending.push_back(Bytes::from_static(&[TERMINAL_EOF]));
                    input.pending_bytes += 1;
                }
                input.pump(fd);
                if input.eof && input.pending.is_empty() && !input.closed {
                    input.closed = true;
                    input.ack_due = true;
                    if run.terminal.is_none() {
                        run.stdin = None;
                    }
                }
                if input.closed && run.terminal.is_none() {
                    run.stdin = None;
                }
            } else if let Some(FileTask::Write { writer, input, .. }) = op.file.as_mut() {
                let mut budget = WRITE_CHUNK;
                while budget > 0
                    && let Some(chunk) = input.pending.front_mut()
                {
                    let n = chunk.len().min(budget);
                    if let Err(refusal) = writer.write(&chunk[..n]) {
                        finished.push((id.clone(), Some(refusal)));
                        break;
                    }
                    let _ = chunk.split_to(n);
                    if chunk.is_empty() {
                        input.pending.pop_front();
                    }
                    input.pending_bytes -= n;
                    input.consumed += n as u64;
                    input.ack_due = true;
                    budget -= n;
                }
                if input.eof && input.pending.is_empty() {
                    finished.push((id.clone(), None));
                }
            }
        }
        for (id, refusal) in finished {
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            let Some(FileTask::Write {
                writer,
                mut input,
                started,
            }) = op.file.take()
            else {
                continue;
            };
            input.close();
            let mut result = match refusal {
                Some(refusal) => {
                    writer.abort();
                    refusal.into()
                }
                None => writer.finish(),
            };
            result.duration_ms = started.elapsed().as_millis() as u64;
            self.send_ack(&id, &input);
            self.complete(&id, result);
        }
    }

    /// Sends streamed file reads on, a chunk per read within the credit.
    fn stream_files(&mut self, buf: &mut [u8]) {
        let ids: Vec<OperationId> = self
            .ops
            .iter()
            .filter(|(_, op)| matches!(op.file, Some(FileTask::Read { .. })))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if self.credit == 0 {
                return;
            }
            let credit = usize::try_from(self.credit).unwrap_or(usize::MAX);
            let Some(Some(FileTask::Read {
                file, left, sent, ..
            })) = self.ops.get_mut(&id).map(|op| op.file.as_mut())
            else {
                continue;
            };
            let want = buf
                .len()
                .min(credit)
                .min(left.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX)));
            let read = if want == 0 {
                Ok(0)
            } else {
                file.read(&mut buf[..want])
            };
            match read {
                Ok(0) => {
                    let Some(Some(FileTask::Read {
                        sent,
                        size,
                        started,
                        ..
                    })) = self.ops.get_mut(&id).map(|op| op.file.take())
                    else {
                        continue;
                    };
                    let mut result = OperationResult::with_outcome(Outcome::Exited { code: 0 });
                    result.file_size = size;
                    result.bytes_written = sent;
                    result.duration_ms = started.elapsed().as_millis() as u64;
                    self.complete(&id, result);
                }
                Ok(n) => {
                    *sent += n as u64;
                    if let Some(l) = left {
                        *l -= n as u64;
                    }
                    self.credit -= n as u64;
                    let data = Bytes::copy_from_slice(&buf[..n]);
                    self.emit(
                        &id,
                        EventKind::Output {
                            stream: OutputStream::Stdout,
                            data,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if let Some(op) = self.ops.get_mut(&id) {
                        op.file = None;
                    }
                    let result = OperationResult::with_outcome(Outcome::FileError {
                        kind: corral_proto::FileErrorKind::Other,
                        message: format!("reading: {e}"),
                    });
                    self.complete(&id, result);
                }
            }
        }
    }

    fn send_ack(&mut self, id: &OperationId, input: &Input) {
        self.send(InitMessage::InputAck {
            operation_id: id.clone(),
            received: input.received,
            consumed: input.consumed,
            closed: input.closed,
        });
    }

    /// Tells the worker how far each input got, once per turn of the loop.
    fn send_acks(&mut self) {
        let mut acks = Vec::new();
        for (id, op) in &mut self.ops {
            if let Some(input) = op.input_mut()
                && std::mem::take(&mut input.ack_due)
            {
                acks.push(InitMessage::InputAck {
                    operation_id: id.clone(),
                    received: input.received,
                    consumed: input.consumed,
                    closed: input.closed,
                });
            }
        }
        for ack in acks {
            self.send(ack);
        }
    }

    fn cancel(&mut self, id: &OperationId) {
        let grace = self.config.kill_grace;
        let Some(op) = self.ops.get_mut(id) else {
            return;
        };
        if let Some(task) = op.file.take() {
            let started = match task {
                FileTask::Read { started, .. } => started,
                FileTask::Write {
                    writer, started, ..
                } => {
                    writer.abort();
                    started
                }
            };
            let mut result = OperationResult::with_outcome(Outcome::Canceled);
            result.duration_ms = started.elapsed().as_millis() as u64;
            self.complete(id, result);
            return;
        }
        let Some(run) = op.running.as_mut() else {
            return;
        };
        if run.ending.is_some() {
            return;
        }
        run.ending = Some(Ending::Canceled);
        procs::ending(run.pgid, run.exit.is_none());
        let _ = killpg(run.pgid, Signal::SIGTERM);
        run.kill_at = Some(Instant::now() + grace);
    }

    /// Sends `signal` to a running command's process group (a file
    /// operation, or one that ended, takes none).
    fn signal(&mut self, id: &OperationId, signal: i32) {
        let Some(run) = self.ops.get(id).and_then(|op| op.running.as_ref()) else {
            return;
        };
        if let Ok(sig) = Signal::try_from(signal) {
            let _ = killpg(run.pgid, sig);
        }
    }

    /// Kills every process but this one; running operations end as
    /// canceled. Needs no fork, so it works at the process limit. Returns
    /// how many processes there were.
    fn reset(&mut self) -> u32 {
        let ids: Vec<OperationId> = self.ops.keys().cloned().collect();
        for id in &ids {
            if let Some(run) = self.ops.get_mut(id).and_then(|op| op.running.as_mut())
                && run.ending.is_none()
            {
                run.ending = Some(Ending::Canceled);
                run.kill_at = Some(Instant::now());
            }
        }
        for id in &ids {
            if self.ops.get(id).is_some_and(|op| op.file.is_some()) {
                self.cancel(id);
            }
        }
        let me = std::process::id();
        let sessions: Vec<Pid> = self
            .ops
            .values()
            .filter_map(|op| op.running.as_ref().map(|r| r.pgid))
            .collect();
        let before = procs::count(me, &sessions);
        let until = Instant::now() + RESET_FOR;
        loop {
            let alive = if me == 1 {
                // As PID 1: everything in the sandbox but us.
                nix::sys::signal::kill(Pid::from_raw(-1), Signal::SIGKILL).is_ok()
            } else {
                // Outside a sandbox (tests): the operations' sessions only.
                let mut any = false;
                for op in self.ops.values() {
                    if let Some(run) = &op.running {
                        any |= procs::kill_session(run.pgid, run.tag, run.exit.is_none());
                    }
                }
                any
            };
            self.reap();
            if !alive || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        before
    }

    fn start(&mut self, id: OperationId, spec: OperationSpec) {
        let started = Instant::now();
        let mut op = Op {
            spec: spec.without_data(),
            data_digest: spec_digest(&spec),
            first_seq: 0,
            running: None,
            file: None,
            result: None,
        };
        let immediate = match &spec {
            OperationSpec::Shell(_)
            | OperationSpec::PutArchive(_)
            | OperationSpec::GetArchive(_) => None,
            OperationSpec::ReadFile(r) if r.stream => {
                let _as = AsCommandUser::new(self.config.command_uid);
                match fileops::open_read(&self.config.roots, r) {
                    Ok((file, size)) => {
                        op.file = Some(FileTask::Read {
                            file,
                            left: (r.limit > 0).then_some(r.limit),
                            sent: 0,
                            size,
                            started,
                        });
                        None
                    }
                    Err(refusal) => Some(refusal.into()),
                }
            }
            OperationSpec::ReadFile(r) => {
                let _as = AsCommandUser::new(self.config.command_uid);
                Some(fileops::read_file(&self.config.roots, r))
            }
            OperationSpec::WriteFile(w) if w.stream => {
                let _as = AsCommandUser::new(self.config.command_uid);
                let opened = FileWriter::open(&self.config.roots, w, self.config.command_uid)
                    .and_then(|mut writer| match writer.write(&w.data) {
                        Ok(()) => Ok(writer),
                        Err(refusal) => {
                            writer.abort();
                            Err(refusal)
                        }
                    });
                match opened {
                    Ok(writer) => {
                        op.file = Some(FileTask::Write {
                            writer: Box::new(writer),
                            input: Input {
                                ack_due: true,
                                ..Input::default()
                            },
                            started,
                        });
                        None
                    }
                    Err(refusal) => Some(refusal.into()),
                }
            }
            OperationSpec::WriteFile(w) => {
                let _as = AsCommandUser::new(self.config.command_uid);
                Some(fileops::write_file_as(
                    &self.config.roots,
                    w,
                    self.config.command_uid,
                ))
            }
        };
        self.ops.insert(id.clone(), op);
        if let Some(mut result) = immediate {
            result.duration_ms = started.elapsed().as_millis() as u64;
            self.complete(&id, result);
            return;
        }
        let launch = match &spec {
            OperationSpec::Shell(shell) => {
                find_shell(shell.use_bash).map(|sh| Launch::shell(sh, shell))
            }
            OperationSpec::PutArchive(a) => self.archive_helper("--put-archive", &a.path),
            OperationSpec::GetArchive(a) if a.contents => {
                self.archive_helper("--get-contents", &a.path)
            }
            OperationSpec::GetArchive(a) => self.archive_helper("--get-archive", &a.path),
            OperationSpec::ReadFile(_) | OperationSpec::WriteFile(_) => return,
        };
        match launch.and_then(|launch| self.spawn(&launch)) {
            Ok((pid, run)) => {
                self.pids.insert(pid.as_raw(), id.clone());
                let seq = self.emit(
                    &id,
                    EventKind::Started {
                        pid: pid.as_raw() as u32,
                    },
                );
                if let Some(op) = self.ops.get_mut(&id) {
                    op.first_seq = seq;
                    op.running = Some(run);
                }
            }
            Err(reason) => self.complete(
                &id,
                OperationResult::with_outcome(Outcome::SpawnFailed { reason }),
            ),
        }
    }

    /// This binary run as an archive helper (`--put-archive PATH` or
    /// `--get-archive PATH`) with the roots: its stdout carries nothing but
    /// the archive, so none of it is kept in the result.
    fn archive_helper(&self, flag: &str, path: &str) -> Result<Launch<'static>, String> {
        let helper = self
            .config
            .helper
            .clone()
            .ok_or("the supervisor cannot find its own binary")?;
        let mut args: Vec<OsString> = vec![flag.into(), path.into()];
        if let Some(uid) = self.config.command_uid {
            args.extend(["--as".into(), uid.to_string().into()]);
        }
        args.push("--roots".into());
        args.push(self.config.roots.workspace.clone().into_os_string());
        for other in &self.config.roots.others {
            args.push(other.clone().into_os_string());
        }
        let get = flag != "--put-archive";
        Ok(Launch {
            program: helper,
            args,
            workdir: None,
            env: None,
            stdin: !get,
            terminal: None,
            timeout: Duration::from_millis(corral_proto::limits::MAX_TIMEOUT_MS),
            limits: [
                if get {
                    0
                } else {
                    corral_proto::limits::DEFAULT_OUTPUT_LIMIT_BYTES
                },
                corral_proto::limits::DEFAULT_OUTPUT_LIMIT_BYTES,
            ],
            keep_background: false,
            switches_itself: true,
        })
    }

    #[allow(unsafe_code)]
    fn spawn(&mut self, spec: &Launch<'_>) -> Result<(Pid, Box<Running>), String> {
        let shell = &spec.program;
        let workdir = match &spec.workdir {
            Some(w) => self.config.roots.workspace.join(w),
            None => self.config.roots.workspace.clone(),
        };
        if !workdir.is_dir() {
            return Err(format!(
                "working directory {}: no such directory",
                workdir.display()
            ));
        }
        let mut cmd = Command::new(shell);
        cmd.args(&spec.args)
            .env_clear()
            .envs(self.base_env.iter().map(|(k, v)| (k, v)));
        // The pseudo-terminal: the command's stdin, stdout and stderr; the
        // master side stays here for output, input and window sizes.
        let mut master: Option<File> = None;
        if let Some(size) = spec.terminal {
            let ws = nix::pty::Winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(Some(&ws), None).map_err(|e| format!("openpty: {e}"))?;
            let slave = File::from(pty.slave);
            if let Some(uid) = self.config.command_uid {
                // The command's own terminal: it may change its modes.
                let _ = nix::unistd::fchown(
                    &slave,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(uid)),
                );
            }
            let dup = |f: &File| f.try_clone().map_err(|e| format!("terminal: {e}"));
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave))
                .env("TERM", "xterm-256color");
            master = Some(File::from(pty.master));
        } else {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        }
        if let Some(env) = spec.env {
            cmd.envs(env);
        }
        cmd.current_dir(&workdir);
        let terminal = master.is_some();
        let uid = self.config.command_uid.filter(|_| !spec.switches_itself);
        let tag = uid.map(|_| procs::tag(self.launched));
        self.launched += 1;
        let keep_background = spec.keep_background;
        // SAFETY: runs in the forked child before exec. The supervisor is
        // single-threaded, so no lock (allocator included) can be held by
        // another thread at the fork. The child becomes the operation's
        // keeper (see `keeper`), which forks the command and never returns
        // here; the command switches to its user, and makes itself, not
        // PID 1, the first choice of the OOM killer (a process that changed
        // user is not dumpable, and its proc files are not its own until it
        // is again).
        unsafe {
            cmd.pre_exec(move || {
                session_setup(terminal)?;
                crate::keeper::fork(keep_background)?;
                command_setup(uid, tag)?;
                let _ = nix::sys::prctl::set_dumpable(true);
                let _ = std::fs::write("/proc/self/oom_score_adj", b"1000");
                Ok(())
            });
        }
        let oom_kills_at_start = oom_kills();
        let mut child = cmd.spawn().map_err(|e| match e.raw_os_error() {
            Some(libc_eagain) if libc_eagain == Errno::EAGAIN as i32 => {
                format!("{e} (the sandbox's process limit is reached)")
            }
            _ => format!("{}: {e}", shell.display()),
        })?;
        // The child holds the terminal's slave side now; ours are closed
        // with `cmd`.
        drop(cmd);
        let pid = Pid::from_raw(child.id() as i32);
        let (pipes, stdin, input) = match master {
            Some(master) => {
                let clones = master
                    .try_clone()
                    .and_then(|a| Ok((a, master.try_clone()?)));
                let (input_fd, out) = match clones {
                    Ok(c) => c,
                    Err(e) => {
                        // Not tracked, so not left running.
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(format!("terminal: {e}"));
                    }
                };
                (
                    [Some(Pipe(out)), None],
                    Some(input_fd),
                    Some(Input::default()),
                )
            }
            None => {
                let stdout = child
                    .stdout
                    .take()
                    .map(|p| Pipe(File::from(OwnedFd::from(p))));
                let stderr = child
                    .stderr
                    .take()
                    .map(|p| Pipe(File::from(OwnedFd::from(p))));
                let stdin = child.stdin.take().map(|p| File::from(OwnedFd::from(p)));
                let input = stdin.as_ref().map(|_| Input::default());
                ([stdout, stderr], stdin, input)
            }
        };
        for p in pipes.iter().flatten() {
            let _ = set_nonblocking(p.fd());
            let _ = fcntl(p.fd(), FcntlArg::F_SETPIPE_SZ(PIPE_BYTES));
        }
        if let Some(fd) = &stdin {
            let _ = set_nonblocking(fd.as_fd());
        }
        let terminal = match (&spec.terminal, &stdin) {
            (Some(_), Some(fd)) => fd.try_clone().ok(),
            _ => None,
        };
        let started = Instant::now();
        Ok((
            pid,
            Box::new(Running {
                pgid: pid,
                tag,
                started,
                deadline: started + spec.timeout,
                ending: None,
                kill_at: None,
                keep_background: spec.keep_background,
                pipes,
                captures: [HeadTail::new(spec.limits[0]), HeadTail::new(spec.limits[1])],
                exit: None,
                linger_until: None,
                oom_kills_at_start,
                stdin,
                input,
                terminal,
            }),
        ))
    }

    /// Reads what is available on one pipe, within the credit.
    fn read_pipe(&mut self, id: &OperationId, stream: usize, buf: &mut [u8]) {
        let credit = self.credit;
        let Some(run) = self.ops.get_mut(id).and_then(|op| op.running.as_mut()) else {
            return;
        };
        let Some(pipe) = run.pipes[stream].as_mut() else {
            return;
        };
        let want = buf.len().min(usize::try_from(credit).unwrap_or(usize::MAX));
        if want == 0 {
            return;
        }
        match pipe.read(&mut buf[..want]) {
            Ok(0) => run.pipes[stream] = None,
            Ok(n) => {
                run.captures[stream].push(&buf[..n]);
                self.credit -= n as u64;
                let data = Bytes::copy_from_slice(&buf[..n]);
                self.emit(
                    id,
                    EventKind::Output {
                        stream: STREAMS[stream],
                        data,
                    },
                );
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("corral-init: reading output of {id}: {e}");
                run.pipes[stream] = None;
            }
        }
    }

    fn drain_orphans(&mut self, ready: &[bool], buf: &mut [u8]) {
        let mut keep = Vec::with_capacity(self.orphans.len());
        for (mut pipe, is_ready) in std::mem::take(&mut self.orphans)
            .into_iter()
            .zip(ready.iter().copied().chain(std::iter::repeat(false)))
        {
            let open = !is_ready
                || match pipe.read(buf) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => {
                        e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::Interrupted
                    }
                };
            if open {
                keep.push(pipe);
            }
        }
        self.orphans = keep;
    }

    /// A stop request counts only from outside the sandbox: the container
    /// engine's signals come from outside this PID namespace (sender pid
    /// 0), while a command's `kill -TERM 1` names its sender, and the
    /// sandbox may not stop its own supervisor.
    fn read_signals(&mut self) {
        while let Ok(Some(info)) = self.signals.read_signal() {
            match Signal::try_from(info.ssi_signo as i32) {
                Ok(Signal::SIGCHLD) => {}
                // SI_USER with no sender pid: kill(2) from another PID
                // namespace. A sender inside cannot forge it: sigqueue(3)
                // to another process must say SI_QUEUE (a negative code).
                Ok(Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP)
                    if info.ssi_pid == 0 && info.ssi_code == 0 =>
                {
                    self.shutdown = true
                }
                _ => {}
            }
        }
    }

    /// Reaps every exited child: ours, and orphans reparented to PID 1.
    /// When an operation's main process exits, its input closes and, unless
    /// it keeps its background, the rest of its session is killed.
    fn reap(&mut self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    if let Some(relay) = self.relay.as_mut()
                        && relay.reaped(pid.as_raw(), Instant::now())
                    {
                        eprintln!(
                            "corral-init: the egress relay ended ({status:?}); starting it again"
                        );
                        continue;
                    }
                    let Some(id) = self.pids.remove(&pid.as_raw()) else {
                        continue;
                    };
                    let linger = self.config.linger;
                    if let Some(run) = self.ops.get_mut(&id).and_then(|op| op.running.as_mut()) {
                        let now = Instant::now();
                        run.exit = Some(status);
                        run.linger_until = Some(now + linger);
                        if let Some(input) = run.input.as_mut() {
                            input.close();
                        }
                        if run.terminal.is_none() {
                            run.stdin = None;
                        }
                        if !run.keep_background {
                            procs::kill_session(run.pgid, run.tag, false);
                            run.kill_at = Some(now);
                        }
                    }
                }
            }
        }
    }

    fn enforce_deadlines(&mut self, now: Instant) {
        let grace = self.config.kill_grace;
        for op in self.ops.values_mut() {
            let Some(run) = op.running.as_mut() else {
                continue;
            };
            if run.ending.is_none() && run.exit.is_none() && now >= run.deadline {
                run.ending = Some(Ending::TimedOut);
                procs::ending(run.pgid, true);
                let _ = killpg(run.pgid, Signal::SIGTERM);
                run.kill_at = Some(now + grace);
            }
            if run.kill_at.is_some_and(|t| now >= t) {
                // Repeated until the session is gone: a fork bomb may add
                // members between two kills.
                run.kill_at = procs::kill_session(run.pgid, run.tag, run.exit.is_none())
                    .then(|| now + Duration::from_millis(50));
            }
        }
    }

    fn finish_ready(&mut self, now: Instant) {
        let mut done = Vec::new();
        let mut orphaned = Vec::new();
        for (id, op) in &mut self.ops {
            let Some(run) = op.running.as_mut() else {
                continue;
            };
            if run.exit.is_none() {
                continue;
            }
            let lingered = run.linger_until.is_some_and(|t| now >= t);
            // A kept background child that never stops writing would hold
            // the operation forever: past this, its pipes go regardless.
            let overdue = run.linger_until.is_some_and(|t| now >= t + OVERDUE);
            if lingered && self.credit > 0 {
                // Whatever is still buffered was read while we had credit;
                // a pipe with nothing to read now is held by a background
                // child. Stop waiting for it.
                for p in &mut run.pipes {
                    if p.as_ref().is_some_and(|p| {
                        let mut fds = [PollFd::new(p.fd(), PollFlags::POLLIN)];
                        overdue || matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
                    }) && let Some(pipe) = p.take()
                    {
                        orphaned.push(pipe);
                    }
                }
            }
            if run.pipes.iter().all(Option::is_none) {
                done.push(id.clone());
            }
        }
        self.orphans.extend(orphaned);
        if self.orphans.len() > MAX_ORPHAN_PIPES {
            let excess = self.orphans.len() - MAX_ORPHAN_PIPES;
            self.orphans.drain(..excess);
        }
        for id in done {
            let Some(run) = self.ops.get_mut(&id).and_then(|op| op.running.take()) else {
                continue;
            };
            let Running {
                pgid,
                tag,
                started,
                ending,
                captures,
                exit,
                oom_kills_at_start,
                keep_background,
                input,
                ..
            } = *run;
            if ending.is_some() || !keep_background {
                procs::kill_session(pgid, tag, false);
            }
            if let Some(mut input) = input {
                input.close();
                self.send_ack(&id, &input);
            }
            let oomed = || match (oom_kills_at_start, oom_kills()) {
                (Some(a), Some(b)) => b > a,
                _ => false,
            };
            let outcome = match (ending, exit) {
                (Some(Ending::Canceled), _) => Outcome::Canceled,
                (Some(Ending::TimedOut), _) => Outcome::TimedOut,
                (None, Some(WaitStatus::Signaled(_, Signal::SIGKILL, _))) if oomed() => {
                    Outcome::OutOfMemory
                }
                (None, Some(WaitStatus::Exited(_, 137))) if oomed() => Outcome::OutOfMemory,
                (None, Some(WaitStatus::Exited(_, code))) => Outcome::Exited { code },
                (None, Some(WaitStatus::Signaled(_, sig, _))) => {
                    Outcome::Signaled { signal: sig as i32 }
                }
                (None, other) => Outcome::SpawnFailed {
                    reason: format!("unexpected wait status {other:?}"),
                },
            };
            let [out, err] = captures;
            let result = OperationResult {
                outcome,
                stdout: out.finish(),
                stderr: err.finish(),
                duration_ms: started.elapsed().as_millis() as u64,
                ..OperationResult::with_outcome(Outcome::Canceled)
            };
            self.complete(&id, result);
        }
    }

    fn complete(&mut self, id: &OperationId, result: OperationResult) {
        let seq = self.emit(id, EventKind::Finished(Box::new(result.clone())));
        if let Some(op) = self.ops.get_mut(id) {
            if op.first_seq == 0 {
                op.first_seq = seq;
            }
            op.result = Some(result);
        }
        let weight = self.ops.get(id).map_or(0, op_weight);
        self.finished.push_back((id.clone(), weight));
        self.finished_bytes += weight;
        while self.finished.len() > MAX_FINISHED
            || (self.finished_bytes > self.config.finished_budget_bytes && self.finished.len() > 1)
        {
            let Some((old, w)) = self.finished.pop_front() else {
                break;
            };
            self.finished_bytes -= w;
            self.ops.remove(&old);
        }
    }

    fn kill_everything(&mut self) {
        for op in self.ops.values_mut() {
            if let Some(run) = &op.running {
                procs::kill_session(run.pgid, run.tag, run.exit.is_none());
            }
            if let Some(FileTask::Write { writer, .. }) = op.file.take() {
                writer.abort();
            }
        }
        // As PID 1, everything else in the sandbox too (never outside one:
        // kill(-1) would reach every process of this user).
        if std::process::id() == 1 {
            let _ = nix::sys::signal::kill(Pid::from_raw(-1), Signal::SIGKILL);
        }
    }
}
