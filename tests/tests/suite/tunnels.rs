//! Raw TCP and many connections through the way in, against a worker in
//! its own process: `corral port forward` listening on loopback, each of
//! its connections a `CONNECT` tunnel through the worker's port listener
//! to a server in a sandbox, carrying a gibibyte byte for byte both ways;
//! its refusals said; the exposure it made revoked when it ends. And a
//! thousand idle WebSockets held open to one sandbox, with the worker's
//! memory for them, and one past the sandbox's bound refused. And a
//! checkpointed sandbox woken by a request to a port that wakes it, its
//! exposures kept across a restart of the worker.

use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use corral_e2e::{WorkerProcess, binary, free_port, run_shell, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::pb::PortAccess;
use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const IMAGE: &str = "corral-debian:latest";

/// A TCP echo server of the sandbox's (a thread per connection).
const ECHO: &str = r#"
import socket, sys, threading
def serve(c):
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        c.sendall(b)
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// A WebSocket server of the sandbox's (asyncio, one thread for all): it
/// answers the handshake (`Sec-WebSocket-Accept` from the client's key),
/// then echoes what comes.
const WEBSOCKETS: &str = r#"
import asyncio, base64, hashlib, sys
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
async def serve(r, w):
    head = await r.readuntil(b"\r\n\r\n")
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    await w.drain()
    while True:
        b = await r.read(65536)
        if not b:
            break
        w.write(b)
        await w.drain()
    w.close()
async def main():
    s = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    await s.serve_forever()
asyncio.run(main())
"#;

/// A worker with a port listener on loopback, and a sandbox of the
/// Debian image running `script` (a Python server) on `port`; the worker
/// given `more` flags.
async fn worker_serving_with(
    state: &std::path::Path,
    script: &str,
    port: u16,
    more: &[&str],
) -> Result<(WorkerProcess, WorkerClient, SandboxId, String)> {
    let listen = format!("127.0.0.1:{}", free_port()?);
    let args = [
        &["--ports-listen", listen.as_str(), "--allow-image", IMAGE],
        more,
    ]
    .concat();
    let worker = WorkerProcess::spawn(
        state,
        &unique_id("tun"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &args,
    )?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(
            Some(&sb),
            SandboxSpec {
                image: Some(IMAGE.into()),
                ..SandboxSpec::default()
            },
        )
        .await?;
    run_shell(
        &client,
        &sb,
        &format!("cat > /tmp/server.py <<'EOF'\n{script}\nEOF"),
    )
    .await?;
    client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new(format!(
                "exec python3 /tmp/server.py {port}"
            ))),
        )
        .await?;
    Ok((worker, client, sb, listen))
}

/// `corral port forward` against `worker`: the child (its stderr in
/// `stderr`) and the address it listens on.
fn forward(
    worker: &WorkerProcess,
    sb: &SandboxId,
    port: u16,
    stderr: &std::path::Path,
    env: &[(&str, &str)],
) -> Result<(Child, String)> {
    let mut child = Command::new(binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(worker.token_file())
        .args(["port", "forward", sb.as_str(), &port.to_string()])
        .args(["--local", "127.0.0.1:0"])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr)?)
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let Some(addr) = line
        .strip_prefix("listening on ")
        .and_then(|r| r.split_whitespace().next())
    else {
        let _ = child.kill();
        bail!(
            "the forward did not start: {line:?}; {}",
            std::fs::read_to_string(stderr).unwrap_or_default()
        );
    };
    Ok((child, addr.to_string()))
}

/// A connection through the forward that the sandbox's echo server
/// answers (waiting, a minute at most, for it to listen).
async fn echoing(addr: &str) -> Result<tokio::net::TcpStream> {
    for _ in 0..600 {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"ping").await?;
        let mut four = [0u8; 4];
        match tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut four)).await {
            Ok(Ok(_)) if &four == b"ping" => return Ok(s),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    bail!("the sandbox's server never answered through the forward")
}

fn stop(child: &mut Child) -> Result<Option<i32>> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    for _ in 0..200 {
        if let Some(s) = child.try_wait()? {
            return Ok(s.code());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    bail!("the forward did not end within 10 s of SIGTERM")
}

/// The word at each 8-byte offset is the offset itself: any byte lost,
/// added or moved shows.
fn pattern(from: u64, buf: &mut [u8]) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(from + 8 * i as u64).to_le_bytes());
    }
}

