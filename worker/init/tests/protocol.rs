//! The supervisor's wire protocol, against the real `corral-init` binary run
//! as an ordinary process (no container): frames in on stdin, frames out on
//! stdout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest};
use corral_proto::{
    ArchiveSpec, EventKind, FileErrorKind, OperationId, OperationResult, OperationSpec, Outcome,
    OutputStream, ReadFileSpec, ShellSpec, TerminalSize, WriteFileSpec, pb,
};

struct Init {
    child: Child,
    rx: mpsc::Receiver<InitMessage>,
    _dir: tempfile::TempDir,
}

impl Init {
    fn start() -> Self {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::create_dir_all(&tmp).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_corral-init"))
            .arg("--roots")
            .arg(&ws)
            .arg(&tmp)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut dec = FrameDecoder::new();
            let mut buf = vec![0u8; 65536];
            loop {
                let n = match out.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                dec.extend(&buf[..n]);
                while let Ok(Some(m)) = dec.next_message::<pb::InitMessage>() {
                    if tx.send(InitMessage::try_from(m).unwrap()).is_err() {
                        return;
                    }
                }
            }
        });
        Self {
            child,
            rx,
            _dir: dir,
        }
    }

    fn send(&mut self, req: InitRequest) {
        self.raw(&frame::encode(&pb::InitRequest::from(req)));
    }

    fn raw(&mut self, bytes: &[u8]) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(bytes).unwrap();
        stdin.flush().unwrap();
    }

    fn recv(&self) -> InitMessage {
        self.rx
            .recv_timeout(Duration::from_secs(10))
            .expect("no frame from corral-init")
    }

    fn nothing_for(&self, d: Duration) -> bool {
        self.rx.recv_timeout(d).is_err()
    }

    /// Events until the operation's Finished.
    fn until_finished(&self) -> Vec<corral_proto::Event> {
        let mut events = Vec::new();
        loop {
            match self.recv() {
                InitMessage::Event(e) => {
                    let done = matches!(e.kind, EventKind::Finished(_));
                    events.push(e);
                    if done {
                        return events;
                    }
                }
                InitMessage::InputAck { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// The next input acknowledgement (events in between are skipped).
    fn ack(&self) -> (u64, u64, bool) {
        loop {
            match self.recv() {
                InitMessage::InputAck {
                    received,
                    consumed,
                    closed,
                    ..
                } => return (received, consumed, closed),
                InitMessage::Event(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

impl Drop for Init {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &str) -> (OperationId, InitRequest) {
    let id = OperationId::random();
    let req = InitRequest::Run {
        operation_id: id.clone(),
        spec: OperationSpec::Shell(ShellSpec::new(cmd)),
    };
    (id, req)
}

fn attach(init: &mut Init, after_seq: u64, window_bytes: u64) -> corral_proto::init::Welcome {
    init.send(InitRequest::Attach {
        after_seq,
        window_bytes,
        attach: 1,
    });
    let mut pages = attach_pages(init);
    let mut w = pages.remove(0);
    for mut p in pages {
        w.operations.append(&mut p.operations);
    }
    w
}

/// The pages of the Welcome that answers an Attach.
fn attach_pages(init: &mut Init) -> Vec<corral_proto::init::Welcome> {
    let mut pages = Vec::new();
    loop {
        match init.recv() {
            InitMessage::Welcome(w) => {
                let more = w.more;
                pages.push(w);
                if !more {
                    return pages;
                }
            }
            other => panic!("expected welcome, got {other:?}"),
        }
    }
}

#[test]
fn runs_a_command_and_streams_its_events_in_order() {
    let mut init = Init::start();
    let w = attach(&mut init, 0, 1 << 20);
    assert_eq!(w.last_seq, 0);
    let (_, req) = run("echo hi; echo there >&2; exit 3");
    init.send(req);
    let events = init.until_finished();
    assert!(
        events.windows(2).all(|p| p[0].seq + 1 == p[1].seq),
        "{events:?}"
    );
    assert!(matches!(events[0].kind, EventKind::Started { .. }));
    let EventKind::Finished(r) = &events.last().unwrap().kind else {
        unreachable!()
    };
    assert_eq!(r.outcome, Outcome::Exited { code: 3 });
    assert_eq!(&r.stdout.head[..], b"hi\n");
    assert_eq!(&r.stderr.head[..], b"there\n");
}

#[test]
fn malformed_and_oversized_frames_are_rejected_and_the_link_recovers() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    init.raw(&[0, 0, 0, 3, 0xff, 0xff, 0xff]);
    let InitMessage::Rejected { reason, .. } = init.recv() else {
        panic!()
    };
    assert!(reason.starts_with("malformed frame"), "{reason}");

    // A valid frame with an invalid request (NUL in the command).
    let bad = pb::InitRequest {
        kind: Some(pb::init_request::Kind::Run(pb::init_request::Run {
            operation_id: "x".into(),
            spec: Some(OperationSpec::Shell(ShellSpec::new("echo a\0b")).into()),
        })),
    };
    init.raw(&frame::encode(&bad));
    let InitMessage::Rejected { reason, .. } = init.recv() else {
        panic!()
    };
    assert!(reason.contains("NUL"), "{reason}");

    // Announce a frame over the limit, then actually send its bytes: it is
    // refused without being buffered, and what follows decodes fine.
    let len = corral_proto::limits::MAX_FRAME_BYTES + 1;
    let mut oversized = (len as u32).to_be_bytes().to_vec();
    oversized.resize(4 + len, 0x55);
    init.raw(&oversized);
    let InitMessage::Rejected { reason, .. } = init.recv() else {
        panic!()
    };
    assert!(reason.contains("exceeds the limit"), "{reason}");
    let (_, req) = run("echo still fine");
    init.send(req);
    let events = init.until_finished();
    let EventKind::Finished(r) = &events.last().unwrap().kind else {
        unreachable!()
    };
    assert_eq!(&r.stdout.head[..], b"still fine\n");
}

#[test]
fn output_waits_for_credit() {
    let mut init = Init::start();
    attach(&mut init, 0, 0);
    let (_, req) = run("echo 0123456789");
    init.send(req);
    assert!(
        matches!(init.recv(), InitMessage::Event(e) if matches!(e.kind, EventKind::Started { .. }))
    );
    // No credit: the output stays in the pipe.
    assert!(init.nothing_for(Duration::from_millis(500)));
    init.send(InitRequest::Credit { bytes: 4 });
    let InitMessage::Event(e) = init.recv() else {
        panic!()
    };
    assert!(matches!(&e.kind, EventKind::Output { data, .. } if &data[..] == b"0123"));
    assert!(init.nothing_for(Duration::from_millis(300)));
    init.send(InitRequest::Credit { bytes: 1 << 20 });
    let events = init.until_finished();
    let EventKind::Finished(r) = &events.last().unwrap().kind else {
        unreachable!()
    };
    assert_eq!(&r.stdout.head[..], b"0123456789\n");
}

/// A command that exits with its output still in the pipe, read by a
/// consumer slower than the linger and overdue times: every byte comes,
/// however late the credit.
#[test]
fn output_left_in_the_pipe_after_the_command_exits_comes_whole_however_late_the_credit() {
    let mut init = Init::start();
    attach(&mut init, 0, 4096);
    // About 600 KB: more than the window, less than the pipe holds, so the
    // command exits at once with most of it unread.
    let (_, req) = run("seq 1 100000");
    init.send(req);
    let mut got = Vec::new();
    loop {
        match init.recv() {
            InitMessage::Event(e) => match e.kind {
                EventKind::Output { data, .. } => got.extend_from_slice(&data),
                EventKind::Finished(_) => panic!("finished before its output was read"),
                _ => {}
            },
            other => panic!("unexpected {other:?}"),
        }
        if got.len() == 4096 {
            break;
        }
    }
    // Past the linger and the overdue time of a background child's pipe.
    assert!(init.nothing_for(Duration::from_millis(2000)));
    init.send(InitRequest::Credit { bytes: 1 << 20 });
    let events = init.until_finished();
    got.extend(stdout_of(&events));
    let want: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    assert_eq!(got.len(), want.len(), "output lost");
    assert!(got == want.as_bytes());
    let r = result_of(&events);
    assert_eq!(r.outcome, Outcome::Exited { code: 0 });
    assert_eq!(r.stdout.total_bytes, want.len() as u64);
}

#[test]
fn a_reattach_replays_exactly_what_came_after_the_cursor_and_runs_are_idempotent() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let (id, req) = run("for i in 1 2 3; do echo $i; done");
    init.send(req.clone());
    let events = init.until_finished();
    // The same run again: ignored, nothing runs twice.
    init.send(req);
    assert!(init.nothing_for(Duration::from_millis(300)));
    // A different spec under the same id: refused.
    init.send(InitRequest::Run {
        operation_id: id.clone(),
        spec: OperationSpec::Shell(ShellSpec::new("echo other")),
    });
    assert!(matches!(init.recv(), InitMessage::Rejected { operation_id: Some(o), .. } if o == id));

    let cut = events[1].seq;
    let w = attach(&mut init, cut, 1 << 20);
    assert_eq!(w.last_seq, events.last().unwrap().seq);
    assert_eq!(w.operations.len(), 1);
    assert_eq!(w.operations[0].id, id);
    assert!(w.operations[0].result.is_some());
    let mut replay = Vec::new();
    while replay.len() < events.len() - 2 {
        let InitMessage::Event(e) = init.recv() else {
            panic!()
        };
        replay.push(e);
    }
    assert_eq!(replay, events[2..].to_vec());
    assert!(init.nothing_for(Duration::from_millis(200)));
}

#[test]
fn cancel_ends_the_command_and_is_idempotent() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let (id, req) = run("sleep 300");
    init.send(req);
    assert!(
        matches!(init.recv(), InitMessage::Event(e) if matches!(e.kind, EventKind::Started { .. }))
    );
    init.send(InitRequest::Cancel {
        operation_id: id.clone(),
    });
    init.send(InitRequest::Cancel {
        operation_id: id.clone(),
    });
    init.send(InitRequest::Cancel {
        operation_id: OperationId::random(),
    });
    let events = init.until_finished();
    let EventKind::Finished(r) = &events.last().unwrap().kind else {
        unreachable!()
    };
    assert_eq!(r.outcome, Outcome::Canceled);
    init.send(InitRequest::Cancel { operation_id: id });
    assert!(init.nothing_for(Duration::from_millis(200)));
}

#[test]
fn random_frames_are_rejected_and_the_supervisor_keeps_serving() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut sent = 0;
    for _ in 0..300 {
        let len = (next() % 200) as usize;
        let mut frame = (len as u32).to_be_bytes().to_vec();
        frame.extend((0..len).map(|_| next() as u8));
        init.raw(&frame);
        sent += 1;
    }
    // Every frame got an answer or was a harmless no-op (random bytes can
    // decode as a valid Credit or Cancel); none of it crashed the process.
    let mut answers = 0;
    while !init.nothing_for(Duration::from_millis(300)) {
        answers += 1;
    }
    assert!(answers <= sent);
    assert!(init.child.try_wait().unwrap().is_none(), "corral-init died");
    // And it still works.
    let (_, req) = run("echo alive");
    init.send(req);
    let events = init.until_finished();
    let EventKind::Finished(r) = &events.last().unwrap().kind else {
        unreachable!()
    };
    assert_eq!(&r.stdout.head[..], b"alive\n");
}

#[test]
fn what_is_remembered_of_finished_operations_is_bounded_by_size() {
    let mut init = Init::start_with(&["--finished-budget", "4000"]);
    attach(&mut init, 0, 1 << 20);
    let mut ids = Vec::new();
    for _ in 0..6 {
        let (id, req) = run("head -c 1500 /dev/zero | tr '\\0' x");
        init.send(req);
        init.until_finished();
        ids.push(id);
    }
    let w = attach(&mut init, u64::MAX - 1, 1 << 20);
    let kept: Vec<_> = w.operations.iter().map(|o| o.id.clone()).collect();
    assert!(kept.len() < 6 && !kept.is_empty(), "kept {}", kept.len());
    assert!(kept.contains(&ids[5]), "the newest is kept");
    assert!(!kept.contains(&ids[0]), "the oldest goes first");
}

fn shell(spec: ShellSpec) -> (OperationId, InitRequest) {
    let id = OperationId::random();
    let req = InitRequest::Run {
        operation_id: id.clone(),
        spec: OperationSpec::Shell(spec),
    };
    (id, req)
}

fn result_of(events: &[corral_proto::Event]) -> OperationResult {
    match &events.last().unwrap().kind {
        EventKind::Finished(r) => (**r).clone(),
        other => panic!("not finished: {other:?}"),
    }
}

fn stdout_of(events: &[corral_proto::Event]) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Output { data, .. } => Some(data.to_vec()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[test]
fn commands_start_with_no_signal_blocked_or_ignored() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let (_, req) = run("grep -E '^Sig(Blk|Ign)' /proc/self/status");
    init.send(req);
    let out = String::from_utf8(result_of(&init.until_finished()).stdout.head.to_vec()).unwrap();
    assert!(out.contains("SigBlk:\t0000000000000000"), "{out}");
    assert!(out.contains("SigIgn:\t0000000000000000"), "{out}");

    let (_, req) = run("kill -TERM $$; sleep 5");
    init.send(req);
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Signaled { signal: 15 });
    assert_eq!(r.outcome.exit_status(), 143);

    let (_, req) = run("trap 'echo caught; exit 7' TERM; kill -TERM $$; sleep 5");
    init.send(req);
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Exited { code: 7 });
    assert_eq!(&r.stdout.head[..], b"caught\n");
}

/// A command's keeper is a fresh `corral-init --keep`, told what to run
/// through a memory file: the command's words and environment appear in
/// neither its arguments (anyone in the sandbox reads those) nor its
/// environment (its C library would act on that as root); the command
/// gets both whole, starts where it was asked to, and is the OOM killer's
/// first choice.
#[test]
fn a_keeper_holds_none_of_its_commands_words_or_environment() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let mut spec = ShellSpec::new(
        "tr '\\0' ' ' < /proc/$PPID/cmdline; echo; \
         cat /proc/$PPID/environ > /dev/null && echo readable; \
         tr '\\0' ' ' < /proc/$PPID/environ | wc -c; \
         cat /proc/self/oom_score_adj; \
         echo \"$SECRET_VALUE|$EMPTY|$(pwd)\"",
    );
    spec.env.insert(
        "SECRET_VALUE".into(),
        "s3cr3t with spaces = and more".into(),
    );
    spec.env.insert("EMPTY".into(), String::new());
    spec.workdir = Some("/".into());
    let (_, req) = shell(spec);
    init.send(req);
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    let out = r.stdout.to_lossy_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "corral-init --keep ",
            "readable",
            "0",
            "1000",
            "s3cr3t with spaces = and more||/"
        ],
        "{out}"
    );
}

