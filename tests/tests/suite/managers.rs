//! One conformance suite for the operation managers, run against the local
//! one (worker library in-process) and the remote one (gRPC), on real
//! sandboxes.

use std::time::Duration;

use corral_e2e::{Harness, WorkerProcess, free_port, unique_id};
use corral_harness::client::WorkerClient;
use corral_harness::follow::{FollowError, Follower};
use corral_harness::ops::{Manager, OpStatus, Operation, OperationManager};
use corral_harness::worker_api::WorkerApi;
use corral_proto::{OperationId, OperationSpec, Outcome, SandboxId, SandboxSpec, ShellSpec};
use tokio::sync::mpsc;

fn shell(cmd: &str) -> OperationSpec {
    OperationSpec::Shell(ShellSpec::new(cmd))
}

/// Reads updates until `id` reaches a terminal status; returns its statuses
/// in order and the last snapshot.
async fn until_terminal(
    updates: &mut mpsc::Receiver<Operation>,
    id: &OperationId,
) -> anyhow::Result<(Vec<OpStatus>, Operation)> {
    let mut statuses = Vec::new();
    loop {
        let op = tokio::time::timeout(Duration::from_secs(60), updates.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("updates closed"))?;
        if &op.id != id {
            continue;
        }
        if statuses.last() != Some(&op.status) {
            statuses.push(op.status);
        }
        if op.status.is_terminal() {
            return Ok((statuses, op));
        }
    }
}

async fn until_status(
    updates: &mut mpsc::Receiver<Operation>,
    id: &OperationId,
    want: OpStatus,
) -> anyhow::Result<Operation> {
    loop {
        let op = tokio::time::timeout(Duration::from_secs(60), updates.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("updates closed"))?;
        if &op.id == id && op.status == want {
            return Ok(op);
        }
        anyhow::ensure!(
            &op.id != id || !op.status.is_terminal(),
            "{id} ended as {:?}",
            op.status
        );
    }
}

