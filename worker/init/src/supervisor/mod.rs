//! The supervisor: one thread, one `poll` loop, no async runtime. Its rooms:
//! this one (the loop, the worker's requests, the egress relay), [`launch`]
//! (starting operations), [`input`] (what goes into them) and [`ending`]
//! (how they end).
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
use corral_proto::init::{
    InitMessage, InitRequest, OperationRecord, RejectKind, WELCOME_PAGE_BYTES, Welcome,
};
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

mod ending;
mod input;
mod launch;

use launch::set_window_size;
pub(crate) use launch::{command_setup, session_setup};

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
    /// Where commands start when they name no directory, and what a
    /// relative one is taken from: the image's WORKDIR, as the container
    /// started in it (`None`: the workspace).
    pub workdir: Option<PathBuf>,
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
            workdir: None,
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
    /// The ingress relay, once the worker asked for it.
    ingress: Option<Relay>,
}

/// The egress relay process and the listening socket it serves: bound by
/// the supervisor, so the port stays the relay's across restarts.
struct Relay {
    /// The egress relay's listener; none for the ingress relay.
    listener: Option<std::net::TcpListener>,
    /// The ingress relay's secret (the worker's), passed to it alone.
    secret: Vec<u8>,
    pid: Option<i32>,
    /// When to start it again after it died (not at once: a relay that
    /// dies at start must not spin).
    restart_at: Option<Instant>,
}

/// How long a dead relay waits before it is started again.
const RELAY_RESTART: Duration = Duration::from_millis(100);

impl Relay {
    fn bind() -> io::Result<Self> {
        let listener = std::net::TcpListener::bind(crate::relay::PROXY_ADDR)?;
        crate::relay::loopback_congestion(&listener);
        Ok(Self {
            listener: Some(listener),
            secret: Vec::new(),
            pid: None,
            restart_at: Some(Instant::now()),
        })
    }

    /// The ingress relay, to be started now, with `secret`.
    fn ingress(secret: Vec<u8>) -> Self {
        Self {
            listener: None,
            secret,
            pid: None,
            restart_at: Some(Instant::now()),
        }
    }

    fn name(&self) -> &'static str {
        if self.listener.is_some() {
            "egress"
        } else {
            "ingress"
        }
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
        let mut cmd = Command::new(helper);
        cmd.arg(format!("--{}-relay", self.name()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if self.listener.is_none() {
            let hex: String = self.secret.iter().map(|b| format!("{b:02x}")).collect();
            cmd.env(crate::ingress::SECRET_ENV, hex);
        }
        if let Some(listener) = &self.listener {
            let fd = listener.as_raw_fd();
            // SAFETY: runs in the forked child before exec; the supervisor
            // is single-threaded, and dup2 is async-signal-safe. The copy
            // on fd 3 is not close-on-exec: the relay gets the listener,
            // nothing else.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        match cmd.spawn() {
            Ok(child) => {
                self.pid = Some(child.id() as i32);
                self.restart_at = None;
            }
            Err(e) => {
                eprintln!("corral-init: starting the {} relay: {e}", self.name());
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
        ingress: None,
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

impl Supervisor {
    fn main_loop(&mut self) {
        let mut buf = vec![0u8; READ_CHUNK];
        while !self.shutdown {
            let now = Instant::now();
            self.reap();
            for relay in [self.relay.as_mut(), self.ingress.as_mut()]
                .into_iter()
                .flatten()
            {
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
        for t in [&self.relay, &self.ingress]
            .into_iter()
            .filter_map(|r| r.as_ref().and_then(|r| r.restart_at))
        {
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

    fn reject(&mut self, operation_id: Option<OperationId>, kind: RejectKind, reason: String) {
        eprintln!("corral-init: rejected frame: {reason}");
        self.send(InitMessage::Rejected {
            operation_id,
            kind,
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
                    Err(e) => {
                        self.reject(None, RejectKind::Malformed, format!("invalid request: {e}"))
                    }
                },
                Err(e) => self.reject(None, RejectKind::Malformed, format!("malformed frame: {e}")),
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
                            RejectKind::IdReused,
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
            InitRequest::Port(e) => {
                let event = self.journal.push(None, EventKind::Port(e));
                self.send(InitMessage::Event(event));
            }
            // A pool member claimed with egress: its first command comes
            // after this, so none can take the port first either.
            InitRequest::StartRelay => self.start_relay(),
            // The worker bound its socket first.
            // A new secret (the worker's restarted, say): the relay that
            // runs keeps its connection until it ends, then starts with it.
            InitRequest::StartIngress { secret } => match self.ingress.as_mut() {
                Some(r) => r.secret = secret,
                None => self.ingress = Some(Relay::ingress(secret)),
            },
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
}