#[test]
fn background_processes_end_with_the_command_unless_kept() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    // Its own process group too (a shell with job control makes those).
    let (_, req) = run("sleep 100 >/dev/null & echo $!; set -m; sleep 100 >/dev/null & echo $!");
    init.send(req);
    let r = result_of(&init.until_finished());
    let pids: Vec<i32> = r
        .stdout
        .to_lossy_string()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    std::thread::sleep(Duration::from_millis(300));
    for pid in &pids {
        assert!(
            !alive(*pid),
            "background process {pid} outlived its command"
        );
    }

    let mut spec = ShellSpec::new("sleep 100 >/dev/null 2>&1 & echo $!");
    spec.keep_background = true;
    let (_, req) = shell(spec);
    init.send(req);
    let r = result_of(&init.until_finished());
    let pid: i32 = r.stdout.to_lossy_string().trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(pid), "a kept background process was killed");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Pids printed one a line.
fn pids_of(r: &OperationResult) -> Vec<i32> {
    r.stdout
        .to_lossy_string()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

#[test]
fn nothing_escapes_its_operation_by_leaving_the_session() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    // A new session, and a new session whose parent is gone at once (a
    // double fork): both used to outlive their command.
    let escape = |n: u32| format!("setsid sh -c 'echo $$; exec sleep {n} >/dev/null 2>&1'");
    let cmd = format!("{} & ( {} & ); sleep 0.3", escape(101), escape(102));
    let (_, req) = run(&cmd);
    init.send(req);
    let r = result_of(&init.until_finished());
    let pids = pids_of(&r);
    assert_eq!(pids.len(), 2, "{:?}", r.stdout.to_lossy_string());
    std::thread::sleep(Duration::from_millis(300));
    for pid in &pids {
        assert!(
            !alive(*pid),
            "process {pid} left its session and outlived its command"
        );
    }

    // Kept background that left the session: it stays when the command
    // ends, and goes when the command times out or is canceled.
    let mut spec = ShellSpec::new(format!("{} & sleep 0.3", escape(103)));
    spec.keep_background = true;
    let (_, req) = shell(spec);
    init.send(req);
    let kept = pids_of(&result_of(&init.until_finished()));
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(kept[0]), "a kept background process was killed");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(kept[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();

    let mut spec = ShellSpec::new(format!("{} & sleep 0.3; exec sleep 100", escape(104)));
    spec.keep_background = true;
    spec.timeout_ms = Some(1_000);
    let (_, req) = shell(spec);
    init.send(req);
    let r = result_of(&init.until_finished());
    assert!(matches!(r.outcome, Outcome::TimedOut), "{:?}", r.outcome);
    let pids = pids_of(&r);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !alive(pids[0]),
        "a timed-out operation left {} behind",
        pids[0]
    );
}

