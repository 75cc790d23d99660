//! The way out: nothing that leaves a sandbox harms the host, another
//! user, or the worker. A tree copied out comes bounded (modes, links,
//! special files, git's configuration, a byte ceiling); the archive helper
//! cannot be traced by the sandbox's commands; nothing a command starts
//! outlives it by leaving its session; the user's token goes to no socket
//! another user listens on; a second signal ends `corral exec` whatever its
//! worker is doing.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use corral_e2e::{Harness, binary};
use corral_proto::{OperationSpec, SandboxId, SandboxSpec, ShellSpec};

async fn corral(url: &str, args: &[&str]) -> Result<Output> {
    Ok(tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(url)
        .args(args)
        .env_remove("CORRAL_WORKER")
        .output()
        .await?)
}

async fn ok(h: &Harness, sb: &SandboxId, cmd: &str) -> Result<String> {
    let r = h.run(sb, cmd).await?;
    if !r.outcome.is_success() {
        bail!("{cmd}: {r:?}");
    }
    Ok(r.stdout.to_lossy_string())
}

fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", dir)
        .output()?;
    if !out.status.success() {
        bail!("git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A hostile tree: a repository whose config runs a command through
/// `core.fsmonitor`, a hook, modes 0777 and 0666, a FIFO, and one 8 MB file
/// under a hundred hard links. What comes out: no git configuration (said
/// so), modes at most 0755/0644, no FIFO (said so), the links as links (8
/// MB, not 800), and a ceiling that stops a copy with a clear error.
#[tokio::test]
async fn a_hostile_tree_comes_out_bounded() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let sid = sb.as_str();
    let local = tempfile::tempdir()?;
    let marker = local.path().join("fsmonitor-ran");
    // A real repository, made here and copied in.
    let repo = local.path().join("proj");
    std::fs::create_dir(&repo)?;
    git(&repo, &["init", "-q"])?;
    std::fs::write(repo.join("a.txt"), "a\n")?;
    let up = corral(
        &h.url,
        &["cp", repo.to_str().unwrap(), &format!("{sid}:/workspace/")],
    )
    .await?;
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    ok(
        &h,
        &sb,
        &format!(
            "cd /workspace/proj && printf '[core]\\n\\tfsmonitor = \"touch {m}; false\"\\n' >> .git/config && \
             mkdir -p .git/hooks && printf '#!/bin/sh\\ntouch {m}\\n' > .git/hooks/post-checkout && \
             chmod 755 .git/hooks/post-checkout && \
             echo x > open.sh && chmod 0777 open.sh && echo y > open.txt && chmod 0666 open.txt && \
             mkfifo pipe && head -c 8388608 /dev/zero > big && \
             for i in $(seq 1 100); do ln big link$i; done",
            m = marker.display()
        ),
    )
    .await?;
    let out = local.path().join("out");
    std::fs::create_dir(&out)?;
    let got = corral(
        &h.url,
        &["cp", &format!("{sid}:proj"), out.to_str().unwrap()],
    )
    .await?;
    let said = String::from_utf8_lossy(&got.stderr);
    assert!(got.status.success(), "{said}");
    let copy = out.join("proj");
    assert!(!copy.join(".git/config").exists(), "git's config came out");
    assert!(!copy.join(".git/hooks").exists(), "git's hooks came out");
    assert!(copy.join(".git/HEAD").is_file());
    assert!(
        said.contains(".git/config: git configuration, left out"),
        "{said}"
    );
    assert!(said.contains("--with-git-config"), "{said}");
    assert!(said.contains("pipe: a special file, left out"), "{said}");
    assert!(said.lines().count() < 8, "one line per hook: {said}");
    assert!(!copy.join("pipe").exists());
    // git run in the copy runs nothing of the sandbox's.
    git(&copy, &["status", "--short"])?;
    assert!(!marker.exists(), "the sandbox's fsmonitor ran on the host");
    let mode = |p: &str| -> Result<u32> {
        Ok(std::fs::metadata(copy.join(p))?.permissions().mode() & 0o7777)
    };
    assert_eq!(mode("open.sh")?, 0o755);
    assert_eq!(mode("open.txt")?, 0o644);
    let big = std::fs::metadata(copy.join("big"))?;
    assert_eq!(big.nlink(), 101, "hard links came out as copies");
    assert_eq!(big.len(), 8 << 20);
    let used = std::process::Command::new("du")
        .args(["-sk"])
        .arg(&copy)
        .output()?;
    let kib: u64 = String::from_utf8_lossy(&used.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .parse()?;
    assert!(kib < 12 * 1024, "{kib} KiB on disk for one 8 MB file");

    // Asked for: the configuration comes.
    let again = local.path().join("again");
    let got = corral(
        &h.url,
        &[
            "cp",
            "--with-git-config",
            &format!("{sid}:proj"),
            again.to_str().unwrap(),
        ],
    )
    .await?;
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert!(again.join(".git/config").is_file());
    // A ceiling: a clear error, and nothing past it.
    let capped = local.path().join("capped");
    let got = corral(
        &h.url,
        &[
            "cp",
            "--max-bytes",
            "1m",
            &format!("{sid}:proj"),
            capped.to_str().unwrap(),
        ],
    )
    .await?;
    let said = String::from_utf8_lossy(&got.stderr);
    assert_eq!(got.status.code(), Some(125), "{said}");
    assert!(said.contains("--max-bytes"), "{said}");
    assert!(!capped.join("big").exists());
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

/// A command that leaves its session (`setsid`), and one whose parent dies
/// at once, used to outlive their operation and could then work on what
/// came after it (the archive helper of a `cp`, say). Now they end with it.
#[tokio::test]
async fn nothing_a_command_starts_outlives_it_by_leaving_its_session() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    ok(
        &h,
        &sb,
        "setsid sh -c 'exec sleep 1001' >/dev/null 2>&1 & \
         ( setsid sh -c 'exec sleep 1002' >/dev/null 2>&1 & ) ; sleep 0.3",
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left = ok(
        &h,
        &sb,
        "for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done | grep -c 'sleep 100[12]' || true",
    )
    .await?;
    assert_eq!(
        left.trim(),
        "0",
        "processes that left their session live on"
    );
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

/// Waits (30 s at most) for the archive helpers of three copies, tries to
/// attach to each (`PTRACE_ATTACH`), and writes `RESULT ERRNO` per attempt
/// to /tmp/tracer.out; /tmp/tracer.ready once it watches.
/// Watches for three archive helpers (each a process of the supervisor's program,
/// its argv[0] that of PID 1, whose parent is an operation's keeper, not
/// PID 1, and which still is 200 ms later: a command is that too, until
/// its exec is through) and tries to open its memory;
/// first the same on a control, a plain process of the sandbox's user that
/// it did not start, which must succeed for the attempts to mean anything
/// (the sandbox's user may read its own processes' memory). Opening it is
/// what an attach (ptrace) needs too, without disturbing what it opens.
const TRACER: &str = r#"
import os, time
def argv(p):
    return open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")
def ppid(p):
    for line in open("/proc/%s/status" % p):
        if line.startswith("PPid:"):
            return int(line.split()[1])
def attempt(p):
    try:
        os.close(os.open("/proc/%s/mem" % p, os.O_RDONLY))
        return 0
    except OSError as err:
        return err.errno
init = argv(1)[0]
control = [p for p in os.listdir("/proc") if p.isdigit() and argv(p)[:2] == [b"sleep", b"301"]]
results = ["control %d" % attempt(control[0]) if control else "control none"]
checked, helpers, end = set(), 0, time.time() + 30
open("/tmp/tracer.ready", "w").close()
while time.time() < end and helpers < 3:
    for p in os.listdir("/proc"):
        if not p.isdigit() or p in checked or p == "1":
            continue
        try:
            if argv(p)[0] != init or ppid(p) == 1:
                continue
        except (OSError, TypeError, IndexError):
            continue
        checked.add(p)
        r = attempt(p)
        time.sleep(0.2)
        try:
            if argv(p)[0] != init:
                continue
        except (OSError, IndexError):
            continue
        helpers += 1
        results.append("helper %d" % r)
with open("/tmp/tracer.out", "w") as f:
    f.write("\n".join(results) + "\n")
"#;

/// The attack that wrote `~/.bashrc` through `corral cp`: a process of the
/// sandbox's user (kept in the background, the strongest case) waits for
/// the archive helper and opens its memory (or traces it) to make it emit
/// extra entries. The helper is a fork of the supervisor, never exec'd, so
/// it is not dumpable from its first instruction: every attempt fails, for
/// a sandbox whose commands are root too (an exec'd helper was open to them
/// in the moment before it made itself untraceable).
async fn the_archive_helper_resists_a_tracer(run_as_root: bool) -> Result<()> {
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            image: Some("corral-debian:latest".into()),
            run_as_root,
            ..SandboxSpec::default()
        })
        .await?;
    for command in [
        "sleep 301 &".to_owned(),
        format!("cat > /tmp/tracer.py <<'EOF'\n{TRACER}\nEOF\npython3 /tmp/tracer.py &"),
    ] {
        let mut spec = ShellSpec::new(command);
        spec.keep_background = true;
        h.run_spec(&sb, OperationSpec::Shell(spec)).await?;
    }
    ok(
        &h,
        &sb,
        "while [ ! -e /tmp/tracer.ready ]; do sleep 0.05; done",
    )
    .await?;
    // Three uploads whose archives come in part and then wait: their
    // helpers live until the tracer is done with them.
    let mut header = tar::Header::new_gnu();
    header.set_path("report.bin")?;
    header.set_size(1 << 20);
    header.set_mode(0o644);
    header.set_cksum();
    let mut first = header.as_bytes().to_vec();
    first.extend(std::iter::repeat_n(7u8, 4096));
    let mut held = Vec::new();
    for i in 0..3 {
        let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(2);
        tx.send(first.clone().into()).await?;
        let uploading = tokio::spawn({
            let client = h.client.clone();
            let sb = sb.clone();
            async move {
                client
                    .upload(
                        &sb,
                        &corral_proto::OperationId::random(),
                        &format!("report-{i}.bin"),
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                    )
                    .await
            }
        });
        held.push((tx, uploading));
    }
    let results = ok(
        &h,
        &sb,
        "for i in $(seq 1 400); do [ -e /tmp/tracer.out ] && break; sleep 0.1; done; cat /tmp/tracer.out",
    )
    .await?;
    // The uploads end without their end: the worker cancels them.
    for (tx, uploading) in held {
        drop(tx);
        let _ = uploading.await?;
    }
    let mut lines = results.lines().filter(|l| !l.is_empty());
    assert_eq!(
        lines.next(),
        Some("control 0"),
        "the sandbox's user could not open its own process's memory, so the attempt on the helper means nothing: {results}"
    );
    assert_eq!(
        lines.collect::<Vec<_>>(),
        vec!["helper 13"; 3],
        "the tracer did not find the helper, or opened its memory (EACCES expected): {results}"
    );
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_archive_helper_cannot_be_traced_by_the_sandbox() -> Result<()> {
    the_archive_helper_resists_a_tracer(false).await
}

#[tokio::test]
async fn the_archive_helper_cannot_be_traced_by_a_root_sandbox() -> Result<()> {
    the_archive_helper_resists_a_tracer(true).await
}

/// Another local user (nobody) listening on a port of loopback (0: any),
/// writing down each connection's bytes, in hex, a line each.
struct Squatter {
    child: tokio::process::Child,
    stdout: tokio::process::ChildStdout,
    port: u16,
}

const SQUAT: &str = r#"
import socket, sys, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(16)
print(s.getsockname()[1], flush=True)
lock = threading.Lock()
def serve(c):
    c.settimeout(2)
    got = b""
    try:
        while True:
            d = c.recv(65536)
            if not d:
                break
            got += d
    except OSError:
        pass
    with lock:
        print(got.hex(), flush=True)
s.settimeout(60)
while True:
    try:
        c, _ = s.accept()
    except OSError:
        break
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

impl Squatter {
    async fn start(port: u16) -> Result<Self> {
        use tokio::io::AsyncBufReadExt;
        if !nix::unistd::geteuid().is_root() {
            bail!("this test needs root (it runs a listener as the user nobody)");
        }
        // Debian's python: a toolchain under root's home is not nobody's
        // to run.
        let mut child = tokio::process::Command::new("/usr/bin/python3")
            .args(["-c", SQUAT, &port.to_string()])
            .uid(65534)
            .gid(65534)
            .current_dir("/")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut stdout = child.stdout.take().context("piped")?;
        let mut first = Vec::new();
        tokio::io::BufReader::new(&mut stdout)
            .read_until(b'\n', &mut first)
            .await?;
        let port = String::from_utf8_lossy(&first).trim().parse()?;
        Ok(Self {
            child,
            stdout,
            port,
        })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops it, and fails if any connection carried a request (and so
    /// the token).
    async fn assert_no_request(self, what: &str) -> Result<()> {
        let got = self.got().await?;
        assert!(
            !got.iter().any(|c| sent_a_request(c)),
            "the squatter got {what}: {got:?}"
        );
        Ok(())
    }

    /// What each connection sent, once it is stopped.
    async fn got(mut self) -> Result<Vec<Vec<u8>>> {
        // Connections still open have two seconds to say what they got.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        self.child.start_kill()?;
        let mut out = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut self.stdout, &mut out).await?;
        out.lines()
            .map(|l| {
                (0..l.len() / 2)
                    .map(|i| u8::from_str_radix(&l[2 * i..2 * i + 2], 16).map_err(Into::into))
                    .collect()
            })
            .collect()
    }
}

/// Whether `bytes` (what a client sent on one connection) hold an HTTP/2
/// request: a HEADERS frame after the preface, which carries the token
/// (the whole of it, whatever HPACK made of its bytes). A probe of what the
/// listener speaks (a cut TLS hello, a bare preface) carries none.
fn sent_a_request(bytes: &[u8]) -> bool {
    let Some(mut rest) = bytes.strip_prefix(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice()) else {
        return false;
    };
    while rest.len() >= 9 {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        if rest[3] == 1 {
            return true;
        }
        rest = &rest[(9 + len).min(rest.len())..];
    }
    false
}

/// Another local user takes the port of a stopped worker: `corral` finds
/// that the socket is not its user's (nor root's) and sends it no token.
#[tokio::test]
async fn a_squatter_on_the_workers_port_gets_no_token() -> Result<()> {
    let home = tempfile::tempdir()?;
    let state = home.path().join(".local/state/corral/worker");
    std::fs::create_dir_all(&state)?;
    let token = "own-token-of-this-user-0123456789";
    std::fs::write(state.join("token"), token)?;
    std::fs::set_permissions(state.join("token"), std::fs::Permissions::from_mode(0o600))?;
    let squatter = Squatter::start(0).await?;
    let out = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", &squatter.url(), "exec", "--", "true"])
        .env("HOME", home.path())
        .env_remove("XDG_STATE_HOME")
        .env_remove("CORRAL_WORKER")
        .env_remove("CORRAL_TOKEN_FILE")
        .output()
        .await?;
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{said}");
    assert!(said.contains("belongs to uid 65534"), "{said}");
    squatter.assert_no_request("the token").await?;
    Ok(())
}

/// A client connected to its worker, which stops; another local user takes
/// the port before the client calls again: the reconnect sends that user
/// nothing (every connection is checked, not only the first).
#[tokio::test]
async fn a_squatter_on_a_restarted_workers_port_gets_no_token_on_reconnect() -> Result<()> {
    use corral_harness::client::{Credentials, WorkerClient};
    let state = tempfile::tempdir()?;
    let port = corral_e2e::free_port()?;
    let wid = corral_e2e::unique_id("squat");
    let mut worker = corral_e2e::WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let token = worker.token();
    let client = WorkerClient::connect_with(&worker.url, &Credentials::token(Some(&token))).await?;
    client.list_sandboxes().await?;
    worker.kill9();
    let squatter = Squatter::start(port).await?;
    // A caller waiting for its worker tries again and again.
    for _ in 0..5 {
        client
            .list_sandboxes()
            .await
            .err()
            .context("a call answered by the squatter")?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    squatter
        .assert_no_request("a request with the token")
        .await?;
    // The worker back on its port: the same client goes on.
    let worker = corral_e2e::WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    client.list_sandboxes().await?;
    drop(worker);
    Ok(())
}

/// `corral run --control URL`: the service's token (which reaches every
/// session it hosts) goes to no socket of another user.
#[tokio::test]
async fn a_squatter_on_the_services_port_gets_no_token() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("service-token");
    std::fs::write(&token_file, "service-token-0123456789abcdef")?;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    let squatter = Squatter::start(0).await?;
    let out = tokio::process::Command::new(binary("corral")?)
        .args(["run", "--control", &squatter.url(), "--control-token-file"])
        .arg(&token_file)
        .arg("say hello")
        .env("HOME", dir.path())
        .env_remove("CORRAL_WORKER")
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let said = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("belongs to uid 65534"), "{said}");
    squatter.assert_no_request("the service's token").await?;
    Ok(())
}

/// The first SIGTERM cancels the command, which waits for the worker; the
/// worker waits for its Docker engine, which is gone. A second SIGTERM
/// ends `corral exec` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_exec_during_a_docker_outage() -> Result<()> {
    use tokio::net::{UnixListener, UnixStream};
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("docker.sock");
    let listener = UnixListener::bind(&sock)?;
    let proxy = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            conns.spawn(async move {
                if let Ok(mut docker) = UnixStream::connect("/var/run/docker.sock").await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut docker).await;
                }
            });
        }
    });
    let host = format!("unix://{}", sock.display());
    let h = Harness::start_with(|c| c.docker_host = Some(host.clone())).await?;
    let sb = h.sandbox().await?;
    let mut exec = tokio::process::Command::new(binary("corral")?)
        .args([
            "--worker",
            &h.url,
            "exec",
            "--sandbox",
            sb.as_str(),
            "--",
            "sh",
            "-c",
        ])
        .arg("trap '' TERM; echo started; sleep 300")
        .env_remove("CORRAL_WORKER")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = exec.stdout.take().expect("piped");
    let mut line = String::new();
    {
        use tokio::io::AsyncBufReadExt;
        tokio::io::BufReader::new(&mut stdout)
            .read_line(&mut line)
            .await?;
    }
    assert_eq!(line, "started\n");
    // The engine goes away (every connection with it).
    proxy.abort();
    let _ = proxy.await;
    let _ = std::fs::remove_file(&sock);
    let pid = nix::unistd::Pid::from_raw(exec.id().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        exec.try_wait()?.is_none(),
        "the first SIGTERM waits for the cancel"
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let status = tokio::time::timeout(Duration::from_secs(5), exec.wait())
        .await
        .map_err(|_| anyhow::anyhow!("corral exec still runs 5 s after a second SIGTERM"))??;
    assert_eq!(status.code(), Some(143));
    let mut err = String::new();
    if let Some(mut e) = exec.stderr.take() {
        tokio::io::AsyncReadExt::read_to_string(&mut e, &mut err).await?;
    }
    assert!(err.contains("second signal"), "{err}");
    // Its sandbox goes with the harness (by its worker's label).
    drop(h);
    Ok(())
}

