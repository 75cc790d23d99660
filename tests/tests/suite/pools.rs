//! Warm pools on a real worker (its `--pool` flag) and a real engine: a
//! claim is a started sandbox with what was asked of it applied; no member
//! is handed out twice or keeps anything of an earlier tenant; members that
//! die are replaced; capacity holds; a restart leaves nothing behind.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use corral_e2e::{WorkerProcess, free_port, run_shell, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::{SandboxId, SandboxSpec};

fn spawn(state: &std::path::Path, id: &str, port: u16, args: &[&str]) -> Result<WorkerProcess> {
    WorkerProcess::spawn(state, id, port, &[], args)
}

/// Waits until the worker's first pool has `ready` members.
async fn ready(client: &WorkerClient, ready: u32) -> Result<corral_proto::PoolInfo> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = client.worker_info().await?;
        let pool = info.pools.first().cloned().context("no pool")?;
        if pool.ready >= ready {
            return Ok(pool);
        }
        if Instant::now() > deadline {
            bail!("the pool never had {ready} ready: {pool:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The containers of this worker that are pool members (by their names).
fn members(worker_id: &str) -> Result<Vec<String>> {
    let out = std::process::Command::new("docker")
        .args([
            "ps",
            "-a",
            "--filter",
            &format!("label=corral.worker={worker_id}"),
            "--format",
            "{{.ID}} {{.Names}}",
        ])
        .output()?;
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .filter(|l| l.contains("-pool-"))
        .filter_map(|l| l.split(' ').next().map(String::from))
        .collect())
}

#[tokio::test]
async fn a_claim_is_a_started_sandbox_with_what_was_asked_and_nothing_of_a_tenant_before()
-> Result<()> {
    let state = tempfile::tempdir()?;
    let metrics_port = free_port()?;
    let worker = spawn(
        state.path(),
        &unique_id("pl"),
        free_port()?,
        &[
            "--pool",
            "corral-sandbox:latest=2",
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
        ],
    )?;
    let client = worker.client().await?;
    let before = ready(&client, 2).await?;
    assert_eq!((before.size, before.claims), (2, 0));
    assert!(before.last_refill_ms > 0, "{before:?}");
    // Members are not the user's sandboxes.
    assert!(client.list_sandboxes().await?.is_empty());
    let id = SandboxId::new(unique_id("sb"))?;
    let spec = SandboxSpec {
        env: [("GREETING".to_string(), "from the claim".to_string())].into(),
        labels: [("team".to_string(), "pools".to_string())].into(),
        ttl_ms: Some(3_600_000),
        idle_timeout_ms: Some(600_000),
        ..SandboxSpec::default()
    };
    let made = client.create_sandbox(Some(&id), spec.clone()).await?;
    assert_eq!(made.id, id);
    assert_eq!(made.spec.labels, spec.labels);
    assert_eq!(made.spec.ttl_ms, Some(3_600_000));
    // Its commands have its environment, its user and its workspace.
    let out = run_shell(
        &client,
        &id,
        "echo \"$GREETING\"; id -u; pwd; ls -A /workspace | wc -l",
    )
    .await?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "from the claim", "{out}");
    assert_ne!(lines[1], "0");
    assert_eq!(lines[2], "/workspace");
    assert_eq!(lines[3], "0", "a fresh workspace: {out}");
    let after = client.worker_info().await?;
    assert_eq!(after.pools[0].claims, 1);
    // The metrics say as much: size, ready, claims, refills.
    let text = super::fleet::scrape(metrics_port).await?;
    let series = |name: &str| {
        super::fleet::sample(&text, &format!("corral_{name}"))
            .with_context(|| format!("{name}: {text}"))
    };
    let t = "template=\"corral-sandbox:latest=2\"";
    assert_eq!(series(&format!("pool_size{{{t}}}"))?, 2.0);
    assert_eq!(
        series(&format!("pool_ready{{{t}}}"))?,
        f64::from(after.pools[0].ready)
    );
    assert_eq!(
        series(&format!("pool_claims_total{{{t},result=\"claimed\"}}"))?,
        1.0
    );
    assert!(series(&format!("pool_refill_seconds_count{{{t}}}"))? >= 2.0);
    // And the command line.
    let out = std::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url, "worker", "info"])
        .env("CORRAL_TOKEN_FILE", worker.token_file())
        .env_remove("CORRAL_WORKER")
        .output()?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(shown.contains("corral-sandbox:latest=2 ("), "{shown}");
    assert!(shown.contains("of 2 ready; 1 claimed, 0 missed"), "{shown}");
    assert_eq!(
        client
            .list_sandboxes()
            .await?
            .iter()
            .map(|s| s.id.clone())
            .collect::<Vec<_>>(),
        vec![id.clone()]
    );
    // The same create again is the same sandbox, not another claim.
    client.create_sandbox(Some(&id), spec).await?;
    assert_eq!(client.worker_info().await?.pools[0].claims, 1);
    // The pool is made whole again.
    ready(&client, 2).await?;
    client.destroy_sandbox(&id).await?;
    // A claim's lifetime is its own: one with a short TTL is removed by it.
    let short = client
        .create_sandbox(
            None,
            SandboxSpec {
                ttl_ms: Some(1500),
                ..SandboxSpec::default()
            },
        )
        .await?;
    assert_eq!(client.worker_info().await?.pools[0].claims, 2);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.get_sandbox(&short.id).await {
            Err(e) if e.reason() == Some(corral_proto::reason::Reason::SandboxRemoved) => break,
            other => {
                if Instant::now() > deadline {
                    bail!("a claim outlived its TTL: {other:?}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn two_hundred_claims_in_a_row_never_share_a_member() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = spawn(
        state.path(),
        &unique_id("pl"),
        free_port()?,
        &["--pool", "corral-sandbox:latest=4"],
    )?;
    let client = worker.client().await?;
    let mut containers = HashSet::new();
    for i in 0..200 {
        // A member is ready each time: every create is a claim.
        ready(&client, 1).await?;
        let sb = client.create_sandbox(None, SandboxSpec::default()).await?;
        assert!(
            containers.insert(sb.container_id.clone()),
            "claim {i} got container {} again",
            sb.container_id
        );
        // Whatever a tenant leaves, the next one never sees.
        let out = run_shell(
            &client,
            &sb.id,
            "ls /workspace/left-behind 2>/dev/null; touch /workspace/left-behind /tmp/left-behind; echo ok",
        )
        .await?;
        assert_eq!(out.trim(), "ok", "claim {i}: {out}");
        client.destroy_sandbox(&sb.id).await?;
    }
    let pool = client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (200, 0), "{pool:?}");
    Ok(())
}

/// A pool with a ceiling follows demand: after a burst of six creates at
/// once (one finds a member, five are made cold), it keeps six members
/// ready, not its floor of one, and says so. (That it goes back to its
/// floor five minutes after the burst is `pool::tests`' with a clock.)
#[tokio::test]
async fn a_pool_with_a_ceiling_grows_to_the_burst_it_saw() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = spawn(
        state.path(),
        &unique_id("pl"),
        free_port()?,
        &["--pool", "corral-sandbox:latest=1,max=8"],
    )?;
    let client = worker.client().await?;
    let before = ready(&client, 1).await?;
    assert_eq!((before.size, before.max_size), (1, 8), "{before:?}");
    let burst = futures_util::future::join_all(
        (0..6).map(|_| client.create_sandbox(None, SandboxSpec::default())),
    )
    .await;
    let made: Vec<_> = burst.into_iter().collect::<Result<_, _>>()?;
    let after = ready(&client, 6).await?;
    assert_eq!(
        (after.size, after.claims + after.misses),
        (6, 6),
        "{after:?}"
    );
    // And no more than that.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = client.worker_info().await?.pools[0].clone();
    assert_eq!((held.size, held.ready), (6, 6), "{held:?}");
    for sb in made {
        client.destroy_sandbox(&sb.id).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_member_killed_from_outside_is_replaced_and_never_handed_out() -> Result<()> {
    let state = tempfile::tempdir()?;
    let wid = unique_id("pl");
    let worker = spawn(
        state.path(),
        &wid,
        free_port()?,
        &["--pool", "corral-sandbox:latest=2"],
    )?;
    let client = worker.client().await?;
    ready(&client, 2).await?;
    let first = members(&wid)?;
    assert_eq!(first.len(), 2, "{first:?}");
    for c in &first {
        let killed = std::process::Command::new("docker")
            .args(["kill", c])
            .output()?;
        assert!(killed.status.success());
    }
    // Both are replaced by new ones; the dead are gone.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = members(&wid)?;
        if now.len() == 2 && now.iter().all(|c| !first.contains(c)) {
            break;
        }
        if Instant::now() > deadline {
            bail!("members not replaced: {now:?} (killed {first:?})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ready(&client, 2).await?;
    let sb = client.create_sandbox(None, SandboxSpec::default()).await?;
    assert!(
        !first
            .iter()
            .any(|c| sb.container_id.starts_with(c.as_str()))
    );
    assert_eq!(
        run_shell(&client, &sb.id, "echo alive").await?.trim(),
        "alive"
    );
    Ok(())
}

#[tokio::test]
async fn a_full_worker_with_a_pool_refuses_as_before_and_a_miss_is_made_cold() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = spawn(
        state.path(),
        &unique_id("pl"),
        free_port()?,
        &["--max-sandboxes", "3", "--pool", "corral-sandbox:latest=1"],
    )?;
    let client = worker.client().await?;
    ready(&client, 1).await?;
    // A claim, then at once another create of the template: none is ready
    // yet, so it is made cold (and counted as a miss).
    let a = client.create_sandbox(None, SandboxSpec::default()).await?;
    let b = client.create_sandbox(None, SandboxSpec::default()).await?;
    let pool = client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (1, 1), "{pool:?}");
    assert_eq!(run_shell(&client, &b.id, "echo cold").await?.trim(), "cold");
    // A create that matches no template is made cold too.
    let c = client
        .create_sandbox(
            None,
            SandboxSpec {
                pids_limit: Some(64),
                ..SandboxSpec::default()
            },
        )
        .await?;
    // Three sandboxes: the worker is full, its pool's slot given up.
    let e = client
        .create_sandbox(None, SandboxSpec::default())
        .await
        .expect_err("full");
    assert!(e.is_refusal(), "{e}");
    for sb in [&a, &b, &c] {
        client.destroy_sandbox(&sb.id).await?;
    }
    // Room again: the pool fills.
    ready(&client, 1).await?;
    Ok(())
}

#[tokio::test]
async fn a_restarted_worker_keeps_its_claims_and_leaves_no_member_behind() -> Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("pl"), free_port()?);
    let args = ["--pool", "corral-sandbox:latest=2"];
    let mut worker = spawn(state.path(), &wid, port, &args)?;
    let client = worker.client().await?;
    ready(&client, 2).await?;
    let sb = client
        .create_sandbox(
            None,
            SandboxSpec {
                env: [("KEPT".to_string(), "yes".to_string())].into(),
                ..SandboxSpec::default()
            },
        )
        .await?;
    ready(&client, 2).await?;
    let before: Vec<String> = members(&wid)?
        .into_iter()
        .filter(|c| !sb.container_id.starts_with(c.as_str()))
        .collect();
    worker.kill9();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = spawn(state.path(), &wid, port, &args)?;
    std::mem::forget(std::mem::replace(&mut worker, again));
    let client = worker.client().await?;
    // The claimed sandbox is adopted, its environment still given.
    let listed: Vec<SandboxId> = client
        .list_sandboxes()
        .await?
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(listed, vec![sb.id.clone()]);
    assert_eq!(
        run_shell(&client, &sb.id, "echo $KEPT").await?.trim(),
        "yes"
    );
    // The old members are removed, new ones made (the claimed sandbox's
    // container keeps the name it was made with).
    ready(&client, 2).await?;
    let claimed = |c: &String| sb.container_id.starts_with(c.as_str());
    let now: Vec<String> = members(&wid)?.into_iter().filter(|c| !claimed(c)).collect();
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(
        now.iter().all(|c| !before.contains(c)),
        "{before:?} {now:?}"
    );
    // A stop (SIGTERM) ends at once, pool or not. Blocking: off the
    // runtime, whose connections must see the goodbye.
    let code = tokio::task::spawn_blocking(move || {
        let mut w = worker;
        w.terminate(Duration::from_secs(30))
    })
    .await??;
    assert_eq!(code, Some(0));
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}