#[test]
fn stdin_is_placed_by_offset_and_closed_at_its_end() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let mut spec = ShellSpec::new("cat; echo done");
    spec.stdin = true;
    let (id, req) = shell(spec);
    init.send(req);
    let input = |offset: u64, data: &'static [u8], eof: bool| InitRequest::Input {
        operation_id: id.clone(),
        offset,
        data: Bytes::from_static(data),
        eof,
    };
    init.send(input(0, b"hello\n", false));
    // A repeat that overlaps: only its new part counts.
    init.send(input(3, b"lo\nworld", false));
    // A gap is refused.
    init.send(input(100, b"x", false));
    init.send(input(11, b"\n", true));
    let mut rejected = false;
    let events = loop {
        match init.recv() {
            InitMessage::Rejected { reason, .. } => {
                assert!(reason.contains("offset 100"), "{reason}");
                rejected = true;
            }
            InitMessage::Event(e) if matches!(e.kind, EventKind::Finished(_)) => break vec![e],
            _ => {}
        }
    };
    assert!(rejected);
    let r = result_of(&events);
    assert_eq!(r.stdout.to_lossy_string(), "hello\nworld\ndone\n");
    // Input after the end: said closed.
    init.send(input(12, b"late", false));
    assert!(init.ack().2);
}

