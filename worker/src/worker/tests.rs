//! The lifecycle on the fake runtime, on paused time: capacity and pools,
//! drain, idle and lifetime sweeps, and the races of checkpoint, restore,
//! fork and removal; each failure of the engine at each step of a create,
//! claim, fork and restore leaves nothing behind. The same lifecycle on a
//! real engine is the `tests` crate's.

use std::sync::Arc;
use std::time::Duration;

use corral_proto::{SandboxId, SandboxSpec};

use super::table::Lookup;
use super::{Worker, WorkerConfig};
use crate::error::WorkerError;
use crate::runtime::Runtime as _;
use crate::runtime::fake::{FakeRuntime, Run, Step};
use crate::state::StateDir;

const WORKER: &str = "fake-worker";

struct Fixture {
    worker: Worker,
    fake: Arc<FakeRuntime>,
    /// The state directory, kept while the worker runs.
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn start(tweak: impl FnOnce(&mut WorkerConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fake = FakeRuntime::new(WORKER);
        let worker = Self::start_on(&dir, &fake, tweak).await;
        Self {
            worker,
            fake,
            _dir: dir,
        }
    }

    async fn start_on(
        dir: &tempfile::TempDir,
        fake: &Arc<FakeRuntime>,
        tweak: impl FnOnce(&mut WorkerConfig),
    ) -> Worker {
        let mut config = WorkerConfig::new(dir.path().to_path_buf());
        config.worker_id = Some(WORKER.into());
        config.max_sandboxes = 4;
        config.policy.allowed_runtimes = vec!["runsc".into()];
        config.sweep_interval = Duration::from_secs(3600);
        tweak(&mut config);
        let state = StateDir::open(&config.state_dir).unwrap();
        state.worker_id(Some(WORKER), || unreachable!()).unwrap();
        let runtime: Arc<dyn crate::runtime::Runtime> = fake.clone();
        Worker::start_on(config, state, runtime, None, None)
            .await
            .unwrap()
    }

    /// Nothing of sandbox `id` is left: no container, no record, no
    /// socket directory, no slot.
    fn nothing_left_of(&self, id: &SandboxId) {
        assert!(
            !self
                .fake
                .containers()
                .iter()
                .any(|(_, s, _)| s == id.as_str()),
            "a container of {id} is left: {:?}",
            self.fake.containers()
        );
        assert!(
            self.worker.inner.state.load(id).is_none(),
            "the record of {id} is left"
        );
        assert!(
            !self.worker.egress_dir(id).exists(),
            "the socket directory of {id} is left"
        );
        assert!(
            matches!(
                self.worker.inner.table.lookup(id),
                Lookup::Unknown | Lookup::Removed { .. }
            ),
            "the slot of {id} is left"
        );
    }

    /// Every slot is free again: `max_sandboxes` sandboxes can be made.
    async fn every_slot_free(&self) {
        assert_eq!(self.worker.info().sandboxes, 0, "slots still held");
        assert!(
            self.fake.containers().is_empty(),
            "{:?}",
            self.fake.containers()
        );
    }
}

fn id(s: &str) -> SandboxId {
    SandboxId::new(s.to_string()).unwrap()
}

fn gvisor() -> SandboxSpec {
    SandboxSpec {
        runtime: Some("runsc".into()),
        ..SandboxSpec::default()
    }
}

/// A sandbox with an egress proxy (a socket directory of its own).
fn with_egress() -> SandboxSpec {
    SandboxSpec {
        egress: vec!["example.com".parse().unwrap()],
        ..SandboxSpec::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_sandbox_is_made_and_removed_with_everything_it_held() {
    let f = Fixture::start(|c| {
        c.policy.allowed_egress = vec!["example.com".parse().unwrap()];
    })
    .await;
    let a = id("a");
    let info = f
        .worker
        .create_sandbox(Some(a.clone()), with_egress())
        .await
        .unwrap();
    assert_eq!(
        f.fake.containers(),
        vec![(info.container_id.clone(), "a".into(), Run::Running)]
    );
    assert!(f.worker.egress_dir(&a).exists());
    assert!(f.worker.destroy_sandbox(&a).await.unwrap());
    f.nothing_left_of(&a);
    f.every_slot_free().await;
    assert!(
        !f.worker.destroy_sandbox(&a).await.unwrap(),
        "removed twice"
    );
}

#[tokio::test(start_paused = true)]
async fn each_failure_of_a_create_leaves_nothing_behind() {
    // The engine refuses to make the container; then it makes it but the
    // supervisor never answers (every attach fails until the create gives up).
    for (step, times) in [(Step::Create, 1), (Step::Attach, u32::MAX)] {
        let f = Fixture::start(|c| {
            c.policy.allowed_egress = vec!["example.com".parse().unwrap()];
        })
        .await;
        f.fake.fail(step, times);
        let a = id("a");
        let e = f
            .worker
            .create_sandbox(Some(a.clone()), with_egress())
            .await
            .unwrap_err();
        match step {
            Step::Create => assert!(matches!(e, WorkerError::Docker(_)), "{e}"),
            _ => assert!(matches!(e, WorkerError::InitUnresponsive { .. }), "{e}"),
        }
        f.nothing_left_of(&a);
        f.every_slot_free().await;
        // The id and the slots are free for the next create.
        f.fake.fail(step, 0);
        f.worker
            .create_sandbox(Some(a.clone()), with_egress())
            .await
            .unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_create_at_capacity_is_refused_and_takes_nothing() {
    let f = Fixture::start(|c| c.max_sandboxes = 2).await;
    for n in ["a", "b"] {
        f.worker
            .create_sandbox(Some(id(n)), SandboxSpec::default())
            .await
            .unwrap();
    }
    let e = f
        .worker
        .create_sandbox(Some(id("c")), SandboxSpec::default())
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::AtCapacity(_)), "{e}");
    f.nothing_left_of(&id("c"));
    assert_eq!(f.fake.calls(Step::Create), 2);
}

#[tokio::test(start_paused = true)]
async fn a_removal_during_a_create_waits_for_it_and_leaves_nothing() {
    let f = Fixture::start(|_| {}).await;
    f.fake.slow(Step::Create, Duration::from_secs(3));
    let a = id("a");
    let making = {
        let w = f.worker.clone();
        let a = a.clone();
        tokio::spawn(async move { w.create_sandbox(Some(a), SandboxSpec::default()).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Mid-create the sandbox is not unknown: a call waits for it.
    assert!(matches!(f.worker.inner.table.lookup(&a), Lookup::Busy(_)));
    assert!(f.worker.destroy_sandbox(&a).await.unwrap());
    making.await.unwrap().unwrap();
    f.nothing_left_of(&a);
    f.every_slot_free().await;
}

#[tokio::test(start_paused = true)]
async fn a_create_given_up_midway_removes_its_container_by_name() {
    let f = Fixture::start(|_| {}).await;
    f.fake.slow(Step::Create, Duration::from_secs(3));
    let a = id("a");
    let making = {
        let w = f.worker.clone();
        let a = a.clone();
        tokio::spawn(async move { w.create_sandbox(Some(a), SandboxSpec::default()).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    making.abort();
    let _ = making.await;
    // The engine makes the container after the client went away; the
    // guard's undo removes it once the engine has answered.
    tokio::time::sleep(Duration::from_secs(10)).await;
    f.nothing_left_of(&a);
    f.every_slot_free().await;
}

#[tokio::test(start_paused = true)]
async fn a_checkpointed_and_restored_sandbox_is_never_unknown_meanwhile() {
    let f = Fixture::start(|_| {}).await;
    let a = id("a");
    let made = f
        .worker
        .create_sandbox(Some(a.clone()), gvisor())
        .await
        .unwrap();
    f.fake.slow(Step::Checkpoint, Duration::from_secs(4));
    f.fake.slow(Step::Restore, Duration::from_secs(4));
    let cycle = {
        let w = f.worker.clone();
        let a = a.clone();
        tokio::spawn(async move {
            w.checkpoint_sandbox(&a).await?;
            w.restore_sandbox(&a).await
        })
    };
    // A client asks all along, as a reconnecting one does.
    let mut seen = std::collections::BTreeSet::new();
    while !cycle.is_finished() {
        match f.worker.get_sandbox(&a).await {
            Ok(info) => {
                assert_eq!(info.container_id, made.container_id);
                seen.insert(format!("{:?}", info.state));
            }
            Err(e) => panic!("get_sandbox during a checkpoint or restore: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let restored = cycle.await.unwrap().unwrap();
    assert_eq!(
        restored.container_id, made.container_id,
        "replaced, not restored"
    );
    assert!(seen.contains("Checkpointed"), "{seen:?}");
    // A call that needs it running waited for the restore, then found it.
    f.worker.sandbox(&a).await.unwrap();
    assert_eq!(f.fake.calls(Step::Create), 1);
}

#[tokio::test(start_paused = true)]
async fn a_removal_during_a_restore_waits_for_it() {
    let f = Fixture::start(|_| {}).await;
    let a = id("a");
    f.worker
        .create_sandbox(Some(a.clone()), gvisor())
        .await
        .unwrap();
    f.worker.checkpoint_sandbox(&a).await.unwrap();
    f.fake.slow(Step::Restore, Duration::from_secs(5));
    let restoring = {
        let w = f.worker.clone();
        let a = a.clone();
        tokio::spawn(async move { w.restore_sandbox(&a).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(f.worker.destroy_sandbox(&a).await.unwrap());
    restoring.await.unwrap().unwrap();
    f.nothing_left_of(&a);
    f.every_slot_free().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_restore_leaves_the_sandbox_checkpointed_and_restorable() {
    let f = Fixture::start(|_| {}).await;
    let a = id("a");
    f.worker
        .create_sandbox(Some(a.clone()), gvisor())
        .await
        .unwrap();
    f.worker.checkpoint_sandbox(&a).await.unwrap();
    f.fake.fail(Step::Restore, 1);
    f.worker.restore_sandbox(&a).await.unwrap_err();
    assert!(matches!(
        f.worker.inner.table.lookup(&a),
        Lookup::Checkpointed(_)
    ));
    assert_eq!(
        f.worker.info().sandboxes,
        0,
        "a checkpointed sandbox holds no slot"
    );
    f.worker.restore_sandbox(&a).await.unwrap();
    f.worker.sandbox(&a).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_fork_copies_the_parent_into_each_child() {
    let f = Fixture::start(|_| {}).await;
    let p = id("p");
    let parent = f
        .worker
        .create_sandbox(Some(p.clone()), SandboxSpec::default())
        .await
        .unwrap();
    let forked = f
        .worker
        .fork_sandbox(&p, vec![id("c1"), id("c2")])
        .await
        .unwrap();
    let child = |n: usize| forked.children[n].container_id.clone();
    assert_eq!(
        f.fake.copied_from(&child(0)),
        Some(parent.container_id.clone())
    );
    assert_eq!(f.fake.copied_from(&child(1)), Some(child(0)));
    // The parent was frozen for the first copy and thawed.
    assert_eq!(f.fake.calls(Step::Pause), 1);
    assert!(
        f.fake
            .containers()
            .iter()
            .all(|(_, _, r)| *r == Run::Running)
    );
    let record = f.worker.inner.state.load(&id("c1")).unwrap();
    assert!(record.forking_from.is_none());
}

#[tokio::test(start_paused = true)]
async fn each_failure_of_a_fork_removes_its_children_and_thaws_the_parent() {
    for step in [Step::Create, Step::Pause, Step::Copy] {
        let f = Fixture::start(|_| {}).await;
        let p = id("p");
        f.worker
            .create_sandbox(Some(p.clone()), SandboxSpec::default())
            .await
            .unwrap();
        f.fake.fail(step, 1);
        f.worker
            .fork_sandbox(&p, vec![id("c1"), id("c2")])
            .await
            .unwrap_err();
        f.nothing_left_of(&id("c1"));
        f.nothing_left_of(&id("c2"));
        assert_eq!(
            f.fake.containers().len(),
            1,
            "{step:?}: {:?}",
            f.fake.containers()
        );
        assert_eq!(
            f.fake.containers()[0].2,
            Run::Running,
            "{step:?}: the parent stays frozen"
        );
        f.worker.sandbox(&p).await.unwrap();
        assert_eq!(f.worker.info().sandboxes, 1, "{step:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_removal_of_the_parent_during_a_fork_waits_for_the_copy() {
    let f = Fixture::start(|_| {}).await;
    let p = id("p");
    f.worker
        .create_sandbox(Some(p.clone()), SandboxSpec::default())
        .await
        .unwrap();
    f.fake.slow(Step::Copy, Duration::from_secs(3));
    let forking = {
        let w = f.worker.clone();
        let p = p.clone();
        tokio::spawn(async move { w.fork_sandbox(&p, vec![id("c1")]).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(f.fake.calls(Step::Pause), 1, "the copy is under way");
    assert!(f.worker.destroy_sandbox(&p).await.unwrap());
    // The copy ended before the parent went: the child has it.
    forking.await.unwrap().unwrap();
    f.nothing_left_of(&p);
    f.worker.sandbox(&id("c1")).await.unwrap();
    assert_eq!(f.fake.calls(Step::Unpause), 1);
}

fn pool(size: u32) -> crate::pool::Template {
    format!("{}={size}", corral_proto::sandbox::DEFAULT_IMAGE)
        .parse()
        .unwrap()
}

/// Waits (on paused time) until the pools hold `n` ready members.
async fn pool_ready(w: &Worker, n: u32) {
    for _ in 0..600 {
        if w.info().pools.iter().map(|p| p.ready).sum::<u32>() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "the pool never held {n} ready members: {:?}",
        w.info().pools
    );
}

#[tokio::test(start_paused = true)]
async fn a_create_claims_a_pool_member_and_the_pool_refills() {
    let f = Fixture::start(|c| c.pools = vec![pool(2)]).await;
    pool_ready(&f.worker, 2).await;
    assert_eq!(f.fake.calls(Step::Create), 2);
    let a = id("a");
    let info = f
        .worker
        .create_sandbox(Some(a.clone()), SandboxSpec::default())
        .await
        .unwrap();
    // A member's container, not a new one.
    assert_eq!(f.fake.calls(Step::Create), 2);
    assert!(
        f.fake
            .containers()
            .iter()
            .any(|(c, _, _)| *c == info.container_id)
    );
    pool_ready(&f.worker, 2).await;
    assert_eq!(f.fake.calls(Step::Create), 3);
    assert_eq!(f.worker.info().pools[0].claims, 1);
}

#[tokio::test(start_paused = true)]
async fn at_capacity_a_pool_member_gives_up_its_slot() {
    let f = Fixture::start(|c| {
        c.max_sandboxes = 3;
        c.pools = vec![pool(2)];
    })
    .await;
    pool_ready(&f.worker, 2).await;
    // Not the pool's template: each takes a slot a member gives up.
    let other = || SandboxSpec {
        memory_bytes: Some(256 << 20),
        ..SandboxSpec::default()
    };
    for n in ["a", "b", "c"] {
        f.worker.create_sandbox(Some(id(n)), other()).await.unwrap();
    }
    assert_eq!(f.worker.info().sandboxes, 3);
    let e = f
        .worker
        .create_sandbox(Some(id("d")), other())
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::AtCapacity(_)), "{e}");
    // The members' containers went with their slots.
    assert_eq!(f.fake.containers().len(), 3, "{:?}", f.fake.containers());
}

#[tokio::test(start_paused = true)]
async fn a_failed_pool_fill_leaves_nothing_and_is_tried_again() {
    let f = Fixture::start(|c| c.pools = vec![pool(1)]).await;
    // The engine refuses twice, then the supervisors never answer: each
    // member given up goes with its container.
    f.fake.fail(Step::Create, 2);
    f.fake.fail(Step::Attach, u32::MAX);
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert!(
        f.fake.calls(Step::Create) >= 4,
        "{}",
        f.fake.calls(Step::Create)
    );
    assert!(f.fake.containers().len() <= 1, "{:?}", f.fake.containers());
    assert_eq!(f.worker.info().pools[0].ready, 0);
    // The engine is well again: the pool fills, with one container.
    f.fake.fail(Step::Attach, 0);
    pool_ready(&f.worker, 1).await;
    assert_eq!(f.fake.containers().len(), 1, "{:?}", f.fake.containers());
}

#[tokio::test(start_paused = true)]
async fn a_drain_empties_the_pools_and_removes_what_is_left_at_its_deadline() {
    let f = Fixture::start(|c| {
        c.pools = vec![pool(1)];
        c.drain_deadline = Duration::from_secs(30);
    })
    .await;
    pool_ready(&f.worker, 1).await;
    let a = id("a");
    f.worker
        .create_sandbox(Some(a.clone()), gvisor())
        .await
        .unwrap();
    f.worker.drain(true).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The members are gone; the sandbox is served until the deadline.
    assert_eq!(f.fake.containers().len(), 1, "{:?}", f.fake.containers());
    let e = f
        .worker
        .create_sandbox(Some(id("b")), SandboxSpec::default())
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::Draining), "{e}");
    f.worker.sandbox(&a).await.unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    f.nothing_left_of(&a);
    f.every_slot_free().await;
}

#[tokio::test(start_paused = true)]
async fn a_claim_racing_a_drain_is_either_served_or_refused_and_leaks_nothing() {
    let f = Fixture::start(|c| c.pools = vec![pool(2)]).await;
    pool_ready(&f.worker, 2).await;
    f.fake.slow(Step::Remove, Duration::from_millis(500));
    let claims: Vec<_> = ["a", "b", "c"]
        .into_iter()
        .map(|n| {
            let w = f.worker.clone();
            tokio::spawn(async move { w.create_sandbox(Some(id(n)), SandboxSpec::default()).await })
        })
        .collect();
    f.worker.drain(true).unwrap();
    let mut served = 0;
    for c in claims {
        match c.await.unwrap() {
            Ok(_) => served += 1,
            Err(WorkerError::Draining) => {}
            Err(e) => panic!("{e}"),
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    // What was served runs; every member not handed out is gone.
    assert_eq!(f.worker.info().sandboxes, served);
    assert_eq!(
        f.fake.containers().len(),
        served as usize,
        "{:?}",
        f.fake.containers()
    );
    assert!(f.worker.info().pools.iter().all(|p| p.ready == 0));
}

#[tokio::test(start_paused = true)]
async fn an_idle_sandbox_is_removed_after_its_timeout_and_a_used_one_is_not() {
    let f = Fixture::start(|_| {}).await;
    let idle = SandboxSpec {
        idle_timeout_ms: Some(10_000),
        ..SandboxSpec::default()
    };
    f.worker
        .create_sandbox(Some(id("idle")), idle.clone())
        .await
        .unwrap();
    f.worker
        .create_sandbox(Some(id("used")), idle)
        .await
        .unwrap();
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        f.worker.get_sandbox(&id("used")).await.unwrap();
    }
    f.nothing_left_of(&id("idle"));
    assert!(f.worker.get_sandbox(&id("used")).await.is_ok());
    let e = f.worker.get_sandbox(&id("idle")).await.unwrap_err();
    assert!(matches!(e, WorkerError::Removed { .. }), "{e}");
}

#[tokio::test(start_paused = true)]
async fn a_lifetime_ends_a_checkpointed_sandbox_and_one_restored_late() {
    let f = Fixture::start(|_| {}).await;
    let ttl = || SandboxSpec {
        ttl_ms: Some(10_000),
        ..gvisor()
    };
    let (a, b) = (id("a"), id("b"));
    f.worker
        .create_sandbox(Some(a.clone()), ttl())
        .await
        .unwrap();
    f.worker
        .create_sandbox(Some(b.clone()), ttl())
        .await
        .unwrap();
    f.worker.checkpoint_sandbox(&a).await.unwrap();
    f.worker.checkpoint_sandbox(&b).await.unwrap();
    // b's restore is under way when its lifetime ends: it is not taken
    // mid-restore, and goes once it runs.
    f.fake.slow(Step::Restore, Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let restoring = {
        let w = f.worker.clone();
        let b = b.clone();
        tokio::spawn(async move { w.restore_sandbox(&b).await })
    };
    tokio::time::sleep(Duration::from_secs(7)).await;
    f.nothing_left_of(&a);
    assert!(matches!(f.worker.inner.table.lookup(&b), Lookup::Busy(_)));
    // It ran again, and went at once: the restore says which it saw.
    match restoring.await.unwrap() {
        Ok(_) | Err(WorkerError::Removed { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    f.nothing_left_of(&b);
    f.every_slot_free().await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_supervisor_is_reported_then_swept() {
    let f = Fixture::start(|_| {}).await;
    let a = id("a");
    let info = f
        .worker
        .create_sandbox(Some(a.clone()), SandboxSpec::default())
        .await
        .unwrap();
    f.fake.kill(&info.container_id);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let info = f.worker.get_sandbox(&a).await.unwrap();
    assert!(
        matches!(info.state, corral_proto::SandboxState::Lost(_)),
        "{:?}",
        info.state
    );
    f.worker.sweep().await.unwrap();
    f.nothing_left_of(&a);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_worker_adopts_its_sandboxes_and_removes_what_it_has_no_record_of() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeRuntime::new(WORKER);
    let first = Fixture::start_on(&dir, &fake, |_| {}).await;
    first
        .create_sandbox(Some(id("a")), SandboxSpec::default())
        .await
        .unwrap();
    first.create_sandbox(Some(id("b")), gvisor()).await.unwrap();
    first.checkpoint_sandbox(&id("b")).await.unwrap();
    first.shutdown().await;
    drop(first);
    // A container of this worker that no record names.
    fake.create(&id("stray"), &SandboxSpec::default(), None, &[])
        .await
        .unwrap();
    let second = Fixture::start_on(&dir, &fake, |_| {}).await;
    second.sandbox(&id("a")).await.unwrap();
    assert!(matches!(
        second.inner.table.lookup(&id("b")),
        Lookup::Checkpointed(_)
    ));
    assert!(!fake.containers().iter().any(|(_, s, _)| s == "stray"));
    second.restore_sandbox(&id("b")).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_claim_leaves_nothing_of_the_sandbox_or_the_member() {
    let f = Fixture::start(|c| c.pools = vec![pool(1)]).await;
    pool_ready(&f.worker, 1).await;
    let member = f.fake.containers()[0].0.clone();
    // The member's supervisor no longer answers the sandbox's attach.
    f.fake.fail(Step::Attach, u32::MAX);
    let a = id("a");
    let e = f
        .worker
        .create_sandbox(Some(a.clone()), SandboxSpec::default())
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::InitUnresponsive { .. }), "{e}");
    f.nothing_left_of(&a);
    assert!(
        !f.fake.containers().iter().any(|(c, _, _)| *c == member),
        "the claimed member's container is left"
    );
    assert_eq!(f.worker.info().pools[0].claims, 1);
}

/// A record as the previous release wrote it (before `restored` and the
/// spec's `egress_proxy`), for a container of `container`.
fn earlier_record(id: &str, container: &str, runtime: &str, checkpointed: bool) -> String {
    let runtime = if runtime.is_empty() {
        "null".to_string()
    } else {
        format!("{runtime:?}")
    };
    let checkpointed = if checkpointed {
        r#","checkpointed":true"#
    } else {
        ""
    };
    format!(
        r#"{{"version":1,"id":"{id}","spec":{{"image":null,"network":"none","memory_bytes":null,"cpu_millis":null,"pids_limit":null,"workspace_bytes":null,"tmp_bytes":null,"run_as_root":false,"writable_rootfs":false,"add_capabilities":[],"env":{{}},"runtime":{runtime}}},"created_at_unix_ms":1764900000000,"container_id":"{container}"{checkpointed}}}"#
    )
}

#[tokio::test(start_paused = true)]
async fn a_state_directory_of_the_previous_release_is_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeRuntime::new(WORKER);
    let running = fake
        .create(&id("old-a"), &SandboxSpec::default(), None, &[])
        .await
        .unwrap();
    let saved = fake
        .create(&id("old-b"), &gvisor(), None, &[])
        .await
        .unwrap();
    fake.checkpoint(&saved).await.unwrap();
    {
        let state = StateDir::open(dir.path()).unwrap();
        state.worker_id(Some(WORKER), || unreachable!()).unwrap();
    }
    let records = dir.path().join("sandboxes");
    std::fs::create_dir_all(&records).unwrap();
    for (id, json) in [
        ("old-a", earlier_record("old-a", &running, "", false)),
        ("old-b", earlier_record("old-b", &saved, "runsc", true)),
    ] {
        std::fs::write(records.join(format!("{id}.json")), json).unwrap();
    }
    let w = Fixture::start_on(&dir, &fake, |_| {}).await;
    let a = w.sandbox(&id("old-a")).await.unwrap();
    assert_eq!(a.container_id, running);
    assert!(matches!(
        w.inner.table.lookup(&id("old-b")),
        Lookup::Checkpointed(_)
    ));
    let b = w.restore_sandbox(&id("old-b")).await.unwrap();
    assert_eq!(b.container_id, saved);
    assert_eq!(fake.containers().len(), 2, "{:?}", fake.containers());
}
