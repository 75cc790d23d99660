//! Running many workers: drain (flag, signal, call; health; survives a
//! restart; a deadline), the metrics endpoint, and worker ids.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use corral_e2e::{WorkerProcess, free_port, unique_id};
use corral_harness::client::{ClientError, WorkerClient};
use corral_proto::{SandboxId, SandboxSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;

/// `GET path` over plain HTTP/1.1: the whole response.
async fn get(port: u16, path: &str) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// `GET /metrics`.
pub async fn scrape(port: u16) -> Result<String> {
    let out = get(port, "/metrics").await?;
    if !out.starts_with("HTTP/1.1 200") {
        bail!("metrics answered {}", out.lines().next().unwrap_or(""));
    }
    Ok(out)
}

/// The value of one sample line (`name{labels} value`), if present.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

async fn health(url: &str) -> Result<i32> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect()
        .await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    Ok(health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await?
        .into_inner()
        .status)
}

async fn wait_health(url: &str, want: ServingStatus) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if health(url).await? == want as i32 {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("health did not become {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn unavailable(e: &ClientError) -> bool {
    matches!(e, ClientError::Status(s) if s.code() == tonic::Code::Unavailable)
}

async fn new_sandbox(client: &WorkerClient) -> Result<SandboxId, ClientError> {
    let id = SandboxId::new(unique_id("sb")).map_err(ClientError::Protocol)?;
    client
        .create_sandbox(Some(&id), SandboxSpec::default())
        .await
        .map(|_| id)
}

#[tokio::test]
async fn a_draining_worker_refuses_new_sandboxes_serves_its_own_and_says_so_across_a_restart()
-> Result<()> {
    let state = tempfile::tempdir()?;
    let id = unique_id("drain");
    let (port, metrics) = (free_port()?, free_port()?);
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let args = ["--metrics-listen", metrics_addr.as_str()];
    let w = WorkerProcess::spawn(state.path(), &id, port, &[], &args)?;
    let client = w.client().await?;
    wait_health(&w.url, ServingStatus::Serving).await?;
    let kept = new_sandbox(&client).await?;
    let before = scrape(metrics).await?;
    assert_eq!(sample(&before, "corral_draining"), Some(0.0), "{before}");
    assert!(get(metrics, "/readyz").await?.starts_with("HTTP/1.1 200"));
    assert_eq!(
        sample(&before, "corral_sandboxes{state=\"ready\"}"),
        Some(1.0),
        "{before}"
    );

    // SIGUSR1: health goes NOT_SERVING, creates are refused, the sandbox
    // it has is served.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(w.child.id() as i32),
        nix::sys::signal::Signal::SIGUSR1,
    )?;
    wait_health(&w.url, ServingStatus::NotServing).await?;
    let refused = new_sandbox(&client).await.unwrap_err();
    assert!(unavailable(&refused), "{refused}");
    assert!(refused.to_string().contains("draining"), "{refused}");
    assert_eq!(refused.reason(), Some(corral_proto::Reason::Draining));
    assert!(refused.is_refusal());
    let info = client.worker_info().await?;
    assert!(info.draining && info.drain_deadline_ms > 0, "{info:?}");
    let out = corral_e2e::run_shell(&client, &kept, "echo still served").await?;
    assert_eq!(out, "still served\n");
    let during = scrape(metrics).await?;
    assert_eq!(sample(&during, "corral_draining"), Some(1.0), "{during}");
    assert!(get(metrics, "/readyz").await?.starts_with("HTTP/1.1 503"));
    assert_eq!(
        sample(
            &during,
            "corral_sandbox_creates_total{outcome=\"draining\"}"
        ),
        Some(1.0),
        "{during}"
    );
    assert!(
        sample(
            &during,
            "corral_operations_total{kind=\"shell\",outcome=\"ok\"}"
        ) >= Some(1.0),
        "{during}"
    );

    // A restart goes on draining, with the same deadline.
    // Blocking: off the runtime, whose connections must see the goodbye.
    let (w, code) = tokio::task::spawn_blocking(move || {
        let mut w = w;
        let code = w.terminate(Duration::from_secs(20));
        (w, code)
    })
    .await?;
    assert_eq!(code?, Some(0));
    let w2 = WorkerProcess::spawn(state.path(), &id, port, &[], &args)?;
    let client = w2.client().await?;
    wait_health(&w2.url, ServingStatus::NotServing).await?;
    let again = client.worker_info().await?;
    assert_eq!(again.drain_deadline_ms, info.drain_deadline_ms);
    assert!(client.get_sandbox(&kept).await.is_ok(), "re-adopted");

    // The Drain call ends it.
    let ended = client.drain(false).await?;
    assert!(!ended.draining && ended.drain_deadline_ms == 0, "{ended:?}");
    wait_health(&w2.url, ServingStatus::Serving).await?;
    let made = new_sandbox(&client).await?;
    client.destroy_sandbox(&made).await?;
    client.destroy_sandbox(&kept).await?;
    drop(w);
    Ok(())
}