#[test]
fn a_terminal_has_its_size_resizes_and_ends_at_eof() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let mut spec = ShellSpec::new("test -t 0 && test -t 1 && stty size; read x; stty size; cat");
    spec.terminal = Some(TerminalSize { rows: 24, cols: 80 });
    let (id, req) = shell(spec);
    init.send(req);
    // Wait for the first size to be printed before resizing.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("24 80") {
        if let InitMessage::Event(e) = init.recv()
            && let EventKind::Output { data, .. } = e.kind
        {
            seen.extend_from_slice(&data);
        }
    }
    init.send(InitRequest::Resize {
        operation_id: id.clone(),
        size: TerminalSize {
            rows: 50,
            cols: 132,
        },
    });
    init.send(InitRequest::Input {
        operation_id: id,
        offset: 0,
        data: Bytes::from_static(b"go\n"),
        eof: true,
    });
    let events = init.until_finished();
    seen.extend(stdout_of(&events));
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("50 132"), "{text:?}");
    assert_eq!(result_of(&events).outcome, Outcome::Exited { code: 0 });
}

#[test]
fn a_fifo_is_refused_while_the_supervisor_goes_on() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let (_, req) = run("mkfifo pipe");
    init.send(req);
    init.until_finished();
    for spec in [
        OperationSpec::ReadFile(ReadFileSpec::new("pipe")),
        OperationSpec::ReadFile(ReadFileSpec {
            stream: true,
            limit: 0,
            ..ReadFileSpec::new("pipe")
        }),
        OperationSpec::WriteFile(WriteFileSpec {
            append: true,
            ..WriteFileSpec::new("pipe", Bytes::from_static(b"x"))
        }),
    ] {
        init.send(InitRequest::Run {
            operation_id: OperationId::random(),
            spec,
        });
        let r = result_of(&init.until_finished());
        assert!(
            matches!(&r.outcome, Outcome::FileError { kind: FileErrorKind::NotRegular, message } if message.contains("FIFO")),
            "{r:?}"
        );
    }
    let (_, req) = run("echo next");
    init.send(req);
    assert_eq!(
        &result_of(&init.until_finished()).stdout.head[..],
        b"next\n"
    );
}

