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
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStderr, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest, OperationRecord, Welcome};
use corral_proto::{
    EventKind, OperationId, OperationResult, OperationSpec, Outcome, OutputStream, ShellSpec, pb,
};
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal, killpg};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use crate::capture::HeadTail;
use crate::fileops::{self, Roots};
use crate::journal::Journal;

/// Time between SIGTERM and SIGKILL when a command times out or is canceled.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// After a command's main process exits, how long its pipes may stay open
/// (held by background children) before the operation ends anyway.
pub const LINGER: Duration = Duration::from_millis(200);
/// Finished operations remembered for re-attaching workers.
pub const MAX_FINISHED: usize = 1024;
/// Bytes of finished operations (results and specs) remembered: the
/// supervisor lives in the sandbox's memory budget, so what it keeps is
/// bounded by size as well as by count.
pub const MAX_FINISHED_BYTES: usize = 64 << 20;
/// Largest read from an output pipe (and so the largest output event).
const READ_CHUNK: usize = 256 * 1024;
/// Pipe buffer asked for (the unprivileged maximum by default): fewer,
/// larger reads when a command writes fast.
const PIPE_BYTES: i32 = 1 << 20;

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

enum Pipe {
    Out(ChildStdout),
    Err(ChildStderr),
}

impl Pipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Pipe::Out(p) => p.read(buf),
            Pipe::Err(p) => p.read(buf),
        }
    }
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Pipe::Out(p) => p.as_fd(),
            Pipe::Err(p) => p.as_fd(),
        }
    }
}

struct Running {
    pgid: Pid,
    started: Instant,
    deadline: Instant,
    ending: Option<Ending>,
    /// Next SIGKILL of the group, once a timeout or cancel began.
    kill_at: Option<Instant>,
    pipes: [Option<Pipe>; 2],
    captures: [HeadTail; 2],
    exit: Option<WaitStatus>,
    linger_until: Option<Instant>,
    oom_kills_at_start: Option<u64>,
}

struct Op {
    spec: OperationSpec,
    first_seq: u64,
    running: Option<Box<Running>>,
    result: Option<OperationResult>,
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
    };
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
    let spec = match &op.spec {
        OperationSpec::Shell(s) => s.command.len(),
        OperationSpec::ReadFile(r) => r.path.len(),
        OperationSpec::WriteFile(w) => w.path.len() + w.data.len(),
    };
    let result = op.result.as_ref().map_or(0, |r| {
        r.stdout.head.len()
            + r.stdout.tail.len()
            + r.stderr.head.len()
            + r.stderr.tail.len()
            + r.file_data.len()
    });
    256 + spec + result
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

