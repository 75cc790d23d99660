//! `corral serve`, the control plane as a service: real workers in their
//! own processes, the strict scripted model server, the service in its own
//! process, and clients over gRPC (the harness's `ControlClient`, and
//! `corral run --control`).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use corral_e2e::model::ModelServer;
use corral_e2e::serve::{Setup, respond};
use corral_e2e::unique_id;
use corral_harness::client::Credentials;
use corral_harness::control::ControlClient;
use corral_proto::{Reason, pb};
use futures_util::StreamExt;
use serde_json::{Value, json};

fn request(command: &str) -> pb::StartSessionRequest {
    pb::StartSessionRequest {
        session_id: unique_id("s-"),
        request_json: json!({ "prompt": command }).to_string(),
        settings: Some(pb::RunSettings {
            keep_sandbox: true,
            ..Default::default()
        }),
    }
}

/// Every event of a session after `after`, to its run's last one.
async fn events(client: &ControlClient, id: &str, after: u64) -> Result<Vec<(u64, Value)>> {
    let mut stream = client.watch(id, after).await?;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while let Some(item) = tokio::time::timeout_at(deadline, stream.next())
        .await
        .context("the session's events did not end")?
    {
        let (seq, line) = item?;
        out.push((seq, serde_json::from_str::<Value>(&line)?));
    }
    Ok(out)
}