#[test]
fn large_files_stream_in_and_out_under_flow_control() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    const SIZE: usize = 24 << 20;
    let data: Vec<u8> = (0..SIZE).map(|i| (i * 7 + i / 4093) as u8).collect();
    let id = OperationId::random();
    init.send(InitRequest::Run {
        operation_id: id.clone(),
        spec: OperationSpec::WriteFile(WriteFileSpec {
            stream: true,
            ..WriteFileSpec::new("big.bin", Bytes::copy_from_slice(&data[..1000]))
        }),
    });
    // The input's offsets count from the end of the spec's own bytes.
    // Sent within a window of what init has written out.
    let rest = &data[1000..];
    let window = corral_init::supervisor::MAX_INPUT_BUFFER as u64 / 2;
    let (mut sent, mut consumed) = (0u64, 0u64);
    while sent < rest.len() as u64 {
        if sent - consumed + (1 << 20) > window {
            consumed = init.ack().1;
            continue;
        }
        let end = (sent as usize + (1 << 20)).min(rest.len());
        init.send(InitRequest::Input {
            operation_id: id.clone(),
            offset: sent,
            data: Bytes::copy_from_slice(&rest[sent as usize..end]),
            eof: end == rest.len(),
        });
        sent = end as u64;
    }
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    assert_eq!(r.bytes_written, SIZE as u64);

    let read = OperationId::random();
    init.send(InitRequest::Run {
        operation_id: read,
        spec: OperationSpec::ReadFile(ReadFileSpec {
            stream: true,
            limit: 0,
            ..ReadFileSpec::new("big.bin")
        }),
    });
    let mut got = Vec::with_capacity(SIZE);
    loop {
        let InitMessage::Event(e) = init.recv() else {
            continue;
        };
        match e.kind {
            EventKind::Output { data, .. } => {
                got.extend_from_slice(&data);
                init.send(InitRequest::Credit {
                    bytes: data.len() as u64,
                });
            }
            EventKind::Finished(r) => {
                assert_eq!((r.file_size, r.bytes_written), (SIZE as u64, SIZE as u64));
                assert!(r.file_data.is_empty());
                break;
            }
            _ => {}
        }
    }
    assert!(got == data, "the file came back different");
}

