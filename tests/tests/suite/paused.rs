//! The harness's waiting logic against the scripted worker of
//! `corral_e2e::fake_api`, with paused time: the follower across outages
//! shorter and longer than its patience, the operation manager running an
//! operation at most once across an outage and answering a lost worker
//! and a lost sandbox. Minutes of deadlines run in milliseconds; the same
//! paths run against real workers in the fleet and restart suites.

use std::time::Duration;

use anyhow::Result;
use corral_e2e::fake_api::FakeApi;
use corral_harness::follow::{FollowError, Follower};
use corral_harness::ops::{Manager, OpStatus, Operation, OperationManager};
use corral_harness::worker_api::WorkerApi;
use corral_proto::{EventKind, OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};
use tokio::time::Instant;

const PATIENCE: Duration = Duration::from_secs(60);

async fn sandbox(fake: &FakeApi) -> Result<SandboxId> {
    let id = SandboxId::random();
    fake.create_sandbox(&id, &SandboxSpec::default()).await?;
    Ok(id)
}

fn shell(cmd: &str) -> OperationSpec {
    OperationSpec::Shell(ShellSpec::new(cmd))
}

/// The next snapshot of `id` in one of `statuses`.
async fn until(
    updates: &mut tokio::sync::mpsc::Receiver<Operation>,
    id: &OperationId,
    statuses: &[OpStatus],
) -> Result<Operation> {
    loop {
        let op = updates
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("the manager went away"))?;
        if &op.id == id && statuses.contains(&op.status) {
            return Ok(op);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_follower_outlives_a_short_outage_and_loses_nothing() -> Result<()> {
    let fake = FakeApi::new();
    let sb = sandbox(&fake).await?;
    let op = OperationId::random();
    let mut f = Follower::from_now(fake.clone(), sb.clone(), None, PATIENCE).await?;
    fake.submit(&sb, &op, &shell("x")).await?;
    fake.output(&sb, &op, "one");
    assert!(matches!(f.next().await?.kind, EventKind::Started { .. }));
    assert!(matches!(f.next().await?.kind, EventKind::Output { .. }));
    // Down for 50 s of its 60: what happened meanwhile is there after.
    fake.go_down();
    let back = fake.clone();
    let (sb2, op2) = (sb.clone(), op.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(50)).await;
        back.output(&sb2, &op2, "two");
        back.exit(&sb2, &op2, 0);
        back.come_back();
    });
    let started = Instant::now();
    let e = f.next().await?;
    assert!(
        matches!(&e.kind, EventKind::Output { data, .. } if &data[..] == b"two"),
        "{e:?}"
    );
    assert!(started.elapsed() >= Duration::from_secs(50));
    assert!(f.unreachable_for().is_none());
    assert!(matches!(f.next().await?.kind, EventKind::Finished(_)));
    assert_eq!(f.cursor(), 4);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_follower_gives_up_after_its_patience_and_not_before() -> Result<()> {
    let fake = FakeApi::new();
    let sb = sandbox(&fake).await?;
    let mut f = Follower::from_now(fake.clone(), sb.clone(), None, PATIENCE).await?;
    fake.go_down();
    let started = Instant::now();
    match f.next().await {
        Err(FollowError::GaveUp { patience, .. }) => assert_eq!(patience, PATIENCE),
        other => panic!("{other:?}"),
    }
    let waited = started.elapsed();
    assert!(
        waited >= PATIENCE && waited < PATIENCE + Duration::from_secs(1),
        "{waited:?}"
    );
    // A later call starts a new patience, and finds the worker back.
    fake.come_back();
    let op = OperationId::random();
    fake.submit(&sb, &op, &shell("x")).await?;
    assert!(matches!(f.next().await?.kind, EventKind::Started { .. }));
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_operation_added_during_an_outage_runs_once_and_holds_nothing_up() -> Result<()> {
    let fake = FakeApi::new();
    let sb = sandbox(&fake).await?;
    let (manager, mut updates) = Manager::start_with(fake.clone(), sb.clone(), PATIENCE);
    let running = Operation::new(OperationId::random(), shell("sleep 1000"));
    let running_id = running.id.clone();
    manager.add(running).await?;
    until(&mut updates, &running_id, &[OpStatus::Awaiting]).await?;
    // Down for 20 s. An add is taken at once and submitted when the worker
    // answers; a cancel meanwhile is not held up behind it.
    fake.go_down();
    let op = Operation::new(OperationId::random(), shell("make"));
    let id = op.id.clone();
    let started = Instant::now();
    manager.add(op.clone()).await?;
    // Added again (a resumed session does): ignored.
    manager.add(op).await?;
    until(&mut updates, &id, &[OpStatus::Ready]).await?;
    let back = fake.clone();
    let seen = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(20)).await;
        let before = back.started();
        back.come_back();
        before
    });
    manager.cancel(&running_id, "stop").await.ok();
    until(&mut updates, &running_id, &[OpStatus::Canceling]).await?;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        seen.await?,
        std::slice::from_ref(&running_id),
        "nothing new ran while it was down"
    );
    // Back: the new one is submitted and the old one canceled, in either
    // order.
    let (mut awaiting, mut canceled) = (false, false);
    while !(awaiting && canceled) {
        let op = updates
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("the manager went away"))?;
        awaiting |= op.id == id && op.status == OpStatus::Awaiting;
        canceled |= op.id == running_id && op.status == OpStatus::Canceled;
    }
    fake.output(&sb, &id, "built");
    fake.exit(&sb, &id, 0);
    let done = until(&mut updates, &id, &[OpStatus::Completed]).await?;
    assert_eq!(
        done.result.map(|r| r.outcome),
        Some(corral_proto::Outcome::Exited { code: 0 })
    );
    assert_eq!(fake.started(), [running_id, id.clone()]);
    assert_eq!(fake.submits(&id), 1, "tried while down, sent once");
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_cancel_while_its_submit_is_under_way_stops_it_once_submitted() -> Result<()> {
    let fake = FakeApi::new();
    let sb = sandbox(&fake).await?;
    let (manager, mut updates) = Manager::start_with(fake.clone(), sb.clone(), PATIENCE);
    // Following the sandbox first (a manager takes commands once it is).
    let first = Operation::new(OperationId::random(), shell("true"));
    let first_id = first.id.clone();
    manager.add(first).await?;
    until(&mut updates, &first_id, &[OpStatus::Awaiting]).await?;
    fake.go_down();
    let op = Operation::new(OperationId::random(), shell("sleep 1000"));
    let id = op.id.clone();
    manager.add(op).await?;
    manager.cancel(&id, "changed my mind").await?;
    until(&mut updates, &id, &[OpStatus::Canceling]).await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    fake.come_back();
    // Submitted once the worker answers, then canceled there.
    let ended = until(
        &mut updates,
        &id,
        &[OpStatus::Canceled, OpStatus::Completed],
    )
    .await?;
    assert_eq!(ended.status, OpStatus::Canceled, "{ended:?}");
    assert_eq!(fake.submits(&id), 1);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_worker_gone_past_the_deadline_and_a_lost_sandbox_are_losses() -> Result<()> {
    let fake = FakeApi::new();
    let sb = sandbox(&fake).await?;
    let (manager, mut updates) = Manager::start_with(fake.clone(), sb.clone(), PATIENCE);
    let op = Operation::new(OperationId::random(), shell("sleep 1000"));
    let id = op.id.clone();
    manager.add(op).await?;
    until(&mut updates, &id, &[OpStatus::Awaiting]).await?;
    // Gone for good: the running operation fails as lost at the deadline.
    fake.go_down();
    let started = Instant::now();
    let failed = until(&mut updates, &id, &[OpStatus::Failed]).await?;
    assert!(failed.lost, "{failed:?}");
    assert!(started.elapsed() >= PATIENCE, "{:?}", started.elapsed());
    // Another sandbox, lost while its operation runs: lost at once.
    fake.come_back();
    let sb = sandbox(&fake).await?;
    let (manager, mut updates) = Manager::start_with(fake.clone(), sb.clone(), PATIENCE);
    let op = Operation::new(OperationId::random(), shell("sleep 1000"));
    let id = op.id.clone();
    manager.add(op).await?;
    until(&mut updates, &id, &[OpStatus::Awaiting]).await?;
    let started = Instant::now();
    fake.lose(&sb, "container stopped with exit code 137");
    let failed = until(&mut updates, &id, &[OpStatus::Failed]).await?;
    assert!(failed.lost, "{failed:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    Ok(())
}