impl Supervisor {
    fn main_loop(&mut self) {
        let mut buf = vec![0u8; READ_CHUNK];
        while !self.shutdown {
            let now = Instant::now();
            self.reap();
            self.enforce_deadlines(now);
            self.finish_ready(now);
            let timeout = self.poll_timeout(Instant::now());

            // Which fds to watch: stdin, signals, and (with credit) pipes.
            let mut targets: Vec<(OperationId, usize)> = Vec::new();
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
                                PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR,
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
            let Some(run) = &op.running else { continue };
            let candidates = [
                run.ending.is_none().then_some(run.deadline),
                run.kill_at,
                run.linger_until,
            ];
            for t in candidates.into_iter().flatten() {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
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
                    })
                    .collect();
                self.send(InitMessage::Welcome(Welcome {
                    version: crate::VERSION.into(),
                    boot_id: self.boot_id.clone(),
                    last_seq: self.journal.last_seq(),
                    operations,
                }));
                for event in self.journal.read_after(after_seq, usize::MAX) {
                    self.send(InitMessage::Event(event));
                }
            }
            InitRequest::Credit { bytes } => {
                self.credit = self.credit.saturating_add(bytes);
            }
            InitRequest::Cancel { operation_id } => self.cancel(&operation_id),
            InitRequest::Run { operation_id, spec } => {
                if let Some(op) = self.ops.get(&operation_id) {
                    if op.spec != spec {
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
        }
    }

    fn cancel(&mut self, id: &OperationId) {
        let grace = self.config.kill_grace;
        let Some(run) = self.ops.get_mut(id).and_then(|op| op.running.as_mut()) else {
            return;
        };
        if run.ending.is_some() {
            return;
        }
        run.ending = Some(Ending::Canceled);
        let _ = killpg(run.pgid, Signal::SIGTERM);
        run.kill_at = Some(Instant::now() + grace);
    }

    fn start(&mut self, id: OperationId, spec: OperationSpec) {
        let started = Instant::now();
        let immediate = match &spec {
            OperationSpec::Shell(_) => None,
            OperationSpec::ReadFile(r) => {
                let _as = AsCommandUser::new(self.config.command_uid);
                Some(fileops::read_file(&self.config.roots, r))
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
        self.ops.insert(
            id.clone(),
            Op {
                spec: spec.clone(),
                first_seq: 0,
                running: None,
                result: None,
            },
        );
        if let Some(mut result) = immediate {
            result.duration_ms = started.elapsed().as_millis() as u64;
            self.complete(&id, result);
            return;
        }
        let OperationSpec::Shell(shell) = spec else {
            return;
        };
        match self.spawn(&shell) {
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

    #[allow(unsafe_code)]
    fn spawn(&self, spec: &ShellSpec) -> Result<(Pid, Box<Running>), String> {
        let shell = find_shell(spec.use_bash)?;
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
        let mut cmd = Command::new(&shell);
        cmd.arg("-c")
            .arg(&spec.command)
            .env_clear()
            .envs(self.base_env.iter().map(|(k, v)| (k, v)))
            .envs(&spec.env)
            .current_dir(&workdir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if let Some(uid) = self.config.command_uid {
            // std drops the supplementary groups too (setgroups before setuid).
            cmd.uid(uid).gid(uid);
        }
        // SAFETY: runs in the forked child before exec (after the switch to
        // the command's user). The supervisor is single-threaded, so no lock
        // (allocator included) can be held by another thread at the fork;
        // the closure makes one prctl and writes one proc file. It makes the
        // command, not PID 1, the first choice of the OOM killer (a process
        // that changed user is not dumpable, and its proc files are not its
        // own until it is again).
        unsafe {
            cmd.pre_exec(|| {
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
        let pid = Pid::from_raw(child.id() as i32);
        let stdout = child.stdout.take().map(Pipe::Out);
        let stderr = child.stderr.take().map(Pipe::Err);
        for p in [&stdout, &stderr].into_iter().flatten() {
            let _ = set_nonblocking(p.fd());
            let _ = fcntl(p.fd(), FcntlArg::F_SETPIPE_SZ(PIPE_BYTES));
        }
        let started = Instant::now();
        let limit = spec.output_limit();
        Ok((
            pid,
            Box::new(Running {
                pgid: pid,
                started,
                deadline: started + spec.timeout(),
                ending: None,
                kill_at: None,
                pipes: [stdout, stderr],
                captures: [HeadTail::new(limit), HeadTail::new(limit)],
                exit: None,
                linger_until: None,
                oom_kills_at_start,
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
    fn reap(&mut self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    let Some(id) = self.pids.remove(&pid.as_raw()) else {
                        continue;
                    };
                    let linger = self.config.linger;
                    if let Some(run) = self.ops.get_mut(&id).and_then(|op| op.running.as_mut()) {
                        run.exit = Some(status);
                        run.linger_until = Some(Instant::now() + linger);
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
            if run.ending.is_none() && now >= run.deadline {
                run.ending = Some(Ending::TimedOut);
                let _ = killpg(run.pgid, Signal::SIGTERM);
                run.kill_at = Some(now + grace);
            }
            if run.kill_at.is_some_and(|t| now >= t) {
                // Repeated until the group is gone: a fork bomb may add
                // members between two kills.
                match killpg(run.pgid, Signal::SIGKILL) {
                    Err(Errno::ESRCH) => run.kill_at = None,
                    _ => run.kill_at = Some(now + Duration::from_millis(50)),
                }
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
            if lingered && self.credit > 0 {
                // Whatever is still buffered was read while we had credit;
                // a pipe with nothing to read now is held by a background
                // child. Stop waiting for it.
                for p in &mut run.pipes {
                    if p.as_ref().is_some_and(|p| {
                        let mut fds = [PollFd::new(p.fd(), PollFlags::POLLIN)];
                        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
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
                started,
                ending,
                captures,
                exit,
                oom_kills_at_start,
                ..
            } = *run;
            if ending.is_some() {
                let _ = killpg(pgid, Signal::SIGKILL);
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
        for op in self.ops.values() {
            if let Some(run) = &op.running {
                let _ = killpg(run.pgid, Signal::SIGKILL);
            }
        }
        // As PID 1, everything else in the sandbox too (never outside one:
        // kill(-1) would reach every process of this user).
        if std::process::id() == 1 {
            let _ = nix::sys::signal::kill(Pid::from_raw(-1), Signal::SIGKILL);
        }
    }
}