/// `corral exec` started while its worker's Docker engine is away waits
/// for the sandbox it makes; a SIGTERM (or SIGINT, SIGHUP) then ends it at
/// once, saying so, as one during its command would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_started_during_a_docker_outage_ends_on_a_signal() -> Result<()> {
    use tokio::net::UnixListener;
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("docker.sock");
    let listener = UnixListener::bind(&sock)?;
    let proxy = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            conns.spawn(async move {
                if let Ok(mut docker) =
                    tokio::net::UnixStream::connect("/var/run/docker.sock").await
                {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut docker).await;
                }
            });
        }
    });
    let host = format!("unix://{}", sock.display());
    let h = Harness::start_with(|c| c.docker_host = Some(host.clone())).await?;
    // The engine goes away before the command is asked for.
    proxy.abort();
    let _ = proxy.await;
    let _ = std::fs::remove_file(&sock);
    for (signal, code) in [
        (nix::sys::signal::Signal::SIGTERM, 143),
        (nix::sys::signal::Signal::SIGINT, 130),
        (nix::sys::signal::Signal::SIGHUP, 129),
    ] {
        let mut exec = tokio::process::Command::new(binary("corral")?)
            .args(["--worker", &h.url, "exec", "--", "true"])
            .env_remove("CORRAL_WORKER")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            exec.try_wait()?.is_none(),
            "exec did not wait for the engine"
        );
        let pid = nix::unistd::Pid::from_raw(exec.id().expect("running") as i32);
        nix::sys::signal::kill(pid, signal)?;
        let status = tokio::time::timeout(Duration::from_secs(6), exec.wait())
            .await
            .map_err(|_| anyhow::anyhow!("corral exec still runs 6 s after {signal}"))??;
        let mut err = String::new();
        if let Some(mut e) = exec.stderr.take() {
            tokio::io::AsyncReadExt::read_to_string(&mut e, &mut err).await?;
        }
        assert_eq!(status.code(), Some(code), "{signal}: {err}");
        assert!(err.contains("before the command started"), "{err}");
    }
    drop(h);
    Ok(())
}