#[tokio::test]
async fn a_forwarded_port_carries_a_gibibyte_byte_for_byte() -> Result<()> {
    const TOTAL: u64 = 1 << 30;
    const CHUNK: usize = 1 << 20;
    let state = tempfile::tempdir()?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let (worker, client, sb, _) =
        worker_serving_with(state.path(), ECHO, 5000, &["--metrics-listen", &metrics]).await?;
    let log = state.path().join("forward.err");
    let (mut fwd, addr) = forward(&worker, &sb, 5000, &log, &[])?;
    // Not exposed before: the forward made a signed exposure of its own.
    let e = client.list_exposures(&sb).await?;
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!((e[0].port, e[0].access()), (5000, PortAccess::Signed));

    let s = echoing(&addr).await?;
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        let mut at = 0;
        while at < TOTAL {
            pattern(at, &mut buf);
            w.write_all(&buf).await?;
            at += CHUNK as u64;
        }
        w.shutdown().await?;
        anyhow::Ok(())
    });
    let started = std::time::Instant::now();
    let mut got = vec![0u8; CHUNK];
    let mut want = vec![0u8; CHUNK];
    let mut at = 0;
    while at < TOTAL {
        r.read_exact(&mut got)
            .await
            .with_context(|| format!("after {at} bytes"))?;
        pattern(at, &mut want);
        if got != want {
            let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            bail!("byte {} came back changed", at + i as u64);
        }
        at += CHUNK as u64;
    }
    writer.await??;
    // All of it, and nothing after.
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await?;
    assert!(rest.is_empty(), "{} bytes past the end", rest.len());
    eprintln!(
        "1 GiB each way through the forward in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    // Counted, each way, once the tunnel ended.
    let mut counted = (0.0, 0.0);
    for _ in 0..50 {
        let text = metrics_text(&metrics).await?;
        let value = |line: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(line))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0.0)
        };
        counted = (
            value("corral_ports_bytes_total{direction=\"in\"}"),
            value("corral_ports_bytes_total{direction=\"out\"}"),
        );
        if counted.0 >= TOTAL as f64 && counted.1 >= TOTAL as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        counted.0 >= TOTAL as f64 && counted.1 >= TOTAL as f64,
        "bytes counted: {counted:?}"
    );

    // Nothing listens on another port: the forward says why, and the
    // client's connection ends.
    let log2 = state.path().join("forward2.err");
    let (mut fwd2, addr2) = forward(&worker, &sb, 5001, &log2, &[])?;
    let mut s = tokio::net::TcpStream::connect(&addr2).await?;
    let mut none = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut none)).await??;
    assert!(none.is_empty());
    assert_eq!(stop(&mut fwd2)?, Some(0));
    let said = std::fs::read_to_string(&log2)?;
    assert!(said.contains("port_not_listening"), "{said}");

    // Exposed signed by someone else: the forward needs that token, and
    // a wrong one is refused with its reason.
    client
        .expose_port(&sb, 5002, PortAccess::Signed, None)
        .await?;
    let out = Command::new(binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(worker.token_file())
        .args(["port", "forward", sb.as_str(), "5002"])
        .env_remove("CORRAL_PORT_TOKEN")
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("CORRAL_PORT_TOKEN"), "{said}");
    let log3 = state.path().join("forward3.err");
    let forged = format!("1999999999999.{}.{}", "a".repeat(24), "b".repeat(64));
    let (mut fwd3, addr3) = forward(
        &worker,
        &sb,
        5002,
        &log3,
        &[("CORRAL_PORT_TOKEN", forged.as_str())],
    )?;
    let mut s = tokio::net::TcpStream::connect(&addr3).await?;
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut none)).await??;
    assert_eq!(stop(&mut fwd3)?, Some(0));
    let said = std::fs::read_to_string(&log3)?;
    assert!(said.contains("invalid_token"), "{said}");
    assert!(!said.contains(&forged), "the token was said: {said}");

    // Ended, the forward takes its exposure with it (and only its own).
    assert_eq!(stop(&mut fwd)?, Some(0));
    let left: Vec<u32> = client
        .list_exposures(&sb)
        .await?
        .iter()
        .map(|e| e.port)
        .collect();
    assert_eq!(left, vec![5002]);
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// A WebSocket handshake through the port listener: the connection, or
/// the refusal's status and reason.
async fn websocket(
    listener: &str,
    path: &str,
    token: &str,
    n: usize,
) -> Result<std::result::Result<tokio::net::TcpStream, (u16, String)>> {
    let mut s = tokio::net::TcpStream::connect(listener).await?;
    let key = format!("dGhlIHNhbXBsZSBub25jZQ{n:02}==");
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {listener}\r\nAuthorization: Bearer {token}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let head = head_of(&mut s).await?;
    let head = String::from_utf8_lossy(&head).to_string();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    if status != 101 {
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).await?;
        let reason = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"]["reason"].as_str().map(str::to_string))
            .unwrap_or_default();
        return Ok(Err((status, reason)));
    }
    if !head.to_ascii_lowercase().contains("sec-websocket-accept: ") {
        bail!("no Sec-WebSocket-Accept: {head}");
    }
    Ok(Ok(s))
}

