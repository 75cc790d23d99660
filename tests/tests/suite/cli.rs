//! The `corral` command line: exit codes, live streams, one-line errors.

use std::process::Output;

use corral_e2e::{Harness, binary, unique_id};

async fn corral(args: &[&str]) -> anyhow::Result<Output> {
    Ok(tokio::process::Command::new(binary("corral")?)
        .args(args)
        .env_remove("CORRAL_WORKER")
        .output()
        .await?)
}

fn one_line_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        err.lines().count(),
        1,
        "expected one line on stderr, got: {err}"
    );
    assert!(err.starts_with("corral: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[tokio::test]
async fn exit_codes_and_streams() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let base = ["--worker", h.url.as_str(), "exec", "--sandbox", sb.as_str()];
    let run = |extra: &'static [&'static str]| {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        async move { corral(&args).await }
    };
    let out = run(&[
        "-e",
        "WHO=you",
        "--",
        "sh",
        "-c",
        "echo hi $WHO; echo oops >&2; exit 5",
    ])
    .await?;
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi you\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");

    let out = run(&["--", "echo", "it's", "a b"]).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "it's a b\n");

    let out = run(&["--timeout", "1s", "--", "sleep", "30"]).await?;
    assert_eq!(out.status.code(), Some(124));
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));

    let out = run(&["--", "sh", "-c", "kill -KILL $$"]).await?;
    assert_eq!(out.status.code(), Some(137));

    let out = run(&["-w", "/tmp", "--", "pwd"]).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/tmp\n");

    let out = run(&["--bash", "--", "echo", "through bash"]).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "through bash\n");

    // -it with no terminal for input: refused at once, as `docker exec -it`.
    let out = run(&["-it", "--", "cat"]).await?;
    assert_eq!(out.status.code(), Some(2));
    assert!(one_line_error(&out).contains("not a TTY"));

    // No timeout unless asked, and 0 is none: the worker's cap (24 h), not
    // a hidden ten minutes.
    for extra in [&[][..], &["--timeout", "0"][..]] {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "echo", "untimed"]);
        let out = corral(&args).await?;
        assert_eq!(String::from_utf8_lossy(&out.stdout), "untimed\n");
    }
    let untimed: Vec<_> = h
        .client
        .list_operations(&sb)
        .await?
        .into_iter()
        .filter_map(|r| match r.spec {
            corral_proto::OperationSpec::Shell(s) if s.command.contains("untimed") => {
                Some(s.timeout_ms)
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        untimed,
        vec![Some(corral_proto::limits::MAX_TIMEOUT_MS); 2],
        "{untimed:?}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn ctrl_c_cancels_the_command_and_exits_130() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let mut child = tokio::process::Command::new(binary("corral")?)
        .args([
            "--worker",
            &h.url,
            "exec",
            "--sandbox",
            sb.as_str(),
            "--",
            "sh",
            "-c",
            "echo go; sleep 300",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line).await?;
    assert_eq!(line, "go\n");
    let pid = nix::unistd::Pid::from_raw(child.id().expect("pid") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)?;
    let out = child.wait_with_output().await?;
    assert_eq!(out.status.code(), Some(130));
    assert!(String::from_utf8_lossy(&out.stderr).contains("canceled"));
    let left = h.client.get_sandbox(&sb).await?.running_operations;
    assert_eq!(left, 0, "the command still runs");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn errors_are_one_clear_line() -> anyhow::Result<()> {
    let out = corral(&["--worker", "http://127.0.0.1:1", "sandbox", "ls"]).await?;
    assert_eq!(out.status.code(), Some(125));
    assert!(one_line_error(&out).contains("cannot reach the worker at http://127.0.0.1:1"));

    let h = Harness::start().await?;
    let out = corral(&[
        "--worker",
        &h.url,
        "exec",
        "--sandbox",
        "nope",
        "--",
        "true",
    ])
    .await?;
    assert_eq!(out.status.code(), Some(125));
    assert!(one_line_error(&out).contains("unknown sandbox nope"));

    let out = corral(&["--worker", &h.url, "sandbox", "rm", "nope"]).await?;
    assert!(one_line_error(&out).contains("unknown sandbox nope"));

    let out = corral(&["exec", "--bogus", "--", "true"]).await?;
    assert_eq!(out.status.code(), Some(2), "usage errors exit 2");
    assert!(one_line_error(&out).contains("'--bogus'"));
    let out = corral(&["sandbox", "create", "--memory", "lots"]).await?;
    assert_eq!(out.status.code(), Some(2));
    assert!(one_line_error(&out).contains("not a size"));

    let state = tempfile::tempdir()?;
    let state_arg = state.path().to_string_lossy().to_string();
    let out = corral(&[
        "--state-dir",
        &state_arg,
        "--docker-host",
        "unix:///nonexistent/docker.sock",
        "sandbox",
        "ls",
    ])
    .await?;
    assert_eq!(out.status.code(), Some(125));
    assert!(one_line_error(&out).contains("Docker"));
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn the_embedded_worker_runs_and_cleans_up() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let home = tempfile::tempdir()?;
    // Left open by an older version: Corral's directory, the worker's, its
    // log and lock. Made its owner's only at the next start.
    let corral_dir = home.path().join("corral");
    let state = corral_dir.join("embedded");
    std::fs::create_dir_all(&state)?;
    let mode = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
    for (p, m) in [
        (corral_dir.clone(), 0o755),
        (state.clone(), 0o755),
        (state.join("worker.log"), 0o644),
        (state.join("start.lock"), 0o644),
    ] {
        if m == 0o644 {
            std::fs::write(&p, "")?;
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m))?;
    }
    let s = state.to_string_lossy().to_string();
    let worker_id = unique_id("emb");
    std::fs::write(state.join("worker-id"), &worker_id)?;
    let out = corral(&[
        "--state-dir",
        &s,
        "exec",
        "--",
        "sh",
        "-c",
        "echo embedded; exit 4",
    ])
    .await?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "embedded\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(mode(&corral_dir)?, 0o700);
    assert_eq!(mode(&state)?, 0o700);
    for f in ["worker.log", "start.lock", "token"] {
        assert_eq!(mode(&state.join(f))?, 0o600, "{f}");
    }

    // A sandbox outlives the process that created it, and a later one adopts it.
    let out = corral(&[
        "--state-dir",
        &s,
        "sandbox",
        "create",
        "--id",
        "kept",
        "--pids",
        "100",
    ])
    .await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "kept\n");
    let out = corral(&[
        "--state-dir",
        &s,
        "exec",
        "--sandbox",
        "kept",
        "--",
        "sh",
        "-c",
        "echo 1 > f; cat f",
    ])
    .await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "1\n");
    let out = corral(&["--state-dir", &s, "sandbox", "ls"]).await?;
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        listing.contains("kept") && listing.contains("ready"),
        "{listing}"
    );
    let out = corral(&["--state-dir", &s, "sandbox", "rm", "kept"]).await?;
    assert!(out.status.success());
    let left = std::process::Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=corral.worker={worker_id}"),
        ])
        .output()?;
    assert!(left.stdout.is_empty(), "containers left behind");
    Ok(())
}