async fn conformance<W: WorkerApi>(h: &Harness, make: impl Fn() -> W) -> anyhow::Result<()> {
    let sb = h.sandbox().await?;
    let (mgr, mut updates) = Manager::start(make(), sb.clone());

    // A command's life: ready, awaiting (with output so far), completed.
    let op = Operation::new(
        OperationId::random(),
        shell("echo hi; sleep 0.6; echo bye; exit 3"),
    );
    mgr.add(op.clone()).await?;
    let mut saw_progress = false;
    let mut statuses = Vec::new();
    let last = loop {
        let snap = tokio::time::timeout(Duration::from_secs(60), updates.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("updates closed"))?;
        if snap.id != op.id {
            continue;
        }
        if statuses.last() != Some(&snap.status) {
            statuses.push(snap.status);
        }
        saw_progress |=
            snap.status == OpStatus::Awaiting && &snap.progress.stdout_tail[..] == b"hi\n";
        if snap.status.is_terminal() {
            break snap;
        }
    };
    assert_eq!(
        statuses,
        vec![OpStatus::Ready, OpStatus::Awaiting, OpStatus::Completed]
    );
    assert!(saw_progress, "no output-so-far while it ran");
    let result = last.result.ok_or_else(|| anyhow::anyhow!("no result"))?;
    assert_eq!(result.outcome, Outcome::Exited { code: 3 });
    assert_eq!(result.stdout.to_lossy_string(), "hi\nbye\n");

    // At most once: the same id again is ignored, here and by a new manager.
    let counted = Operation::new(
        OperationId::random(),
        shell("echo run >> /workspace/runs; echo counted"),
    );
    mgr.add(counted.clone()).await?;
    let (statuses, _) = until_terminal(&mut updates, &counted.id).await?;
    assert_eq!(statuses.first(), Some(&OpStatus::Ready));
    assert_eq!(statuses.last(), Some(&OpStatus::Completed));
    mgr.add(counted.clone()).await?;

    // Cancel: idempotent, and a no-op for unknown or finished operations.
    let long = Operation::new(OperationId::random(), shell("echo started; sleep 300"));
    mgr.add(long.clone()).await?;
    until_status(&mut updates, &long.id, OpStatus::Awaiting).await?;
    mgr.cancel(&long.id, "user asked").await?;
    mgr.cancel(&long.id, "user asked again").await?;
    mgr.cancel(&OperationId::random(), "unknown").await?;
    mgr.cancel(&counted.id, "finished").await?;
    let (statuses, last) = until_terminal(&mut updates, &long.id).await?;
    assert_eq!(statuses, vec![OpStatus::Canceling, OpStatus::Canceled]);
    assert_eq!(last.result.map(|r| r.outcome), Some(Outcome::Canceled));

    // An operation that cannot start fails, with the reason.
    let mut bad = ShellSpec::new("true");
    bad.workdir = Some("/nope".into());
    let bad = Operation::new(OperationId::random(), OperationSpec::Shell(bad));
    mgr.add(bad.clone()).await?;
    let (_, last) = until_terminal(&mut updates, &bad.id).await?;
    assert_eq!(last.status, OpStatus::Failed);
    assert!(
        last.failure.as_deref().is_some_and(|f| f.contains("/nope")),
        "{:?}",
        last.failure
    );

    // A session that resumes with a new manager re-adds what it had: a
    // finished operation reports its result without running again, a
    // running one is followed to its end.
    let running = Operation::new(
        OperationId::random(),
        shell("echo run >> /workspace/runs; sleep 1; echo late"),
    );
    mgr.add(running.clone()).await?;
    until_status(&mut updates, &running.id, OpStatus::Awaiting).await?;
    mgr.shutdown().await;
    drop(updates);
    let (mgr, mut updates) = Manager::start(make(), sb.clone());
    mgr.add(counted.clone()).await?;
    let (_, last) = until_terminal(&mut updates, &counted.id).await?;
    assert_eq!(
        last.result.map(|r| r.stdout.to_lossy_string()),
        Some("counted\n".into())
    );
    mgr.add(running.clone()).await?;
    let (_, last) = until_terminal(&mut updates, &running.id).await?;
    assert_eq!(
        last.result.map(|r| r.stdout.to_lossy_string()),
        Some("late\n".into())
    );
    let runs = h.run(&sb, "wc -l < /workspace/runs").await?;
    assert_eq!(
        runs.stdout.to_lossy_string().trim(),
        "2",
        "an operation ran twice"
    );
    mgr.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn local_manager_conforms() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let worker = h.worker.clone();
    conformance(&h, || worker.clone()).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn remote_manager_conforms() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    // One connection, shared by every call of the manager.
    let client = WorkerClient::connect(&h.url, None).await?;
    conformance(&h, || client.clone()).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn remote_manager_survives_a_worker_restart() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("mg"), free_port()?);
    let mut worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    // The same connection throughout: it is made again under the manager
    // when the worker comes back.
    let (mgr, mut updates) = Manager::start(client.clone(), sb.clone());
    let op = Operation::new(OperationId::random(), shell("sleep 1.5; echo survived"));
    mgr.add(op.clone()).await?;
    until_status(&mut updates, &op.id, OpStatus::Awaiting).await?;
    worker.kill9();
    let worker2 = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let (_, last) = until_terminal(&mut updates, &op.id).await?;
    assert_eq!(last.status, OpStatus::Completed);
    assert_eq!(
        last.result.map(|r| r.stdout.to_lossy_string()),
        Some("survived\n".into())
    );
    mgr.shutdown().await;
    let client = worker2.client().await?;
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// A waiter's patience counts from when the worker became unreachable, not
/// from its last event: a worker that came back and then stayed quiet for
/// longer than the patience is retried when it blinks again. A worker gone
/// for good is given up on, with its address named.
#[tokio::test]
async fn a_follower_retries_after_a_quiet_reconnect_and_gives_up_on_a_gone_worker()
-> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("fw"), free_port()?);
    // Each process is kept until the end: dropping one removes its
    // worker's containers.
    let mut first = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = first.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let patience = Duration::from_secs(3);
    let mut follower = Follower::from_now(client.clone(), sb.clone(), None, patience).await?;
    let (tx, mut rx) = mpsc::channel(1024);
    let task = tokio::spawn(async move {
        loop {
            let next = follower.next().await;
            let end = next.is_err();
            if tx.send(next).await.is_err() || end {
                return;
            }
        }
    });
    // A blink, then a reconnect, then a silence longer than the patience.
    first.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut second = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    tokio::time::sleep(patience + Duration::from_secs(3)).await;
    // Another blink: retried, not given up on.
    second.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut third = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let op = OperationId::random();
    WorkerApi::submit(&client, &sb, &op, &shell("echo after")).await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the follower stopped"))?;
        match next {
            Ok(e) if e.operation_id.as_ref() == Some(&op) => break,
            Ok(_) => {}
            Err(e) => anyhow::bail!("the follower gave up on a worker that came back: {e}"),
        }
    }
    // Gone for good: given up on after the patience, its address named.
    third.kill9();
    let started = std::time::Instant::now();
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await? {
            Some(Ok(_)) => {}
            Some(Err(e)) => break e,
            None => anyhow::bail!("the follower stopped without an error"),
        }
    };
    assert!(matches!(err, FollowError::GaveUp { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("worker http://127.0.0.1:{port} unreachable")),
        "{err}"
    );
    assert!(started.elapsed() >= patience - Duration::from_millis(500));
    task.await?;
    let last = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    last.client().await?.destroy_sandbox(&sb).await?;
    Ok(())
}