#[tokio::test]
async fn a_drain_removes_what_is_left_at_its_deadline() -> Result<()> {
    let state = tempfile::tempdir()?;
    let id = unique_id("drain");
    let w = WorkerProcess::spawn(
        state.path(),
        &id,
        free_port()?,
        &[],
        &["--drain-deadline", "2s"],
    )?;
    let client = w.client().await?;
    let sandbox = new_sandbox(&client).await?;
    let info = client.drain(true).await?;
    assert!(info.draining);
    // Asked again: the deadline stays.
    assert_eq!(
        client.drain(true).await?.drain_deadline_ms,
        info.drain_deadline_ms
    );
    assert!(client.get_sandbox(&sandbox).await.is_ok());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match client.get_sandbox(&sandbox).await {
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => break,
            Ok(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => bail!("the sandbox outlived the drain deadline: {other:?}"),
        }
    }
    let info = client.worker_info().await?;
    assert!(info.draining && info.sandboxes == 0, "{info:?}");
    Ok(())
}

/// Two workers that share an id (as two users' default workers once did:
/// both named after the host) on one engine, each with its own state
/// directory: the second's start and sweeps leave the first's sandbox
/// alone, and it goes on serving.
#[tokio::test]
async fn two_workers_sharing_an_id_never_remove_each_others_sandboxes() -> Result<()> {
    use corral_proto::{OperationId, OperationSpec, ShellSpec};
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let id = unique_id("same");
    let a = WorkerProcess::spawn(a_dir.path(), &id, free_port()?, &[], &[])?;
    let client = a.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let b = WorkerProcess::spawn(
        b_dir.path(),
        &id,
        free_port()?,
        &[],
        &["--sweep-interval", "200ms"],
    )?;
    let b_client = b.client().await?;
    // Its start and a few sweeps.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(b_client.list_sandboxes().await?.is_empty());
    let op = OperationId::random();
    let after = client.get_sandbox(&sb).await?.last_seq;
    client
        .submit(&sb, &op, OperationSpec::Shell(ShellSpec::new("echo alive")))
        .await?;
    let (_, r) = corral_e2e::collect(&client, &sb, &op, after).await?;
    assert_eq!(&r.stdout.head[..], b"alive\n", "{r:?}");
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

#[tokio::test]
async fn a_worker_given_no_id_is_named_after_its_host_and_its_state_directory() -> Result<()> {
    let state = tempfile::tempdir()?;
    let port = free_port()?;
    // The test harness always names its workers; this one is started by
    // hand to get the default.
    let mut child = std::process::Command::new(corral_e2e::binary("corral-worker")?)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--state-dir"])
        .arg(state.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("stdout")?;
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    let _ = child.kill();
    let _ = child.wait();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    let stored = std::fs::read_to_string(state.path().join("worker-id"))?;
    assert!(
        stored.starts_with(&format!("{}-", host.trim())) && stored.len() == host.trim().len() + 9,
        "{stored:?} for host {host:?}"
    );
    assert!(line.contains(&stored), "{line}");
    Ok(())
}

/// `corral exec` of a long command on worker `w` with a deadline of
/// `lost_after`, once it has printed "started"; its stdout is kept open.
async fn exec_started(
    w: &WorkerProcess,
    lost_after: &str,
) -> Result<(tokio::process::Child, tokio::process::ChildStdout)> {
    let mut child = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args([
            "--worker",
            &w.url,
            "--worker-lost-after",
            lost_after,
            "--token-file",
        ])
        .arg(w.token_file())
        .args(["exec", "--", "sh", "-c", "echo started; sleep 300"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut first = [0u8; 8];
    tokio::time::timeout(Duration::from_secs(60), stdout.read_exact(&mut first)).await??;
    assert_eq!(&first, b"started\n");
    Ok((child, stdout))
}

/// A token file for several workers and their clients.
fn shared_token(text: &str) -> Result<(tempfile::TempDir, std::path::PathBuf)> {
    let dir = tempfile::tempdir()?;
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{text}\n"))?;
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok((dir, token))
}

/// The `result` event of a `corral run --json` output.
fn result_of(out: &std::process::Output) -> Result<serde_json::Value> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|e| e["type"] == "result")
        .with_context(|| {
            format!(
                "no result: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// Kills a worker and removes its containers: its host is gone for good.
fn lose_host(w: &mut WorkerProcess) {
    w.kill9();
    corral_e2e::remove_containers_of(&w.worker_id);
}

#[tokio::test]
async fn exec_on_a_lost_worker_says_it_waits_then_exits_125_at_the_deadline() -> Result<()> {
    let state = tempfile::tempdir()?;
    let mut w = WorkerProcess::spawn(state.path(), &unique_id("lost"), free_port()?, &[], &[])?;
    let (child, _stdout) = exec_started(&w, "8s").await?;
    let lost_at = tokio::time::Instant::now();
    lose_host(&mut w);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    let took = lost_at.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains(&format!("waiting for worker {}", w.url)),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "sandbox lost: worker {} unreachable for 8s",
            w.url
        )),
        "{stderr}"
    );
    // The deadline, give or take a backoff step and the keepalive.
    assert!(took < Duration::from_secs(40), "{took:?}");
    Ok(())
}

#[tokio::test]
async fn a_session_whose_worker_is_lost_fails_within_the_deadline_and_says_why() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let state = tempfile::tempdir()?;
    let sessions = tempfile::tempdir()?;
    let mut w = WorkerProcess::spawn(state.path(), &unique_id("lost"), free_port()?, &[], &[])?;
    let model = ModelServer::start(vec![responses::calls(&[(
        "c1",
        "Bash",
        &serde_json::json!({"command": "echo started; sleep 120"}).to_string(),
    )])])
    .await;
    let token = w.token_file();
    let token = token.to_string_lossy();
    let mut cmd = corral_e2e::run::command(
        &model,
        &w.url,
        sessions.path(),
        &["--session", "s1", "Sleep."],
    );
    cmd.env("CORRAL_TOKEN_FILE", token.as_ref())
        .env("CORRAL_WORKER_LOST_AFTER", "5s");
    let child = cmd.spawn()?;
    // The command is running once the worker has an operation.
    let client = w.client().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while client.worker_info().await?.running_operations == 0 {
        if tokio::time::Instant::now() > deadline {
            bail!("the command never started");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lose_host(&mut w);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await??;
    let result = result_of(&out)?;
    assert_eq!(result["status"], "failed", "{result}");
    let error = result["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "sandbox lost: worker {} unreachable for 5s",
            w.url
        )),
        "{error}"
    );
    // The call is answered as lost in the log, and the log says why the
    // run failed.
    let log = std::fs::read_to_string(sessions.path().join("s1.jsonl"))?;
    assert!(log.contains("\"type\":\"sandbox_lost\""), "{log}");
    Ok(())
}

/// `corral ARGS` against `workers` (a `--worker` list) with `token`.
async fn corral(
    workers: &str,
    token: &std::path::Path,
    args: &[&str],
) -> Result<std::process::Output> {
    Ok(tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", workers, "--token-file"])
        .arg(token)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await?)
}

#[tokio::test]
async fn new_sandboxes_are_placed_where_there_is_room_and_never_on_a_draining_worker() -> Result<()>
{
    // Three workers of two slots each, sharing one token file.
    let (_token_dir, token) = shared_token("placement-test-token-0123456789")?;
    let mut workers = Vec::new();
    let mut states = Vec::new();
    for _ in 0..3 {
        let state = tempfile::tempdir()?;
        let args = [
            "--max-sandboxes",
            "2",
            "--token-file",
            token.to_str().context("path")?,
        ];
        workers.push(WorkerProcess::spawn(
            state.path(),
            &unique_id("place"),
            free_port()?,
            &[],
            &args,
        )?);
        states.push(state);
    }
    let list = workers
        .iter()
        .map(|w| w.url.as_str())
        .collect::<Vec<_>>()
        .join(",");
    // The third drains: nothing new goes there.
    let third =
        WorkerClient::connect(&workers[2].url, Some("placement-test-token-0123456789")).await?;
    third.drain(true).await?;
    for i in 0..4 {
        let out = corral(&list, &token, &["sandbox", "create"]).await?;
        assert!(
            out.status.success(),
            "create {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut counts = Vec::new();
    for w in &workers {
        let c = WorkerClient::connect(&w.url, Some("placement-test-token-0123456789")).await?;
        counts.push(c.worker_info().await?.sandboxes);
    }
    assert_eq!(
        counts,
        [2, 2, 0],
        "two each where there is room, none on the draining one"
    );
    // Full: the next one is refused with every worker's reason.
    let out = corral(&list, &token, &["sandbox", "create"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("no worker can take it"), "{stderr}");
    assert!(
        stderr.contains("draining") && stderr.contains("full"),
        "{stderr}"
    );
    // A listing covers every worker; exec finds a sandbox wherever it is.
    let out = corral(&list, &token, &["sandbox", "ls", "-q"]).await?;
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let out = corral(
        &list,
        &token,
        &["exec", "--sandbox", &ids[3], "--", "echo", "found"],
    )
    .await?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "found\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The drain ends: exec places its own sandbox there (the only room).
    let out = corral(&workers[2].url, &token, &["worker", "undrain"]).await?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("draining:   no"));
    let out = corral(&list, &token, &["exec", "--", "echo", "placed"]).await?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "placed\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A DNS name stands for its addresses.
    let dns = format!("dns:///localhost:{}", workers[2].port);
    let out = corral(&dns, &token, &["exec", "--", "echo", "by name"]).await?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "by name\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(states);
    Ok(())
}

#[tokio::test]
async fn a_session_that_asks_for_it_goes_on_in_a_fresh_sandbox_on_another_worker() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let (_token_dir, token) = shared_token("replacement-test-token-0123456789")?;
    let (sa, sb) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let args = ["--token-file", token.to_str().context("path")?];
    let mut workers = [
        WorkerProcess::spawn(sa.path(), &unique_id("repl"), free_port()?, &[], &args)?,
        WorkerProcess::spawn(sb.path(), &unique_id("repl"), free_port()?, &[], &args)?,
    ];
    let list = format!("{},{}", workers[0].url, workers[1].url);
    let sessions = tempfile::tempdir()?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c1",
            "Bash",
            &serde_json::json!({"command": "echo started; sleep 120"}).to_string(),
        )]),
        responses::text("Starting over."),
    ])
    .await;
    let mut cmd = corral_e2e::run::command(
        &model,
        &list,
        sessions.path(),
        &[
            "--session",
            "moves",
            "--on-sandbox-lost",
            "new_sandbox",
            "Sleep.",
        ],
    );
    cmd.env("CORRAL_TOKEN_FILE", &token)
        .env("CORRAL_WORKER_LOST_AFTER", "4s");
    let child = cmd.spawn()?;
    // Whichever worker got it runs the command; that one's host is lost.
    let token_text = "replacement-test-token-0123456789";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let placed = 'found: loop {
        for (i, w) in workers.iter().enumerate() {
            let c = WorkerClient::connect(&w.url, Some(token_text)).await?;
            if c.worker_info().await?.running_operations > 0 {
                break 'found i;
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the command never started");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let lost_url = workers[placed].url.clone();
    lose_host(&mut workers[placed]);
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output()).await??;
    let result = result_of(&out)?;
    assert_eq!(result["status"], "done", "{result}");
    assert_eq!(result["final_text"], "Starting over.");
    // One run: one start, the replacement said as such, its turns counted
    // across both sandboxes.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let types: Vec<String> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|e| e["type"].as_str().map(String::from))
        .collect();
    let count = |t: &str| types.iter().filter(|x| *x == t).count();
    assert_eq!(
        (count("session_started"), count("sandbox_replaced")),
        (1, 1),
        "{stdout}"
    );
    assert_eq!(result["run_turns"], result["turns"], "one run: {result}");
    // The model was told: the call's result says it was lost, and a note
    // says the sandbox is fresh and why.
    let second = &model.received()[1];
    let text = second.text();
    // Failed by the manager, or answered as lost by the replacement:
    // either way, not run again.
    assert!(
        text.contains("Error: sandbox lost: worker") || text.contains("it was not run again"),
        "{text}"
    );
    assert!(
        text.contains("The sandbox your tools run in was lost (worker"),
        "{text}"
    );
    assert!(text.contains(&lost_url), "{text}");
    // It lives on the other worker now, as generation 1.
    let survivor = &workers[1 - placed];
    let c = WorkerClient::connect(&survivor.url, Some(token_text)).await?;
    let sandboxes = c.list_sandboxes().await?;
    assert_eq!(sandboxes.len(), 1, "{sandboxes:?}");
    assert!(
        sandboxes[0].id.as_str().ends_with("-g1"),
        "{:?}",
        sandboxes[0].id
    );
    let log = std::fs::read_to_string(sessions.path().join("moves.jsonl"))?;
    assert!(log.contains("\"type\":\"placed\""), "{log}");
    assert!(
        log.contains(&format!("\"worker\":\"{}\"", survivor.url)),
        "{log}"
    );
    // `session rm` removes every generation's sandbox it can reach, and
    // says which one it could not (the first lived on the lost host).
    let rm = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &list, "session", "rm", "moves"])
        .env("CORRAL_SESSIONS_DIR", sessions.path())
        .env("CORRAL_TOKEN_FILE", &token)
        .output()
        .await?;
    let said = String::from_utf8_lossy(&rm.stderr);
    assert!(rm.status.success(), "{said}");
    assert!(
        c.list_sandboxes().await?.is_empty(),
        "the survivor's sandbox is gone"
    );
    assert!(
        said.contains("of an earlier generation was not removed"),
        "{said}"
    );
    Ok(())
}

