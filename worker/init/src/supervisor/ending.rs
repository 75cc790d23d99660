//! How operations end: canceled, signalled, reaped, past their deadline,
//! their output drained, their result recorded (and the oldest finished
//! ones forgotten), and everything killed on a reset or at the end.

use super::*;

impl Supervisor {
    pub(super) fn cancel(&mut self, id: &OperationId) {
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
    pub(super) fn signal(&mut self, id: &OperationId, signal: i32) {
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
    pub(super) fn reset(&mut self) -> u32 {
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

    /// Reads what is available on one pipe, within the credit.
    pub(super) fn read_pipe(&mut self, id: &OperationId, stream: usize, buf: &mut [u8]) {
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

    pub(super) fn drain_orphans(&mut self, ready: &[bool], buf: &mut [u8]) {
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
    pub(super) fn read_signals(&mut self) {
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
    pub(super) fn reap(&mut self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    let Some(pid) = status.pid() else { continue };
                    let no_worker = matches!(status, WaitStatus::Exited(_, c) if c == i32::from(crate::ingress::NO_WORKER));
                    if self
                        .ingress
                        .as_ref()
                        .is_some_and(|r| r.pid == Some(pid.as_raw()))
                        && no_worker
                    {
                        // Started again when the worker asks.
                        self.ingress = None;
                        continue;
                    }
                    if let Some(relay) = [self.relay.as_mut(), self.ingress.as_mut()]
                        .into_iter()
                        .flatten()
                        .find(|r| r.pid == Some(pid.as_raw()))
                    {
                        relay.reaped(pid.as_raw(), Instant::now());
                        eprintln!(
                            "corral-init: the {} relay ended ({status:?}); starting it again",
                            relay.name()
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

    pub(super) fn enforce_deadlines(&mut self, now: Instant) {
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

    pub(super) fn finish_ready(&mut self, now: Instant) {
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
                // A pipe still held open by a background child, with
                // nothing in it now (or held past the overdue time): stop
                // waiting for it. A pipe whose every writer is gone is read
                // to its end, however long credit takes to come: what is in
                // it is the command's output.
                for p in &mut run.pipes {
                    if p.as_ref().is_some_and(|p| held_by_another(p, overdue))
                        && let Some(pipe) = p.take()
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

    pub(super) fn complete(&mut self, id: &OperationId, result: OperationResult) {
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

    pub(super) fn kill_everything(&mut self) {
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

/// Whether a finished command's output pipe is held open by another process
/// (a background child) that the operation should stop waiting for: nothing
/// to read now while some writer is alive, or, once `overdue`, any writer
/// alive. A pipe whose writers are all gone (`POLLHUP`) never is: what is
/// left in it was written, and is read to the end.
fn held_by_another(pipe: &Pipe, overdue: bool) -> bool {
    let mut fds = [PollFd::new(pipe.fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(0) => true,
        Ok(_) => {
            overdue
                && !fds[0]
                    .revents()
                    .is_some_and(|r| r.contains(PollFlags::POLLHUP))
        }
        Err(_) => overdue,
    }
}