#[tokio::test]
async fn sandbox_create_loosens_only_what_it_is_told() -> anyhow::Result<()> {
    // A worker whose operator allows these loosenings.
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let out = corral(&[
        "--worker",
        &h.url,
        "sandbox",
        "create",
        "--id",
        "loose",
        "--network",
        "bridge",
        "--memory",
        "300m",
        "--cpus",
        "0.5",
        "--pids",
        "99",
        "--workspace-size",
        "64m",
        "--tmp-size",
        "32m",
        "--root",
        "--writable-rootfs",
        "--cap-add",
        "CAP_CHOWN",
        "-e",
        "STAGE=test",
    ])
    .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "loose\n");
    let info = h
        .client
        .get_sandbox(&corral_proto::SandboxId::new("loose")?)
        .await?;
    let s = info.spec;
    assert_eq!(s.network, corral_proto::NetworkMode::Bridge);
    assert_eq!(
        (s.memory_bytes, s.cpu_millis, s.pids_limit),
        (Some(300 << 20), Some(500), Some(99))
    );
    assert_eq!(
        (s.workspace_bytes, s.tmp_bytes),
        (Some(64 << 20), Some(32 << 20))
    );
    assert!(s.run_as_root && s.writable_rootfs);
    assert_eq!(s.add_capabilities, vec!["CAP_CHOWN".to_string()]);
    let out = corral(&[
        "--worker",
        &h.url,
        "exec",
        "--sandbox",
        "loose",
        "--",
        "sh",
        "-c",
        "id -u; echo $STAGE; df -m /workspace | tail -1",
    ])
    .await?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.starts_with("0\ntest\n"), "{text}");
    assert!(text.contains(" 64 "), "workspace is 64 MiB: {text}");
    h.stop().await;
    Ok(())
}

