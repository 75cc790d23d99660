//! The front door: `corral serve --tenants DIR` over two real workers,
//! callers with keys made by `corral admin key create`. Each tenant sees
//! and reaches its own sandboxes alone (another's id answers exactly as one
//! that does not exist, for every call), an auditor reads but never runs,
//! a revoked key is refused within a second, an expired one at once, and
//! the audit log names who did what without a key or a value.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use corral_e2e::serve::Setup;
use corral_e2e::{run_shell, unique_id};
use corral_harness::client::{ClientError, Credentials, WorkerClient};
use corral_harness::control::{ControlClient, ControlError};
use corral_proto::{Reason, SandboxId, SandboxSpec, pb};
use futures_util::StreamExt;
use serde_json::Value;

/// `corral serve` of `setup` started again with `args`.
fn restart_with(setup: &mut Setup, args: Vec<String>) -> Result<()> {
    setup.kill_service();
    setup.service_args = args;
    setup.start_service()
}

fn admin(dir: &Path, args: &[&str]) -> Result<std::process::Output> {
    Ok(std::process::Command::new(corral_e2e::binary("corral")?)
        .arg("admin")
        .arg("--tenants")
        .arg(dir)
        .args(args)
        .output()?)
}

/// A new key (its JSON: `key`, `id`, `tenant`, `scopes`, `expires`).
fn new_key(dir: &Path, tenant: &str, scope: &str, expires: Option<&str>) -> Result<Value> {
    let mut args = vec![
        "key", "create", "--tenant", tenant, "--scope", scope, "--json",
    ];
    if let Some(e) = expires {
        args.extend(["--expires", e]);
    }
    let out = admin(dir, &args)?;
    ensure!(out.status.success(), "{out:?}");
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn key_of(v: &Value) -> &str {
    v["key"].as_str().unwrap_or_default()
}

/// A call's refusal as a client sees it: code, reason, and message with
/// the id it named replaced.
fn refusal(r: Result<(), tonic::Status>, id: &str) -> String {
    match r {
        Ok(()) => "ok".into(),
        // The metadata's names too, in their order: a worker's headers
        // passed through would tell an answer of a worker from one of the
        // front door's own.
        Err(s) => format!(
            "{:?} {:?} {} {:?}",
            s.code(),
            corral_proto::reason::of(&s),
            s.message().replace(id, "ID"),
            s.metadata()
                .keys()
                .map(|k| match k {
                    tonic::metadata::KeyRef::Ascii(k) => k.as_str().to_string(),
                    tonic::metadata::KeyRef::Binary(k) => k.as_str().to_string(),
                })
                .collect::<Vec<_>>()
        ),
    }
}

/// Every call of `corral.v1.Worker` that names a sandbox, on `id`.
async fn every_call(client: &WorkerClient, id: &str) -> Vec<(&'static str, String)> {
    let c = client.raw();
    let sid = || id.to_string();
    let op = "op-1".to_string();
    let mut out = Vec::new();
    macro_rules! call {
        ($name:literal, $e:expr) => {
            out.push(($name, refusal($e.await.map(|_| ()), id)));
        };
    }
    call!(
        "GetSandbox",
        c.clone().get_sandbox(pb::GetSandboxRequest { id: sid() })
    );
    call!(
        "SetSandboxEgress",
        c.clone().set_sandbox_egress(pb::SetSandboxEgressRequest {
            id: sid(),
            rules: vec![]
        })
    );
    call!(
        "CheckpointSandbox",
        c.clone()
            .checkpoint_sandbox(pb::CheckpointSandboxRequest { id: sid() })
    );
    call!(
        "RestoreSandbox",
        c.clone()
            .restore_sandbox(pb::RestoreSandboxRequest { id: sid() })
    );
    call!(
        "ForkSandbox",
        c.clone().fork_sandbox(pb::ForkSandboxRequest {
            id: sid(),
            child_ids: vec![],
            count: 1
        })
    );
    call!(
        "SubmitOperation",
        c.clone().submit_operation(pb::SubmitOperationRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            spec: Some(
                corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true")).into()
            ),
        })
    );
    call!(
        "RunOperation",
        c.clone().run_operation(pb::SubmitOperationRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            spec: Some(
                corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true")).into()
            ),
        })
    );
    call!(
        "GetOperation",
        c.clone().get_operation(pb::GetOperationRequest {
            sandbox_id: sid(),
            operation_id: op.clone()
        })
    );
    call!(
        "Upload",
        c.clone()
            .upload(futures_util::stream::iter(vec![pb::UploadRequest {
                sandbox_id: sid(),
                operation_id: op.clone(),
                path: "x".into(),
                data: bytes::Bytes::new(),
                eof: true,
            }]))
    );
    call!(
        "Download",
        c.clone().download(pb::DownloadRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            archive: Some(pb::ArchiveSpec {
                path: "x".into(),
                contents: false
            }),
        })
    );
    call!(
        "ListOperations",
        c.clone().list_operations(pb::ListOperationsRequest {
            sandbox_id: sid(),
            page_token: String::new()
        })
    );
    call!(
        "CancelOperation",
        c.clone().cancel_operation(pb::CancelOperationRequest {
            sandbox_id: sid(),
            operation_id: op.clone()
        })
    );
    call!(
        "SignalOperation",
        c.clone().signal_operation(pb::SignalOperationRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            signal: 15
        })
    );
    call!(
        "WatchSandbox",
        c.clone().watch_sandbox(pb::WatchSandboxRequest {
            sandbox_id: sid(),
            after_seq: 0,
            operation_id: String::new()
        })
    );
    call!(
        "WriteInput",
        c.clone().write_input(pb::WriteInputRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            offset: 0,
            data: bytes::Bytes::new(),
            eof: true
        })
    );
    call!(
        "ResizeTerminal",
        c.clone().resize_terminal(pb::ResizeTerminalRequest {
            sandbox_id: sid(),
            operation_id: op.clone(),
            size: Some(pb::TerminalSize { rows: 24, cols: 80 })
        })
    );
    call!(
        "ResetSandbox",
        c.clone()
            .reset_sandbox(pb::ResetSandboxRequest { id: sid() })
    );
    call!(
        "GetSandboxStats",
        c.clone()
            .get_sandbox_stats(pb::GetSandboxStatsRequest { sandbox_id: sid() })
    );
    call!(
        "DestroySandbox",
        c.clone()
            .destroy_sandbox(pb::DestroySandboxRequest { id: sid() })
    );
    out
}

fn status_of(e: ClientError) -> tonic::Status {
    match e {
        ClientError::Status(s) => s,
        other => tonic::Status::unknown(other.to_string()),
    }
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        image: Some("corral-sandbox:latest".into()),
        env: [(
            "DEPLOY_SECRET".to_string(),
            "env-value-never-logged".to_string(),
        )]
        .into(),
        ..SandboxSpec::default()
    }
}

