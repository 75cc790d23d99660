//! Commands behave as on a real machine: signals, process lifetime, stdin
//! and terminals, file operations that never block the supervisor, and a
//! `corral exec` that cleans up however it is ended. All through the real
//! `corral` binary or the gRPC API, against real sandboxes.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use corral_e2e::{Harness, binary, collect};
use corral_proto::{
    EventKind, FileErrorKind, OperationId, OperationSpec, Outcome, ReadFileSpec, SandboxId,
    SandboxSpec, WriteFileSpec,
};
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

fn corral(h: &Harness) -> Result<tokio::process::Command> {
    let mut cmd = tokio::process::Command::new(binary("corral")?);
    cmd.arg("--worker")
        .arg(&h.url)
        .env_remove("CORRAL_WORKER")
        .kill_on_drop(true);
    Ok(cmd)
}

async fn exec_in(h: &Harness, sb: &SandboxId, args: &[&str]) -> Result<Output> {
    Ok(corral(h)?
        .args(["exec", "--sandbox", sb.as_str()])
        .args(args)
        .output()
        .await?)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Processes of the sandbox whose command line starts with `prefix`.
async fn count_procs(h: &Harness, sb: &SandboxId, prefix: &str) -> Result<usize> {
    let script = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done";
    let r = h.run(sb, script).await?;
    Ok(r.stdout
        .to_lossy_string()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .count())
}

#[tokio::test]
async fn commands_start_unmasked_and_signals_reach_them() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let out = exec_in(
        &h,
        &sb,
        &["--", "grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"],
    )
    .await?;
    let status = text(&out.stdout);
    assert!(status.contains("SigBlk:\t0000000000000000"), "{status}");
    assert!(status.contains("SigIgn:\t0000000000000000"), "{status}");

    let out = exec_in(&h, &sb, &["--", "sh", "-c", "kill -TERM $$; sleep 5"]).await?;
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));

    let out = exec_in(
        &h,
        &sb,
        &[
            "--",
            "sh",
            "-c",
            "trap 'echo caught; exit 7' TERM; kill -TERM $$; sleep 5",
        ],
    )
    .await?;
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(text(&out.stdout), "caught\n");

    // A timeout's SIGTERM arrives: the command ends at once, well within
    // the grace; only a command that ignores it waits for the SIGKILL.
    let started = Instant::now();
    let out = exec_in(&h, &sb, &["--timeout", "2s", "--", "sleep", "100"]).await?;
    let plain = started.elapsed();
    assert_eq!(out.status.code(), Some(124));
    let started = Instant::now();
    let out = exec_in(
        &h,
        &sb,
        &[
            "--timeout",
            "2s",
            "--",
            "sh",
            "-c",
            "trap '' TERM; sleep 100",
        ],
    )
    .await?;
    let stubborn = started.elapsed();
    assert_eq!(out.status.code(), Some(124));
    assert!(
        plain < Duration::from_millis(3500),
        "a plain timeout took {plain:?}"
    );
    assert!(
        stubborn >= Duration::from_secs(4),
        "a command ignoring SIGTERM ended after {stubborn:?}, before the grace"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn background_processes_end_with_their_command_unless_kept_and_reset_clears_all() -> Result<()>
{
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let out = exec_in(&h, &sb, &["--", "sh", "-c", "sleep 1001 & echo started"]).await?;
    assert_eq!(text(&out.stdout), "started\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count_procs(&h, &sb, "sleep 1001").await?, 0);

    let out = exec_in(
        &h,
        &sb,
        &[
            "--keep-background",
            "--",
            "sh",
            "-c",
            "sleep 1002 & sleep 1003 & echo started",
        ],
    )
    .await?;
    assert_eq!(text(&out.stdout), "started\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count_procs(&h, &sb, "sleep 100").await?, 2);

    let out = corral(&h)?
        .args(["sandbox", "reset", sb.as_str()])
        .output()
        .await?;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("killed "),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(count_procs(&h, &sb, "sleep 100").await?, 0);
    assert_eq!(
        h.run(&sb, "echo files stay")
            .await?
            .stdout
            .to_lossy_string(),
        "files stay\n"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn after_a_fork_bomb_the_sandbox_serves_again_and_its_neighbour_never_noticed() -> Result<()>
{
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            pids_limit: Some(64),
            ..SandboxSpec::default()
        })
        .await?;
    let neighbour = h.sandbox().await?;
    let base = {
        let started = Instant::now();
        h.run(&neighbour, "true").await?;
        started.elapsed()
    };
    let bomb = exec_in(&h, &sb, &["--", "sh", "-c", "f(){ f|f& }; f"]);
    let watch = async {
        let mut worst = Duration::ZERO;
        for _ in 0..20 {
            let started = Instant::now();
            let r = h.run(&neighbour, "true").await?;
            assert_eq!(r.outcome, Outcome::Exited { code: 0 });
            worst = worst.max(started.elapsed());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::Ok(worst)
    };
    let (out, worst) = tokio::join!(bomb, watch);
    let (out, worst) = (out?, worst?);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // Generous: the neighbour's commands all ran, none waited on the bomb.
    assert!(
        worst < base + Duration::from_secs(2),
        "the neighbour's slowest command took {worst:?} (alone: {base:?})"
    );
    // The bomb's session was killed with its main process: the sandbox
    // serves again within seconds.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = h.run(&sb, "echo alive").await?;
        if r.outcome == (Outcome::Exited { code: 0 }) {
            assert_eq!(r.stdout.to_lossy_string(), "alive\n");
            break;
        }
        if Instant::now() > deadline {
            bail!("the sandbox still fails after its fork bomb: {r:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_sandbox_at_its_process_limit_can_be_reset() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            pids_limit: Some(32),
            ..SandboxSpec::default()
        })
        .await?;
    // Processes kept in the background until no more can start.
    let out = exec_in(
        &h,
        &sb,
        &[
            "--keep-background",
            "--",
            "sh",
            "-c",
            "i=0; while [ $i -lt 100 ]; do sleep 1000 2>/dev/null & i=$((i+1)); done 2>/dev/null; true",
        ],
    )
    .await?;
    // The shell itself gives up ("can't fork") once the limit is reached,
    // which frees its own slot: a command that stays takes it.
    assert_ne!(out.status.code(), Some(125), "{}", text(&out.stderr));
    h.client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(corral_proto::ShellSpec::new("exec sleep 1000")),
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let full = h.run(&sb, "echo x").await?;
    assert!(
        matches!(&full.outcome, Outcome::SpawnFailed { reason } if reason.contains("process limit")),
        "{full:?}"
    );
    let killed = h.client.reset_sandbox(&sb).await?;
    assert!(killed > 10, "killed {killed}");
    let r = h.run(&sb, "echo back").await?;
    assert_eq!(r.stdout.to_lossy_string(), "back\n");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn stdin_reaches_the_command_piped_or_from_a_file() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let mut child = corral(&h)?
        .args(["exec", "-i", "--sandbox", sb.as_str(), "--", "sh"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin
        .write_all(b"echo hi\ncat <<EOF\nfrom a heredoc\nEOF\nexit 4\n")
        .await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hi\nfrom a heredoc\n");

    // Several megabytes, from a file: every byte, then end of input.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("input");
    let data: Vec<u8> = (0..6_000_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    std::fs::write(&path, &data)?;
    let from_file = |args: &'static [&'static str]| {
        let (h, sb, path) = (&h, &sb, &path);
        async move {
            anyhow::Ok(
                corral(h)?
                    .args(["exec", "-i", "--sandbox", sb.as_str(), "--"])
                    .args(args)
                    .stdin(std::fs::File::open(path)?)
                    .output()
                    .await?,
            )
        }
    };
    let out = from_file(&["sh", "-c", "wc -c; echo end"]).await?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).split_whitespace().collect::<Vec<_>>(),
        ["6000000", "end"]
    );

    // A command that stops reading: the rest of the input is dropped.
    let out = from_file(&["head", "-c", "5"]).await?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "abcde");
    h.stop().await;
    Ok(())
}

/// Output of a pseudo-terminal's master side, read on a thread.
struct Screen {
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Screen {
    fn new(master: std::fs::File) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        std::thread::spawn(move || {
            let mut master = master;
            let mut buf = [0u8; 4096];
            while let Ok(n) = master.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Self { seen }
    }

    async fn wait_for(&self, what: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let text = text(&self.seen.lock().unwrap());
            if text.contains(what) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{what:?} never appeared; the screen shows {text:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[allow(unsafe_code)]
fn set_size(fd: &impl AsRawFd, rows: u16, cols: u16) {
    let ws = nix::libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize, alive for the call.
    unsafe {
        nix::libc::ioctl(fd.as_raw_fd(), nix::libc::TIOCSWINSZ, &ws);
    }
}

#[tokio::test]
async fn exec_it_bash_works_like_a_terminal() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let pty = nix::pty::openpty(None, None)?;
    set_size(&pty.master, 33, 101);
    let slave = std::fs::File::from(pty.slave);
    let mut child = corral(&h)?
        .args([
            "exec",
            "-it",
            "--sandbox",
            sb.as_str(),
            "--",
            "bash",
            "--norc",
            "-i",
        ])
        .stdin(Stdio::from(OwnedFd::from(slave.try_clone()?)))
        .stdout(Stdio::from(OwnedFd::from(slave.try_clone()?)))
        .stderr(Stdio::from(OwnedFd::from(slave)))
        .spawn()?;
    let master = std::fs::File::from(pty.master);
    let mut keys = master.try_clone()?;
    let screen = Screen::new(master.try_clone()?);
    let mut type_in = |s: &str| keys.write_all(s.as_bytes());

    type_in("stty size; tty\r")?;
    screen.wait_for("33 101").await?;
    screen.wait_for("/dev/pts/").await?;
    // The window changes: the terminal's size follows.
    set_size(&master, 40, 120);
    let pid = nix::unistd::Pid::from_raw(child.id().context("pid")? as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGWINCH)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    type_in("stty size\r")?;
    screen.wait_for("40 120").await?;
    // Ctrl-C interrupts the command in the sandbox, not corral.
    type_in("sleep 100; echo not-$((6*7))-interrupted\r")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    type_in("\x03")?;
    type_in("echo after-$((40+2))\r")?;
    screen.wait_for("after-42").await?;
    let shown = text(&screen.seen.lock().unwrap());
    assert!(!shown.contains("not-42-interrupted"), "{shown:?}");
    type_in("exit 3\r")?;
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait()).await??;
    assert_eq!(status.code(), Some(3));
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_fifo_is_refused_while_the_sandbox_goes_on() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    assert!(
        h.run(&sb, "mkfifo /workspace/pipe")
            .await?
            .outcome
            .is_success()
    );
    let long = OperationId::random();
    let after = h.client.get_sandbox(&sb).await?.last_seq;
    h.client
        .submit(
            &sb,
            &long,
            OperationSpec::Shell(corral_proto::ShellSpec::new("sleep 1; echo long done")),
        )
        .await?;
    for spec in [
        ReadFileSpec::new("pipe"),
        ReadFileSpec {
            stream: true,
            limit: 0,
            ..ReadFileSpec::new("/workspace/pipe")
        },
    ] {
        let (_, r) = h.run_spec(&sb, OperationSpec::ReadFile(spec)).await?;
        assert!(
            matches!(&r.outcome, Outcome::FileError { kind: FileErrorKind::NotRegular, message } if message.contains("FIFO")),
            "{r:?}"
        );
    }
    assert_eq!(
        h.run(&sb, "echo next").await?.stdout.to_lossy_string(),
        "next\n"
    );
    let (_, r) = collect(&h.client, &sb, &long, after).await?;
    assert_eq!(r.stdout.to_lossy_string(), "long done\n");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_hundred_megabytes_go_in_and_come_back_byte_for_byte() -> Result<()> {
    const SIZE: usize = 100 << 20;
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let data = Bytes::from(
        (0..SIZE)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
            .collect::<Vec<u8>>(),
    );
    let write = OperationId::random();
    let after = h.client.get_sandbox(&sb).await?.last_seq;
    let record = h
        .client
        .submit(
            &sb,
            &write,
            OperationSpec::WriteFile(WriteFileSpec {
                stream: true,
                ..WriteFileSpec::new("big.bin", data.slice(..1 << 20))
            }),
        )
        .await?;
    // The reply does not carry the bytes back.
    let OperationSpec::WriteFile(echo) = &record.spec else {
        bail!("not a write: {:?}", record.spec)
    };
    assert!(echo.data.is_empty());
    let mut offset = 0usize;
    let rest = data.slice(1 << 20..);
    while offset < rest.len() {
        let end = (offset + (1 << 20)).min(rest.len());
        let (taken, closed) = h
            .client
            .write_input(
                &sb,
                &write,
                offset as u64,
                rest.slice(offset..end),
                end == rest.len(),
            )
            .await?;
        assert!(!closed || end == rest.len());
        assert_eq!(taken, end as u64);
        offset = end;
    }
    let (_, r) = collect(&h.client, &sb, &write, after).await?;
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    assert_eq!(r.bytes_written, SIZE as u64);
    assert_eq!(
        h.run(&sb, "wc -c < big.bin")
            .await?
            .stdout
            .to_lossy_string()
            .trim(),
        SIZE.to_string()
    );
    // Appending adds to the end.
    let (_, r) = h
        .run_spec(
            &sb,
            OperationSpec::WriteFile(WriteFileSpec {
                append: true,
                ..WriteFileSpec::new("big.bin", Bytes::from_static(b"tail"))
            }),
        )
        .await?;
    assert!(r.outcome.is_success(), "{r:?}");

    let read = OperationId::random();
    let after = h.client.get_sandbox(&sb).await?.last_seq;
    // Watched before it starts: a watcher holds the sandbox's output
    // window back, so nothing is evicted from the journal before it is read.
    let mut stream = h.client.watch(&sb, after, Some(&read)).await?;
    h.client
        .submit(
            &sb,
            &read,
            OperationSpec::ReadFile(ReadFileSpec {
                stream: true,
                limit: 0,
                ..ReadFileSpec::new("big.bin")
            }),
        )
        .await?;
    let mut got = Vec::with_capacity(SIZE + 4);
    while let Some(event) = stream.next().await {
        match event?.kind {
            EventKind::Output { data, .. } => got.extend_from_slice(&data),
            EventKind::Finished(r) => {
                assert_eq!(r.file_size, SIZE as u64 + 4);
                assert_eq!(r.bytes_written, SIZE as u64 + 4);
                break;
            }
            EventKind::Gap { .. } => bail!("output was dropped"),
            _ => {}
        }
    }
    assert_eq!(got.len(), SIZE + 4);
    assert!(got[..SIZE] == data[..], "the file came back different");
    assert_eq!(&got[SIZE..], b"tail");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_large_write_reply_fits_a_stock_grpc_client() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    // tonic's default: 4 MiB per message received.
    let mut stock = corral_proto::pb::worker_client::WorkerClient::connect(h.url.clone()).await?;
    let spec = OperationSpec::WriteFile(WriteFileSpec::new("five.bin", vec![7u8; 5 << 20]));
    let reply = stock
        .submit_operation(corral_proto::pb::SubmitOperationRequest {
            sandbox_id: sb.to_string(),
            operation_id: OperationId::random().to_string(),
            spec: Some(spec.into()),
        })
        .await?
        .into_inner();
    assert_eq!(reply.sandbox_id, sb.to_string());
    let size = h
        .run(&sb, "wc -c < five.bin")
        .await?
        .stdout
        .to_lossy_string();
    assert_eq!(size.trim(), (5 << 20).to_string());
    h.stop().await;
    Ok(())
}

/// The sandboxes of the harness's worker.
async fn sandboxes(h: &Harness) -> Result<Vec<corral_proto::SandboxInfo>> {
    Ok(h.client.list_sandboxes().await?)
}

async fn wait_running(h: &Harness) -> Result<SandboxId> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(sb) = sandboxes(h)
            .await?
            .into_iter()
            .find(|s| s.running_operations > 0)
        {
            return Ok(sb.id);
        }
        if Instant::now() > deadline {
            bail!("no command started");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_gone(h: &Harness, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    while !sandboxes(h).await?.is_empty() {
        if Instant::now() > deadline {
            bail!("sandboxes left: {:?}", sandboxes(h).await?);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[tokio::test]
async fn exec_ends_its_command_and_sandbox_on_sigterm_sighup_and_a_closed_pipe() -> Result<()> {
    let h = Harness::start().await?;
    for (signal, code) in [
        (nix::sys::signal::Signal::SIGTERM, 143),
        (nix::sys::signal::Signal::SIGHUP, 129),
    ] {
        let child = corral(&h)?
            .args(["exec", "--", "sleep", "300"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        wait_running(&h).await?;
        let pid = nix::unistd::Pid::from_raw(child.id().context("pid")? as i32);
        nix::sys::signal::kill(pid, signal)?;
        let out = tokio::time::timeout(Duration::from_secs(15), child.wait_with_output()).await??;
        assert_eq!(
            out.status.code(),
            Some(code),
            "{signal}: {}",
            text(&out.stderr)
        );
        wait_gone(&h, Duration::from_secs(5)).await?;
    }

    // `| head -2`: once its reader is gone the command is stopped.
    let mut child = corral(&h)?
        .args([
            "exec",
            "--",
            "sh",
            "-c",
            "i=0; while true; do echo line $i; i=$((i+1)); done",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut first = [0u8; 64];
    tokio::io::AsyncReadExt::read_exact(&mut stdout, &mut first).await?;
    assert!(text(&first).starts_with("line 0\nline 1\n"));
    drop(stdout);
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait()).await??;
    assert_eq!(status.code(), Some(141));
    wait_gone(&h, Duration::from_secs(5)).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_sandbox_whose_exec_client_died_is_removed_by_its_worker() -> Result<()> {
    let h = Harness::start().await?;
    let mut child = corral(&h)?
        .args(["exec", "--idle-timeout", "3s", "--", "sleep", "300"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_running(&h).await?;
    // SIGKILL: nothing of the client's own cleanup runs.
    child.kill().await?;
    wait_gone(&h, Duration::from_secs(15)).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn two_commands_without_a_worker_share_one_local_worker_that_leaves_when_idle() -> Result<()>
{
    let state = tempfile::tempdir()?;
    let local = |args: &[&str]| -> Result<tokio::process::Command> {
        let mut cmd = tokio::process::Command::new(binary("corral")?);
        cmd.args(args)
            .env_remove("CORRAL_WORKER")
            .env("CORRAL_STATE_DIR", state.path())
            .env("CORRAL_LOCAL_WORKER_IDLE", "2s")
            .kill_on_drop(true);
        Ok(cmd)
    };
    let first = local(&["exec", "--", "sh", "-c", "sleep 2; echo first"])?.output();
    let second = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        local(&["exec", "--", "echo", "second"])?
            .output()
            .await
            .map_err(anyhow::Error::from)
    };
    let (first, second) = tokio::join!(first, second);
    let (first, second) = (first?, second?);
    assert_eq!(text(&first.stdout), "first\n", "{}", text(&first.stderr));
    assert_eq!(text(&second.stdout), "second\n", "{}", text(&second.stderr));
    assert!(first.status.success() && second.status.success());
    // One worker served both, and it leaves once nobody is connected.
    let log = std::fs::read_to_string(state.path().join("worker.log"))?;
    assert_eq!(log.matches("local worker serving").count(), 1, "{log}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while state.path().join("worker.sock").exists() {
        if Instant::now() > deadline {
            bail!("the local worker did not leave when idle");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(state.path().join("worker.log"))?;
    assert!(log.contains("the local worker exits"), "{log}");
    // The next command starts one again.
    let out = local(&["exec", "--", "echo", "again"])?.output().await?;
    assert_eq!(text(&out.stdout), "again\n", "{}", text(&out.stderr));
    Ok(())
}

/// The worker's own limits: a sandbox that names no idle timeout gets the
/// worker's, and one with a TTL goes when it is up even while a client
/// watches it.
#[tokio::test]
async fn the_workers_idle_timeout_and_a_sandboxs_ttl_remove_it() -> Result<()> {
    let h = Harness::start_with(|c| c.default_idle_timeout = Some(Duration::from_secs(1))).await?;
    h.sandbox().await?;
    wait_gone(&h, Duration::from_secs(15)).await?;

    let h2 = Harness::start().await?;
    let sb = h2
        .sandbox_with(corral_proto::SandboxSpec {
            ttl_ms: Some(1500),
            ..corral_proto::SandboxSpec::default()
        })
        .await?;
    // Watched all along: busy, and still removed at its TTL. Its watcher
    // is told why, as is a call that names it afterwards.
    let mut watch = h2.client.watch(&sb, 0, None).await?;
    wait_gone(&h2, Duration::from_secs(15)).await?;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(10), watch.next()).await? {
            Some(Ok(_)) => continue,
            other => break other,
        }
    };
    let Some(Err(e)) = end else {
        panic!("the watch of a removed sandbox ended as if whole: {end:?}");
    };
    assert!(
        e.to_string()
            .contains("was removed: it lived past its lifetime"),
        "{e}"
    );
    let named = h2.client.get_sandbox(&sb).await.unwrap_err();
    assert!(
        named
            .to_string()
            .contains("was removed: it lived past its lifetime"),
        "{named}"
    );
    h.stop().await;
    h2.stop().await;
    Ok(())
}

/// The output bytes among `events`.
fn output_of(events: &[EventKind]) -> Vec<u8> {
    events
        .iter()
        .filter_map(|k| match k {
            EventKind::Output { data, .. } => Some(data.to_vec()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// A `RunOperation` stream, read whole: its first message's operation,
/// then its events (an error if it does not end within 60 s).
async fn run_stream(
    h: &Harness,
    req: corral_proto::pb::SubmitOperationRequest,
) -> std::result::Result<(corral_proto::pb::Operation, Vec<EventKind>), tonic::Status> {
    use corral_proto::pb::run_operation_response::Kind;
    let mut stream = h.client.raw().run_operation(req).await?.into_inner();
    let Some(Kind::Submitted(op)) = stream.message().await?.and_then(|m| m.kind) else {
        return Err(tonic::Status::internal("no operation first"));
    };
    let mut events = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .map_err(|_| tonic::Status::deadline_exceeded("no end"))??;
        match next.and_then(|m| m.kind) {
            None => return Ok((op, events)),
            Some(Kind::Event(e)) => events.push(
                corral_proto::Event::try_from(e)
                    .map_err(|e| tonic::Status::internal(e.to_string()))?
                    .kind,
            ),
            Some(Kind::Submitted(_)) => return Err(tonic::Status::internal("a second operation")),
        }
    }
}

#[tokio::test]
async fn a_run_is_one_call_that_ends_with_its_result_and_runs_its_id_once() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let id = OperationId::random();
    let req = |command: &str| corral_proto::pb::SubmitOperationRequest {
        sandbox_id: sb.to_string(),
        operation_id: id.to_string(),
        spec: Some(OperationSpec::Shell(corral_proto::ShellSpec::new(command)).into()),
    };
    // Another run of the sandbox meanwhile: neither stream has the
    // other's events.
    let other = run_stream(
        &h,
        corral_proto::pb::SubmitOperationRequest {
            operation_id: OperationId::random().to_string(),
            ..req("for i in $(seq 50); do echo other; sleep 0.01; done")
        },
    );
    let counted = "echo ran >> /tmp/runs; head -c 3000000 /dev/zero | tr '\\0' x; exit 3";
    let (ran, other) = tokio::join!(run_stream(&h, req(counted)), other);
    let (op, events) = ran?;
    let (_, other) = other?;
    let said = output_of(&other);
    assert_eq!(said, b"other\n".repeat(50));
    assert_eq!(op.operation_id, id.to_string());
    let out = output_of(&events);
    assert_eq!(
        out.len(),
        3_000_000,
        "the output came whole, and only its own"
    );
    assert!(out.iter().all(|b| *b == b'x'));
    let Some(EventKind::Finished(r)) = events.last() else {
        panic!(
            "the stream did not end with its result: {:?}",
            events.last()
        );
    };
    assert_eq!(r.outcome, Outcome::Exited { code: 3 });
    // Its id again: the same operation, not run twice, its events replayed.
    let (again, replayed) = run_stream(&h, req(counted)).await?;
    assert_eq!(
        again.status,
        corral_proto::pb::OperationStatus::Finished as i32
    );
    assert!(matches!(replayed.last(), Some(EventKind::Finished(_))));
    assert_eq!(
        h.run(&sb, "wc -l < /tmp/runs")
            .await?
            .stdout
            .to_lossy_string()
            .trim(),
        "1"
    );
    // Its id with another command: refused; an unknown sandbox: not found.
    let refused = run_stream(&h, req("true")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
    let missing = run_stream(
        &h,
        corral_proto::pb::SubmitOperationRequest {
            sandbox_id: "no-such-sandbox".into(),
            ..req("true")
        },
    )
    .await
    .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
    // An 8 MiB write is a run's to make, as a submit's.
    let write = corral_proto::pb::SubmitOperationRequest {
        operation_id: OperationId::random().to_string(),
        spec: Some(
            OperationSpec::WriteFile(WriteFileSpec::new("big.bin", vec![1u8; 8 << 20])).into(),
        ),
        ..req("true")
    };
    let (_, events) = run_stream(&h, write).await?;
    assert!(matches!(events.last(), Some(EventKind::Finished(r)) if r.outcome.is_success()));
    h.stop().await;
    Ok(())
}

/// Input calls may come in any order within 8 MiB of what the command has
/// (a client with several in flight): one past it waits for those before
/// it, and the command reads every byte in its place; one further is
/// refused at once as a gap, and the input goes on; one whose
/// predecessors never come is refused after 10 s.
#[tokio::test]
async fn input_calls_out_of_order_are_put_in_order_and_a_far_gap_is_refused() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let op = OperationId::random();
    let mut spec = corral_proto::ShellSpec::new(
        "cat > /tmp/in && head -c 1048576 /tmp/in | tr -d a | wc -c \
         && tail -c 1048576 /tmp/in | tr -d b | wc -c && wc -c < /tmp/in",
    );
    spec.stdin = true;
    let rec = h
        .client
        .submit(&sb, &op, OperationSpec::Shell(spec))
        .await?;
    let mib = 1u64 << 20;
    let a = Bytes::from(vec![b'a'; mib as usize]);
    let b = Bytes::from(vec![b'b'; mib as usize]);
    // The second MiB first: it waits for the first.
    let second = {
        let (client, sb, op) = (h.client.clone(), sb.clone(), op.clone());
        tokio::spawn(async move { client.write_input(&sb, &op, mib, b, false).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "a call past the input waits");
    let far = h
        .client
        .write_input(&sb, &op, 20 * mib, Bytes::from_static(b"x"), false)
        .await;
    assert!(
        matches!(&far, Err(e) if e.reason() == Some(corral_proto::reason::Reason::InputGap)),
        "{far:?}"
    );
    h.client.write_input(&sb, &op, 0, a, false).await?;
    second.await??;
    h.client
        .write_input(&sb, &op, 2 * mib, Bytes::new(), true)
        .await?;
    let (_, r) = collect(&h.client, &sb, &op, rec.first_seq.saturating_sub(1)).await?;
    assert_eq!(r.outcome, Outcome::Exited { code: 0 }, "{r:?}");
    assert_eq!(r.stdout.to_lossy_string(), "0\n0\n2097152\n");
    // A call past the input whose predecessors never come is refused as
    // a gap after a while (10 s), not kept waiting.
    let op = OperationId::random();
    let mut spec = corral_proto::ShellSpec::new("cat >/dev/null");
    spec.stdin = true;
    h.client
        .submit(&sb, &op, OperationSpec::Shell(spec))
        .await?;
    let started = Instant::now();
    let alone = tokio::time::timeout(
        Duration::from_secs(60),
        h.client
            .write_input(&sb, &op, mib, Bytes::from_static(b"x"), false),
    )
    .await?;
    assert!(
        matches!(&alone, Err(e) if e.reason() == Some(corral_proto::reason::Reason::InputGap)),
        "{alone:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "{:?}",
        started.elapsed()
    );
    h.client.cancel(&sb, &op).await?;
    Ok(())
}