/// `sandbox ls` (a table, JSON, ids), `inspect`, `rm` of several and of
/// all, and `prune` of what nobody uses.
#[tokio::test]
async fn sandboxes_are_listed_inspected_removed_and_pruned() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let w = ["--worker", h.url.as_str()];
    let sb = |args: &[&str]| {
        let mut all: Vec<String> = w.iter().map(|s| s.to_string()).collect();
        all.push("sandbox".into());
        all.extend(args.iter().map(|s| s.to_string()));
        async move {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            corral(&args).await
        }
    };
    let mut ids = Vec::new();
    for name in ["one", "two", "three"] {
        let label = format!("name={name}");
        let out = sb(&[
            "create",
            "--id",
            &unique_id(name),
            "-l",
            &label,
            "-l",
            "team=x",
        ])
        .await?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        ids.push(String::from_utf8(out.stdout)?.trim().to_string());
    }
    let out = sb(&["ls", "-q"]).await?;
    let mut listed: Vec<String> = String::from_utf8(out.stdout)?
        .lines()
        .map(String::from)
        .collect();
    listed.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(listed, want);

    let out = sb(&["ls"]).await?;
    let table = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("WORKER"),
        "{table}"
    );
    let col = lines[0].find("IMAGE");
    assert!(
        lines[1..]
            .iter()
            .all(|l| l[col.unwrap()..].starts_with("corral-sandbox")),
        "{table}"
    );
    assert!(table.contains(&h.worker_id), "{table}");

    let out = sb(&["ls", "--json"]).await?;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json.as_array().map(Vec::len), Some(3));
    assert_eq!(json[0]["worker_id"], h.worker_id.as_str());
    assert_eq!(json[0]["state"], "ready");
    // Labels: kept, shown, and a filter.
    let out = sb(&["ls", "-q", "--label", "name=two", "--label", "team=x"]).await?;
    assert_eq!(String::from_utf8(out.stdout)?.trim(), ids[1]);
    let out = sb(&["ls", "-q", "--label", "name=two", "--label", "team=y"]).await?;
    assert!(out.stdout.is_empty());
    let bad = sb(&["create", "--label", "a b=c"]).await?;
    assert!(!bad.status.success(), "{bad:?}");
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("invalid `labels`: key \"a b\""),
        "{bad:?}"
    );

    let out = sb(&["inspect", &ids[0], "--json"]).await?;
    let one: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(one["id"], ids[0].as_str());
    assert_eq!(one["spec"]["labels"]["name"], "one");
    assert!(
        one["spec"].is_object() && one["last_used_unix_ms"].as_i64() > Some(0),
        "{one}"
    );
    assert!(one["usage"]["pids"].as_u64() >= Some(1), "{one}");
    // The limits in force: the worker's defaults, as none were asked.
    assert_eq!(one["limits"]["pids_limit"], 256, "{one}");
    assert_eq!(one["limits"]["cpu_millis"], 1000, "{one}");
    let out = sb(&["inspect", &ids[0]]).await?;
    let text = String::from_utf8(out.stdout)?;
    assert!(
        text.contains("worker:") && text.contains("processes"),
        "{text}"
    );
    assert!(
        text.contains("1024.0 MiB of memory, 1 CPU, 256 processes"),
        "{text}"
    );

    // Several at once; an unknown one is named, the others still go.
    let out = sb(&["rm", &ids[0], "nope", &ids[1]]).await?;
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown sandbox nope"));
    let out = sb(&["ls", "-q"]).await?;
    assert_eq!(String::from_utf8(out.stdout)?.trim(), ids[2]);

    // Used just now: kept by a prune of what is an hour idle, not by one of
    // what is idle at all.
    let out = sb(&["prune"]).await?;
    assert!(out.status.success() && out.stdout.is_empty());
    let out = sb(&["prune", "--idle", "0s"]).await?;
    assert_eq!(String::from_utf8(out.stdout)?.trim(), ids[2]);
    let out = sb(&["create"]).await?;
    assert!(out.status.success());
    let out = sb(&["rm", "--all"]).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = sb(&["ls", "-q"]).await?;
    assert!(out.stdout.is_empty());
    h.stop().await;
    Ok(())
}