#[tokio::test]
async fn a_thousand_idle_websockets_are_held_and_one_past_the_bound_refused() -> Result<()> {
    const HELD: usize = 1000;
    let bound = corral_worker::ports::MAX_CONNECTIONS;
    let state = tempfile::tempdir()?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let (worker, client, sb, listener) = worker_serving_with(
        state.path(),
        WEBSOCKETS,
        9000,
        &["--metrics-listen", &metrics],
    )
    .await?;
    client
        .expose_port(&sb, 9000, PortAccess::Private, None)
        .await?;
    let token = worker.token();
    let path = format!("/p/{sb}/9000/ws");
    // Once the server listens.
    let mut first = None;
    for _ in 0..600 {
        match websocket(&listener, &path, &token, 0).await? {
            Ok(s) => {
                first = Some(s);
                break;
            }
            Err((502 | 503, _)) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(other) => bail!("refused: {other:?}"),
        }
    }
    let mut held = vec![first.context("the sandbox's server never listened")?];
    let before = worker.rss()?;
    for n in 1..HELD {
        match websocket(&listener, &path, &token, n % 100).await? {
            Ok(s) => held.push(s),
            Err(e) => bail!("the WebSocket {n} was refused: {e:?}"),
        }
    }
    // Held and idle for a while: every one still carries.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = worker.rss()?;
    for (n, s) in held.iter_mut().enumerate() {
        let frame = [0x89u8, 0x80, 1, 2, 3, 4]; // a masked, empty ping
        s.write_all(&frame).await?;
        let mut back = [0u8; 6];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
            .await
            .with_context(|| format!("the WebSocket {n} no longer carries"))??;
        assert_eq!(back, frame);
    }
    let per = after.saturating_sub(before) / (HELD as u64 - 1);
    eprintln!(
        "{HELD} idle WebSockets: the worker's memory {} MiB -> {} MiB ({} KiB each)",
        before >> 20,
        after >> 20,
        per >> 10
    );
    // The issue's goal: at most 64 MiB for a thousand.
    assert!(
        after.saturating_sub(before) <= 64 << 20,
        "{HELD} WebSockets took {} MiB of the worker's memory",
        after.saturating_sub(before) >> 20
    );
    // Up to the sandbox's bound, then refused with its reason.
    while held.len() < bound {
        match websocket(&listener, &path, &token, 0).await? {
            Ok(s) => held.push(s),
            Err(e) => bail!("refused under the bound, at {}: {e:?}", held.len()),
        }
    }
    match websocket(&listener, &path, &token, 0).await? {
        Ok(_) => bail!("a connection past the bound of {bound} was carried"),
        Err((status, reason)) => {
            assert_eq!((status, reason.as_str()), (429, "too_many_connections"))
        }
    }
    // What the worker's metrics say of it.
    let text = metrics_text(&metrics).await?;
    let value = |line: &str| -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(line))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    assert_eq!(
        value("corral_ports_open_connections "),
        Some(bound as f64),
        "{text}"
    );
    assert!(
        value("corral_ports_requests_total{outcome=\"too_many_connections\"}") >= Some(1.0),
        "{text}"
    );
    // One closed, one more fits.
    drop(held.pop());
    let mut again = None;
    for _ in 0..50 {
        if let Ok(s) = websocket(&listener, &path, &token, 0).await? {
            again = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    again.context("a place freed by a closed connection was not taken again")?;
    drop(held);
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// One GET through the port listener, on a connection of its own: the
/// status and the body.
async fn get(listener: &str, path: &str, bearer: Option<&str>) -> Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(listener).await?;
    let auth = bearer.map_or(String::new(), |b| format!("Authorization: Bearer {b}\r\n"));
    let req = format!("GET {path} HTTP/1.1\r\nHost: {listener}\r\n{auth}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut all))
        .await
        .context("no answer within 60 s")??;
    let text = String::from_utf8_lossy(&all).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    Ok((status, body.to_string()))
}

fn reason(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["reason"].as_str().map(str::to_string))
        .unwrap_or_default()
}

#[tokio::test]
async fn a_request_wakes_a_checkpointed_sandbox_and_exposures_outlive_a_restart() -> Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("wake"), free_port()?);
    let listen = format!("127.0.0.1:{}", free_port()?);
    let args = [
        "--ports-listen",
        listen.as_str(),
        "--allow-image",
        IMAGE,
        "--allow-runtime",
        "runsc",
    ];
    let public = [&args[..], &["--allow-public-ports"]].concat();
    let mut worker =
        WorkerProcess::spawn(state.path(), &wid, port, &[("CORRAL_LOG", "warn")], &public)?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(
            Some(&sb),
            SandboxSpec {
                image: Some(IMAGE.into()),
                runtime: Some("runsc".into()),
                ..SandboxSpec::default()
            },
        )
        .await?;
    run_shell(
        &client,
        &sb,
        "mkdir -p /tmp/www && echo awake > /tmp/www/hello",
    )
    .await?;
    client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new(
                "cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1",
            )),
        )
        .await?;
    let e = client
        .expose_port_waking(
            &sb,
            8000,
            PortAccess::Signed,
            Some(Duration::from_secs(3600)),
            true,
        )
        .await?;
    assert!(e.wake_on_request);
    let other = client
        .expose_port(&sb, 8001, PortAccess::Signed, None)
        .await?;
    client
        .expose_port(&sb, 8002, PortAccess::Public, None)
        .await?;
    for p in 8010..8020 {
        client
            .expose_port(&sb, p, PortAccess::Private, None)
            .await?;
    }
    // A time to live past any clock: refused, not born expired.
    let e2 = client
        .expose_port(
            &sb,
            8003,
            PortAccess::Private,
            Some(Duration::from_secs(u64::MAX / 1000)),
        )
        .await
        .expect_err("an endless time to live was taken");
    assert!(e2.to_string().contains("ttl"), "{e2}");
    let path = format!("/p/{sb}/8000/hello");
    let mut up = false;
    for _ in 0..600 {
        if get(&listen, &path, Some(&e.token)).await?.0 == 200 {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "the sandbox's server never answered");

    client.checkpoint_sandbox(&sb).await?;
    let asleep =
        |c: &corral_proto::SandboxInfo| c.state == corral_proto::SandboxState::Checkpointed;
    assert!(asleep(&client.get_sandbox(&sb).await?));
    // Exposures of a checkpointed sandbox are still listed, and revoked
    // (many at once, none lost).
    let listed = client.list_exposures(&sb).await?;
    assert_eq!(listed.len(), 13, "{listed:?}");
    let revokes = (8010..8020).map(|p| client.revoke_access(&sb, p));
    for r in futures_util::future::join_all(revokes).await {
        assert!(r?, "a kept exposure was not found to revoke");
    }
    let left: Vec<u32> = client
        .list_exposures(&sb)
        .await?
        .iter()
        .map(|e| e.port)
        .collect();
    assert_eq!(left, vec![8000, 8001, 8002]);
    // A port that does not wake it, and a request with no credential or
    // a wrong one: refused, and the sandbox sleeps on.
    let (status, body) = get(&listen, &format!("/p/{sb}/8001/"), Some(&other.token)).await?;
    assert_eq!((status, reason(&body).as_str()), (404, "not_exposed"));
    let (status, body) = get(&listen, &path, None).await?;
    assert_eq!((status, reason(&body).as_str()), (401, "unauthenticated"));
    let (status, body) = get(&listen, &path, Some(&other.token)).await?;
    assert_eq!((status, reason(&body).as_str()), (401, "invalid_token"));
    assert!(
        asleep(&client.get_sandbox(&sb).await?),
        "woken by a refused request"
    );
    // Its credential, by eight at once: woken once, and each answered by
    // its server, which was checkpointed with it.
    let wakes = (0..8).map(|_| get(&listen, &path, Some(&e.token)));
    for r in futures_util::future::join_all(wakes).await {
        let (status, body) = r?;
        assert_eq!((status, body.trim()), (200, "awake"), "{body}");
    }
    assert_eq!(
        client.get_sandbox(&sb).await?.state,
        corral_proto::SandboxState::Ready
    );

    // A restart of the worker: the exposures and their tokens hold; a
    // public one only while the operator still allows public ports.
    worker.kill9();
    let worker = WorkerProcess::spawn(state.path(), &wid, port, &[("CORRAL_LOG", "warn")], &args)?;
    let client = worker.client().await?;
    let listed = client.list_exposures(&sb).await?;
    let ports: Vec<(u32, bool)> = listed.iter().map(|e| (e.port, e.wake_on_request)).collect();
    assert_eq!(ports, vec![(8000, true), (8001, false)]);
    let (status, body) = get(&listen, &format!("/p/{sb}/8002/hello"), None).await?;
    assert_eq!((status, reason(&body).as_str()), (404, "not_exposed"));
    let mut answered = (0, String::new());
    for _ in 0..300 {
        answered = get(&listen, &path, Some(&e.token)).await?;
        if answered.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (answered.0, answered.1.trim()),
        (200, "awake"),
        "{answered:?}"
    );
    // A revocation is kept too.
    assert!(client.revoke_access(&sb, 8000).await?);
    let (status, body) = get(&listen, &path, Some(&e.token)).await?;
    assert_eq!((status, reason(&body).as_str()), (401, "revoked"));
    client.destroy_sandbox(&sb).await?;
    assert!(
        !state
            .path()
            .join("ports")
            .join(format!("{sb}.json"))
            .exists(),
        "a removed sandbox's exposures were kept"
    );
    Ok(())
}