#[tokio::test]
async fn concurrent_creates_never_go_over_capacity() -> Result<()> {
    let state = tempfile::tempdir()?;
    let w = WorkerProcess::spawn(
        state.path(),
        &unique_id("cap"),
        free_port()?,
        &[],
        &["--max-sandboxes", "3"],
    )?;
    let client = w.client().await?;
    let creates = (0..8).map(|_| new_sandbox(&client));
    let results = futures_util::future::join_all(creates).await;
    let made = results.iter().filter(|r| r.is_ok()).count();
    let full = results
        .iter()
        .filter(|r| matches!(r, Err(ClientError::Status(s)) if s.code() == tonic::Code::ResourceExhausted))
        .count();
    assert_eq!((made, full), (3, 5), "{results:?}");
    assert_eq!(client.worker_info().await?.sandboxes, 3);
    Ok(())
}

#[tokio::test]
async fn a_session_finds_its_worker_by_id_when_its_address_changed() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let state = tempfile::tempdir()?;
    let sessions = tempfile::tempdir()?;
    let id = unique_id("moved");
    let mut first = WorkerProcess::spawn(state.path(), &id, free_port()?, &[], &[])?;
    let model =
        ModelServer::start(vec![responses::text("First."), responses::text("Second.")]).await;
    let token = first.token_file();
    let run = |url: String, prompt: &'static str| {
        let mut cmd =
            corral_e2e::run::command(&model, &url, sessions.path(), &["--session", "s", prompt]);
        cmd.env("CORRAL_TOKEN_FILE", &token);
        async move { Ok::<_, anyhow::Error>(cmd.output().await?) }
    };
    let out = run(first.url.clone(), "One.").await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same worker (state, id) comes back on another port, as a
    // restarted pod comes back at another address.
    first.kill9();
    std::mem::forget(first);
    let second = WorkerProcess::spawn(state.path(), &id, free_port()?, &[], &[])?;
    let out = run(second.url.clone(), "Two.").await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Second."), "{stdout}");
    assert!(stdout.contains("\"resumed\":true"), "{stdout}");
    Ok(())
}

