//! The worker's slot table on a real engine: a sandbox in transition is
//! never unknown (a call naming one being made waits for it), and a create
//! its client walks away from leaves nothing behind: no container, no
//! record, no slot, and its id free to be made again.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use corral_e2e::{WorkerProcess, free_port, run_shell, unique_id};
use corral_harness::client::{ClientError, WorkerClient};
use corral_proto::{SandboxId, SandboxSpec};

/// Containers of worker `wid` labelled as sandbox `id`.
fn containers_of(wid: &str, id: &SandboxId) -> Result<Vec<String>> {
    let out = std::process::Command::new("docker")
        .args(["ps", "-aq", "--filter"])
        .arg(format!("label=corral.worker={wid}"))
        .arg("--filter")
        .arg(format!("label=corral.sandbox={id}"))
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect())
}

/// A create of sandbox `id`, under way in a task of its own.
fn create_in_background(
    client: &WorkerClient,
    id: &SandboxId,
) -> tokio::task::JoinHandle<Result<corral_proto::SandboxInfo, ClientError>> {
    let (client, id) = (client.clone(), id.clone());
    tokio::spawn(async move {
        client
            .create_sandbox(Some(&id), SandboxSpec::default())
            .await
    })
}

#[tokio::test]
async fn a_call_naming_a_sandbox_being_made_waits_for_it_never_not_found() -> Result<()> {
    let state = tempfile::tempdir()?;
    let wid = unique_id("slots");
    let worker = WorkerProcess::spawn(state.path(), &wid, free_port()?, &[], &[])?;
    let client = worker.client().await?;
    for _ in 0..3 {
        let id = SandboxId::new(unique_id("sb"))?;
        let making = create_in_background(&client, &id);
        // Asked while it is made (a create takes longer than this): the
        // answer waits for it, and is the sandbox.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let was_done = making.is_finished();
        let info = client.get_sandbox(&id).await?;
        ensure!(info.id == id);
        let ops = client.list_operations(&id).await?;
        ensure!(ops.is_empty(), "{ops:?}");
        let made = making.await??;
        ensure!(made.id == id && made.container_id == info.container_id);
        if was_done {
            eprintln!("the create of {id} was done before it was asked for");
        }
        assert_eq!(run_shell(&client, &id, "echo ok").await?, "ok\n");
        client.destroy_sandbox(&id).await?;
    }
    drop(worker);
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}

#[tokio::test]
async fn a_create_its_client_leaves_leaves_nothing_behind_and_its_id_is_free() -> Result<()> {
    let state = tempfile::tempdir()?;
    let wid = unique_id("slots");
    let worker = WorkerProcess::spawn(
        state.path(),
        &wid,
        free_port()?,
        &[],
        &["--max-sandboxes", "2"],
    )?;
    let client = worker.client().await?;
    // Walked away from at several points of its making.
    for after_ms in [5u64, 150, 400, 800] {
        let id = SandboxId::new(unique_id("gone"))?;
        let making = create_in_background(&client, &id);
        tokio::time::sleep(Duration::from_millis(after_ms)).await;
        making.abort();
        let _ = making.await;
        // Whatever it had is undone, or it was made in time: either it
        // runs, or nothing of it is left (no record, no container, no
        // slot), within a while.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let listed = client.list_sandboxes().await?.iter().any(|s| s.id == id);
            let record = state
                .path()
                .join("sandboxes")
                .join(format!("{id}.json"))
                .exists();
            let containers = containers_of(&wid, &id)?;
            let held = client.worker_info().await?.sandboxes;
            if listed {
                ensure!(record && containers.len() == 1, "{id}: {containers:?}");
                client.destroy_sandbox(&id).await?;
                break;
            }
            if !record && containers.is_empty() && held == 0 {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "{id} left after its create was dropped at {after_ms} ms: record {record}, containers {containers:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // No slot is kept for it: the worker of two takes two, and the id
        // is made again.
        ensure!(client.worker_info().await?.sandboxes == 0);
        let again = client
            .create_sandbox(Some(&id), SandboxSpec::default())
            .await?;
        let other = client.create_sandbox(None, SandboxSpec::default()).await?;
        assert_eq!(run_shell(&client, &again.id, "echo ok").await?, "ok\n");
        client.destroy_sandbox(&again.id).await?;
        client.destroy_sandbox(&other.id).await?;
    }
    drop(worker);
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}