/// A server of the sandbox's for the front door's test: GET answers the
/// headers it got as JSON; a request with Upgrade is switched, then
/// echoed.
const HEADERS: &str = r#"
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.headers.get("Upgrade"):
            self.send_response(101)
            self.send_header("Upgrade", self.headers["Upgrade"])
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            c = self.connection
            while True:
                b = c.recv(65536)
                if not b:
                    break
                c.sendall(b)
            self.close_connection = True
            return
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

/// A key of a tenants' directory (`corral admin key create --json`).
fn new_key(dir: &std::path::Path, tenant: &str, scope: &str) -> Result<String> {
    let out = Command::new(binary("corral")?)
        .arg("admin")
        .arg("--tenants")
        .arg(dir)
        .args([
            "key", "create", "--tenant", tenant, "--scope", scope, "--json",
        ])
        .output()?;
    if !out.status.success() {
        bail!("key create: {out:?}");
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["key"].as_str().context("no key")?.to_string())
}

/// Kills the child when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn through_the_front_door_a_key_reaches_its_own_tenants_ports_alone() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker_ports = format!("127.0.0.1:{}", free_port()?);
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("fdp"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &["--ports-listen", &worker_ports, "--allow-image", IMAGE],
    )?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run")?;
    let bolt = new_key(tenants.path(), "bolt", "run")?;
    let auditor = new_key(tenants.path(), "acme", "read")?;
    let serve_dir = tempfile::tempdir()?;
    let front = format!("127.0.0.1:{}", free_port()?);
    let ports = format!("127.0.0.1:{}", free_port()?);
    let mut cmd = Command::new(binary("corral")?);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", serve_dir.path())
        .env("CORRAL_LOG", "warn")
        .args(["--worker", &worker.url, "--token-file"])
        .arg(worker.token_file())
        .args(["serve", "--listen", &front, "--ports-listen", &ports])
        .arg("--serve-state-dir")
        .arg(serve_dir.path().join("state"))
        .arg("--sessions-dir")
        .arg(serve_dir.path().join("sessions"))
        .arg("--tenants")
        .arg(tenants.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let _serve = Killed(corral_e2e::spawn_listening(&mut cmd, "corral serve")?);
    let front_url = format!("http://{front}");
    let as_acme = WorkerClient::connect(&front_url, Some(&acme)).await?;
    let sb = as_acme
        .create_sandbox(
            None,
            SandboxSpec {
                image: Some(IMAGE.into()),
                ..SandboxSpec::default()
            },
        )
        .await?
        .id;
    run_shell(
        &as_acme,
        &sb,
        &format!("cat > /tmp/server.py <<'EOF'\n{HEADERS}\nEOF"),
    )
    .await?;
    as_acme
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("exec python3 /tmp/server.py 8000")),
        )
        .await?;
    // Private: the URL is the front door's.
    let e = as_acme
        .expose_port(&sb, 8000, PortAccess::Private, None)
        .await?;
    assert_eq!(e.url, format!("http://{ports}/p/{sb}/8000/"));
    let path = format!("/p/{sb}/8000/x");
    let mut answered = (0, String::new());
    for _ in 0..600 {
        answered = get(&ports, &path, Some(&acme)).await?;
        if answered.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(answered.0, 200, "{answered:?}");
    // The server saw no key of the front door's, nor the workers' token.
    let seen: serde_json::Value = serde_json::from_str(&answered.1)?;
    assert!(seen.get("authorization").is_none(), "{seen}");
    assert!(!answered.1.contains("corral_"), "{seen}");
    // Another tenant's key: as a port not exposed; an auditor's: never
    // into a sandbox; none, a forged key: refused.
    let (status, body) = get(&ports, &path, Some(&bolt)).await?;
    assert_eq!((status, reason(&body).as_str()), (404, "not_exposed"));
    let (status, body) = get(&ports, &path, Some(&auditor)).await?;
    assert_eq!((status, reason(&body).as_str()), (403, "permission_denied"));
    let (status, body) = get(&ports, &path, None).await?;
    assert_eq!((status, reason(&body).as_str()), (401, "unauthenticated"));
    let forged = format!("corral_{}_{}", "0".repeat(16), "1".repeat(64));
    let (status, body) = get(&ports, &path, Some(&forged)).await?;
    assert_eq!((status, reason(&body).as_str()), (401, "unauthenticated"));
    assert!(!body.contains(&forged), "{body}");
    let (status, body) = get(&ports, "/p/no-such-sandbox/8000/", Some(&acme)).await?;
    assert_eq!((status, reason(&body).as_str()), (404, "not_exposed"));
    // An upgrade through both listeners, carried both ways.
    let mut s = tokio::net::TcpStream::connect(&ports).await?;
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {ports}\r\nAuthorization: Bearer {acme}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let head = head_of(&mut s).await?;
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(b"through both").await?;
    let mut back = [0u8; 12];
    s.read_exact(&mut back).await?;
    assert_eq!(&back, b"through both");
    drop(s);
    // A Host naming another sandbox (which a worker with a wildcard
    // domain would route by), a key anywhere but the bearer: refused.
    let mut s = tokio::net::TcpStream::connect(&ports).await?;
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: 8000-someone-else.ports.test\r\nAuthorization: Bearer {acme}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let mut all = Vec::new();
    s.read_to_end(&mut all).await?;
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.starts_with("HTTP/1.1 400") && text.contains("bad_route"),
        "{text}"
    );
    let (status, body) = get(&ports, &format!("{path}?token={acme}"), Some(&acme)).await?;
    assert_eq!((status, reason(&body).as_str()), (400, "misplaced_key"));
    // A key revoked: its open connections end too.
    let brief = new_key(tenants.path(), "acme", "run")?;
    // Taken once the front door has seen it (within a second or so).
    for _ in 0..100 {
        if get(&ports, &path, Some(&brief)).await?.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut held = tokio::net::TcpStream::connect(&ports).await?;
    held.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {ports}\r\nAuthorization: Bearer {brief}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        .as_bytes(),
    )
    .await?;
    let head = head_of(&mut held).await?;
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let id = brief.split('_').nth(1).context("a key's id")?.to_string();
    let out = Command::new(binary("corral")?)
        .arg("admin")
        .arg("--tenants")
        .arg(tenants.path())
        .args(["key", "revoke", &id])
        .output()?;
    assert!(out.status.success(), "{out:?}");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), held.read_to_end(&mut rest))
        .await
        .context("a revoked key's connection still carries")??;
    // A tunnel of `corral port forward`, the tenant's key in the
    // environment, through the front door alone.
    let log = state.path().join("forward.err");
    let mut fwd = Command::new(binary("corral")?)
        .args([
            "port",
            "forward",
            sb.as_str(),
            "8000",
            "--local",
            "127.0.0.1:0",
        ])
        .env("CORRAL_URL", &front_url)
        .env("CORRAL_API_KEY", &acme)
        .env_remove("CORRAL_WORKER")
        .env_remove("CORRAL_TOKEN_FILE")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(fwd.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let addr = line
        .strip_prefix("listening on ")
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| {
            format!(
                "{line:?}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })?
        .to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(b"GET /tunnelled HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut all)).await??;
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200"),
        "{text}; {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(!text.contains("corral_"), "{text}");
    assert_eq!(stop(&mut fwd)?, Some(0));
    // Signed: the token alone, no key, through the front door.
    let signed = as_acme
        .expose_port(&sb, 8000, PortAccess::Signed, None)
        .await?;
    let (status, _) = get(&ports, &path, Some(&signed.token)).await?;
    assert_eq!(status, 200);
    as_acme.destroy_sandbox(&sb).await?;
    Ok(())
}

/// The worker's metrics endpoint's text.
async fn metrics_text(addr: &str) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all)).await??;
    Ok(String::from_utf8_lossy(&all).to_string())
}