#[tokio::test]
async fn a_session_rerun_after_its_worker_is_gone_goes_on_elsewhere_when_it_asked_to() -> Result<()>
{
    use corral_e2e::model::{ModelServer, responses};
    let (_token_dir, token) = shared_token("rerun-test-token-0123456789")?;
    let args = ["--token-file", token.to_str().context("path")?];
    let (sa, sb) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut a = WorkerProcess::spawn(sa.path(), &unique_id("rerun"), free_port()?, &[], &args)?;
    let b = WorkerProcess::spawn(sb.path(), &unique_id("rerun"), free_port()?, &[], &args)?;
    let sessions = tempfile::tempdir()?;
    let model =
        ModelServer::start(vec![responses::text("First."), responses::text("Second.")]).await;
    let run = |workers: String, extra: &'static [&'static str]| {
        let mut argv = vec!["--session", "s"];
        argv.extend_from_slice(extra);
        let mut cmd = corral_e2e::run::command(&model, &workers, sessions.path(), &argv);
        cmd.env("CORRAL_TOKEN_FILE", &token)
            .env("CORRAL_WORKER_LOST_AFTER", "2s");
        async move { Ok::<_, anyhow::Error>(cmd.output().await?) }
    };
    let out = run(a.url.clone(), &["--on-sandbox-lost", "new_sandbox", "One."]).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lose_host(&mut a);
    let out = run(format!("{},{}", a.url, b.url), &["Two."]).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Second."), "{stdout}");
    let told = model.received()[1].text();
    assert!(
        told.contains("The sandbox your tools run in was lost (worker"),
        "{told}"
    );
    let on_b = WorkerClient::connect(&b.url, Some("rerun-test-token-0123456789"))
        .await?
        .list_sandboxes()
        .await?;
    assert!(
        on_b.len() == 1 && on_b[0].id.as_str().ends_with("-g1"),
        "{on_b:?}"
    );
    Ok(())
}

