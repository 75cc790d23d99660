//! corral-cluster-check: Corral across three hosts, inside a network
//! namespace of its own. The test `cluster::three_workers_in_a_network_namespace`
//! makes the namespace (loopback up, a hosts file naming the three workers
//! `workers.cluster.test`) and runs this in it with `ip netns exec`; run by
//! hand elsewhere, it would bind addresses of the machine's own loopback.
//!
//! Three `corral-worker` processes serve on 127.0.1.1-3:7070 (their own
//! state directories and ids, 12 sandboxes each, one token), the scripted
//! model server on 127.0.0.1, and `corral` finds the workers by DNS name.
//! Two replicas of the front door (`corral serve --tenants --peers`) serve
//! on 127.0.2.1-2:7071 for one scenario. Each scenario prints `ok: ...`; the first failure ends the run with an
//! error (exit 1). Workers are killed and their containers removed on the
//! way out, whatever happened.

// A test program: it reports on stdout.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::model::ModelServer;
use corral_e2e::serve::respond;
use corral_e2e::{WorkerProcess, binary, unique_id};
use corral_harness::client::WorkerClient;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

const HOSTS: [&str; 3] = ["127.0.1.1", "127.0.1.2", "127.0.1.3"];
const PORT: u16 = 7070;
const WORKERS: &str = "dns:///workers.cluster.test:7070";
const TOKEN: &str = "cluster-check-token-0123456789";
const CAPACITY: u32 = 12;