#[tokio::test]
async fn a_sandboxs_way_in_is_held_to_its_byte_rate() -> Result<()> {
    const BYTES: usize = 3 << 20;
    let state = tempfile::tempdir()?;
    let (worker, client, sb, listener) = worker_serving_with(
        state.path(),
        ECHO,
        5000,
        &["--ports-max-bytes-per-second", "1000000"],
    )
    .await?;
    client
        .expose_port(&sb, 5000, PortAccess::Private, None)
        .await?;
    let token = worker.token();
    // A tunnel, once the server listens.
    let mut s = None;
    for _ in 0..600 {
        let mut c = tokio::net::TcpStream::connect(&listener).await?;
        c.write_all(
            format!("CONNECT {sb}:5000 HTTP/1.1\r\nHost: {sb}:5000\r\nProxy-Authorization: Bearer {token}\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let head = head_of(&mut c).await.unwrap_or_default();
        if head.starts_with(b"HTTP/1.1 200") {
            s = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = s.context("the sandbox's server never listened")?;
    // 3 MiB each way at a million bytes a second (after a second's worth
    // at once): at least two seconds, and whole.
    let started = std::time::Instant::now();
    let (mut r, mut w) = s.into_split();
    let data: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
    let sent = data.clone();
    let writer = tokio::spawn(async move { w.write_all(&sent).await });
    let mut back = vec![0u8; BYTES];
    let mut got = 0;
    while got < BYTES {
        match tokio::time::timeout(Duration::from_secs(10), r.read(&mut back[got..])).await {
            Ok(Ok(0)) => bail!("ended after {got} bytes"),
            Ok(Ok(n)) => got += n,
            Ok(Err(e)) => bail!("after {got} bytes: {e}"),
            Err(_) => bail!("stalled after {got} bytes, {:?} in", started.elapsed()),
        }
    }
    writer.await??;
    let took = started.elapsed();
    assert!(back == data, "the bytes came back changed");
    assert!(
        took >= Duration::from_millis(1800),
        "3 MiB each way at 1 MB/s took {took:?}"
    );
    eprintln!("3 MiB each way at 1 MB/s took {took:?}");
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// An answer's head, read a byte at a time (what follows is the other
/// side's); an error if the connection ends first.
async fn head_of(s: &mut tokio::net::TcpStream) -> Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await? == 0 {
            bail!("closed before the head: {}", String::from_utf8_lossy(&head));
        }
        head.push(b[0]);
    }
    Ok(head)
}

/// The sandbox's port events so far: (port, what, detail, bytes in, out).
async fn port_events(
    client: &WorkerClient,
    sb: &SandboxId,
) -> Result<Vec<(u16, String, String, u64, u64)>> {
    use futures_util::StreamExt as _;
    let last = client.get_sandbox(sb).await?.last_seq;
    let mut stream = client.watch(sb, 0, None).await?;
    let mut out = Vec::new();
    if last == 0 {
        return Ok(out);
    }
    loop {
        let e = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .context("events")?
            .context("the stream ended")??;
        if let corral_proto::EventKind::Port(p) = &e.kind {
            out.push((
                p.port,
                p.what.as_str().to_string(),
                p.detail.clone(),
                p.bytes_in,
                p.bytes_out,
            ));
        }
        if e.seq >= last {
            break;
        }
    }
    Ok(out)
}

/// Waits (10 s at most) for the sandbox's port events to hold one that
/// `wanted` takes; all of them.
async fn port_event(
    client: &WorkerClient,
    sb: &SandboxId,
    wanted: impl Fn(&(u16, String, String, u64, u64)) -> bool,
) -> Result<Vec<(u16, String, String, u64, u64)>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let all = port_events(client, sb).await?;
        if all.iter().any(&wanted) {
            return Ok(all);
        }
        if std::time::Instant::now() > deadline {
            bail!("not among the sandbox's port events: {all:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `CONNECT` tunnel to `port` of `sb` once its server listens.
async fn tunnel_to(
    listener: &str,
    sb: &SandboxId,
    port: u16,
    token: &str,
) -> Result<tokio::net::TcpStream> {
    for _ in 0..600 {
        let mut c = tokio::net::TcpStream::connect(listener).await?;
        c.write_all(
            format!("CONNECT {sb}:{port} HTTP/1.1\r\nHost: {sb}:{port}\r\nProxy-Authorization: Bearer {token}\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        if head_of(&mut c)
            .await
            .unwrap_or_default()
            .starts_with(b"HTTP/1.1 200")
        {
            return Ok(c);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the sandbox's server never listened")
}

#[tokio::test]
async fn the_way_in_is_told_on_the_sandboxs_stream_and_idle_connections_are_cut() -> Result<()> {
    let state = tempfile::tempdir()?;
    let (worker, client, sb, listener) =
        worker_serving_with(state.path(), ECHO, 5000, &["--ports-idle-timeout", "2s"]).await?;
    client
        .expose_port(&sb, 5000, PortAccess::Private, None)
        .await?;
    port_event(&client, &sb, |e| {
        (e.1.as_str(), e.2.as_str()) == ("exposed", "private")
    })
    .await?;
    // No credential: refused, and told.
    let mut c = tokio::net::TcpStream::connect(&listener).await?;
    c.write_all(format!("CONNECT {sb}:5000 HTTP/1.1\r\nHost: {sb}:5000\r\n\r\n").as_bytes())
        .await?;
    let head = head_of(&mut c).await?;
    assert!(
        head.starts_with(b"HTTP/1.1 401"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    port_event(&client, &sb, |e| {
        (e.1.as_str(), e.2.as_str()) == ("refused", "unauthenticated")
    })
    .await?;

    // A tunnel that carries 1,000 bytes each way, then nothing: cut.
    let token = worker.token();
    let mut quiet = tunnel_to(&listener, &sb, 5000, &token).await?;
    quiet.write_all(&[7u8; 1000]).await?;
    let mut back = [0u8; 1000];
    quiet.read_exact(&mut back).await?;
    // One that keeps talking, a byte every 300 ms, is not.
    let mut busy = tunnel_to(&listener, &sb, 5000, &token).await?;
    let since = std::time::Instant::now();
    let mut b = [0u8; 1];
    let cut = loop {
        busy.write_all(b"x").await?;
        busy.read_exact(&mut b)
            .await
            .context("the busy tunnel was cut")?;
        match tokio::time::timeout(Duration::from_millis(300), quiet.read(&mut back)).await {
            Ok(Ok(0)) => break since.elapsed(),
            Ok(r) => bail!("the quiet tunnel said {r:?}"),
            Err(_) if since.elapsed() > Duration::from_secs(20) => {
                bail!("the quiet tunnel was never cut")
            }
            Err(_) => {}
        }
    };
    eprintln!("an idle tunnel was cut after {cut:?} (the timeout: 2 s)");
    assert!(cut >= Duration::from_millis(1500), "cut after {cut:?}");
    let all = port_event(&client, &sb, |e| e.1 == "closed" && e.2 == "idle").await?;
    assert!(
        all.iter()
            .any(|e| *e == (5000, "closed".into(), "idle".into(), 1000, 1000)),
        "{all:?}"
    );
    assert!(
        all.iter()
            .any(|e| (e.1.as_str(), e.2.as_str()) == ("opened", "private")),
        "{all:?}"
    );
    // The busy one goes on past several timeouts, then ends with the
    // exposure's revocation, told as such.
    for _ in 0..10 {
        busy.write_all(b"y").await?;
        busy.read_exact(&mut b)
            .await
            .context("the busy tunnel was cut")?;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(client.revoke_access(&sb, 5000).await?);
    let n = tokio::time::timeout(Duration::from_secs(5), busy.read(&mut b)).await??;
    assert_eq!(n, 0, "the revoked tunnel went on");
    let all = port_event(&client, &sb, |e| e.1 == "closed" && e.2 == "revoked").await?;
    assert!(
        all.iter().any(|e| e.1 == "revoked" && e.0 == 5000),
        "{all:?}"
    );
    client.destroy_sandbox(&sb).await?;
    Ok(())
}