#[tokio::test]
async fn tenants_reach_their_own_sandboxes_alone_and_an_auditor_reads_but_never_runs() -> Result<()>
{
    let mut setup = Setup::start(2, 4).await?;
    let tenants = tempfile::tempdir()?;
    let logs = tempfile::tempdir()?;
    let log = logs.path().join("audit.log");
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    let auditor = new_key(tenants.path(), "acme", "read", None)?;
    restart_with(
        &mut setup,
        vec![
            "--tenants".into(),
            tenants.path().display().to_string(),
            "--audit-log".into(),
            log.display().to_string(),
        ],
    )?;
    let url = setup.url();
    let as_acme = WorkerClient::connect(&url, Some(key_of(&acme))).await?;
    let as_bolt = WorkerClient::connect(&url, Some(key_of(&bolt))).await?;
    let as_auditor = WorkerClient::connect(&url, Some(key_of(&auditor))).await?;

    // Acme's sandboxes, one with an id of its own choosing, on whichever
    // worker; the worker stamps them with the tenant, whatever the client
    // said.
    let mut claimed = spec();
    claimed
        .labels
        .insert(corral_proto::sandbox::TENANT_LABEL.into(), "bolt".into());
    let a1 = as_acme.create_sandbox(None, claimed).await?.id;
    let chosen = SandboxId::new(format!("acme.{}", unique_id("own")))?;
    let a2 = as_acme.create_sandbox(Some(&chosen), spec()).await?.id;
    ensure!(a2 == chosen);
    let info = as_acme.get_sandbox(&a1).await?;
    ensure!(
        info.spec
            .labels
            .get(corral_proto::sandbox::TENANT_LABEL)
            .map(String::as_str)
            == Some("acme"),
        "{:?}",
        info.spec.labels
    );
    ensure!(run_shell(&as_acme, &a1, "echo hello | tee f").await? == "hello\n");
    let b1 = as_bolt.create_sandbox(None, spec()).await?.id;

    // Each lists its own.
    let ids = |v: Vec<corral_proto::SandboxInfo>| {
        let mut ids: Vec<String> = v.into_iter().map(|s| s.id.to_string()).collect();
        ids.sort();
        ids
    };
    let mut want = vec![a1.to_string(), a2.to_string()];
    want.sort();
    ensure!(ids(as_acme.list_sandboxes().await?) == want);
    ensure!(ids(as_bolt.list_sandboxes().await?) == vec![b1.to_string()]);

    // Every call bolt makes on acme's sandbox answers as on one that does
    // not exist.
    let missing = unique_id("nobody-has-it");
    let on_acmes = every_call(&as_bolt, a1.as_str()).await;
    let on_missing = every_call(&as_bolt, &missing).await;
    ensure!(
        on_acmes == on_missing,
        "another tenant's sandbox is told apart from a missing one:\n{on_acmes:#?}\n{on_missing:#?}"
    );
    for (call, answer) in &on_acmes {
        ensure!(
            answer.starts_with("NotFound Some(SandboxNotFound)"),
            "{call}: {answer}"
        );
    }
    // And acme's sandbox is as it was.
    ensure!(run_shell(&as_acme, &a1, "cat f").await? == "hello\n");

    // A tenant names ids of its own namespace alone (`bolt.…`), or random
    // ones: bolt naming acme's id, for a sandbox or a fork's child, is
    // refused exactly as naming a free id of acme's namespace, so neither
    // tells it whether acme has one.
    let free = SandboxId::new(format!("acme.{}", unique_id("free")))?;
    let mut answers = Vec::new();
    for id in [&chosen, &free] {
        let made = status_of(
            as_bolt
                .create_sandbox(Some(id), spec())
                .await
                .err()
                .context("bolt made a sandbox of acme's namespace")?,
        );
        let forked = status_of(
            as_bolt
                .fork_sandbox(&b1, std::slice::from_ref(id), 0)
                .await
                .err()
                .context("bolt forked into acme's namespace")?,
        );
        for s in [&made, &forked] {
            ensure!(
                s.code() == tonic::Code::InvalidArgument
                    && corral_proto::reason::of(s) == Some(Reason::InvalidArgument),
                "{s:?}"
            );
        }
        answers.push((
            made.message().replace(id.as_str(), "ID"),
            forked.message().replace(id.as_str(), "ID"),
        ));
    }
    ensure!(answers[0] == answers[1], "{answers:?}");
    let own = SandboxId::new(format!("bolt.{}", unique_id("own")))?;
    ensure!(as_bolt.create_sandbox(Some(&own), spec()).await?.id == own);
    as_bolt.destroy_sandbox(&own).await?;
    ensure!(as_acme.get_sandbox(&chosen).await?.id == chosen);
    ensure!(ids(as_bolt.list_sandboxes().await?) == vec![b1.to_string()]);
    // The worker tells a tenant of its own work alone.
    ensure!(as_bolt.worker_info().await?.sandboxes == 0);
    // An id of a megabyte is a line of its bounded length in the audit log.
    let huge = "x".repeat(1 << 20);
    let _ = as_bolt
        .raw()
        .destroy_sandbox(pb::DestroySandboxRequest { id: huge })
        .await;

    // The auditor (acme's, scope read) lists, inspects and reads output,
    // but runs nothing, moves no file and removes nothing.
    ensure!(ids(as_auditor.list_sandboxes().await?) == want);
    ensure!(as_auditor.get_sandbox(&a1).await?.id == a1);
    // It reads logs, not secrets: an environment's names, never values.
    let env = |info: corral_proto::SandboxInfo| info.spec.env.get("DEPLOY_SECRET").cloned();
    ensure!(env(as_auditor.get_sandbox(&a1).await?).as_deref() == Some("(hidden)"));
    ensure!(
        as_auditor.list_sandboxes().await?.into_iter().all(|s| s
            .spec
            .env
            .values()
            .all(|v| v == "(hidden)"))
    );
    ensure!(env(as_acme.get_sandbox(&a1).await?).as_deref() == Some("env-value-never-logged"));
    let ops = as_auditor.list_operations(&a1).await?;
    ensure!(!ops.is_empty());
    let (events, _) = corral_e2e::collect(&as_auditor, &a1, &ops[0].id, 0).await?;
    ensure!(corral_e2e::stdout_of(&events) == b"hello\n");
    let refused = [
        (
            "SubmitOperation",
            as_auditor
                .submit(
                    &a1,
                    &corral_proto::OperationId::random(),
                    corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true")),
                )
                .await
                .map(|_| ()),
        ),
        (
            "RunOperation",
            as_auditor
                .run(
                    &a1,
                    &corral_proto::OperationId::random(),
                    corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("true")),
                    None,
                )
                .await
                .map(|_| ()),
        ),
        (
            "DestroySandbox",
            as_auditor.destroy_sandbox(&a1).await.map(|_| ()),
        ),
        (
            "CreateSandbox",
            as_auditor.create_sandbox(None, spec()).await.map(|_| ()),
        ),
        (
            "ResetSandbox",
            as_auditor.reset_sandbox(&a1).await.map(|_| ()),
        ),
    ];
    for (call, r) in refused {
        let s = status_of(
            r.err()
                .with_context(|| format!("the auditor's {call} was taken"))?,
        );
        ensure!(
            s.code() == tonic::Code::PermissionDenied
                && corral_proto::reason::of(&s) == Some(Reason::PermissionDenied),
            "{call}: {s:?}"
        );
    }
    let download = as_auditor
        .download(
            &a1,
            &corral_proto::OperationId::random(),
            corral_proto::ArchiveSpec::new("f".to_string()),
        )
        .await
        .err()
        .context("the auditor downloaded a file")?;
    ensure!(status_of(download).code() == tonic::Code::PermissionDenied);

    ensure!(as_bolt.destroy_sandbox(&b1).await?);

    // A revoked key is refused within a second; an expired one at once.
    let bolt_id = bolt["id"].as_str().unwrap_or_default().to_string();
    let revoked = admin(tenants.path(), &["key", "revoke", &bolt_id])?;
    ensure!(revoked.status.success(), "{revoked:?}");
    let at = Instant::now();
    loop {
        match as_bolt.list_sandboxes().await {
            Err(e) => {
                let s = status_of(e);
                ensure!(s.code() == tonic::Code::Unauthenticated, "{s:?}");
                break;
            }
            Ok(_) => {
                ensure!(
                    at.elapsed() < Duration::from_secs(1),
                    "a revoked key still works after a second"
                );
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
    let brief = new_key(tenants.path(), "acme", "run", Some("1s"))?;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let late = WorkerClient::connect(&url, Some(key_of(&brief))).await?;
    let s = status_of(
        late.list_sandboxes()
            .await
            .err()
            .context("an expired key worked")?,
    );
    ensure!(s.code() == tonic::Code::Unauthenticated, "{s:?}");
    let stranger = WorkerClient::connect(&url, Some("corral_0123456789ab_0000")).await?;
    let s = status_of(
        stranger
            .list_sandboxes()
            .await
            .err()
            .context("a malformed key worked")?,
    );
    ensure!(s.code() == tonic::Code::Unauthenticated, "{s:?}");

    // The ones acme made go with acme's word.
    ensure!(as_acme.destroy_sandbox(&a1).await?);
    ensure!(as_acme.destroy_sandbox(&a2).await?);

    // The log: who made what, and the refusals; never a key or a value.
    setup.kill_service();
    let text = std::fs::read_to_string(&log)?;
    let lines: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let has = |call: &str, tenant: &str, sandbox: &str, outcome: &str| {
        lines.iter().any(|l| {
            l["call"] == call
                && l["tenant"] == tenant
                && l["sandbox"] == sandbox
                && l["outcome"] == outcome
        })
    };
    ensure!(has("CreateSandbox", "acme", a1.as_str(), "ok"), "{text}");
    ensure!(
        has("DestroySandbox", "bolt", a1.as_str(), "sandbox_not_found"),
        "{text}"
    );
    ensure!(
        has("SubmitOperation", "acme", a1.as_str(), "permission_denied"),
        "{text}"
    );
    ensure!(has("DestroySandbox", "acme", a2.as_str(), "ok"), "{text}");
    ensure!(
        text.lines().all(|l| l.len() < 1024),
        "an audit line is longer than a kilobyte"
    );
    for secret in [
        key_of(&acme),
        key_of(&bolt),
        key_of(&auditor),
        "env-value-never-logged",
    ] {
        ensure!(
            !text.contains(secret),
            "the audit log holds a secret: {text}"
        );
    }
    let verify = std::process::Command::new(corral_e2e::binary("corral")?)
        .args(["admin", "audit", "verify"])
        .arg(&log)
        .output()?;
    ensure!(verify.status.success(), "{verify:?}");
    Ok(())
}

/// Every event of a session, to its run's last one.
async fn session_events(client: &ControlClient, id: &str) -> Result<Vec<Value>> {
    let mut stream = client.watch(id, 0).await?;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while let Some(item) = tokio::time::timeout_at(deadline, stream.next())
        .await
        .context("the session's events did not end")?
    {
        let (_, line) = item?;
        out.push(serde_json::from_str::<Value>(&line)?);
    }
    Ok(out)
}

fn control_refusal<T>(r: Result<T, ControlError>, ids: &[&str]) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(ControlError::Status(s)) => {
            let mut text = s.message().to_string();
            for id in ids {
                text = text.replace(id, "ID");
            }
            format!("{:?} {:?} {text}", s.code(), corral_proto::reason::of(&s))
        }
        Err(e) => format!("{e}"),
    }
}