#[tokio::test]
async fn exec_on_a_worker_that_went_silent_ends_at_the_deadline_too() -> Result<()> {
    // SIGSTOP: connections stay open and new ones are accepted by the
    // kernel, but nothing answers (a host gone without a word).
    let state = tempfile::tempdir()?;
    let mut w = WorkerProcess::spawn(state.path(), &unique_id("silent"), free_port()?, &[], &[])?;
    let (child, _stdout) = exec_started(&w, "6s").await?;
    let pid = nix::unistd::Pid::from_raw(w.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)?;
    let stopped = tokio::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output()).await;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT)?;
    let out = out??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("unreachable for 6s"), "{stderr}");
    // Keepalive (two 10 s pings at most) notices, then the deadline.
    assert!(
        stopped.elapsed() < Duration::from_secs(45),
        "{:?}",
        stopped.elapsed()
    );
    w.kill9();
    Ok(())
}

/// With several workers, every per-sandbox command finds the worker that
/// has the sandbox; `sandbox ls` lists what answers and warns about a
/// worker that does not; `worker info` covers each worker.
#[tokio::test]
async fn per_sandbox_commands_find_their_worker_among_several() -> Result<()> {
    let secret = "several-workers-token-0123456789";
    let (_token_dir, token) = shared_token(secret)?;
    let mut workers = Vec::new();
    let mut states = Vec::new();
    for _ in 0..2 {
        let state = tempfile::tempdir()?;
        let args = ["--token-file", token.to_str().context("path")?];
        workers.push(WorkerProcess::spawn(
            state.path(),
            &unique_id("many"),
            free_port()?,
            &[],
            &args,
        )?);
        states.push(state);
    }
    let (dead, _hole) = corral_e2e::fake::black_hole()?;
    let list = format!("{},{}", workers[0].url, workers[1].url);
    // The sandbox is on the second worker.
    let second = WorkerClient::connect(&workers[1].url, Some(secret)).await?;
    let sb = SandboxId::new(unique_id("far"))?;
    second
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let ok = |out: &std::process::Output| {
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let inspected = ok(&corral(&list, &token, &["sandbox", "inspect", sb.as_str()]).await?)?;
    assert!(inspected.contains(&workers[1].worker_id), "{inspected}");
    let stats = ok(&corral(&list, &token, &["sandbox", "stats", sb.as_str()]).await?)?;
    assert!(stats.contains(sb.as_str()), "{stats}");
    ok(&corral(&list, &token, &["sandbox", "reset", sb.as_str()]).await?)?;
    let info = ok(&corral(&list, &token, &["worker", "info"]).await?)?;
    for w in &workers {
        assert!(
            info.contains(&w.url) && info.contains(&w.worker_id),
            "{info}"
        );
    }
    // A third worker that never answers: the listing has the others and
    // says which one it could not ask.
    let with_dead = format!("{list},{dead}");
    let out = corral(&with_dead, &token, &["sandbox", "ls", "-q"]).await?;
    assert_eq!(ok(&out)?, format!("{sb}\n"));
    let warned = String::from_utf8_lossy(&out.stderr);
    assert!(
        warned.contains("warning: not listed") && warned.contains(&dead),
        "{warned}"
    );
    ok(&corral(&list, &token, &["sandbox", "rm", sb.as_str()]).await?)?;
    assert!(second.list_sandboxes().await?.is_empty());
    let out = corral(&list, &token, &["sandbox", "rm", sb.as_str()]).await?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("unknown sandbox {sb}")),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A suspended session holds nothing on its worker: when that worker is
/// gone (a replaced node), a rerun goes on on another worker of
/// `--worker`, with the files it had, whatever its loss policy, and the
/// model is told it moved.
#[tokio::test]
async fn a_suspended_session_whose_worker_is_gone_goes_on_elsewhere_with_its_files() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let secret = "suspended-move-token-0123456789";
    let (_token_dir, token) = shared_token(secret)?;
    let args = ["--token-file", token.to_str().context("path")?];
    let (sa, sb) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut a = WorkerProcess::spawn(sa.path(), &unique_id("susp"), free_port()?, &[], &args)?;
    let b = WorkerProcess::spawn(sb.path(), &unique_id("susp"), free_port()?, &[], &args)?;
    let sessions = tempfile::tempdir()?;
    let write = serde_json::json!({"command": "echo kept > /workspace/notes.txt"}).to_string();
    let read = serde_json::json!({"command": "cat /workspace/notes.txt"}).to_string();
    let model = ModelServer::start(vec![
        responses::calls(&[("c1", "Bash", &write)]),
        responses::text("Written."),
        responses::calls(&[("c2", "Bash", &read)]),
        responses::text("Read."),
    ])
    .await;
    let run = |workers: String, prompt: &'static str| {
        let mut cmd = corral_e2e::run::command(
            &model,
            &workers,
            sessions.path(),
            &["--session", "s", prompt],
        );
        // Suspended at the end of each run, as a user's runs are.
        cmd.env_remove("CORRAL_KEEP_SANDBOX")
            .env("CORRAL_TOKEN_FILE", &token)
            .env("CORRAL_WORKER_LOST_AFTER", "2s");
        async move { Ok::<_, anyhow::Error>(cmd.output().await?) }
    };
    let out = run(a.url.clone(), "write it").await?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        sessions.path().join("s.workspace.tar").exists(),
        "suspended"
    );
    lose_host(&mut a);
    let out = run(format!("{},{}", a.url, b.url), "read it").await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("\"text\":\"kept\""),
        "the files came along: {stdout}"
    );
    let told = model.received()[2].text();
    assert!(
        told.contains("This session was suspended, and it goes on now"),
        "{told}"
    );
    let state = corral_harness::agent::replay(sessions.path(), "s")?;
    let config = state.config.context("config")?;
    assert_eq!(
        config.worker.as_deref(),
        Some(b.url.as_str()),
        "recorded on b"
    );
    assert_eq!(config.worker_id.as_deref(), Some(b.worker_id.as_str()));
    Ok(())
}