fn types(events: &[(u64, Value)]) -> Vec<String> {
    events
        .iter()
        .map(|(_, e)| e["type"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_sessions_at_once_over_two_workers_each_watched_and_listed() -> Result<()> {
    // Pooled workers, as a service that starts sessions by the dozen has
    // (cold creates of 50 containers at once on two busy cores take longer
    // than a start's patience).
    // (Texts kept: the other tests show the clients go by reasons.)
    let setup = Setup::start_with(
        2,
        64,
        ModelServer::responding(corral_e2e::serve::respond).await,
        false,
        25,
    )
    .await?;
    setup.pools_ready(25).await?;
    let client = setup.client().await?;
    let mut starting = tokio::task::JoinSet::new();
    for i in 0..50 {
        let client = client.clone();
        starting.spawn(async move {
            // `no_worker` means "try again later": a client does (the
            // workers are slow to answer on two cores busy with the rest of
            // the suite).
            let req = request(&format!("echo hello-{i}"));
            let mut tries = 0;
            let r = loop {
                match client.start(req.clone()).await {
                    Err(e) if e.reason() == Some(Reason::NoWorker) && tries < 20 => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    r => break r,
                }
            };
            (i, r)
        });
    }
    let mut ids = Vec::new();
    while let Some(done) = starting.join_next().await {
        let (i, started) = done?;
        let started = started.map_err(|e| {
            anyhow::anyhow!(
                "session {i}: {e} (reason {:?}, flag {:?})",
                e.reason(),
                e.flag()
            )
        })?;
        ensure!(!started.resumed && started.events_before == 0);
        ids.push((i, started.session_id));
    }
    let mut watching = tokio::task::JoinSet::new();
    for (i, id) in ids.clone() {
        let client = client.clone();
        watching.spawn(async move { (i, id.clone(), events(&client, &id, 0).await) });
    }
    while let Some(done) = watching.join_next().await {
        let (i, id, events) = done?;
        let events = events?;
        let t = types(&events);
        ensure!(
            t.first().map(String::as_str) == Some("session_started"),
            "{id}: {t:?}"
        );
        ensure!(
            t.last().map(String::as_str) == Some("result"),
            "{id}: {t:?}"
        );
        let (_, result) = events.last().context("no events")?;
        ensure!(result["status"] == "done", "{id}: {result}");
        let output = events
            .iter()
            .find(|(_, e)| e["type"] == "tool_result")
            .map(|(_, e)| e["text"].as_str().unwrap_or_default().to_string())
            .context("no tool result")?;
        ensure!(output.contains(&format!("hello-{i}")), "{id}: {output}");
        // Numbered from 1, one after another.
        ensure!(events.iter().map(|(n, _)| *n).eq(1..=events.len() as u64));
    }
    // A watcher that joins once it is all over still gets every event,
    // from any point.
    let (_, id) = &ids[0];
    let all = events(&client, id, 0).await?;
    let tail = events(&client, id, 2).await?;
    ensure!(tail.len() + 2 == all.len() && tail[0].0 == 3);

    let listed = client.list().await?;
    ensure!(listed.len() == 50, "{} listed", listed.len());
    ensure!(
        listed
            .iter()
            .all(|s| !s.running && s.events > 0 && s.turns == 2)
    );
    let per_worker: std::collections::BTreeMap<&str, usize> =
        listed.iter().fold(Default::default(), |mut m, s| {
            *m.entry(s.worker.as_str()).or_default() += 1;
            m
        });
    ensure!(
        per_worker.len() == 2 && per_worker.values().all(|n| *n >= 10),
        "placed over both workers: {per_worker:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_late_watcher_sees_it_all_a_full_service_refuses_and_strangers_are_turned_away()
-> Result<()> {
    let setup = Setup::start(1, 1).await?;
    let client = setup.client().await?;
    let first = client
        .start(request(
            "echo one | tee /workspace/one.txt; sleep 3; echo two",
        ))
        .await?;
    let id = first.session_id;

    // At its bound, a start is refused, saying which flag sets it.
    let refused = client
        .start(request("echo never"))
        .await
        .err()
        .context("a second session was started past --max-sessions 1")?;
    ensure!(refused.reason() == Some(Reason::AtCapacity), "{refused}");
    ensure!(
        refused.flag().as_deref() == Some("--max-sessions"),
        "{refused}"
    );
    // The running one cannot be started twice, or removed.
    let twice = client
        .start(pb::StartSessionRequest {
            session_id: id.clone(),
            ..request("echo again")
        })
        .await
        .err()
        .context("a running session was started again")?;
    ensure!(twice.reason() == Some(Reason::SessionRunning), "{twice}");
    let rm = client
        .remove(&id, false)
        .await
        .err()
        .context("removed while running")?;
    ensure!(rm.reason() == Some(Reason::SessionRunning), "{rm}");

    // A watcher joining while the call runs gets everything from the start.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let seen = events(&client, &id, 0).await?;
    let t = types(&seen);
    ensure!(
        t[0] == "session_started" && t.last().map(String::as_str) == Some("result"),
        "{t:?}"
    );
    ensure!(t.contains(&"tool_call".to_string()) && t.contains(&"tool_result".to_string()));

    // Unknown sessions, inputs to a session that ended.
    let unknown = client
        .watch("s-nosuchsession", 0)
        .await
        .err()
        .context("watched nothing")?;
    ensure!(
        unknown.reason() == Some(Reason::SessionNotFound),
        "{unknown}"
    );
    let ended = client
        .send_input(&id, "more")
        .await
        .err()
        .context("input to an ended run")?;
    ensure!(ended.reason() == Some(Reason::SessionNotRunning), "{ended}");

    // Without the token, or with another one: refused.
    for token in [None, Some("not-the-token-but-long-enough")] {
        let stranger = ControlClient::connect(&setup.url(), &Credentials::token(token)).await?;
        let e = stranger
            .list()
            .await
            .err()
            .context("a stranger listed sessions")?;
        ensure!(e.reason() == Some(Reason::Unauthenticated), "{e}");
    }

    // Its files come out as a tar stream of /workspace's contents.
    let mut tar = Vec::new();
    let mut chunks = client.export(&id).await?;
    while let Some(chunk) = chunks.next().await {
        tar.extend_from_slice(&chunk?);
    }
    let mut archive = tar::Archive::new(&tar[..]);
    let mut names = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.display().to_string();
        if name.ends_with("one.txt") {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut entry, &mut text)?;
            ensure!(text == "one\n", "{text:?}");
        }
        names.push(name);
    }
    ensure!(
        names.iter().any(|n| n.ends_with("one.txt")),
        "{names:?} after {:?}",
        seen.iter()
            .filter(|(_, e)| e["type"] == "tool_result" || e["type"] == "tool_call")
            .collect::<Vec<_>>()
    );

    // A fork is a session of its own, its files copied.
    let child = unique_id("s-");
    client.fork(&id, &child, None).await?;
    let listed = client.list().await?;
    ensure!(listed.len() == 2 && listed.iter().any(|s| s.session_id == child));
    let e = client
        .fork(&id, &child, None)
        .await
        .err()
        .context("forked twice")?;
    ensure!(e.reason() == Some(Reason::Conflict), "{e}");

    // Over now: removed, with their sandboxes.
    client.remove(&id, false).await?;
    client.remove(&child, false).await?;
    ensure!(client.list().await?.is_empty());
    let gone = client
        .remove(&id, false)
        .await
        .err()
        .context("removed twice")?;
    ensure!(gone.reason() == Some(Reason::SessionNotFound), "{gone}");
    let worker = setup.worker(&setup.workers[0].url).await?;
    let sandboxes = worker.list_sandboxes().await?;
    ensure!(sandboxes.is_empty(), "{sandboxes:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_killed_mid_session_resumes_every_session_and_runs_no_call_twice() -> Result<()> {
    let mut setup = Setup::start(1, 8).await?;
    let client = setup.client().await?;
    let command = "echo ran >> /workspace/count; sleep 5; echo finished";
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(client.start(request(command)).await?.session_id);
    }
    // Each one's call has started.
    for id in &ids {
        let mut stream = client.watch(id, 0).await?;
        loop {
            let (_, line) = tokio::time::timeout(Duration::from_secs(60), stream.next())
                .await?
                .context("ended before its call")??;
            if line.contains("\"type\":\"tool_call\"") {
                break;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    setup.kill_service();
    setup.start_service()?;
    let client = setup.client().await?;
    let worker = setup.worker(&setup.workers[0].url.clone()).await?;
    for id in &ids {
        let seen = events(&client, id, 0).await?;
        let t = types(&seen);
        ensure!(
            t.last().map(String::as_str) == Some("result"),
            "{id}: {t:?}"
        );
        let (_, result) = seen.last().context("no events")?;
        ensure!(result["status"] == "done", "{id}: {result}");
        // One answer for the one call, whichever run gave it.
        let results: Vec<_> = seen
            .iter()
            .filter(|(_, e)| e["type"] == "tool_result")
            .collect();
        ensure!(results.len() == 1, "{id}: {t:?}");
        ensure!(
            results[0].1["text"]
                .as_str()
                .unwrap_or_default()
                .contains("finished"),
            "{id}: {}",
            results[0].1
        );
        ensure!(
            seen.iter()
                .filter(|(_, e)| e["type"] == "session_started")
                .count()
                == 2,
            "started, then resumed after the restart: {t:?}"
        );
        // The command ran once.
        let listed = client.list().await?;
        let info = listed
            .iter()
            .find(|s| &s.session_id == id)
            .context("not listed")?;
        let sandbox = corral_proto::SandboxId::new(info.sandbox_id.clone())?;
        let count = corral_e2e::run_shell(&worker, &sandbox, "cat /workspace/count").await?;
        ensure!(count == "ran\n", "{id}: the call ran {count:?}");
    }
    Ok(())
}

/// A session started with its own endpoint, model and API keeps them
/// across a service killed mid-run: every request after the restart names
/// the model it was started with, at its endpoint, in its API, never the
/// service's defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_its_model_endpoint_and_api_across_a_service_restart() -> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    // The service's own defaults: another model, another API.
    setup.kill_service();
    setup.service_args = ["--model", "local", "--api", "chat"]
        .map(String::from)
        .to_vec();
    setup.start_service()?;
    let client = setup.client().await?;
    let elsewhere = ModelServer::responding(respond).await;
    let id = unique_id("s-");
    client
        .start(pb::StartSessionRequest {
            session_id: id.clone(),
            request_json: json!({
                "prompt": "echo ran >> /workspace/count; sleep 5; echo finished",
                "model": "scripted",
            })
            .to_string(),
            settings: Some(pb::RunSettings {
                base_url: Some(elsewhere.url.clone()),
                api: Some("responses".into()),
                keep_sandbox: true,
                ..Default::default()
            }),
        })
        .await?;
    let mut stream = client.watch(&id, 0).await?;
    loop {
        let (_, line) = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await?
            .context("ended before its call")??;
        if line.contains("\"type\":\"tool_call\"") {
            break;
        }
    }
    let before = elsewhere.received().len();
    setup.kill_service();
    setup.start_service()?;
    let client = setup.client().await?;
    let seen = events(&client, &id, 0).await?;
    ensure!(
        seen.last().is_some_and(|(_, e)| e["status"] == "done"),
        "{seen:?}"
    );
    let asked = elsewhere.received();
    ensure!(asked.len() > before, "no request after the restart");
    for r in &asked {
        ensure!(
            r.body["model"] == "scripted",
            "a request named {}",
            r.body["model"]
        );
        // The Responses API's body, not Chat Completions'.
        ensure!(r.body.get("input").is_some(), "{}", r.body);
    }
    ensure!(
        setup.model.received().is_empty(),
        "the service's own endpoint was asked"
    );
    Ok(())
}

#[tokio::test]
async fn the_services_key_goes_to_its_own_endpoint_only_and_clients_name_only_allowed_ones()
-> Result<()> {
    let setup = Setup::start(1, 4).await?;
    let client = setup.client().await?;
    let elsewhere = ModelServer::responding(respond).await;
    // A client that names another endpoint, without a key: none is sent.
    let mut req = request("echo away");
    req.settings = Some(pb::RunSettings {
        base_url: Some(elsewhere.url.clone()),
        keep_sandbox: true,
        ..Default::default()
    });
    let id = client.start(req).await?.session_id;
    let seen = events(&client, &id, 0).await?;
    ensure!(
        seen.last().is_some_and(|(_, e)| e["status"] == "done"),
        "{seen:?}"
    );
    // Resumed without naming the endpoint: it keeps its own, still
    // without the service's key.
    let again = client
        .start(pb::StartSessionRequest {
            session_id: id.clone(),
            request_json: json!({ "prompt": "echo again" }).to_string(),
            settings: None,
        })
        .await?;
    events(&client, &id, again.events_before).await?;
    let asked = elsewhere.received();
    ensure!(asked.len() >= 3, "{} requests", asked.len());
    ensure!(
        asked.iter().all(|r| r.authorization.is_none()),
        "the service's key went elsewhere: {:?}",
        asked.iter().map(|r| &r.authorization).collect::<Vec<_>>()
    );
    ensure!(setup.model.received().is_empty());
    // With its own key, that key.
    let mut req = request("echo own");
    req.settings = Some(pb::RunSettings {
        base_url: Some(elsewhere.url.clone()),
        api_key: Some("sk-client-own".into()),
        keep_sandbox: true,
        ..Default::default()
    });
    let id = client.start(req).await?.session_id;
    events(&client, &id, 0).await?;
    let last = elsewhere.received().pop().context("no request")?;
    ensure!(last.authorization.as_deref() == Some("Bearer sk-client-own"));
    // The service's own endpoint gets the service's key.
    let id = client.start(request("echo home")).await?.session_id;
    events(&client, &id, 0).await?;
    let home = setup.model.received();
    ensure!(
        !home.is_empty()
            && home
                .iter()
                .all(|r| r.authorization.as_deref() == Some("Bearer sk-test"))
    );
    // An endpoint the operator did not allow is refused before anything is
    // sent to it, however its address is dressed up.
    for denied in ["http://10.0.0.1:1/v1", "http://127.0.0.1:1@10.0.0.1/v1"] {
        let mut req = request("echo never");
        req.settings = Some(pb::RunSettings {
            base_url: Some(denied.into()),
            ..Default::default()
        });
        let e = client
            .start(req)
            .await
            .err()
            .context("a denied endpoint was used")?;
        ensure!(e.reason() == Some(Reason::PolicyDenied), "{e}");
        ensure!(e.flag().as_deref() == Some("--allow-base-url"), "{e}");
    }
    Ok(())
}

/// `corral run --control` of session `id` on the setup's service.
fn control_run(setup: &Setup, id: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = corral_e2e::run::command(&setup.model, "", setup.sessions.path(), args);
    cmd.arg("--control")
        .arg(setup.url())
        .arg("--control-token-file")
        .arg(setup.service_token())
        .args(["--session", id]);
    cmd
}

#[tokio::test]
async fn a_client_that_goes_and_comes_back_watches_its_session_across_a_service_restart()
-> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    let id = unique_id("s-");
    // The first client goes away while the call runs.
    let mut first = control_run(&setup, &id, &["sleep 4; echo fin"]).spawn()?;
    let client = setup.client().await?;
    let mut stream = loop {
        match client.watch(&id, 0).await {
            Ok(s) => break s,
            Err(e) if e.reason() == Some(Reason::SessionNotFound) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    while let Some(item) = stream.next().await {
        if item?.1.contains("\"type\":\"tool_call\"") {
            break;
        }
    }
    first.kill().await?;
    // The service stops cleanly (watchers are let go), and comes back.
    let pid = nix::unistd::Pid::from_raw(setup.serve.as_ref().context("no service")?.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let mut child = setup.serve.take().context("no service")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "corral serve did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(status.success(), "{status}");
    setup.start_service()?;
    // The second client finds it running again and watches it to its end.
    let second = corral_e2e::run::finish(control_run(&setup, &id, &[])).await?;
    ensure!(second.code == 0, "{}", second.stderr);
    let result = second.result();
    ensure!(result["status"] == "done", "{result}");
    let output = second
        .of_type("tool_result")
        .first()
        .map(|e| e["text"].to_string())
        .context("no tool result")?;
    ensure!(output.contains("fin"), "{output}");
    Ok(())
}

/// The events of a run with what differs between two runs of the same
/// script taken out (ids, times).
fn comparable(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .map(|e| {
            let mut e = e.clone();
            if let Some(o) = e.as_object_mut() {
                for k in ["session_id", "sandbox_id", "worker", "duration_ms"] {
                    o.remove(k);
                }
            }
            e
        })
        .collect()
}

#[tokio::test]
async fn corral_run_through_the_service_shows_what_a_local_run_shows() -> Result<()> {
    let setup = Setup::start(1, 4).await?;
    let prompt = "echo same-output | tee /workspace/out.txt";
    let local = corral_e2e::run::corral_run_env(
        &setup.model,
        &setup.workers[0].url,
        setup.sessions.path(),
        &[prompt],
        &[("CORRAL_TOKEN_FILE", setup.token.to_str().context("path")?)],
    )
    .await?;
    ensure!(local.code == 0, "{}", local.stderr);

    let out_dir = tempfile::tempdir()?;
    let export = out_dir.path().join("exported");
    let mut cmd = corral_e2e::run::command(&setup.model, "", setup.sessions.path(), &[prompt]);
    cmd.arg("--control")
        .arg(setup.url())
        .arg("--control-token-file")
        .arg(setup.service_token())
        .arg("--export")
        .arg(&export);
    let remote = corral_e2e::run::finish(cmd).await?;
    ensure!(remote.code == 0, "{}", remote.stderr);
    ensure!(
        comparable(&local.events) == comparable(&remote.events),
        "local:\n{:#?}\nthrough the service:\n{:#?}",
        local.events,
        remote.events
    );
    ensure!(
        std::fs::read_to_string(export.join("out.txt"))? == "same-output\n",
        "the workspace was exported"
    );

    // Without the service's token: refused, and said so.
    let mut cmd = corral_e2e::run::command(&setup.model, "", setup.sessions.path(), &[prompt]);
    cmd.arg("--control").arg(setup.url());
    let refused = corral_e2e::run::finish(cmd).await?;
    ensure!(refused.code == 1, "{}", refused.stderr);
    ensure!(
        refused.stderr.contains("--control-token-file"),
        "{}",
        refused.stderr
    );
    ensure!(
        refused.events.last().is_some_and(|e| e["type"] == "error"),
        "a JSON reader is told too: {:?}",
        refused.events
    );
    Ok(())
}

/// A worker's refusal of a session's sandbox reaches the service's client
/// as the worker gave it: its reason and the flag that would allow it
/// (every text withheld, so nothing but the reason can say it).
#[tokio::test]
async fn a_workers_refusal_reaches_the_client_with_its_reason_and_flag() -> Result<()> {
    let setup = Setup::start(1, 4).await?;
    let client = setup.client().await?;
    let mut req = request("echo never");
    if let Some(s) = req.settings.as_mut() {
        s.image = Some("registry.invalid/not-allowed:1".into());
    }
    let e = client
        .start(req)
        .await
        .err()
        .context("an image the worker does not allow was used")?;
    ensure!(e.reason() == Some(Reason::PolicyDenied), "{e}");
    ensure!(e.flag().as_deref() == Some("--allow-image"), "{e}");
    let mut req = request("echo never");
    req.request_json =
        json!({ "prompt": "echo never", "network": { "egress": ["pkg.test"] } }).to_string();
    let e = client
        .start(req)
        .await
        .err()
        .context("egress the worker does not allow was given")?;
    ensure!(e.reason() == Some(Reason::PolicyDenied), "{e}");
    ensure!(e.flag().as_deref() == Some("--allow-egress"), "{e}");
    Ok(())
}

/// `corral serve --audit-log FILE`: each call that changes a session or
/// reads its data is one line (who, the call, the session, the outcome),
/// refusals too; no input text, key or token is in it; the chain is whole
/// across a restart, and `corral admin audit verify` finds a line removed.
#[tokio::test]
async fn the_audit_log_has_every_call_once_and_its_chain_finds_a_removed_line() -> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("audit.log");
    setup.kill_service();
    setup.service_args = vec!["--audit-log".into(), log.display().to_string()];
    setup.start_service()?;
    let client = setup.client().await?;
    let secret_text = "echo the-input-text-itself";
    let started = client.start(request(secret_text)).await?;
    let id = started.session_id;
    let _ = events(&client, &id, 0).await?;
    let refused = client.send_input(&id, "more").await.err();
    ensure!(refused.is_some(), "input to an ended run was taken");
    let export = client.export(&id).await?;
    let _: Vec<_> = export.collect().await;
    let fork = unique_id("s-fork");
    client.fork(&id, &fork, None).await?;
    client.remove(&fork, false).await?;
    // Across a restart, the chain goes on.
    setup.kill_service();
    setup.start_service()?;
    let client = setup.client().await?;
    client.remove(&id, false).await?;
    let text = std::fs::read_to_string(&log)?;
    let calls: Vec<(String, String, String)> = text
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l)?;
            Ok((
                v["call"].as_str().unwrap_or_default().to_string(),
                v["session"].as_str().unwrap_or_default().to_string(),
                v["outcome"].as_str().unwrap_or_default().to_string(),
            ))
        })
        .collect::<Result<_>>()?;
    let want = [
        ("StartSession", id.as_str(), "ok"),
        ("WatchSession", id.as_str(), "ok"),
        ("SendInput", id.as_str(), "session_not_running"),
        ("ExportSession", id.as_str(), "ok"),
        ("ForkSession", fork.as_str(), "ok"),
        ("RemoveSession", fork.as_str(), "ok"),
        ("RemoveSession", id.as_str(), "ok"),
    ];
    let got: Vec<(&str, &str, &str)> = calls
        .iter()
        .map(|(c, s, o)| (c.as_str(), s.as_str(), o.as_str()))
        .collect();
    ensure!(got == want, "{got:#?}\n{text}");
    ensure!(!text.contains("the-input-text-itself"), "{text}");
    ensure!(!text.contains(corral_e2e::serve::TOKEN), "{text}");
    let service_token = std::fs::read_to_string(setup.service_token())?;
    ensure!(!text.contains(service_token.trim()), "{text}");
    ensure!(!text.contains("sk-test"), "{text}");
    let corral = corral_e2e::binary("corral")?;
    let verify = |path: &std::path::Path| {
        std::process::Command::new(&corral)
            .args(["admin", "audit", "verify"])
            .arg(path)
            .output()
    };
    let ok = verify(&log)?;
    ensure!(ok.status.success(), "{ok:?}");
    ensure!(
        String::from_utf8_lossy(&ok.stdout).contains("7 records"),
        "{ok:?}"
    );
    let mut lines: Vec<&str> = text.lines().collect();
    lines.remove(3);
    std::fs::write(&log, lines.join("\n") + "\n")?;
    let broken = verify(&log)?;
    ensure!(broken.status.code() == Some(1), "{broken:?}");
    ensure!(
        String::from_utf8_lossy(&broken.stderr).contains("line 4"),
        "{broken:?}"
    );
    Ok(())
}