/// Every call of `corral.v1.Control` that names a session, on `id`.
async fn every_session_call(
    client: &ControlClient,
    tenant: &str,
    id: &str,
) -> Vec<(&'static str, String)> {
    let fork = format!("{tenant}.{}", unique_id("fork-of"));
    vec![
        (
            "WatchSession",
            control_refusal(client.watch(id, 0).await, &[id]),
        ),
        (
            "SendInput",
            control_refusal(client.send_input(id, "more").await, &[id]),
        ),
        (
            "StopSession",
            control_refusal(client.stop(id, false).await, &[id]),
        ),
        (
            "ForkSession",
            control_refusal(client.fork(id, &fork, None).await, &[id, &fork]),
        ),
        (
            "ExportSession",
            control_refusal(client.export(id).await, &[id]),
        ),
        (
            "RemoveSession",
            control_refusal(client.remove(id, false).await, &[id]),
        ),
        (
            "StartSession",
            control_refusal(
                client
                    .start(pb::StartSessionRequest {
                        session_id: id.to_string(),
                        request_json: r#"{"prompt": "echo resumed"}"#.into(),
                        settings: None,
                    })
                    .await,
                &[id],
            ),
        ),
    ]
}

#[tokio::test]
async fn a_tenants_sessions_and_their_sandboxes_are_its_own() -> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    let auditor = new_key(tenants.path(), "acme", "read", None)?;
    restart_with(
        &mut setup,
        vec!["--tenants".into(), tenants.path().display().to_string()],
    )?;
    let url = setup.url();
    let connect = |key: &Value| {
        let key = key_of(key).to_string();
        let url = url.clone();
        async move { ControlClient::connect(&url, &Credentials::token(Some(&key))).await }
    };
    let as_acme = connect(&acme).await?;
    let as_bolt = connect(&bolt).await?;
    let as_auditor = connect(&auditor).await?;

    let id = format!("acme.{}", unique_id("s"));
    as_acme
        .start(pb::StartSessionRequest {
            session_id: id.clone(),
            request_json: r#"{"prompt": "echo from-acme"}"#.into(),
            settings: Some(pb::RunSettings {
                keep_sandbox: true,
                ..Default::default()
            }),
        })
        .await?;
    let events = session_events(&as_acme, &id).await?;
    ensure!(
        events.iter().any(|e| e.to_string().contains("from-acme")),
        "{events:?}"
    );
    let listed = as_acme.list().await?;
    ensure!(
        listed.len() == 1 && listed[0].session_id == id,
        "{listed:?}"
    );
    let sandbox = SandboxId::new(listed[0].sandbox_id.clone())?;
    // The session's sandbox is acme's too, at the front door.
    let sandboxes = WorkerClient::connect(&url, Some(key_of(&acme))).await?;
    let info = sandboxes.get_sandbox(&sandbox).await?;
    ensure!(
        info.spec
            .labels
            .get(corral_proto::sandbox::TENANT_LABEL)
            .map(String::as_str)
            == Some("acme")
    );
    let theirs = WorkerClient::connect(&url, Some(key_of(&bolt))).await?;
    let s = status_of(
        theirs
            .get_sandbox(&sandbox)
            .await
            .err()
            .context("bolt reached acme's session's sandbox")?,
    );
    ensure!(s.code() == tonic::Code::NotFound, "{s:?}");

    // Bolt sees none of it; every call on it answers as on a missing one.
    ensure!(as_bolt.list().await?.is_empty());
    let missing = format!("bolt.{}", unique_id("s-nobody"));
    let on_acmes = every_session_call(&as_bolt, "bolt", &id).await;
    let on_missing = every_session_call(&as_bolt, "bolt", &missing).await;
    ensure!(
        on_acmes[..6] == on_missing[..6],
        "another tenant's session is told apart from a missing one:\n{on_acmes:#?}\n{on_missing:#?}"
    );
    for (call, answer) in &on_acmes[..6] {
        ensure!(
            answer.starts_with("NotFound Some(SessionNotFound)"),
            "{call}: {answer}"
        );
    }
    // A start naming acme's id is refused (an id of acme's namespace,
    // taken or not); one of bolt's own that is missing is a new session.
    ensure!(
        on_acmes[6]
            .1
            .starts_with("InvalidArgument Some(InvalidArgument)"),
        "{:?}",
        on_acmes[6]
    );
    ensure!(
        as_bolt.list().await?.len() == 1,
        "bolt's own session from the start"
    );
    // A start that fails (an image the worker does not allow) leaves no
    // trace in the service's sessions.
    let failed = format!("bolt.{}", unique_id("s-failed"));
    let refused = as_bolt
        .start(pb::StartSessionRequest {
            session_id: failed.clone(),
            request_json: r#"{"prompt": "echo no"}"#.into(),
            settings: Some(pb::RunSettings {
                image: Some("not-allowed:latest".into()),
                ..Default::default()
            }),
        })
        .await;
    ensure!(
        refused.is_err(),
        "a start in an image no worker allows was taken"
    );
    let left: Vec<_> = std::fs::read_dir(setup.sessions.path())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&failed))
        .collect();
    ensure!(left.is_empty(), "a failed start left {left:?}");

    // The auditor lists and watches, and starts and exports nothing.
    ensure!(as_auditor.list().await?.len() == 1);
    ensure!(session_events(&as_auditor, &id).await?.len() == events.len());
    for (call, answer) in [
        (
            "StartSession",
            control_refusal(
                as_auditor
                    .start(pb::StartSessionRequest {
                        session_id: unique_id("s-audit"),
                        request_json: r#"{"prompt": "echo no"}"#.into(),
                        settings: None,
                    })
                    .await,
                &[],
            ),
        ),
        (
            "ExportSession",
            control_refusal(as_auditor.export(&id).await, &[]),
        ),
        (
            "RemoveSession",
            control_refusal(as_auditor.remove(&id, false).await, &[]),
        ),
    ] {
        ensure!(
            answer.starts_with("PermissionDenied Some(PermissionDenied)"),
            "{call}: {answer}"
        );
    }
    // `corral run --control` with the key from the environment alone.
    let via_cli = format!("acme.{}", unique_id("s-cli"));
    let mut cmd = corral_e2e::run::command(
        &setup.model,
        "",
        setup.sessions.path(),
        &[
            "--control",
            &url,
            "--session",
            &via_cli,
            "echo from-the-cli",
        ],
    );
    cmd.env("CORRAL_API_KEY", key_of(&acme));
    let run = corral_e2e::run::finish(cmd).await?;
    ensure!(run.code == 0, "{}", run.stderr);
    ensure!(run.result()["status"] == "done", "{}", run.result());
    ensure!(
        run.of_type("tool_result")
            .iter()
            .any(|e| e["text"].to_string().contains("from-the-cli")),
        "{:?}",
        run.of_type("tool_result")
    );
    let acmes: Vec<String> = as_acme
        .list()
        .await?
        .into_iter()
        .map(|s| s.session_id)
        .collect();
    ensure!(acmes.contains(&via_cli), "{acmes:?}");
    ensure!(
        as_bolt
            .list()
            .await?
            .iter()
            .all(|s| s.session_id != via_cli)
    );
    as_acme.remove(&via_cli, false).await?;

    as_acme.remove(&id, false).await?;
    let bolts = as_bolt.list().await?;
    for s in bolts {
        let _ = as_bolt.stop(&s.session_id, false).await;
        let _ = session_events(&as_bolt, &s.session_id).await;
        as_bolt.remove(&s.session_id, false).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_tenants_quota_holds_under_two_hundred_creates_at_once_and_says_what_it_is() -> Result<()>
{
    let mut setup = Setup::start(2, 4).await?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    let set = admin(
        tenants.path(),
        &["quota", "set", "--tenant", "acme", "sandboxes=20"],
    )?;
    ensure!(set.status.success(), "{set:?}");
    restart_with(
        &mut setup,
        vec!["--tenants".into(), tenants.path().display().to_string()],
    )?;
    let url = setup.url();
    let as_acme = WorkerClient::connect(&url, Some(key_of(&acme))).await?;
    let as_bolt = WorkerClient::connect(&url, Some(key_of(&bolt))).await?;

    let creates = (0..200).map(|_| {
        let c = as_acme.clone();
        tokio::spawn(async move { c.create_sandbox(None, spec()).await })
    });
    let mut made = 0;
    let mut refusals = Vec::new();
    for r in futures_util::future::join_all(creates).await {
        match r? {
            Ok(_) => made += 1,
            Err(e) => refusals.push(status_of(e)),
        }
    }
    let listed = as_acme.list_sandboxes().await?;
    ensure!(
        made == 20 && listed.len() == 20,
        "made {made}, listed {}",
        listed.len()
    );
    for s in &refusals {
        ensure!(
            s.code() == tonic::Code::ResourceExhausted
                && corral_proto::reason::of(s) == Some(Reason::QuotaExceeded)
                && corral_proto::reason::quota_of(s) == Some(("sandboxes".into(), 20, 20)),
            "{s:?}"
        );
    }
    // Another tenant is not held by acme's quota; one removed makes room.
    let b1 = as_bolt.create_sandbox(None, spec()).await?.id;
    ensure!(as_acme.destroy_sandbox(&listed[0].id).await?);
    let again = as_acme.create_sandbox(None, spec()).await?;
    ensure!(as_acme.list_sandboxes().await?.len() == 20);

    // A rate: bolt may ask for 2 a minute (counted from when the quota is
    // set); a change takes effect within a second.
    let set = admin(
        tenants.path(),
        &["quota", "set", "--tenant", "bolt", "creates_per_minute=2"],
    )?;
    ensure!(set.status.success(), "{set:?}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let b2 = as_bolt.create_sandbox(None, spec()).await?.id;
    let b3 = as_bolt.create_sandbox(None, spec()).await?.id;
    let s = status_of(
        as_bolt
            .create_sandbox(None, spec())
            .await
            .err()
            .context("a third create in a minute was taken")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s) == Some(("creates_per_minute".into(), 2, 2)),
        "{s:?}"
    );
    for id in [b1, b2, b3] {
        as_bolt.destroy_sandbox(&id).await?;
    }
    for s in as_acme.list_sandboxes().await? {
        as_acme.destroy_sandbox(&s.id).await?;
    }
    let _ = again;
    Ok(())
}

/// Sets quotas with `corral admin` and waits for the front door to take
/// them (it reads the directory every 250 ms).
async fn set_quota(dir: &Path, tenant: &str, quotas: &[&str]) -> Result<()> {
    let mut args = vec!["quota", "set", "--tenant", tenant];
    args.extend(quotas);
    let set = admin(dir, &args)?;
    ensure!(set.status.success(), "{set:?}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    Ok(())
}

fn sized(memory: Option<u64>, cpu_millis: Option<u32>, pids: Option<u32>) -> SandboxSpec {
    SandboxSpec {
        memory_bytes: memory,
        cpu_millis,
        pids_limit: pids,
        ..spec()
    }
}

const MIB: u64 = 1 << 20;

/// `n` long sessions of acme's started at once, in turn through each of
/// `through`, against its quota `sessions=2`: the ids of those that run
/// (every other start refused with the quota's numbers).
async fn long_starts_at_once(through: &[ControlClient], n: usize) -> Result<Vec<String>> {
    let starts = (0..n).map(|i| {
        let c = through[i % through.len()].clone();
        tokio::spawn(async move {
            c.start(pb::StartSessionRequest {
                session_id: format!("acme.{}-{i}", unique_id("s-long")),
                request_json: r#"{"prompt": "sleep 600"}"#.into(),
                settings: None,
            })
            .await
        })
    });
    let mut running = Vec::new();
    for r in futures_util::future::join_all(starts).await {
        match r? {
            Ok(started) => running.push(started.session_id),
            Err(ControlError::Status(s)) => ensure!(
                corral_proto::reason::quota_of(&s) == Some(("sessions".into(), 2, 2)),
                "{s:?}"
            ),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(running)
}

#[tokio::test]
async fn memory_cpu_process_and_session_quotas_hold_and_a_forks_children_count() -> Result<()> {
    let mut setup = Setup::start(2, 8).await?;
    let tenants = tempfile::tempdir()?;
    let dir = tenants.path();
    let acme = new_key(dir, "acme", "run", None)?;
    set_quota(dir, "acme", &["memory=2g"]).await?;
    restart_with(
        &mut setup,
        vec!["--tenants".into(), dir.display().to_string()],
    )?;
    let url = setup.url();
    let as_acme = WorkerClient::connect(&url, Some(key_of(&acme))).await?;

    // Memory: 20 creates of 512 MiB at once against 2 GiB make exactly 4.
    let creates = (0..20).map(|_| {
        let c = as_acme.clone();
        tokio::spawn(async move {
            c.create_sandbox(None, sized(Some(512 * MIB), None, None))
                .await
        })
    });
    let mut made = 0;
    for r in futures_util::future::join_all(creates).await {
        match r? {
            Ok(_) => made += 1,
            Err(e) => {
                let s = status_of(e);
                ensure!(
                    s.code() == tonic::Code::ResourceExhausted
                        && corral_proto::reason::quota_of(&s)
                            == Some(("memory".into(), 2 << 30, 2 << 30)),
                    "{s:?}"
                );
            }
        }
    }
    let listed = as_acme.list_sandboxes().await?;
    ensure!(
        made == 4 && listed.len() == 4,
        "made {made}, listed {}",
        listed.len()
    );

    // A fork's children take their parent's limits: with 1.5 GiB held, two
    // children of 512 MiB would pass the quota, one does not.
    ensure!(as_acme.destroy_sandbox(&listed[3].id).await?);
    let parent = &listed[0].id;
    let s = status_of(
        as_acme
            .fork_sandbox(parent, &[], 2)
            .await
            .err()
            .context("a fork past the memory quota was made")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s) == Some(("memory".into(), 2 << 30, 3 << 29)),
        "{s:?}"
    );
    let child = SandboxId::new(format!("acme.{}", unique_id("child")))?;
    let forked = as_acme
        .fork_sandbox(parent, std::slice::from_ref(&child), 0)
        .await?;
    ensure!(forked.children.len() == 1);
    ensure!(as_acme.list_sandboxes().await?.len() == 4);

    // A sandbox that names no memory takes its worker's default: the
    // workers say what that is, and the quota counts it.
    let worker = setup.worker(&setup.workers[0].url).await?;
    let default = worker.worker_info().await?.default_limits;
    ensure!(
        default.memory_bytes > 0 && default.cpu_millis > 0 && default.pids_limit > 0,
        "{default:?}"
    );
    for s in as_acme.list_sandboxes().await? {
        as_acme.destroy_sandbox(&s.id).await?;
    }
    set_quota(
        dir,
        "acme",
        &[&format!("memory={}", default.memory_bytes + 100 * MIB)],
    )
    .await?;
    let plain = as_acme.create_sandbox(None, spec()).await?;
    ensure!(
        plain.limits.memory_bytes == default.memory_bytes,
        "{:?}",
        plain.limits
    );
    let s = status_of(
        as_acme
            .create_sandbox(None, sized(Some(200 * MIB), None, None))
            .await
            .err()
            .context("a create past the default's share was made")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s)
            == Some((
                "memory".into(),
                default.memory_bytes + 100 * MIB,
                default.memory_bytes
            )),
        "{s:?}"
    );
    as_acme.destroy_sandbox(&plain.id).await?;

    // CPUs (in thousandths) and processes, summed over the sandboxes.
    set_quota(dir, "acme", &["memory=none", "cpus=1.5", "pids=300"]).await?;
    let one = as_acme
        .create_sandbox(None, sized(None, Some(1000), Some(200)))
        .await?;
    let s = status_of(
        as_acme
            .create_sandbox(None, sized(None, Some(1000), Some(50)))
            .await
            .err()
            .context("a create past the CPU quota was made")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s) == Some(("cpus".into(), 1500, 1000)),
        "{s:?}"
    );
    let s = status_of(
        as_acme
            .create_sandbox(None, sized(None, Some(500), Some(101)))
            .await
            .err()
            .context("a create past the process quota was made")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s) == Some(("pids".into(), 300, 200)),
        "{s:?}"
    );
    let two = as_acme
        .create_sandbox(None, sized(None, Some(500), Some(100)))
        .await?;
    for id in [one.id, two.id] {
        as_acme.destroy_sandbox(&id).await?;
    }

    // Sessions at once: 2 of 5 started together run; a stopped one makes room.
    set_quota(dir, "acme", &["cpus=none", "pids=none", "sessions=2"]).await?;
    let control = ControlClient::connect(&url, &Credentials::token(Some(key_of(&acme)))).await?;
    let running = long_starts_at_once(std::slice::from_ref(&control), 5).await?;
    ensure!(running.len() == 2, "{running:?}");
    control.stop(&running[0], false).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let third = loop {
        match control
            .start(pb::StartSessionRequest {
                session_id: format!("acme.{}", unique_id("s-quota")),
                request_json: r#"{"prompt": "sleep 600"}"#.into(),
                settings: None,
            })
            .await
        {
            Ok(started) => break started.session_id,
            // The stopped session may still be winding down.
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    for id in [&running[1], &third] {
        control.stop(id, false).await?;
    }

    // A new session's sandbox counts against the sandbox quotas as a
    // create does.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !as_acme.list_sandboxes().await?.is_empty() {
        ensure!(
            Instant::now() < deadline,
            "the stopped sessions' sandboxes stay"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    set_quota(dir, "acme", &["sessions=none", "sandboxes=1"]).await?;
    let only = as_acme.create_sandbox(None, spec()).await?;
    let start = || {
        control.start(pb::StartSessionRequest {
            session_id: format!("acme.{}", unique_id("s-quota")),
            request_json: r#"{"prompt": "echo hi"}"#.into(),
            settings: Some(pb::RunSettings {
                keep_sandbox: true,
                ..Default::default()
            }),
        })
    };
    match start().await {
        Err(ControlError::Status(s)) => ensure!(
            corral_proto::reason::quota_of(&s) == Some(("sandboxes".into(), 1, 1)),
            "{s:?}"
        ),
        other => anyhow::bail!("a session past the sandbox quota started: {other:?}"),
    }
    as_acme.destroy_sandbox(&only.id).await?;
    let started = start().await?;
    session_events(&control, &started.session_id).await?;
    // Its fork would make a second sandbox: refused as a create would be.
    let fork = control
        .fork(
            &started.session_id,
            &format!("acme.{}", unique_id("s-fork")),
            None,
        )
        .await;
    match fork {
        Err(ControlError::Status(s)) => ensure!(
            corral_proto::reason::quota_of(&s) == Some(("sandboxes".into(), 1, 1)),
            "{s:?}"
        ),
        other => anyhow::bail!("a session fork past the sandbox quota was made: {other:?}"),
    }
    ensure!(as_acme.list_sandboxes().await?.len() == 1);
    control.remove(&started.session_id, false).await?;
    Ok(())
}

/// `corral admin` through a running front door: `--url` and an admin key
/// in CORRAL_API_KEY, never a directory.
fn remote_admin(url: &str, key: &str, args: &[&str]) -> Result<std::process::Output> {
    let home = tempfile::tempdir()?;
    Ok(std::process::Command::new(corral_e2e::binary("corral")?)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("CORRAL_API_KEY", key)
        .args(["admin", "--url", url])
        .args(args)
        .output()?)
}

#[tokio::test]
async fn an_admin_key_manages_keys_and_quotas_through_a_running_front_door() -> Result<()> {
    let mut setup = Setup::start(1, 4).await?;
    let tenants = tempfile::tempdir()?;
    let logs = tempfile::tempdir()?;
    let log = logs.path().join("audit.log");
    let root = new_key(tenants.path(), "ops", "admin", None)?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    restart_with(
        &mut setup,
        vec![
            "--tenants".into(),
            tenants.path().display().to_string(),
            "--audit-log".into(),
            log.display().to_string(),
        ],
    )?;
    let url = setup.url();
    let admin_key = key_of(&root);

    // A key made through the front door works at once.
    let out = remote_admin(
        &url,
        admin_key,
        &[
            "key",
            "create",
            "--tenant",
            "bolt",
            "--scope",
            "run",
            "--expires",
            "1h",
            "--json",
        ],
    )?;
    ensure!(out.status.success(), "{out:?}");
    let bolt: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        bolt["tenant"] == "bolt" && bolt["expires"].is_string(),
        "{bolt}"
    );
    let as_bolt = WorkerClient::connect(&url, Some(key_of(&bolt))).await?;
    ensure!(as_bolt.list_sandboxes().await?.is_empty());
    // It is in the directory, as an offline `key ls` shows.
    let offline = admin(tenants.path(), &["key", "ls", "--json"])?;
    let online = remote_admin(&url, admin_key, &["key", "ls", "--json"])?;
    ensure!(online.status.success(), "{online:?}");
    ensure!(
        offline.stdout == online.stdout,
        "{}\n{}",
        String::from_utf8_lossy(&offline.stdout),
        String::from_utf8_lossy(&online.stdout)
    );
    let listed: Vec<Value> = serde_json::from_slice(&online.stdout)?;
    ensure!(listed.len() == 3 && listed.iter().all(|k| k.get("key").is_none()));

    // Quotas set through it hold.
    let out = remote_admin(
        &url,
        admin_key,
        &[
            "quota",
            "set",
            "--tenant",
            "bolt",
            "sandboxes=1",
            "memory=4g",
        ],
    )?;
    ensure!(out.status.success(), "{out:?}");
    let out = remote_admin(&url, admin_key, &["quota", "ls", "--json"])?;
    let quotas: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        quotas[0]["tenant"] == "bolt"
            && quotas[0]["sandboxes"] == 1
            && quotas[0]["memory_bytes"] == 4u64 << 30,
        "{quotas}"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let one = as_bolt.create_sandbox(None, spec()).await?;
    let s = status_of(
        as_bolt
            .create_sandbox(None, spec())
            .await
            .err()
            .context("a create past bolt's quota was made")?,
    );
    ensure!(
        corral_proto::reason::quota_of(&s) == Some(("sandboxes".into(), 1, 1)),
        "{s:?}"
    );
    as_bolt.destroy_sandbox(&one.id).await?;

    // Bad input is refused as offline (the exit code of a usage error:
    // the front door's reason, its text withheld here), and changes nothing.
    let out = remote_admin(
        &url,
        admin_key,
        &["quota", "set", "--tenant", "bolt", "gpus=1"],
    )?;
    ensure!(out.status.code() == Some(2), "{out:?}");
    let out = remote_admin(&url, admin_key, &["key", "revoke", "0123456789ab"])?;
    ensure!(out.status.code() == Some(2), "{out:?}");

    // A key without the admin scope may do none of it.
    for args in [
        &["key", "ls"][..],
        &["key", "create", "--tenant", "acme", "--scope", "admin"][..],
        &["quota", "set", "--tenant", "acme", "sandboxes=none"][..],
    ] {
        let out = remote_admin(&url, key_of(&acme), args)?;
        ensure!(out.status.code() == Some(125), "{args:?}: {out:?}");
    }
    // Without a key the command says which one it needs.
    let out = remote_admin(&url, "", &["key", "ls"])?;
    ensure!(out.status.code() == Some(2), "{out:?}");
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("CORRAL_API_KEY"),
        "{out:?}"
    );

    // A key revoked through the front door is refused within a second.
    let out = remote_admin(
        &url,
        admin_key,
        &["key", "revoke", bolt["id"].as_str().unwrap_or_default()],
    )?;
    ensure!(out.status.success(), "{out:?}");
    let at = Instant::now();
    while as_bolt.list_sandboxes().await.is_ok() {
        ensure!(
            at.elapsed() < Duration::from_secs(1),
            "a revoked key still works"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // Each admin call is in the audit log with its subject, never a key.
    let text = std::fs::read_to_string(&log)?;
    for k in [key_of(&bolt), admin_key] {
        ensure!(!text.contains(k), "a key is in the audit log");
    }
    let lines: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let calls = |call: &str| lines.iter().filter(|l| l["call"] == call).count();
    ensure!(
        calls("CreateKey") == 2 && calls("SetQuota") == 3 && calls("RevokeKey") == 2,
        "{text}"
    );
    ensure!(
        lines.iter().any(|l| l["call"] == "RevokeKey"
            && l["outcome"] == "ok"
            && l["subject"] == format!("key:{}", bolt["id"].as_str().unwrap_or_default())),
        "{text}"
    );
    ensure!(
        lines.iter().any(|l| l["call"] == "CreateKey"
            && l["outcome"] == "permission_denied"
            && l["tenant"] == "acme"),
        "{text}"
    );
    Ok(())
}

/// Builds `dockerfile` (the context's only file) through the front door
/// at `url` with `key`: the image, or the refusal.
async fn build_through(url: &str, key: &str, dockerfile: &str) -> Result<String, tonic::Status> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(dockerfile.len() as u64);
    h.set_mode(0o644);
    h.set_path("Dockerfile")
        .map_err(|e| tonic::Status::internal(e.to_string()))?;
    h.set_cksum();
    tar.append(&h, dockerfile.as_bytes())
        .map_err(|e| tonic::Status::internal(e.to_string()))?;
    let tar = tar
        .into_inner()
        .map_err(|e| tonic::Status::internal(e.to_string()))?;
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| tonic::Status::internal(e.to_string()))?
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {key}")
        .parse()
        .map_err(|_| tonic::Status::internal("key"))?;
    let mut raw = pb::worker_client::WorkerClient::with_interceptor(
        channel,
        move |mut req: tonic::Request<()>| {
            req.metadata_mut().insert("authorization", bearer.clone());
            Ok(req)
        },
    );
    let reqs = vec![
        pb::BuildImageRequest {
            dockerfile: "Dockerfile".into(),
            timeout_ms: 120_000,
            ..Default::default()
        },
        pb::BuildImageRequest {
            data: bytes::Bytes::from(tar),
            ..Default::default()
        },
        pb::BuildImageRequest {
            eof: true,
            ..Default::default()
        },
    ];
    let mut events = raw
        .build_image(tokio_stream::iter(reqs))
        .await?
        .into_inner();
    while let Some(ev) = events.next().await {
        if let Some(pb::build_image_event::Kind::Done(done)) = ev?.kind {
            return match done.failure {
                None => Ok(done.image),
                Some(f) => Err(tonic::Status::internal(f.message)),
            };
        }
    }
    Err(tonic::Status::internal(
        "the build's stream ended without its result",
    ))
}

#[tokio::test]
async fn a_build_through_the_front_door_goes_to_a_worker_that_builds_and_its_sandboxes_follow()
-> Result<()> {
    let mut setup = Setup::start(2, 4).await?;
    // A third worker, the one that builds.
    let state = tempfile::tempdir()?;
    let token = setup.token.display().to_string();
    let builder = corral_e2e::WorkerProcess::spawn(
        state.path(),
        &unique_id("builder"),
        corral_e2e::free_port()?,
        &[("CORRAL_LOG", "warn")],
        &[
            "--max-sandboxes",
            "40",
            "--token-file",
            &token,
            "--allow-build",
        ],
    )?;
    let builder_url = builder.url.clone();
    setup.workers.push(builder);
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let auditor = new_key(tenants.path(), "acme", "read", None)?;
    restart_with(
        &mut setup,
        vec!["--tenants".into(), tenants.path().display().to_string()],
    )?;
    let url = setup.url();

    let s = build_through(&url, key_of(&auditor), "FROM corral-sandbox:latest\n")
        .await
        .err()
        .context("a read key built an image")?;
    ensure!(
        corral_proto::reason::of(&s) == Some(Reason::PermissionDenied),
        "{s:?}"
    );
    let nonce = unique_id("built");
    let image = build_through(
        &url,
        key_of(&acme),
        &format!("FROM corral-sandbox:latest\nENV BUILT={nonce}\n"),
    )
    .await?;
    ensure!(image.starts_with("corral-build:"), "{image}");
    // Every sandbox of it is made on the worker that has it, and runs.
    let as_acme = WorkerClient::connect(&url, Some(key_of(&acme))).await?;
    let mut made = Vec::new();
    for _ in 0..4 {
        let sb = as_acme
            .create_sandbox(
                None,
                SandboxSpec {
                    image: Some(image.clone()),
                    ..SandboxSpec::default()
                },
            )
            .await?;
        ensure!(run_shell(&as_acme, &sb.id, "echo $BUILT").await? == format!("{nonce}\n"));
        made.push(sb.id);
    }
    let on_builder = setup.worker(&builder_url).await?.list_sandboxes().await?;
    for id in &made {
        ensure!(
            on_builder.iter().any(|s| &s.id == id),
            "{id} is not on the worker that built its image"
        );
        as_acme.destroy_sandbox(id).await?;
    }

    // A template acme builds through the front door (with the CLI, its key
    // in a file): the sessions that name it start on the worker that has
    // it (there is no registry here: on another, they could not start).
    let ctx = tempfile::tempdir()?;
    std::fs::write(
        ctx.path().join("Dockerfile"),
        format!("FROM corral-sandbox:latest\nRUN echo {nonce} > /etc/built\n"),
    )?;
    let key_file = ctx.path().join("key");
    std::fs::write(&key_file, key_of(&acme))?;
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    let built = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .arg("--worker")
        .arg(&url)
        .arg("--token-file")
        .arg(&key_file)
        .args(["template", "build", "tools", "-q"])
        .arg(ctx.path())
        .env_remove("CORRAL_WORKER")
        .kill_on_drop(true)
        .output()
        .await?;
    ensure!(built.status.success(), "{built:?}");
    let sessions = ControlClient::connect(&url, &Credentials::token(Some(key_of(&acme)))).await?;
    for _ in 0..4 {
        let id = format!("acme.{}", unique_id("s-tpl"));
        sessions
            .start(pb::StartSessionRequest {
                session_id: id.clone(),
                request_json: r#"{"prompt": "cat /etc/built"}"#.into(),
                settings: Some(pb::RunSettings {
                    template: Some("tools".into()),
                    keep_sandbox: true,
                    ..Default::default()
                }),
            })
            .await?;
        let events = session_events(&sessions, &id).await?;
        ensure!(
            events.iter().any(|e| e.to_string().contains(&nonce)),
            "{events:?}"
        );
    }
    let on_builder = setup.worker(&builder_url).await?.list_sandboxes().await?;
    let listed = sessions.list().await?;
    ensure!(listed.len() == 4, "{listed:?}");
    for s in &listed {
        ensure!(
            on_builder.iter().any(|b| b.id.as_str() == s.sandbox_id),
            "session {} is not on the worker that has its template",
            s.session_id
        );
    }
    Ok(())
}

/// `setup`'s service and a second replica of it, both serving the tenants
/// of `dir`, each naming both in `--peers`.
struct TwoReplicas {
    a: String,
    b: String,
    /// The second replica's sessions directory.
    b_sessions: tempfile::TempDir,
    _b_state: tempfile::TempDir,
    b_process: corral_e2e::serve::Replica,
}

impl TwoReplicas {
    fn start(setup: &mut Setup, dir: &Path) -> Result<Self> {
        let a = setup.url();
        let b_port = corral_e2e::free_port()?;
        let b = format!("http://127.0.0.1:{b_port}");
        let peers = format!("{a},{b}");
        let dir = dir.display().to_string();
        let args = |own: &str| -> Vec<String> {
            vec![
                "--tenants".into(),
                dir.clone(),
                "--peers".into(),
                peers.clone(),
                "--advertise".into(),
                own.into(),
            ]
        };
        restart_with(setup, args(&a))?;
        let b_state = tempfile::tempdir()?;
        let b_sessions = tempfile::tempdir()?;
        let replica = setup.spawn_replica(b_port, b_state.path(), b_sessions.path(), &args(&b))?;
        Ok(Self {
            a,
            b,
            b_sessions,
            _b_state: b_state,
            b_process: replica,
        })
    }
}

#[tokio::test]
async fn quotas_and_revocations_hold_over_two_front_door_replicas() -> Result<()> {
    let mut setup = Setup::start(2, 4).await?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    let set = admin(
        tenants.path(),
        &["quota", "set", "--tenant", "acme", "sandboxes=20"],
    )?;
    ensure!(set.status.success(), "{set:?}");
    let two = TwoReplicas::start(&mut setup, tenants.path())?;
    let (a_url, b_url) = (two.a.clone(), two.b.clone());

    let on_a = WorkerClient::connect(&a_url, Some(key_of(&acme))).await?;
    let on_b = WorkerClient::connect(&b_url, Some(key_of(&acme))).await?;
    let creates = (0..200).map(|i| {
        let c = if i % 2 == 0 {
            on_a.clone()
        } else {
            on_b.clone()
        };
        tokio::spawn(async move { c.create_sandbox(None, spec()).await })
    });
    let mut made = 0;
    for r in futures_util::future::join_all(creates).await {
        match r? {
            Ok(_) => made += 1,
            Err(e) => {
                let s = status_of(e);
                ensure!(
                    corral_proto::reason::quota_of(&s) == Some(("sandboxes".into(), 20, 20)),
                    "{s:?}"
                );
            }
        }
    }
    let listed = on_b.list_sandboxes().await?;
    ensure!(
        made == 20 && listed.len() == 20,
        "made {made}, listed {}",
        listed.len()
    );
    // Both replicas answer alike.
    let mut from_a: Vec<String> = on_a
        .list_sandboxes()
        .await?
        .into_iter()
        .map(|s| s.id.to_string())
        .collect();
    let mut from_b: Vec<String> = listed.iter().map(|s| s.id.to_string()).collect();
    from_a.sort();
    from_b.sort();
    ensure!(from_a == from_b);

    // A revoked key is refused by both within a second.
    let bolt_a = WorkerClient::connect(&a_url, Some(key_of(&bolt))).await?;
    let bolt_b = WorkerClient::connect(&b_url, Some(key_of(&bolt))).await?;
    ensure!(bolt_a.list_sandboxes().await?.is_empty() && bolt_b.list_sandboxes().await?.is_empty());
    let revoked = admin(
        tenants.path(),
        &["key", "revoke", bolt["id"].as_str().unwrap_or_default()],
    )?;
    ensure!(revoked.status.success(), "{revoked:?}");
    let at = Instant::now();
    for client in [&bolt_a, &bolt_b] {
        while client.list_sandboxes().await.is_ok() {
            ensure!(
                at.elapsed() < Duration::from_secs(1),
                "a revoked key still works on a replica after a second"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    for s in listed {
        on_a.destroy_sandbox(&s.id).await?;
    }

    // Memory likewise: 40 creates of 512m through both against memory=2g.
    set_quota(tenants.path(), "acme", &["sandboxes=none", "memory=2g"]).await?;
    let creates = (0..40).map(|i| {
        let c = if i % 2 == 0 {
            on_a.clone()
        } else {
            on_b.clone()
        };
        tokio::spawn(async move {
            c.create_sandbox(
                None,
                SandboxSpec {
                    memory_bytes: Some(512 << 20),
                    ..spec()
                },
            )
            .await
        })
    });
    let mut made = 0;
    for r in futures_util::future::join_all(creates).await {
        match r? {
            Ok(_) => made += 1,
            Err(e) => {
                let s = status_of(e);
                ensure!(
                    corral_proto::reason::quota_of(&s) == Some(("memory".into(), 2 << 30, 2 << 30)),
                    "{s:?}"
                );
            }
        }
    }
    let listed = on_a.list_sandboxes().await?;
    ensure!(
        made == 4 && listed.len() == 4,
        "made {made}, listed {}",
        listed.len()
    );
    for s in listed {
        on_b.destroy_sandbox(&s.id).await?;
    }
    Ok(())
}

/// The replica whose sessions directory holds session `id`'s log: 'a' or
/// 'b' (exactly one of them).
fn kept_by(setup: &Setup, two: &TwoReplicas, id: &str) -> Result<char> {
    let on_a = corral_harness::session::log::path_of(setup.sessions.path(), id).exists();
    let on_b = corral_harness::session::log::path_of(two.b_sessions.path(), id).exists();
    match (on_a, on_b) {
        (true, false) => Ok('a'),
        (false, true) => Ok('b'),
        _ => anyhow::bail!("session {id}'s log on a: {on_a}, on b: {on_b}"),
    }
}

#[tokio::test]
async fn a_tenants_sessions_are_the_same_through_either_replica_and_its_quota_holds_over_both()
-> Result<()> {
    let mut setup = Setup::start(2, 8).await?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    let root = new_key(tenants.path(), "ops", "admin", None)?;
    set_quota(tenants.path(), "acme", &["sessions=2"]).await?;
    let two = TwoReplicas::start(&mut setup, tenants.path())?;
    let connect = |url: &str, key: &Value| {
        let key = key_of(key).to_string();
        let url = url.to_string();
        async move { ControlClient::connect(&url, &Credentials::token(Some(&key))).await }
    };
    let (acme_a, acme_b) = (connect(&two.a, &acme).await?, connect(&two.b, &acme).await?);

    // One session started through each: whichever replica took the call,
    // both live at acme's home (one of the two passed its start on).
    let mut ids = Vec::new();
    for (client, word) in [(&acme_a, "through-a"), (&acme_b, "through-b")] {
        let started = client
            .start(pb::StartSessionRequest {
                session_id: String::new(),
                request_json: format!(r#"{{"prompt": "echo {word}"}}"#),
                settings: None,
            })
            .await?;
        ids.push(started.session_id);
    }
    let home = kept_by(&setup, &two, &ids[0])?;
    ensure!(kept_by(&setup, &two, &ids[1])? == home);
    for id in &ids {
        let (from_a, from_b) = (
            session_events(&acme_a, id).await?,
            session_events(&acme_b, id).await?,
        );
        ensure!(from_a == from_b, "the replicas tell session {id} apart");
        ensure!(from_a.iter().any(|e| e.to_string().contains("through-")));
    }
    let listed = |c: ControlClient| async move {
        let mut ids: Vec<String> = c.list().await?.into_iter().map(|s| s.session_id).collect();
        ids.sort();
        anyhow::Ok(ids)
    };
    let mut both = ids.clone();
    both.sort();
    ensure!(listed(acme_a.clone()).await? == both && listed(acme_b.clone()).await? == both);

    // Another tenant sees none of it through either, and every call on
    // acme's sessions answers as on a missing one. (A start of acme's id
    // makes bolt its own session of that id, at bolt's home: each
    // replica's sessions are their tenants' alone.)
    for url in [&two.a, &two.b] {
        let theirs = connect(url, &bolt).await?.list().await?;
        ensure!(theirs.is_empty(), "bolt through {url} lists {theirs:?}");
    }
    for (url, id) in [(&two.a, &ids[0]), (&two.b, &ids[1])] {
        let as_bolt = connect(url, &bolt).await?;
        let on_acmes = every_session_call(&as_bolt, "bolt", id).await;
        let missing = format!("bolt.{}", unique_id("s-nobody"));
        let on_missing = every_session_call(&as_bolt, "bolt", &missing).await;
        ensure!(
            on_acmes[..6] == on_missing[..6],
            "{on_acmes:#?}\n{on_missing:#?}"
        );
    }

    // A key of every tenant's lists and reads them through either replica
    // (one of the two asks the other).
    for url in [&two.a, &two.b] {
        let ops = connect(url, &root).await?;
        let seen = listed(ops.clone()).await?;
        ensure!(ids.iter().all(|id| seen.contains(id)), "{url}: {seen:?}");
        ensure!(!session_events(&ops, &ids[1]).await?.is_empty());
    }

    // The sessions quota over both: of six long starts sent through the
    // two at once, two run (the earlier two finished their runs and stay).
    for (client, id) in [(&acme_a, &ids[0]), (&acme_b, &ids[1])] {
        client.remove(id, false).await?;
    }
    ensure!(listed(acme_b.clone()).await?.is_empty());
    let running = long_starts_at_once(&[acme_a.clone(), acme_b.clone()], 6).await?;
    ensure!(running.len() == 2, "{running:?}");
    for id in &running {
        ensure!(kept_by(&setup, &two, id)? == home);
        acme_b.stop(id, false).await?;
    }

    // A client's own "passed on" mark is no replica's: its call through
    // the replica that is not acme's home is passed on as any other.
    let raw = |url: &str| {
        let url = url.to_string();
        async move {
            anyhow::Ok(pb::control_client::ControlClient::new(
                tonic::transport::Channel::from_shared(url)?
                    .connect()
                    .await?,
            ))
        }
    };
    let away = if home == 'a' {
        two.b.clone()
    } else {
        two.a.clone()
    };
    let mut req = tonic::Request::new(pb::ListSessionsRequest {});
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", key_of(&acme)).parse()?,
    );
    req.metadata_mut()
        .insert("x-corral-forwarded", "1".parse()?);
    let listed = raw(&away).await?.list_sessions(req).await?.into_inner();
    ensure!(listed.sessions.len() == 2, "{listed:?}");
    // An id of a megabyte is refused for what it is through either.
    for url in [&two.a, &two.b] {
        let mut req = tonic::Request::new(pb::WatchSessionRequest {
            session_id: "x".repeat(1 << 20),
            after: 0,
        });
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", key_of(&acme)).parse()?,
        );
        let e = raw(url)
            .await?
            .watch_session(req)
            .await
            .err()
            .context("watched")?;
        ensure!(
            corral_proto::reason::of(&e) == Some(Reason::InvalidArgument),
            "{url}: {:?} {}",
            e.code(),
            e.message().len()
        );
    }
    // With acme's home down, its calls through the other replica are
    // refused as a replica out of reach (no_worker), not as a cut stream.
    let mut two = two;
    if home == 'a' {
        setup.kill_service();
    } else {
        let _ = two.b_process.0.kill();
        let _ = two.b_process.0.wait();
    }
    let via = connect(&away, &acme).await?;
    match via.list().await {
        Err(ControlError::Status(s)) => ensure!(
            s.code() == tonic::Code::Unavailable
                && corral_proto::reason::of(&s) == Some(Reason::NoWorker),
            "{s:?}"
        ),
        other => anyhow::bail!("acme's sessions listed with its home down: {other:?}"),
    }
    Ok(())
}

/// Volumes through the front door: each tenant's own (another's name is
/// as one that does not exist, for a sandbox and a removal), and a
/// sandbox that names one is placed on the worker where it lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_each_tenants_own_and_sandboxes_follow_them() -> Result<()> {
    let mut setup = Setup::start(2, 4).await?;
    let tenants = tempfile::tempdir()?;
    let acme = new_key(tenants.path(), "acme", "run", None)?;
    let bolt = new_key(tenants.path(), "bolt", "run", None)?;
    restart_with(
        &mut setup,
        vec!["--tenants".into(), tenants.path().display().to_string()],
    )?;
    let url = setup.url();
    let as_acme = WorkerClient::connect(&url, Some(key_of(&acme))).await?;
    let as_bolt = WorkerClient::connect(&url, Some(key_of(&bolt))).await?;
    let make = |c: &WorkerClient, name: &str| {
        let mut raw = c.raw();
        let name = name.to_string();
        async move {
            raw.create_volume(pb::CreateVolumeRequest {
                name,
                size_bytes: 16 << 20,
            })
            .await
        }
    };
    let listed = |c: &WorkerClient| {
        let mut raw = c.raw();
        async move {
            Ok::<_, tonic::Status>(
                raw.list_volumes(pb::ListVolumesRequest {})
                    .await?
                    .into_inner()
                    .volumes
                    .into_iter()
                    .map(|v| v.name)
                    .collect::<Vec<_>>(),
            )
        }
    };
    let with = |m: &str| -> Result<SandboxSpec> {
        Ok(SandboxSpec {
            volumes: vec![corral_proto::volume::VolumeMount::parse(m)?],
            ..SandboxSpec::default()
        })
    };
    make(&as_acme, "shared").await?;
    ensure!(listed(&as_acme).await? == vec!["shared".to_string()]);
    ensure!(listed(&as_bolt).await?.is_empty());

    // Bolt naming acme's volume is told what naming none is told.
    let refusal = |e: ClientError| format!("{:?}", e.reason());
    let theirs = as_bolt
        .create_sandbox(None, with("shared:/data")?)
        .await
        .err()
        .context("bolt mounted acme's volume")?;
    let none = as_bolt
        .create_sandbox(None, with("nothing:/data")?)
        .await
        .err()
        .context("a missing volume was mounted")?;
    ensure!(refusal(theirs) == refusal(none));
    let gone = as_bolt
        .raw()
        .delete_volume(pb::DeleteVolumeRequest {
            name: "shared".into(),
        })
        .await?
        .into_inner();
    ensure!(!gone.existed);

    // Acme's sandboxes of it all land where it lives: the writer's file is
    // read by each reader.
    let w = as_acme.create_sandbox(None, with("shared:/data")?).await?;
    run_shell(&as_acme, &w.id, "echo acme > /data/who").await?;
    for _ in 0..4 {
        let r = as_acme
            .create_sandbox(None, with("shared:/data:ro")?)
            .await?;
        ensure!(
            r.worker_id == w.worker_id,
            "{} vs {}",
            r.worker_id,
            w.worker_id
        );
        ensure!(run_shell(&as_acme, &r.id, "cat /data/who").await? == "acme\n");
    }
    // Bolt's volume of the same name is another one.
    make(&as_bolt, "shared").await?;
    let b = as_bolt.create_sandbox(None, with("shared:/data")?).await?;
    let out = run_shell(&as_bolt, &b.id, "cat /data/who 2>&1; echo bolt > /data/who").await?;
    ensure!(out.contains("No such file"), "{out}");
    let r = as_acme
        .create_sandbox(None, with("shared:/data:ro")?)
        .await?;
    ensure!(run_shell(&as_acme, &r.id, "cat /data/who").await? == "acme\n");
    for c in [&as_acme, &as_bolt] {
        for s in c.list_sandboxes().await? {
            c.destroy_sandbox(&s.id).await?;
        }
        let rm = c
            .raw()
            .delete_volume(pb::DeleteVolumeRequest {
                name: "shared".into(),
            })
            .await?
            .into_inner();
        ensure!(rm.existed);
    }
    Ok(())
}