struct Cluster {
    workers: Vec<Option<WorkerProcess>>,
    states: Vec<tempfile::TempDir>,
    ids: Vec<String>,
    token: PathBuf,
    model: ModelServer,
    sessions: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn start() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let token = dir.path().join("token");
        std::fs::write(&token, format!("{TOKEN}\n"))?;
        std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let run = unique_id("cl");
        let mut c = Self {
            workers: Vec::new(),
            states: Vec::new(),
            ids: (1..=3).map(|i| format!("{run}-w{i}")).collect(),
            token,
            model: ModelServer::responding(respond).await,
            sessions: tempfile::tempdir()?,
            _dir: dir,
        };
        for i in 0..3 {
            c.states.push(tempfile::tempdir()?);
            c.workers.push(None);
            c.start_worker(i)?;
        }
        Ok(c)
    }

    fn start_worker(&mut self, i: usize) -> Result<()> {
        let token = self.token.to_str().context("token path")?;
        let max = CAPACITY.to_string();
        let w = WorkerProcess::spawn_on(
            HOSTS[i],
            self.states[i].path(),
            &self.ids[i],
            PORT,
            &[("CORRAL_LOG", "warn")],
            &["--max-sandboxes", &max, "--token-file", token],
        )?;
        self.workers[i] = Some(w);
        Ok(())
    }

    fn url(i: usize) -> String {
        format!("http://{}:{PORT}", HOSTS[i])
    }

    async fn client(&self, i: usize) -> Result<WorkerClient> {
        Ok(WorkerClient::connect(&Self::url(i), Some(TOKEN)).await?)
    }

    /// `corral --worker W ARGS`, with the token.
    fn corral(&self, worker: &str, args: &[&str]) -> Result<tokio::process::Command> {
        let mut cmd = tokio::process::Command::new(binary("corral")?);
        cmd.args(["--worker", worker, "--token-file"])
            .arg(&self.token)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// `corral run` of session `id` asking for `command`, placed among the
    /// workers by their DNS name.
    fn session(
        &self,
        id: &str,
        command: &str,
        env: &[(&str, &str)],
    ) -> Result<tokio::process::Child> {
        let mut cmd = corral_e2e::run::command(
            &self.model,
            WORKERS,
            self.sessions.path(),
            &["--session", id, command],
        );
        cmd.env("CORRAL_TOKEN_FILE", &self.token)
            .envs(env.iter().copied());
        Ok(cmd.spawn()?)
    }

    /// `corral --worker W ARGS`, which must succeed; its stdout.
    async fn ok(&self, worker: &str, args: &[&str]) -> Result<String> {
        let out = self.corral(worker, args)?.output().await?;
        ensure!(
            out.status.success(),
            "corral {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Sandbox ids on each worker.
    async fn sandboxes(&self) -> Result<Vec<Vec<String>>> {
        let mut all = Vec::new();
        for i in 0..3 {
            let listed = self.client(i).await?.list_sandboxes().await?;
            all.push(listed.into_iter().map(|s| s.id.to_string()).collect());
        }
        Ok(all)
    }

    /// Removes every sandbox of every worker (between scenarios).
    async fn clear(&self) -> Result<()> {
        for i in 0..3 {
            let c = self.client(i).await?;
            for sb in c.list_sandboxes().await? {
                c.destroy_sandbox(&sb.id).await?;
            }
        }
        Ok(())
    }
}

/// The `result` event of a `corral run --json` output.
fn result_of(out: &std::process::Output) -> Result<Value> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["type"] == "result")
        .with_context(|| {
            format!(
                "no result event: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

async fn thirty_sessions_spread_over_the_three_within_capacity(c: &Cluster) -> Result<()> {
    let mut runs = Vec::new();
    for i in 0..30 {
        runs.push(c.session(&format!("spread-{i}"), "sleep 3; echo done", &[])?);
    }
    for (i, run) in runs.into_iter().enumerate() {
        let out = tokio::time::timeout(Duration::from_secs(240), run.wait_with_output()).await??;
        let r = result_of(&out)?;
        ensure!(r["status"] == "done", "session {i}: {r}");
    }
    // The sessions keep their sandboxes: where they are is where they went.
    let counts: Vec<usize> = c.sandboxes().await?.iter().map(Vec::len).collect();
    ensure!(counts.iter().sum::<usize>() == 30, "{counts:?}");
    ensure!(
        counts.iter().all(|n| *n >= 1 && *n <= CAPACITY as usize),
        "30 sessions over three workers of {CAPACITY}: {counts:?}"
    );
    println!("ok: 30 sessions placed by DNS name, {counts:?} sandboxes per worker");
    c.clear().await
}

/// Runs `corral exec` on worker `i` printing `n` numbered lines, `every`
/// apart; calls `meanwhile` once `after` lines are out; returns the lines.
async fn exec_lines<F, Fut>(
    c: &Cluster,
    i: usize,
    n: u32,
    every: f64,
    after: usize,
    meanwhile: F,
) -> Result<Vec<String>>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let script = format!("for i in $(seq 1 {n}); do echo line-$i; sleep {every}; done");
    let mut child = c
        .corral(&Cluster::url(i), &["exec", "--", "sh", "-c", &script])?
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut got = Vec::new();
    let mut meanwhile = Some(meanwhile);
    while let Some(line) =
        tokio::time::timeout(Duration::from_secs(120), lines.next_line()).await??
    {
        got.push(line);
        if got.len() == after
            && let Some(f) = meanwhile.take()
        {
            f().await?;
        }
    }
    let out = child.wait_with_output().await?;
    ensure!(
        out.status.code() == Some(0),
        "exec: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<String> = (1..=n).map(|k| format!("line-{k}")).collect();
    ensure!(got == want, "each line once, in order: {got:?}");
    Ok(got)
}

async fn sigkill_and_restart(c: &mut Cluster) -> Result<()> {
    // Killed after 5 of 20 lines, restarted a second later by this task.
    let script = "for i in $(seq 1 20); do echo line-$i; sleep 0.2; done";
    let mut child = c
        .corral(&Cluster::url(1), &["exec", "--", "sh", "-c", script])?
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut got = Vec::new();
    while let Some(line) =
        tokio::time::timeout(Duration::from_secs(120), lines.next_line()).await??
    {
        got.push(line);
        if got.len() == 5 {
            if let Some(mut w) = c.workers[1].take() {
                w.kill9();
                // Not dropped (its drop removes its containers): the
                // restarted worker adopts them.
                std::mem::forget(w);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.start_worker(1)?;
        }
    }
    let out = child.wait_with_output().await?;
    ensure!(
        out.status.code() == Some(0),
        "exec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<String> = (1..=20).map(|k| format!("line-{k}")).collect();
    ensure!(got == want, "each line once, in order: {got:?}");
    println!("ok: w2 SIGKILLed after 5 of 20 lines and restarted: all 20, each once");
    Ok(())
}

fn iptables(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("iptables").args(args).output()?;
    ensure!(
        out.status.success(),
        "iptables {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

async fn ten_seconds_of_dropped_packets_lose_nothing(c: &Cluster) -> Result<()> {
    let rule = ["INPUT", "-d", HOSTS[2], "-j", "DROP"];
    let cut = Instant::now();
    let healed = std::sync::Arc::new(std::sync::Mutex::new(None));
    let h = healed.clone();
    exec_lines(c, 2, 25, 1.0, 3, || async move {
        let mut add = vec!["-I"];
        add.extend(rule);
        iptables(&add)?;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            let mut del = vec!["-D"];
            del.extend(rule);
            let r = iptables(&del);
            *h.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        Ok(())
    })
    .await?;
    let healed = healed.lock().unwrap_or_else(|p| p.into_inner()).take();
    match healed {
        Some(Ok(())) => {}
        Some(Err(e)) => return Err(e),
        None => bail!("the partition was never healed"),
    }
    println!(
        "ok: 10 s of dropped packets to w3 mid command: 25 of 25 lines, each once ({:.1} s)",
        cut.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn a_lost_host_ends_or_moves_its_sessions_within_the_deadline(c: &mut Cluster) -> Result<()> {
    let env = [("CORRAL_WORKER_LOST_AFTER", "5s")];
    let mut runs = Vec::new();
    for i in 0..6 {
        let policy = if i % 2 == 0 { "fail" } else { "new_sandbox" };
        let id = format!("lost-{policy}-{i}");
        let mut env = env.to_vec();
        env.push(("CORRAL_ON_SANDBOX_LOST", policy));
        runs.push((
            id.clone(),
            policy,
            c.session(&id, "echo started; sleep 40", &env)?,
        ));
    }
    // Every command running: then the host with the most of them is lost.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut running = 0;
        for i in 0..3 {
            running += c.client(i).await?.worker_info().await?.running_operations;
        }
        if running == 6 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "only {running} of 6 commands started"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let where_: Vec<Vec<String>> = c.sandboxes().await?;
    let (lost, _) = where_
        .iter()
        .enumerate()
        .max_by_key(|(_, s)| s.len())
        .context("no worker")?;
    let on_lost: Vec<String> = runs
        .iter()
        .filter(|(id, _, _)| {
            where_[lost]
                .iter()
                .any(|s| s.starts_with(&format!("{id}-")))
        })
        .map(|(id, _, _)| id.clone())
        .collect();
    ensure!(
        !on_lost.is_empty(),
        "no session on the worker with the most: {where_:?}"
    );
    let killed_at = Instant::now();
    if let Some(mut w) = c.workers[lost].take() {
        w.kill9();
        corral_e2e::remove_containers_of(&w.worker_id);
    }
    // Each run's end, timed as it comes.
    let ends: Vec<_> = runs
        .into_iter()
        .map(|(id, policy, run)| {
            let ended = tokio::spawn(async move {
                let out =
                    tokio::time::timeout(Duration::from_secs(120), run.wait_with_output()).await;
                (out, Instant::now())
            });
            (id, policy, ended)
        })
        .collect();
    let mut report = BTreeMap::new();
    for (id, policy, ended) in ends {
        let (out, at) = ended.await?;
        let out = out??;
        let took = at.duration_since(killed_at);
        let r = result_of(&out)?;
        let moved = on_lost.contains(&id);
        match (moved, policy) {
            (true, "fail") => {
                ensure!(r["status"] == "failed", "{id}: {r}");
                let error = r["error"].as_str().unwrap_or_default();
                let want = format!(
                    "sandbox lost: worker {} unreachable for 5s",
                    Cluster::url(lost)
                );
                ensure!(error.starts_with(&want), "{id}: {error}");
                // The deadline and a retry step, well before the command's
                // own end (40 s).
                ensure!(took < Duration::from_secs(25), "{id} ended after {took:?}");
            }
            _ => ensure!(
                r["status"] == "done",
                "{id} ({policy}, moved: {moved}): {r}"
            ),
        }
        report.insert(id, r["status"].as_str().unwrap_or_default().to_string());
    }
    c.start_worker(lost)?;
    println!(
        "ok: w{} lost with {} of 6 sessions: {report:?}",
        lost + 1,
        on_lost.len()
    );
    c.clear().await
}

async fn a_drained_worker_gets_no_new_sandboxes(c: &Cluster) -> Result<()> {
    c.ok(&Cluster::url(2), &["worker", "drain"]).await?;
    for _ in 0..6 {
        c.ok(WORKERS, &["sandbox", "create"]).await?;
    }
    let counts: Vec<usize> = c.sandboxes().await?.iter().map(Vec::len).collect();
    ensure!(
        counts[2] == 0 && counts.iter().sum::<usize>() == 6,
        "{counts:?}"
    );
    c.ok(&Cluster::url(2), &["worker", "undrain"]).await?;
    println!("ok: 6 sandboxes while w3 drained: {counts:?}");
    c.clear().await
}

async fn an_abandoned_sandbox_is_gone_after_its_idle_timeout(c: &Cluster) -> Result<()> {
    let id = c
        .ok(WORKERS, &["sandbox", "create", "--idle-timeout", "3s"])
        .await?
        .trim()
        .to_string();
    let made = Instant::now();
    loop {
        if !c.sandboxes().await?.iter().flatten().any(|s| *s == id) {
            break;
        }
        ensure!(
            made.elapsed() < Duration::from_secs(20),
            "{id} outlived its idle timeout"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!(
        "ok: a sandbox left alone with a 3 s idle timeout was gone after {:.1} s",
        made.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A replica of the front door on `host`:7071, over the workers by their
/// DNS name, with the tenants of `tenants` and the replicas `peers`.
fn front_door(
    c: &Cluster,
    host: &str,
    peers: &str,
    tenants: &std::path::Path,
    state: &std::path::Path,
) -> Result<ChildGuard> {
    let mut cmd = std::process::Command::new(binary("corral")?);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", state)
        .env("CORRAL_LOG", "warn")
        .env("OPENAI_API_KEY", "sk-test")
        .args(["--worker", WORKERS, "--token-file"])
        .arg(&c.token)
        .args(["serve", "--listen", &format!("{host}:7071")])
        .args([
            "--base-url",
            &c.model.url,
            "--image",
            "corral-sandbox:latest",
        ])
        .arg("--serve-state-dir")
        .arg(state.join("serve"))
        .arg("--sessions-dir")
        .arg(state.join("sessions"))
        .args(["--heartbeat", "0", "--tenants"])
        .arg(tenants)
        .args([
            "--peers",
            peers,
            "--advertise",
            &format!("http://{host}:7071"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    Ok(ChildGuard(corral_e2e::spawn_listening(
        &mut cmd,
        "a front door replica",
    )?))
}

/// A process killed when dropped.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `corral admin --tenants DIR ARGS`, which must succeed; its stdout.
fn admin(tenants: &std::path::Path, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(binary("corral")?)
        .arg("admin")
        .arg("--tenants")
        .arg(tenants)
        .args(args)
        .output()?;
    ensure!(out.status.success(), "corral admin {args:?}: {out:?}");
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

async fn two_front_doors_over_three_workers_answer_alike_and_hold_quotas(
    c: &Cluster,
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let tenants = dir.path().join("tenants");
    let acme = admin(
        &tenants,
        &["key", "create", "--tenant", "acme", "--scope", "run"],
    )?;
    let bolt = admin(
        &tenants,
        &["key", "create", "--tenant", "bolt", "--scope", "run"],
    )?;
    admin(
        &tenants,
        &["quota", "set", "--tenant", "acme", "sandboxes=6"],
    )?;
    let doors = ["127.0.2.1", "127.0.2.2"];
    let urls: Vec<String> = doors.iter().map(|h| format!("http://{h}:7071")).collect();
    let peers = urls.join(",");
    let mut replicas = Vec::new();
    for (i, host) in doors.iter().enumerate() {
        let state = dir.path().join(format!("replica-{i}"));
        std::fs::create_dir_all(&state)?;
        replicas.push(front_door(c, host, &peers, &tenants, &state)?);
    }
    let on = |url: &str, key: &str| {
        let (url, key) = (url.to_string(), key.to_string());
        async move { WorkerClient::connect(&url, Some(&key)).await }
    };
    let acme_on = [on(&urls[0], &acme).await?, on(&urls[1], &acme).await?];
    // 40 creates at once, half through each replica: exactly 6 are made.
    let creates = (0..40).map(|i| {
        let client = acme_on[i % 2].clone();
        tokio::spawn(async move {
            client
                .create_sandbox(None, corral_proto::SandboxSpec::default())
                .await
        })
    });
    let mut made = Vec::new();
    for r in futures_util::future::join_all(creates).await {
        match r? {
            Ok(s) => made.push(s.id.to_string()),
            Err(corral_harness::client::ClientError::Status(s)) => ensure!(
                corral_proto::reason::quota_of(&s) == Some(("sandboxes".into(), 6, 6)),
                "{s:?}"
            ),
            Err(e) => return Err(e.into()),
        }
    }
    made.sort();
    ensure!(made.len() == 6, "made {}", made.len());
    // Both replicas answer alike; the workers hold them, stamped as acme's.
    for client in &acme_on {
        let mut listed: Vec<String> = client
            .list_sandboxes()
            .await?
            .into_iter()
            .map(|s| s.id.to_string())
            .collect();
        listed.sort();
        ensure!(listed == made, "{listed:?} != {made:?}");
    }
    let mut on_workers = Vec::new();
    for i in 0..3 {
        for s in c.client(i).await?.list_sandboxes().await? {
            ensure!(
                s.spec
                    .labels
                    .get(corral_proto::sandbox::TENANT_LABEL)
                    .map(String::as_str)
                    == Some("acme"),
                "{:?}",
                s.spec.labels
            );
            on_workers.push(s.id.to_string());
        }
    }
    on_workers.sort();
    ensure!(on_workers == made, "{on_workers:?}");
    // Each is reached through either replica, whichever placed it.
    for (i, id) in made.iter().enumerate() {
        let id = corral_proto::SandboxId::new(id.clone())?;
        let out = corral_e2e::run_shell(&acme_on[i % 2], &id, "echo here").await?;
        ensure!(out == "here\n", "{out:?}");
    }
    // Another tenant sees none of them through either.
    for url in &urls {
        let theirs = on(url, &bolt).await?;
        ensure!(theirs.list_sandboxes().await?.is_empty());
        let s = theirs
            .get_sandbox(&corral_proto::SandboxId::new(made[0].clone())?)
            .await
            .err()
            .context("bolt reached acme's sandbox")?;
        ensure!(
            matches!(&s, corral_harness::client::ClientError::Status(s) if s.code() == tonic::Code::NotFound),
            "{s:?}"
        );
    }
    for id in &made {
        acme_on[1]
            .destroy_sandbox(&corral_proto::SandboxId::new(id.clone())?)
            .await?;
    }
    // A session started through each replica lives at acme's home; each is
    // listed and read through the other.
    let control = |url: &str| {
        let (url, key) = (url.to_string(), acme.clone());
        async move {
            corral_harness::control::ControlClient::connect(
                &url,
                &corral_harness::client::Credentials::token(Some(&key)),
            )
            .await
        }
    };
    let sessions_on = [control(&urls[0]).await?, control(&urls[1]).await?];
    let mut started = Vec::new();
    for (i, client) in sessions_on.iter().enumerate() {
        let s = client
            .start(corral_proto::pb::StartSessionRequest {
                session_id: String::new(),
                request_json: format!(r#"{{"prompt": "echo via-{i}"}}"#),
                settings: None,
            })
            .await?;
        started.push(s.session_id);
    }
    for (i, id) in started.iter().enumerate() {
        let mut events = sessions_on[1 - i].watch(id, 0).await?;
        let mut seen = String::new();
        while let Some(item) = tokio::time::timeout(Duration::from_secs(120), events.next())
            .await
            .context("session events")?
        {
            seen.push_str(&item?.1);
        }
        ensure!(seen.contains(&format!("via-{i}")), "{id}: {seen}");
    }
    for client in &sessions_on {
        let mut listed: Vec<String> = client
            .list()
            .await?
            .into_iter()
            .map(|s| s.session_id)
            .collect();
        listed.sort();
        let mut want = started.clone();
        want.sort();
        ensure!(listed == want, "{listed:?} != {want:?}");
    }
    let homes: Vec<bool> = (0..2)
        .map(|i| {
            corral_harness::session::log::path_of(
                &dir.path().join(format!("replica-{i}")).join("sessions"),
                &started[0],
            )
            .exists()
        })
        .collect();
    ensure!(
        homes[0] != homes[1],
        "session {} kept by {homes:?}",
        started[0]
    );
    for id in &started {
        sessions_on[0].remove(id, false).await?;
    }
    drop(replicas);
    c.clear().await?;
    println!(
        "ok: two front door replicas over three workers: 40 creates against a quota of 6 made 6, both answer alike, another tenant sees none, a tenant's sessions live at its home and are read through either"
    );
    Ok(())
}

async fn check() -> Result<()> {
    let mut c = Cluster::start().await?;
    thirty_sessions_spread_over_the_three_within_capacity(&c).await?;
    two_front_doors_over_three_workers_answer_alike_and_hold_quotas(&c).await?;
    sigkill_and_restart(&mut c).await?;
    ten_seconds_of_dropped_packets_lose_nothing(&c).await?;
    a_lost_host_ends_or_moves_its_sessions_within_the_deadline(&mut c).await?;
    a_drained_worker_gets_no_new_sandboxes(&c).await?;
    an_abandoned_sandbox_is_gone_after_its_idle_timeout(&c).await?;
    // Teardown: each worker killed and its containers removed (Drop).
    drop(c);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            println!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(check()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
