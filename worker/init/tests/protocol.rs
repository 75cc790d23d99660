//! The supervisor's wire protocol, against the real `corral-init` binary run
//! as an ordinary process (no container): frames in on stdin, frames out on
//! stdout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use corral_proto::frame::{self, FrameDecoder};
use corral_proto::init::{InitMessage, InitRequest};
use corral_proto::{EventKind, OperationId, OperationSpec, Outcome, ShellSpec, pb};

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
    });
    match init.recv() {
        InitMessage::Welcome(w) => w,
        other => panic!("expected welcome, got {other:?}"),
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