/// `corral ps` lists a sandbox's operations, `corral kill` cancels one by
/// its id alone, and `corral logs` prints what they printed (and, with -f,
/// what they print next).
#[tokio::test]
async fn operations_are_listed_killed_and_their_output_read_back() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let done = h.run(&sb, "echo first-out; echo first-err >&2").await?;
    assert!(done.outcome.is_success());
    let op = corral_proto::OperationId::random();
    h.client
        .submit(
            &sb,
            &op,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new(
                "echo started; sleep 300",
            )),
        )
        .await?;
    let w = ["--worker", h.url.as_str()];
    let with = |args: &[&str]| {
        let mut all: Vec<String> = w.iter().map(|s| s.to_string()).collect();
        all.extend(args.iter().map(|s| s.to_string()));
        all
    };
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        corral(&args).await
    };
    // Running only, then all.
    let out = run(with(&["ps", sb.as_str()])).await?;
    let text = String::from_utf8(out.stdout)?;
    assert!(
        text.starts_with("ID") && text.contains(&op.to_string()),
        "{text}"
    );
    assert!(
        text.contains("running") && text.contains("echo started; sleep 300"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 2, "{text}");
    let out = run(with(&["ps", "--all", sb.as_str()])).await?;
    let text = String::from_utf8(out.stdout)?;
    assert!(text.contains("exited with code 0"), "{text}");

    // What was printed so far, stdout and stderr apart.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let out = run(with(&["logs", sb.as_str()])).await?;
        let (o, e) = (
            String::from_utf8(out.stdout)?,
            String::from_utf8(out.stderr)?,
        );
        if o.contains("started") {
            assert!(o.starts_with("first-out\n"), "{o}");
            assert!(e.contains("first-err"), "{e}");
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no output: {o}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // Followed: what is printed next arrives live, and Ctrl-C ends it.
    let mut follow = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", h.url.as_str(), "logs", "-f", sb.as_str()])
        .env_remove("CORRAL_WORKER")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = follow
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    h.run(&sb, "echo later").await?;
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !seen.contains("later") {
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout_at(
            deadline,
            tokio::io::AsyncReadExt::read(&mut stdout, &mut buf),
        )
        .await??;
        anyhow::ensure!(n > 0, "logs -f ended: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let pid = nix::unistd::Pid::from_raw(follow.id().unwrap_or_default() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)?;
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), follow.wait()).await??;
    assert!(status.success(), "{status:?}");

    // Killed by its id alone; then it is no longer running.
    let out = run(with(&["kill", &op.to_string()])).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let record = loop {
        let r = h.client.operation(&sb, &op).await?;
        if r.result.is_some() {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(
        record.result.map(|r| r.outcome),
        Some(corral_proto::Outcome::Canceled)
    );
    // Killing what has ended: nothing to do (1), not a usage error (2).
    let out = run(with(&["kill", &op.to_string()])).await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not running"));
    let out = run(with(&["kill", "no-such-op"])).await?;
    assert!(String::from_utf8_lossy(&out.stderr).contains("no sandbox of this worker knows"));

    // An exec whose command another client kills says so, with 137, not
    // the 130 of a Ctrl-C it never got.
    let watching = tokio::process::Command::new(binary("corral")?)
        .args(["--worker", h.url.as_str(), "exec", "--sandbox", sb.as_str()])
        .args(["--", "sh", "-c", "sleep 120 # to-be-killed"])
        .env_remove("CORRAL_WORKER")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let target = loop {
        let found = h.client.list_operations(&sb).await?.into_iter().find(|r| {
            r.result.is_none()
                && matches!(&r.spec, corral_proto::OperationSpec::Shell(s) if s.command.contains("to-be-killed"))
        });
        if let Some(r) = found {
            break r.id;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let out = run(with(&["kill", &target.to_string()])).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ended = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        watching.wait_with_output(),
    )
    .await??;
    assert_eq!(ended.status.code(), Some(137));
    assert!(
        String::from_utf8_lossy(&ended.stderr).contains("killed by a cancel from another client"),
        "{}",
        String::from_utf8_lossy(&ended.stderr)
    );
    h.stop().await;
    Ok(())
}

/// `corral sandbox stats` reads a sandbox's cgroup: its limits, its
/// processes, and memory that counts what its workspace holds.
#[tokio::test]
async fn sandbox_stats_show_what_a_sandbox_uses() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(corral_proto::SandboxSpec {
            pids_limit: Some(100),
            ..corral_proto::SandboxSpec::default()
        })
        .await?;
    let r = h
        .run(&sb, "head -c 40000000 /dev/urandom > /workspace/blob")
        .await?;
    assert!(r.outcome.is_success(), "{r:?}");
    let out = corral(&[
        "--worker",
        &h.url,
        "sandbox",
        "stats",
        sb.as_str(),
        "--json",
    ])
    .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let s = &all[0];
    assert_eq!(s["id"], sb.as_str());
    assert_eq!(s["pids_limit"], 100);
    assert!(s["pids"].as_u64() >= Some(1), "{s}");
    assert!(
        s["memory_bytes"].as_u64() >= Some(40_000_000),
        "the workspace counts: {s}"
    );
    assert!(
        s["memory_limit_bytes"].as_u64() > s["memory_bytes"].as_u64(),
        "{s}"
    );
    let out = corral(&["--worker", &h.url, "sandbox", "stats"]).await?;
    let table = String::from_utf8(out.stdout)?;
    assert!(
        table.starts_with("ID") && table.contains(sb.as_str()) && table.contains("MiB"),
        "{table}"
    );
    h.stop().await;
    Ok(())
}

/// `corral worker info` says what a sandbox gets when it names nothing and
/// what it may ask for: the worker's default image and runtime, its policy
/// and ceilings, in text and in JSON.
#[tokio::test]
async fn worker_info_shows_the_default_image_and_the_policy() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let out = corral(&["--worker", h.url.as_str(), "worker", "info"]).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("image:") && text.contains("corral-sandbox"),
        "{text}"
    );
    assert!(
        text.contains("allows:") && text.contains("at most:"),
        "{text}"
    );
    let out = corral(&["--worker", h.url.as_str(), "worker", "info", "--json"]).await?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert!(
        v["default_image"]
            .as_str()
            .is_some_and(|i| i.contains("corral-sandbox")),
        "{v}"
    );
    assert!(
        v["policy"]["ceilings"]["pids"]
            .as_u64()
            .is_some_and(|p| p > 0),
        "{v}"
    );
    h.stop().await;
    Ok(())
}

/// `corral worker drain` names its worker: the local one drained would
/// refuse every sandbox, across restarts, until undrained. A refused
/// create on a draining worker names `undrain`.
#[tokio::test]
async fn a_drain_names_its_worker_and_a_drained_worker_says_how_to_end_it() -> anyhow::Result<()> {
    let home = tempfile::tempdir()?;
    let out = tokio::process::Command::new(binary("corral")?)
        .args(["worker", "drain"])
        .env_remove("CORRAL_WORKER")
        .env("HOME", home.path())
        .env("XDG_STATE_HOME", home.path().join("state"))
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(2));
    let err = one_line_error(&out);
    assert!(err.contains("--worker") && err.contains("undrain"), "{err}");
    assert!(
        !home.path().join("state/corral").join("embedded").exists(),
        "no local worker was started"
    );
    let h = Harness::start().await?;
    let drained = corral(&["--worker", h.url.as_str(), "worker", "drain"]).await?;
    assert!(drained.status.success(), "{drained:?}");
    let out = corral(&["--worker", h.url.as_str(), "exec", "--", "true"]).await?;
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("undrain"), "{err}");
    h.stop().await;
    Ok(())
}