#[test]
fn a_reset_kills_every_process_and_ends_what_runs() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let mut spec = ShellSpec::new("for i in 1 2 3 4 5; do sleep 100 & done; echo $!; wait");
    spec.keep_background = true;
    let (_, req) = shell(spec);
    init.send(req);
    let pid: i32 = loop {
        if let InitMessage::Event(e) = init.recv()
            && let EventKind::Output { data, .. } = e.kind
        {
            break String::from_utf8_lossy(&data).trim().parse().unwrap();
        }
    };
    init.send(InitRequest::Reset);
    let killed = loop {
        match init.recv() {
            InitMessage::ResetDone { killed } => break killed,
            InitMessage::Event(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(killed >= 6, "killed {killed}");
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Canceled);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!alive(pid));
    let (_, req) = run("echo after");
    init.send(req);
    assert_eq!(
        &result_of(&init.until_finished()).stdout.head[..],
        b"after\n"
    );
}

#[test]
fn a_reattach_after_large_operations_is_welcomed_in_pages_under_the_frame_limit() {
    // Five 7 MiB reads are 35 MiB of remembered results: more than one
    // frame may carry.
    let mut init = Init::start();
    attach(&mut init, 0, 64 << 20);
    let (_, req) = run("head -c 7340032 /dev/urandom > big");
    init.send(req);
    init.until_finished();
    let mut ids = Vec::new();
    for _ in 0..5 {
        let id = OperationId::random();
        init.send(InitRequest::Run {
            operation_id: id.clone(),
            spec: OperationSpec::ReadFile(ReadFileSpec::new("big")),
        });
        let r = result_of(&init.until_finished());
        assert_eq!(r.file_data.len(), 7 << 20);
        ids.push(id);
    }
    init.send(InitRequest::Attach {
        after_seq: u64::MAX - 1,
        window_bytes: 1 << 20,
        attach: 7,
    });
    let pages = attach_pages(&mut init);
    assert!(
        pages.len() > 1,
        "one page of {} operations",
        pages[0].operations.len()
    );
    assert!(pages.iter().all(|p| p.boot_id == pages[0].boot_id));
    // Each page names the attach it answers and its place.
    for (i, p) in pages.iter().enumerate() {
        assert_eq!((p.attach, p.page as usize), (7, i));
    }
    let mut kept: Vec<_> = pages
        .iter()
        .flat_map(|p| &p.operations)
        .filter(|o| {
            o.result
                .as_ref()
                .is_some_and(|r| r.file_data.len() == 7 << 20)
        })
        .map(|o| o.id.clone())
        .collect();
    kept.sort_by_key(ToString::to_string);
    ids.sort_by_key(ToString::to_string);
    assert_eq!(kept, ids, "every read is remembered, once");
    // The link goes on after the pages.
    let (_, req) = run("echo after");
    init.send(req);
    assert_eq!(stdout_of(&init.until_finished()), b"after\n");
}

