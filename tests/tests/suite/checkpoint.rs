//! Checkpoint and restore of gVisor sandboxes on a real engine (runsc, and
//! the engine's experimental features on, as `.ci/run` sets them): a
//! sandbox comes back with its processes where they stood and its memory as
//! it was, across a restart of its worker too, and its running operation
//! goes on; what cannot be checkpointed is refused with its reason.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::{WorkerProcess, free_port, run_shell, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::reason::Reason;
use corral_proto::{OperationId, OperationSpec, SandboxSpec, SandboxState, ShellSpec};

fn spawn(state: &std::path::Path, id: &str, port: u16) -> Result<WorkerProcess> {
    WorkerProcess::spawn(state, id, port, &[], &["--allow-runtime", "runsc"])
}

fn corral(worker: &WorkerProcess, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(corral_e2e::binary("corral")?)
        .args(["--worker", &worker.url])
        .args(args)
        .env("CORRAL_TOKEN_FILE", worker.token_file())
        .env_remove("CORRAL_WORKER")
        .output()?;
    ensure!(
        out.status.success(),
        "corral {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// A new gVisor sandbox (only those are checkpointed).
async fn gvisor_sandbox(client: &WorkerClient) -> Result<corral_proto::SandboxInfo> {
    let spec = SandboxSpec {
        runtime: Some("runsc".into()),
        ..SandboxSpec::default()
    };
    Ok(client.create_sandbox(None, spec).await?)
}

/// The counter the sandbox's loop keeps in its memory, as it last wrote it.
async fn count(client: &WorkerClient, id: &corral_proto::SandboxId) -> Result<u64> {
    let out = run_shell(client, id, "cat /tmp/count").await?;
    out.trim()
        .parse()
        .with_context(|| format!("the counter said {out:?}"))
}

#[tokio::test]
async fn a_checkpointed_sandbox_comes_back_with_its_processes_and_memory() -> Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("ck"), free_port()?);
    let mut worker = spawn(state.path(), &wid, port)?;
    let client = worker.client().await?;
    let sb = gvisor_sandbox(&client).await?;
    let id = sb.id.clone();
    run_shell(&client, &id, "echo kept > /workspace/file").await?;
    // A loop whose count lives in its shell's memory, written out (to a
    // file in gVisor's memory) as it goes: an operation that runs on.
    let op = OperationId::random();
    client
        .submit(
            &id,
            &op,
            OperationSpec::Shell(ShellSpec::new(
                "n=0; while :; do n=$((n+1)); echo $n > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done",
            )),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while run_shell(&client, &id, "cat /tmp/count 2>/dev/null || echo 0")
        .await?
        .trim()
        .parse::<u64>()
        .unwrap_or(0)
        < 5
    {
        ensure!(Instant::now() < deadline, "the loop never counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = corral(&worker, &["sandbox", "checkpoint", id.as_str()])?;
    assert_eq!(out, format!("{id}: checkpointed\n"));
    let saved = client.get_sandbox(&id).await?;
    assert_eq!(saved.state, SandboxState::Checkpointed);
    assert!(
        client
            .list_sandboxes()
            .await?
            .iter()
            .any(|s| s.id == id && s.state == SandboxState::Checkpointed)
    );
    // It runs nothing: a command is refused, saying why.
    let e = client
        .submit(
            &id,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("true")),
        )
        .await
        .expect_err("checkpointed");
    assert_eq!(e.reason(), Some(Reason::SandboxCheckpointed), "{e}");
    // It holds no slot, and its worker may go away meanwhile.
    assert_eq!(client.worker_info().await?.sandboxes, 0);
    worker.kill9();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = spawn(state.path(), &wid, port)?;
    std::mem::forget(std::mem::replace(&mut worker, fresh));
    let client = worker.client().await?;
    assert_eq!(
        client.get_sandbox(&id).await?.state,
        SandboxState::Checkpointed
    );
    let out = corral(&worker, &["sandbox", "restore", id.as_str()])?;
    assert_eq!(out, format!("{id}: ready\n"));
    // The loop went on from where it stood: its count, kept in memory,
    // carries on past what it had written (not from 1), and grows.
    let first = count(&client, &id).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = count(&client, &id).await?;
        if now > first {
            break;
        }
        if Instant::now() > deadline {
            bail!("the loop did not go on after the restore: {now}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(first >= 5, "{first}");
    assert_eq!(
        run_shell(&client, &id, "cat /workspace/file").await?,
        "kept\n"
    );
    // Its operation is still the running one, and ends as asked.
    client.cancel(&id, &op).await?;
    let (_, result) = corral_e2e::collect(&client, &id, &op, 0).await?;
    assert_eq!(
        result.outcome,
        corral_proto::Outcome::Canceled,
        "{result:?}"
    );
    client.destroy_sandbox(&id).await?;
    worker.kill9();
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}

#[tokio::test]
async fn what_cannot_be_checkpointed_is_refused_with_its_reason() -> Result<()> {
    let state = tempfile::tempdir()?;
    let wid = unique_id("ck");
    let mut worker = spawn(state.path(), &wid, free_port()?)?;
    let client = worker.client().await?;
    // runc keeps no memory image (that would take CRIU).
    let plain = client.create_sandbox(None, SandboxSpec::default()).await?;
    let e = client
        .checkpoint_sandbox(&plain.id)
        .await
        .expect_err("runc");
    assert_eq!(e.reason(), Some(Reason::NotApplicable), "{e}");
    assert!(e.to_string().contains("runsc"), "{e}");
    assert_eq!(run_shell(&client, &plain.id, "echo on").await?, "on\n");
    let e = client
        .checkpoint_sandbox(&corral_proto::SandboxId::new("no-such-sandbox")?)
        .await
        .expect_err("unknown");
    assert_eq!(e.reason(), Some(Reason::SandboxNotFound), "{e}");
    // A restore of one that runs is answered as it is.
    let again = client.restore_sandbox(&plain.id).await?;
    assert_eq!(again.state, SandboxState::Ready);
    client.destroy_sandbox(&plain.id).await?;
    worker.kill9();
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}

#[tokio::test]
async fn a_pooled_sandbox_is_restored_its_id_stays_taken_and_its_lifetime_still_runs() -> Result<()>
{
    let state = tempfile::tempdir()?;
    let wid = unique_id("ck");
    let mut worker = WorkerProcess::spawn(
        state.path(),
        &wid,
        free_port()?,
        &[],
        &[
            "--allow-runtime",
            "runsc",
            "--pool",
            "corral-sandbox:latest=1,runtime=runsc",
        ],
    )?;
    let client = worker.client().await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.worker_info().await?.pools[0].ready < 1 {
        ensure!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let id = corral_proto::SandboxId::new(unique_id("sb"))?;
    let spec = SandboxSpec {
        runtime: Some("runsc".into()),
        ttl_ms: Some(12_000),
        ..SandboxSpec::default()
    };
    client.create_sandbox(Some(&id), spec.clone()).await?;
    assert_eq!(client.worker_info().await?.pools[0].claims, 1);
    run_shell(&client, &id, "echo in-memory > /tmp/f").await?;
    client.checkpoint_sandbox(&id).await?;
    // Its id is taken while it is checkpointed: the same create answers
    // it, another is a conflict, and no fork child may take it.
    let same = client.create_sandbox(Some(&id), spec.clone()).await?;
    assert_eq!(same.state, SandboxState::Checkpointed);
    let e = client
        .create_sandbox(Some(&id), SandboxSpec::default())
        .await
        .expect_err("taken");
    assert_eq!(e.reason(), Some(Reason::Conflict), "{e}");
    // A claimed member's container is started again from its checkpoint
    // with the mounts it was made with.
    assert_eq!(
        client.restore_sandbox(&id).await?.state,
        SandboxState::Ready
    );
    assert_eq!(run_shell(&client, &id, "cat /tmp/f").await?, "in-memory\n");
    // Restored once, it is not checkpointed again (the engine could never
    // start it from a second checkpoint), and runs on.
    let e = client
        .checkpoint_sandbox(&id)
        .await
        .expect_err("a second checkpoint");
    assert_eq!(e.reason(), Some(Reason::NotApplicable), "{e}");
    // A checkpointed sandbox is still removed when its lifetime is over,
    // as the running one is.
    let other = client
        .create_sandbox(
            None,
            SandboxSpec {
                ttl_ms: Some(6_000),
                ..spec.clone()
            },
        )
        .await?;
    client.checkpoint_sandbox(&other.id).await?;
    for gone in [&other.id, &id] {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            match client.get_sandbox(gone).await {
                Err(e) if e.reason() == Some(Reason::SandboxRemoved) => break,
                other => {
                    if Instant::now() > deadline {
                        bail!("a sandbox outlived its TTL: {other:?}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
    // Nothing of it is left once its removal is done: no container (with
    // its checkpoint), no socket directory.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = std::process::Command::new("docker")
            .args([
                "ps",
                "-aq",
                "--filter",
                &format!("label=corral.sandbox={id}"),
            ])
            .output()?;
        let dir = state.path().join("egress").join(id.as_str());
        if String::from_utf8_lossy(&left.stdout).trim().is_empty() && !dir.exists() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "left behind: {left:?}, {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.kill9();
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}

/// What one probe of a sandbox answered, for the calls that find it.
fn not_found(r: &Result<(), corral_harness::client::ClientError>) -> bool {
    matches!(r, Err(e) if matches!(e.reason(), Some(Reason::SandboxNotFound | Reason::SandboxRemoved)))
}

#[tokio::test]
async fn calls_during_checkpoints_and_restores_never_find_the_sandbox_unknown() -> Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("ck"), free_port()?);
    let worker = spawn(state.path(), &wid, port)?;
    let client = worker.client().await?;
    let sb = gvisor_sandbox(&client).await?;
    let id = sb.id.clone();
    // Probes in a loop meanwhile: GetSandbox, WatchSandbox (opened, then
    // let go), ListSandboxes. None may find it unknown or removed.
    let stop = tokio_util::sync::CancellationToken::new();
    let probes = (0..3).map(|kind| {
        let (client, id, stop) = (client.clone(), id.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut calls, mut lost) = (0u32, Vec::new());
            while !stop.is_cancelled() {
                let r = match kind {
                    0 => client.get_sandbox(&id).await.map(|_| ()),
                    1 => client.watch(&id, 0, None).await.map(|_| ()),
                    _ => match client.list_sandboxes().await {
                        Ok(all) if !all.iter().any(|s| s.id == id) => {
                            lost.push("not listed".to_string());
                            Ok(())
                        }
                        other => other.map(|_| ()),
                    },
                };
                calls += 1;
                if not_found(&r) {
                    lost.push(format!("{r:?}"));
                }
            }
            (calls, lost)
        })
    });
    let probes: Vec<_> = probes.collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let saved = client.checkpoint_sandbox(&id).await?;
    assert_eq!(saved.state, SandboxState::Checkpointed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let back = client.restore_sandbox(&id).await?;
    // Never a replacement: the same container, started again.
    assert_eq!(back.container_id, sb.container_id);
    assert_eq!(run_shell(&client, &id, "echo here").await?, "here\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    // The engine cannot start a container from a second checkpoint: a
    // second one is refused, saying so, and the sandbox runs on.
    let e = client
        .checkpoint_sandbox(&id)
        .await
        .expect_err("a second checkpoint");
    assert_eq!(e.reason(), Some(Reason::NotApplicable), "{e}");
    assert_eq!(run_shell(&client, &id, "echo still").await?, "still\n");
    for p in probes {
        let (calls, lost) = p.await?;
        ensure!(calls > 10, "a probe ran {calls} times");
        ensure!(
            lost.is_empty(),
            "{} of {calls} probes lost it: {lost:?}",
            lost.len()
        );
    }
    client.destroy_sandbox(&id).await?;
    drop(worker);
    corral_e2e::remove_containers_of(&wid);
    Ok(())
}