/// A Download whose client stops reading is dropped by the worker (it may
/// not hold the sandbox's output back); the stream then ends with an
/// error, never as if the archive were whole.
#[tokio::test]
async fn a_dropped_download_ends_with_an_error() -> Result<()> {
    use corral_harness::client::DownloadPart;
    use futures_util::StreamExt;
    let h = Harness::start_with(|c| c.sandbox_limits.watch_stall = Duration::from_secs(1)).await?;
    let sb = h.sandbox().await?;
    ok(&h, &sb, "head -c 200000000 /dev/urandom > /workspace/big").await?;
    let mut parts = h
        .client
        .download(
            &sb,
            &corral_proto::OperationId::random(),
            corral_proto::ArchiveSpec::new("big"),
        )
        .await?;
    let first = parts.next().await;
    assert!(
        matches!(first, Some(Ok(DownloadPart::Data(_)))),
        "{first:?}"
    );
    // Not reading for longer than the worker waits for a stalled watch.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (mut bytes, mut finished, mut error) = (0usize, false, None);
    while let Some(part) = parts.next().await {
        match part {
            Ok(DownloadPart::Data(d)) => bytes += d.len(),
            Ok(DownloadPart::Finished(_)) => finished = true,
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        }
    }
    assert!(!finished, "a dropped download said it finished");
    let error = error.ok_or_else(|| anyhow::anyhow!("ended OK after {bytes} bytes"))?;
    assert!(error.contains("incomplete"), "{error}");
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

/// The host pid of the process of `uid` whose command line is `argv`.
async fn host_pid(uid: u32, argv: &str) -> Result<u32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        for entry in std::fs::read_dir("/proc")? {
            let path = entry?.path();
            let Some(pid) = path
                .file_name()
                .and_then(|n| n.to_str()?.parse::<u32>().ok())
            else {
                continue;
            };
            let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
            let cmdline = std::fs::read(path.join("cmdline")).unwrap_or_default();
            if status.contains(&format!("\nUid:\t{uid}\t"))
                && String::from_utf8_lossy(&cmdline).replace('\0', " ").trim() == argv
            {
                return Ok(pid);
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no process {argv:?} of uid {uid} on the host");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a host process of `uid` reaches of process `pid`: its files
/// (through /proc/PID/root), its environment, a signal.
fn reach_as(uid: u32, pid: u32) -> Result<String> {
    let probe = format!(
        "cat /proc/{pid}/root/workspace/secret.txt >/dev/null 2>&1 && echo file; \
         grep -q hunter2 /proc/{pid}/environ 2>/dev/null && echo environ; \
         kill -0 {pid} 2>/dev/null && echo signal; true"
    );
    let out = std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "sh",
            "-c",
            &probe,
        ])
        .output()?;
    if !out.status.success() {
        bail!("setpriv: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .replace('\n', " ")
        .trim()
        .to_string())
}

/// Every sandbox's commands run as a uid of its own, which no host account
/// holds: the host's uid 1000 (the uid sandboxes once all had) reaches
/// neither a running command's files, nor its environment, nor its
/// signals, while the sandbox's own uid would reach all three (so the probe
/// can tell). Two sandboxes never share a uid, nor the kernel's per-user
/// limits: one that holds every inotify instance a user may have leaves
/// the other free to make one.
#[tokio::test]
async fn a_host_user_and_another_sandbox_reach_nothing_of_a_sandbox() -> Result<()> {
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let debian = || SandboxSpec {
        image: Some("corral-debian:latest".into()),
        ..Default::default()
    };
    let a = h.sandbox_with(debian()).await?;
    let b = h.sandbox_with(debian()).await?;
    let uid_a: u32 = ok(&h, &a, "id -u").await?.trim().parse()?;
    let uid_b: u32 = ok(&h, &b, "id -u").await?.trim().parse()?;
    let range = corral_worker::uids::DEFAULT;
    assert_ne!(uid_a, uid_b);
    for uid in [uid_a, uid_b] {
        assert!((range.first..=range.last).contains(&uid), "{uid}");
    }
    assert_eq!(ok(&h, &a, "whoami").await?, "sandbox\n");

    ok(&h, &a, "echo private > /workspace/secret.txt").await?;
    let op = corral_proto::OperationId::random();
    h.client
        .submit(
            &a,
            &op,
            OperationSpec::Shell(ShellSpec::new("export TOKEN=hunter2; exec sleep 301")),
        )
        .await?;
    let pid = host_pid(uid_a, "sleep 301").await?;
    assert_eq!(
        reach_as(uid_a, pid)?,
        "file environ signal",
        "the probe works"
    );
    assert_eq!(
        reach_as(1000, pid)?,
        "",
        "host uid 1000 reaches the sandbox"
    );
    assert_eq!(
        reach_as(uid_b, pid)?,
        "",
        "another sandbox's uid reaches it"
    );
    h.client.cancel(&a, &op).await?;

    // The per-user inotify limit: a holds all of its user's instances.
    let hold = "import ctypes, time\n\
                libc = ctypes.CDLL(None, use_errno=True)\n\
                fds = []\n\
                while libc.inotify_init1(0) >= 0: fds.append(1)\n\
                open('/tmp/held', 'w').write(f'{len(fds)} {ctypes.get_errno()}')\n\
                time.sleep(300)\n";
    let one = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); \
               print('made' if libc.inotify_init1(0) >= 0 else ctypes.get_errno())";
    ok(&h, &a, &format!("cat > /tmp/hold.py <<'EOF'\n{hold}EOF")).await?;
    let holder = corral_proto::OperationId::random();
    h.client
        .submit(
            &a,
            &holder,
            OperationSpec::Shell(ShellSpec::new("exec python3 /tmp/hold.py")),
        )
        .await?;
    let limit = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")?;
    let mut tries = 0;
    let held = loop {
        let r = h.run(&a, "cat /tmp/held 2>/dev/null").await?;
        // Made empty, then written: a read in between sees nothing yet.
        if r.outcome.is_success() && !r.stdout.to_lossy_string().is_empty() {
            break r.stdout.to_lossy_string();
        }
        tries += 1;
        if tries > 300 {
            bail!("the holder never said how many instances it holds");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        held,
        format!("{} 24", limit.trim()),
        "EMFILE at the user's limit"
    );
    let cmd = format!("python3 -c \"{one}\"");
    assert_eq!(ok(&h, &a, &cmd).await?, "24\n", "a's user is at its limit");
    assert_eq!(ok(&h, &b, &cmd).await?, "made\n", "b shares a's limit");
    h.client.cancel(&a, &holder).await?;
    h.stop().await;
    Ok(())
}

/// The same attack made by a hostile model through `corral run`, with one
/// ordinary Bash call, as it was first done: it starts the tracer in a
/// session of its own, detached, so that it waits for the archive helper
/// of the run's `--export`. Nothing the call starts outlives it, so no
/// tracer is left when the export runs: the export is the workspace's
/// tree alone, beside files of the user's it never touches.
#[tokio::test]
async fn a_hostile_models_tracer_is_gone_before_corral_run_exports() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let home = tempfile::tempdir()?;
    std::fs::write(home.path().join(".bashrc"), "mine\n")?;
    let export = home.path().join("out");
    let attack = format!(
        "cat > /tmp/tracer.py <<'EOF'\n{TRACER}\nEOF\n\
         head -c 8388608 /dev/urandom > /workspace/report.bin\n\
         setsid nohup python3 /tmp/tracer.py >/dev/null 2>&1 < /dev/null &\n\
         while [ ! -e /tmp/tracer.ready ]; do sleep 0.05; done; echo waiting"
    );
    let args = serde_json::json!({ "command": attack }).to_string();
    let model = ModelServer::start(vec![
        responses::calls(&[("c1", "Bash", &args)]),
        responses::text("The report is ready."),
    ])
    .await;
    let run = corral_e2e::run::corral_run_default_image(
        &model,
        &h.url,
        sessions.path(),
        &["--export", export.to_str().unwrap(), "write the report"],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let shown = run.of_type("tool_result");
    assert!(
        shown[0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("waiting"),
        "the tracer started: {shown:?}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&export)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    assert_eq!(names, ["report.bin"], "the export is the workspace's tree");
    assert_eq!(std::fs::metadata(export.join("report.bin"))?.len(), 8 << 20);
    assert_eq!(
        std::fs::read_to_string(home.path().join(".bashrc"))?,
        "mine\n"
    );
    // The sandbox is kept (CORRAL_KEEP_SANDBOX): the tracer is not in it,
    // and never got to attach to anything.
    let started = run.of_type("session_started");
    let sandbox = SandboxId::new(started[0]["sandbox_id"].as_str().unwrap_or_default())?;
    let left = ok(
        &h,
        &sandbox,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c 'tracer[.]py' || true; \
         cat /tmp/tracer.out 2>/dev/null || echo no-attempt",
    )
    .await?;
    assert_eq!(left, "0\nno-attempt\n");
    h.stop().await;
    Ok(())
}

/// Escape sequences from a model's text, from a command's output and in a
/// tool call's arguments reach the user's terminal through `corral run`'s
/// view (no `--json`) as text: a title change, a clipboard write (OSC 52),
/// a screen clear, a C1 CSI and a right-to-left override.
#[tokio::test]
async fn escape_sequences_from_a_model_and_a_command_reach_no_terminal() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let h = Harness::start().await?;
    let sessions = tempfile::tempdir()?;
    let hostile = "\u{1b}]0;pwned\u{7}\u{1b}]52;c;ZWNobyBldmls\u{7}\u{1b}[2J\u{9b}31m\u{202e}";
    let printer = format!(
        "printf '\\033]52;c;ZWNobyBldmls\\007\\033[2J\\302\\23331m\\342\\200\\256out\\n'; echo '{hostile}'"
    );
    let args = serde_json::json!({ "command": printer }).to_string();
    let model = ModelServer::start(vec![
        responses::calls(&[("c1", "Bash", &args)]),
        responses::text(&format!("Done{hostile}.")),
    ])
    .await;
    // The view a person sees: the same command without --json, on a
    // terminal (util-linux `script` gives it one and writes what the
    // terminal received).
    let cmd = corral_e2e::run::command(&model, &h.url, sessions.path(), &["print it"]);
    let std = cmd.as_std();
    let mut line = std.get_program().to_string_lossy().into_owned();
    for a in std.get_args().filter(|a| *a != "--json") {
        line.push_str(&format!(" '{}'", a.to_string_lossy()));
    }
    let mut tty = tokio::process::Command::new("script");
    tty.args(["-q", "-e", "-c", &line, "/dev/null"]).env_clear();
    for (k, v) in std.get_envs() {
        if let Some(v) = v {
            tty.env(k, v);
        }
    }
    tty.env("TERM", "xterm").stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(Duration::from_secs(120), tty.output()).await??;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The view's own line clearing (`ESC [ K`, progress) aside.
    let seen = String::from_utf8_lossy(&out.stdout).replace("\u{1b}[K", "");
    assert!(
        !seen
            .chars()
            .any(|c| matches!(c, '\u{1b}' | '\u{7}' | '\u{9b}' | '\u{202e}')),
        "the terminal received a control character: {seen:?}"
    );
    let all = seen;
    assert!(
        all.contains("Done^[]0;pwned^G"),
        "the model's text, as text: {all}"
    );
    assert!(
        all.contains("^[]52;c;ZWNobyBldmls^G"),
        "the command's output, as text: {all}"
    );
    h.stop().await;
    Ok(())
}