#[tokio::test]
async fn placement_prefers_a_worker_with_a_warm_member() -> Result<()> {
    // One token for both workers, so the CLI can reach either.
    let dir = tempfile::tempdir()?;
    let token = dir.path().join("token");
    std::fs::write(&token, "a-shared-token-of-the-test\n")?;
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let t = token.to_str().context("token path")?;
    let (s1, s2) = (tempfile::tempdir()?, tempfile::tempdir()?);
    // The cold worker has more room; the warm one has a pool.
    let cold = spawn(
        s1.path(),
        &unique_id("cold"),
        free_port()?,
        &["--max-sandboxes", "64", "--token-file", t],
    )?;
    let warm = spawn(
        s2.path(),
        &unique_id("warm"),
        free_port()?,
        &[
            "--max-sandboxes",
            "8",
            "--pool",
            "corral-sandbox:latest=4",
            "--token-file",
            t,
        ],
    )?;
    let wc = WorkerClient::connect(&warm.url, Some("a-shared-token-of-the-test")).await?;
    let workers = format!("{},{}", cold.url, warm.url);
    // Placement chooses among the answers it has: on two cores busy with
    // the rest of the suite, one worker's answer can come more than the
    // default grace after the other's, so the test waits for both.
    let both = "--placement-grace=5s";
    for _ in 0..3 {
        ready(&wc, 1).await?;
        let out = tokio::process::Command::new(corral_e2e::binary("corral")?)
            .args(["--worker", &workers, both, "sandbox", "create"])
            .env_remove("CORRAL_WORKER")
            .env("CORRAL_TOKEN_FILE", &token)
            .output()
            .await?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // All three went to the warm worker, as claims.
    assert_eq!(wc.list_sandboxes().await?.len(), 3);
    assert_eq!(wc.worker_info().await?.pools[0].claims, 3);
    let cc = WorkerClient::connect(&cold.url, Some("a-shared-token-of-the-test")).await?;
    assert!(cc.list_sandboxes().await?.is_empty());
    // A create the pool's template does not fit (other limits) is not
    // drawn to it: it goes where there is more room.
    ready(&wc, 1).await?;
    let out = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args([
            "--worker", &workers, both, "sandbox", "create", "--pids", "64",
        ])
        .env_remove("CORRAL_WORKER")
        .env("CORRAL_TOKEN_FILE", &token)
        .output()
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(cc.list_sandboxes().await?.len(), 1);
    assert_eq!(wc.worker_info().await?.pools[0].claims, 3);
    Ok(())
}

/// A session's sandbox is a claim when a pool fits it: the session's
/// skills are copied into it, and its commands run there.
#[tokio::test]
async fn a_sessions_sandbox_is_a_claim_with_its_skills_in_it() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let template: corral_worker::pool::Template = "corral-sandbox:latest=1"
        .parse()
        .map_err(anyhow::Error::msg)?;
    let h = corral_e2e::Harness::start_with(|c| c.pools = vec![template]).await?;
    ready(&h.client, 1).await?;
    let sessions = tempfile::tempdir()?;
    let skills = tempfile::tempdir()?;
    std::fs::create_dir_all(skills.path().join("greet"))?;
    std::fs::write(
        skills.path().join("greet/SKILL.md"),
        "---\nname: greet\ndescription: Greets.\n---\nSay hello.\n",
    )?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "b",
            "Bash",
            r#"{"command": "cat /workspace/.corral/skills/greet/SKILL.md | tail -1; echo $HOME"}"#,
        )]),
        responses::text("done"),
    ])
    .await;
    let run = corral_e2e::run::corral_run(
        &model,
        &h.url,
        sessions.path(),
        &[
            "--image",
            "corral-sandbox:latest",
            "--skills",
            skills.path().to_str().context("path")?,
            "Greet.",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let result = &run.of_type("tool_result")[0]["text"];
    let text = result.as_str().unwrap_or_default();
    assert!(text.contains("Say hello.\n/workspace"), "{text}");
    let pool = h.client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (1, 0), "{pool:?}");
    h.stop().await;
    Ok(())
}
