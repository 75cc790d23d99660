//! Starting an operation: its process (a shell command, or an archive
//! helper forked from the supervisor) in a session and process group of
//! its own, as the command user, with its pipes or terminal.

use super::*;
use crate::archive::HelperKind;

/// What the process of an operation runs: a shell command, or an archive
/// helper.
pub(super) struct Launch<'a> {
    pub(super) program: PathBuf,
    pub(super) args: Vec<OsString>,
    pub(super) workdir: Option<&'a str>,
    pub(super) env: Option<&'a std::collections::BTreeMap<String, String>>,
    pub(super) stdin: bool,
    pub(super) terminal: Option<TerminalSize>,
    pub(super) timeout: Duration,
    /// Bytes of stdout and stderr the result keeps.
    pub(super) limits: [u64; 2],
    pub(super) keep_background: bool,
    /// An archive helper's work, done in the forked process itself, which
    /// never execs (see [`crate::archive::Helper::run_forked`]) and
    /// switches to the command user itself; `program` is then never run.
    /// None: a command, switched to its user before exec.
    pub(super) helper: Option<crate::archive::Helper>,
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
            helper: None,
        }
    }
}

pub(super) fn find_shell(use_bash: bool) -> Result<PathBuf, String> {
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
pub(super) fn set_window_size(fd: &impl AsRawFd, size: TerminalSize) {
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
pub(super) struct KernelSigaction {
    pub(super) handler: libc::sighandler_t,
    pub(super) flags: libc::c_ulong,
    pub(super) restorer: usize,
    pub(super) mask: u64,
}

/// In the forked child, before exec, as the keeper to be: a session of
/// the operation's own, on its terminal if it has one (the command, forked
/// from it, is in both).
///
/// Only async-signal-safe calls: setsid, ioctl.
#[allow(unsafe_code)]
pub(crate) fn session_setup(terminal: bool) -> io::Result<()> {
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
pub(crate) fn command_setup(uid: Option<u32>, tag: Option<u32>) -> io::Result<()> {
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
    pub(super) fn start(&mut self, id: OperationId, spec: OperationSpec) {
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
            OperationSpec::Shell(_) | OperationSpec::PutArchive(_) => None,
            // A tree that is not there is said as such (a client's 404),
            // not as a helper's failure.
            OperationSpec::GetArchive(a) => {
                let _as = AsCommandUser::new(self.config.command_uid);
                fileops::must_exist(&self.config.roots, &a.path)
                    .err()
                    .map(OperationResult::from)
            }
            OperationSpec::ListDir(a) => {
                let _as = AsCommandUser::new(self.config.command_uid);
                match crate::listing::into_memory(&self.config.roots, &a.path) {
                    Ok((file, size)) => {
                        op.file = Some(FileTask::Read {
                            file,
                            left: None,
                            sent: 0,
                            size,
                            started,
                        });
                        None
                    }
                    Err(failed) => Some(OperationResult::with_outcome(Outcome::FileError {
                        kind: failed.kind,
                        message: failed.message,
                    })),
                }
            }
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
            OperationSpec::PutArchive(a) => Ok(self.archive_helper(HelperKind::Put, &a.path)),
            OperationSpec::GetArchive(a) if a.contents => {
                Ok(self.archive_helper(HelperKind::GetContents, &a.path))
            }
            OperationSpec::GetArchive(a) => Ok(self.archive_helper(HelperKind::Get, &a.path)),
            OperationSpec::ReadFile(_)
            | OperationSpec::WriteFile(_)
            | OperationSpec::ListDir(_) => {
                return;
            }
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

    /// An archive helper (see [`crate::archive::Helper`]) with the roots:
    /// its stdout carries nothing but the archive, so none of it is kept in
    /// the result.
    pub(super) fn archive_helper(&self, kind: HelperKind, path: &str) -> Launch<'static> {
        let get = kind != HelperKind::Put;
        Launch {
            // Never run: the forked process does the work and exits (were
            // an exec ever reached, /dev/null runs nothing).
            program: PathBuf::from("/dev/null"),
            args: Vec::new(),
            // Not where commands start: a sandbox that removed its WORKDIR
            // still gets its files moved and listed.
            workdir: Some("/"),
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
            helper: Some(crate::archive::Helper {
                kind,
                path: path.to_owned(),
                uid: self.config.command_uid,
                roots: self.config.roots.clone(),
            }),
        }
    }

    #[allow(unsafe_code)]
    pub(super) fn spawn(&mut self, spec: &Launch<'_>) -> Result<(Pid, Box<Running>), String> {
        let shell = &spec.program;
        let start = self
            .config
            .workdir
            .as_ref()
            .unwrap_or(&self.config.roots.workspace);
        let workdir = match &spec.workdir {
            Some(w) => start.join(w),
            None => start.clone(),
        };
        if !workdir.is_dir() {
            return Err(format!(
                "working directory {}: no such directory",
                workdir.display()
            ));
        }
        // The command's descriptors 0, 1 and 2, and the sides kept here:
        // a pseudo-terminal (its master side stays here for output, input
        // and window sizes), or pipes (stdin from /dev/null unless asked).
        let cloexec = OFlag::O_CLOEXEC;
        let pipe = || nix::unistd::pipe2(cloexec).map_err(|e| format!("pipe: {e}"));
        let (child_io, kept): ([OwnedFd; 3], Kept) = if let Some(size) = spec.terminal {
            let ws = nix::pty::Winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(Some(&ws), None).map_err(|e| format!("openpty: {e}"))?;
            for fd in [&pty.master, &pty.slave] {
                let _ = fcntl(fd, FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
            }
            if let Some(uid) = self.config.command_uid {
                // The command's own terminal: it may change its modes.
                let _ = nix::unistd::fchown(
                    &pty.slave,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(uid)),
                );
            }
            let dup = |f: &OwnedFd| f.try_clone().map_err(|e| format!("terminal: {e}"));
            (
                [dup(&pty.slave)?, dup(&pty.slave)?, pty.slave],
                Kept::Terminal(File::from(pty.master)),
            )
        } else {
            let (child_in, stdin) = if spec.stdin {
                let (r, w) = pipe()?;
                (r, Some(File::from(w)))
            } else {
                let null = nix::fcntl::open(
                    "/dev/null",
                    OFlag::O_RDWR | cloexec,
                    nix::sys::stat::Mode::empty(),
                )
                .map_err(|e| format!("/dev/null: {e}"))?;
                (null, None)
            };
            let (out_r, out_w) = pipe()?;
            let (err_r, err_w) = pipe()?;
            (
                [child_in, out_w, err_w],
                Kept::Pipes {
                    stdin,
                    out: [Pipe(File::from(out_r)), Pipe(File::from(err_r))],
                },
            )
        };
        let terminal = matches!(kept, Kept::Terminal(_));
        let uid = self.config.command_uid.filter(|_| spec.helper.is_none());
        let helper = spec.helper.clone();
        let tag = uid.map(|_| procs::tag(self.launched));
        self.launched += 1;
        let keep_background = spec.keep_background;
        let oom_kills_at_start = oom_kills();
        let spawned = match helper {
            None => {
                let mut env: std::collections::BTreeMap<&std::ffi::OsStr, &std::ffi::OsStr> = self
                    .base_env
                    .iter()
                    .map(|(k, v)| (k.as_ref(), v.as_ref()))
                    .collect();
                if terminal {
                    env.insert("TERM".as_ref(), "xterm-256color".as_ref());
                }
                for (k, v) in spec.env.into_iter().flatten() {
                    env.insert(k.as_ref(), v.as_ref());
                }
                let orders = crate::keeper::Orders {
                    keep_background,
                    terminal,
                    uid,
                    tag,
                    workdir: workdir.into_os_string(),
                    program: shell.clone().into_os_string(),
                    args: spec.args.clone(),
                    env: env
                        .into_iter()
                        .map(|(k, v)| {
                            let mut e = k.to_os_string();
                            e.push("=");
                            e.push(v);
                            e
                        })
                        .collect(),
                };
                let orders = orders
                    .encode()
                    .map_err(|e| format!("{}: {e}", shell.display()))?;
                spawn_keeper(&orders, &child_io, tag)
            }
            Some(helper) => {
                let mut cmd = Command::new(shell);
                let [i, o, e] = child_io;
                cmd.env_clear()
                    .envs(self.base_env.iter().map(|(k, v)| (k, v)))
                    .current_dir(&workdir)
                    .stdin(Stdio::from(i))
                    .stdout(Stdio::from(o))
                    .stderr(Stdio::from(e));
                // SAFETY: runs in the forked child before exec. The
                // supervisor is single-threaded, so no lock (allocator
                // included) can be held by another thread at the fork. The
                // child becomes the operation's keeper (see `keeper`),
                // which forks the helper and never returns here; the
                // helper makes itself, not PID 1, the first choice of the
                // OOM killer, does its work here and exits (not dumpable,
                // as the supervisor it was forked from).
                unsafe {
                    cmd.pre_exec(move || {
                        session_setup(false)?;
                        crate::keeper::fork(keep_background)?;
                        command_setup(None, None)?;
                        let _ = std::fs::write("/proc/self/oom_score_adj", b"1000");
                        helper.run_forked()
                    });
                }
                // The child's descriptors are closed here with `cmd`.
                cmd.spawn().map(|c| c.id() as libc::pid_t)
            }
        };
        let pid = spawned.map_err(|e| match e.raw_os_error() {
            Some(libc_eagain) if libc_eagain == Errno::EAGAIN as i32 => {
                format!("{e} (the sandbox's process limit is reached)")
            }
            _ => format!("{}: {e}", shell.display()),
        })?;
        let pid = Pid::from_raw(pid);
        let (pipes, stdin, input) = match kept {
            Kept::Terminal(master) => {
                let clones = master
                    .try_clone()
                    .and_then(|a| Ok((a, master.try_clone()?)));
                let (input_fd, out) = match clones {
                    Ok(c) => c,
                    Err(e) => {
                        // Not tracked, so not left running: the keeper
                        // kills its command, and whatever it started.
                        procs::kill_session(pid, tag, true);
                        return Err(format!("terminal: {e}"));
                    }
                };
                (
                    [Some(Pipe(out)), None],
                    Some(input_fd),
                    Some(Input::default()),
                )
            }
            Kept::Pipes { stdin, out: [o, e] } => {
                let input = stdin.as_ref().map(|_| Input::default());
                ([Some(o), Some(e)], stdin, input)
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
}

/// The sides of an operation's descriptors the supervisor keeps.
enum Kept {
    /// The terminal's master side.
    Terminal(File),
    /// The write side of stdin (when asked for), the read sides of stdout
    /// and stderr.
    Pipes { stdin: Option<File>, out: [Pipe; 2] },
}

/// How long a keeper may take to say whether its command runs.
const KEEPER_PATIENCE: Duration = Duration::from_secs(10);

/// Starts `corral-init --keep` with `orders` (see [`crate::keeper`]) and
/// `stdio` as its descriptors 0, 1 and 2, by `posix_spawn` (a vfork: the
/// supervisor's memory is not copied), every signal blocked and at its
/// default; returns once the command has exec'd, or with the errno that
/// stopped it (the keeper then exits on its own, and is reaped as any
/// other child), or, past [`KEEPER_PATIENCE`], with the operation (`tag`)
/// killed.
#[allow(unsafe_code)]
fn spawn_keeper(orders: &[u8], stdio: &[OwnedFd; 3], tag: Option<u32>) -> io::Result<libc::pid_t> {
    let memfd =
        nix::sys::memfd::memfd_create(c"corral-keep", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let mut file = File::from(memfd);
    file.write_all(orders)?;
    io::Seek::seek(&mut file, io::SeekFrom::Start(0))?;
    let (report, report_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    // Each source above every target, so that no dup2 overwrites a
    // source not yet duplicated.
    let high = |fd: &dyn AsFd| -> io::Result<OwnedFd> {
        Ok(fcntl(fd.as_fd(), FcntlArg::F_DUPFD_CLOEXEC(10)).map(|fd| {
            // SAFETY: fcntl returned a new descriptor, owned by no one.
            unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
        })?)
    };
    let sources = [
        high(&stdio[0])?,
        high(&stdio[1])?,
        high(&stdio[2])?,
        high(&file)?,
        high(&report_w)?,
    ];
    drop(report_w);
    let targets = [0, 1, 2, crate::keeper::ORDERS_FD, crate::keeper::REPORT_FD];
    let argv = [
        c"corral-init".as_ptr(),
        c"--keep".as_ptr(),
        std::ptr::null(),
    ];
    let envp = [std::ptr::null::<libc::c_char>()];
    let mut pid: libc::pid_t = 0;
    // SAFETY: the file actions and attributes are initialised before use
    // and destroyed after; every pointer passed lives past the call, and
    // both arrays end with NULL.
    let rc = unsafe {
        let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        libc::posix_spawn_file_actions_init(&mut actions);
        libc::posix_spawnattr_init(&mut attr);
        let mut rc = 0;
        for (from, to) in sources.iter().zip(targets) {
            if rc == 0 {
                rc = libc::posix_spawn_file_actions_adddup2(&mut actions, from.as_raw_fd(), to);
            }
        }
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        if rc == 0 {
            rc = libc::posix_spawnattr_setsigmask(&mut attr, &all);
        }
        if rc == 0 {
            rc = libc::posix_spawnattr_setsigdefault(&mut attr, &all);
        }
        if rc == 0 {
            rc = libc::posix_spawnattr_setflags(
                &mut attr,
                (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short,
            );
        }
        if rc == 0 {
            rc = libc::posix_spawn(
                &mut pid,
                c"/proc/self/exe".as_ptr(),
                &actions,
                &attr,
                argv.as_ptr().cast(),
                envp.as_ptr().cast(),
            );
        }
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::posix_spawnattr_destroy(&mut attr);
        rc
    };
    drop(sources);
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    // The keeper's word: none (the command runs) or an errno; waited for
    // a bounded time (a process of the command's user could stop the
    // command before its exec, which holds the report open).
    let mut report = File::from(report);
    let mut word = Vec::with_capacity(4);
    let deadline = Instant::now() + KEEPER_PATIENCE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fds = [PollFd::new(report.as_fd(), PollFlags::POLLIN)];
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) if left.is_zero() => {
                let pid = Pid::from_raw(pid);
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                procs::kill_session(pid, tag, false);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the command did not start within {} s",
                        KEEPER_PATIENCE.as_secs()
                    ),
                ));
            }
            Ok(0) | Err(Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let mut buf = [0u8; 8];
        match report.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => word.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if word.len() > 4 {
            break;
        }
    }
    match <[u8; 4]>::try_from(word.as_slice()) {
        _ if word.is_empty() => Ok(pid),
        Ok(errno) => Err(io::Error::from_raw_os_error(i32::from_le_bytes(errno))),
        Err(_) => Err(io::Error::other("the keeper said something unreadable")),
    }
}