/// Packs `path` through the protocol: the archive's bytes, taken under
/// credit, and the result.
fn get_archive(init: &mut Init, path: &str) -> (Vec<u8>, corral_proto::OperationResult) {
    init.send(InitRequest::Run {
        operation_id: OperationId::random(),
        spec: OperationSpec::GetArchive(ArchiveSpec::new(path)),
    });
    let mut got = Vec::new();
    loop {
        let InitMessage::Event(e) = init.recv() else {
            continue;
        };
        match e.kind {
            EventKind::Output {
                stream: OutputStream::Stdout,
                data,
            } => {
                got.extend_from_slice(&data);
                init.send(InitRequest::Credit {
                    bytes: data.len() as u64,
                });
            }
            EventKind::Output { data, .. } => {
                init.send(InitRequest::Credit {
                    bytes: data.len() as u64,
                });
            }
            EventKind::Finished(r) => return (got, *r),
            _ => {}
        }
    }
}

/// Unpacks `tar` at `path` through the protocol, fed in 1 MiB inputs
/// within the input window.
fn put_archive(init: &mut Init, path: &str, tar: &[u8]) -> corral_proto::OperationResult {
    let id = OperationId::random();
    init.send(InitRequest::Run {
        operation_id: id.clone(),
        spec: OperationSpec::PutArchive(ArchiveSpec::new(path)),
    });
    let window = corral_init::supervisor::MAX_INPUT_BUFFER as u64 / 2;
    let (mut sent, mut consumed, mut closed) = (0u64, 0u64, false);
    while !closed && sent < tar.len() as u64 {
        if sent - consumed + (1 << 20) > window {
            (_, consumed, closed) = init.ack();
            continue;
        }
        let end = (sent as usize + (1 << 20)).min(tar.len());
        init.send(InitRequest::Input {
            operation_id: id.clone(),
            offset: sent,
            data: Bytes::copy_from_slice(&tar[sent as usize..end]),
            eof: end == tar.len(),
        });
        sent = end as u64;
    }
    result_of(&init.until_finished())
}

#[test]
fn a_tree_goes_out_and_back_in_as_a_tar_stream() {
    let mut init = Init::start();
    attach(&mut init, 0, 1 << 20);
    let (_, make) = run(
        "mkdir -p proj/sub && head -c 3000000 /dev/urandom > proj/sub/big && echo hi > proj/a \
         && chmod 751 proj/a && ln -s ../../etc/passwd proj/out && touch -d @1000000 proj/a",
    );
    init.send(make);
    let r = result_of(&init.until_finished());
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    let (tar, r) = get_archive(&mut init, "proj");
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    assert!(
        r.stdout.head.is_empty(),
        "the archive is not kept in the result"
    );
    assert!(tar.len() > 3_000_000);
    let r = put_archive(&mut init, "copy", &tar);
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    let (_, check) =
        run("cmp proj/sub/big copy/sub/big && stat -c '%a %Y' copy/a && readlink copy/out");
    init.send(check);
    let events = init.until_finished();
    assert_eq!(
        String::from_utf8_lossy(&stdout_of(&events)),
        "751 1000000\n../../etc/passwd\n"
    );
    // Garbage in: a clear error, and the supervisor goes on.
    let r = put_archive(&mut init, "bad", &[7u8; 4096]);
    assert_ne!(r.outcome, Outcome::Exited { code: 0 });
    assert!(!r.stderr.head.is_empty(), "{r:?}");
    // Outside the roots: refused; a tree that is not there, said so (as
    // a file operation's errors are, before anything is packed).
    let (tar, r) = get_archive(&mut init, "/etc");
    assert!(
        matches!(
            &r.outcome,
            Outcome::FileError { kind: FileErrorKind::OutsideSandboxRoots, message }
                if message.contains("outside")
        ),
        "{r:?}"
    );
    assert!(tar.is_empty());
    let (tar, r) = get_archive(&mut init, "proj/nothing");
    assert!(
        matches!(
            &r.outcome,
            Outcome::FileError {
                kind: FileErrorKind::NotFound,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(tar.is_empty());
}
