//! Every refusal is told by its reason, never by its text: the worker and
//! the service run with `--withhold-error-text` (each error status then
//! carries one fixed text), and each refusal is produced for real and read
//! by the client, the command line and a session as it is without it.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use corral_e2e::model::{ModelServer, responses};
use corral_e2e::{WorkerProcess, free_port, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::reason::WITHHELD_TEXT;
use corral_proto::{Reason, SandboxId, SandboxSpec};

fn withheld(e: &corral_harness::client::ClientError) -> bool {
    matches!(e, corral_harness::client::ClientError::Status(s) if s.message() == WITHHELD_TEXT)
}

#[tokio::test]
async fn a_worker_that_withholds_its_texts_is_understood_by_reason_alone() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("rsn"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &["--withhold-error-text", "--max-sandboxes", "1"],
    )?;
    let client = worker.client().await?;
    let spec = || SandboxSpec {
        image: Some("corral-sandbox:latest".into()),
        ..SandboxSpec::default()
    };
    let first = client.create_sandbox(None, spec()).await?;

    // Each refusal: its reason (and flag), and no text to go by.
    let full = client
        .create_sandbox(None, spec())
        .await
        .err()
        .context("a second sandbox past --max-sandboxes 1")?;
    ensure!(
        full.reason() == Some(Reason::AtCapacity) && full.is_refusal() && withheld(&full),
        "{full:?}"
    );

    let root = client
        .create_sandbox(
            None,
            SandboxSpec {
                run_as_root: true,
                ..spec()
            },
        )
        .await
        .err()
        .context("root allowed")?;
    ensure!(root.reason() == Some(Reason::PolicyDenied), "{root:?}");
    ensure!(root.flag().as_deref() == Some("--allow-root"), "{root:?}");

    let other = client
        .create_sandbox(
            Some(&first.id),
            SandboxSpec {
                image: Some("corral-debian:latest".into()),
                ..SandboxSpec::default()
            },
        )
        .await
        .err()
        .context("one id, two specs")?;
    ensure!(other.reason() == Some(Reason::Conflict), "{other:?}");

    let nobody = SandboxId::new("rsn-no-such-sandbox")?;
    let missing = client
        .get_sandbox(&nobody)
        .await
        .err()
        .context("found nothing")?;
    ensure!(
        missing.reason() == Some(Reason::SandboxNotFound),
        "{missing:?}"
    );

    client.destroy_sandbox(&first.id).await?;
    let removed = client
        .get_sandbox(&first.id)
        .await
        .err()
        .context("found it removed")?;
    ensure!(
        removed.reason() == Some(Reason::SandboxRemoved),
        "{removed:?}"
    );

    let stranger =
        WorkerClient::connect(&worker.url, Some("not-the-token-but-long-enough")).await?;
    let denied = stranger
        .list_sandboxes()
        .await
        .err()
        .context("a stranger listed")?;
    ensure!(
        denied.reason() == Some(Reason::Unauthenticated),
        "{denied:?}"
    );

    client.drain(true).await?;
    let draining = client
        .create_sandbox(None, spec())
        .await
        .err()
        .context("created while draining")?;
    ensure!(
        draining.reason() == Some(Reason::Draining) && draining.is_refusal(),
        "{draining:?}"
    );
    client.drain(false).await?;

    // The command line: a full worker is a refusal (exit 125 and a line
    // that names no text), an unknown sandbox a usage error.
    let _held = client.create_sandbox(None, spec()).await?;
    let out = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url, "--token-file"])
        .arg(worker.token_file())
        .args(["exec", "--image", "corral-sandbox:latest", "--", "true"])
        .output()
        .await?;
    ensure!(out.status.code() == Some(125), "{out:?}");
    Ok(())
}

#[tokio::test]
async fn a_session_on_a_worker_that_withholds_its_texts_goes_on_when_its_sandbox_is_lost()
-> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("rsn"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &["--withhold-error-text"],
    )?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c1",
            "Bash",
            &serde_json::json!({"command": "echo started; sleep 120"}).to_string(),
        )]),
        responses::text("Starting over."),
    ])
    .await;
    let sessions = tempfile::tempdir()?;
    let mut cmd = corral_e2e::run::command(
        &model,
        &worker.url,
        sessions.path(),
        &["--on-sandbox-lost", "new_sandbox", "Sleep."],
    );
    cmd.env("CORRAL_TOKEN_FILE", worker.token_file());
    let run = tokio::spawn(corral_e2e::run::finish(cmd));
    // Its sandbox is taken away while its command runs.
    let client = worker.client().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let lost = loop {
        let running = client
            .list_sandboxes()
            .await?
            .into_iter()
            .find(|s| s.running_operations > 0);
        if let Some(s) = running {
            break s;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the command never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let gone = std::process::Command::new("docker")
        .args(["rm", "-f", &lost.container_id])
        .output()?;
    ensure!(gone.status.success(), "{gone:?}");
    let out = run.await??;
    let result = out.result();
    ensure!(result["status"] == "done", "{result}\n{}", out.stderr);
    ensure!(
        out.of_type("sandbox_replaced").len() == 1,
        "{:?}",
        out.events
    );
    Ok(())
}

/// A runtime the engine has not registered is refused with its own reason
/// (`no_such_runtime`), not the engine's raw 400; and the local worker's
/// ceiling on CPUs is the host's.
#[tokio::test]
async fn a_runtime_the_engine_lacks_is_named_with_its_reason() -> anyhow::Result<()> {
    let h = corral_e2e::Harness::start_with(|c| {
        c.policy.allowed_runtimes = vec!["corral-no-such-runtime".into()];
    })
    .await?;
    let e = h
        .sandbox_with(corral_proto::SandboxSpec {
            runtime: Some("corral-no-such-runtime".into()),
            ..Default::default()
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a sandbox under a runtime the engine lacks was made"))?;
    let e = e
        .downcast_ref::<corral_harness::client::ClientError>()
        .ok_or_else(|| anyhow::anyhow!("{e:#}"))?;
    assert_eq!(e.reason(), Some(corral_proto::Reason::NoSuchRuntime), "{e}");
    assert!(e.to_string().contains("corral-no-such-runtime"), "{e}");
    h.stop().await;
    let host = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    assert_eq!(
        corral_worker::policy::permissive().ceilings.cpu_millis as usize,
        host * 1000
    );
    Ok(())
}
