//! The session runner (`corral_harness::runner`) over the fake workers of
//! `corral_e2e::fake_api::FakeFleet` and the scripted model of
//! `corral_e2e::fake_model`, with paused time: a sandbox lost mid-call and
//! the run going on in a fresh one on another worker, a worker down for
//! less and for more than the session's patience, a resume waiting for
//! its worker and going elsewhere when it is gone, the bound on
//! replacements, and a closed run's inbox. Minutes of deadlines run in
//! milliseconds; the same paths run against real workers in the fleet,
//! resilience and serve suites.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::fake_api::{FakeApi, FakeFleet};
use corral_e2e::fake_model::{ScriptedModel, bash_calls};
use corral_harness::agent::events::Event;
use corral_harness::agent::record::OnSandboxLost;
use corral_harness::agent::{Ending, Inbox, StopMode};
use corral_harness::llm::Api;
use corral_harness::runner::{self, MAX_REPLACEMENTS, Run, RunEnd, RunOutcome};
use corral_harness::sessions::{RunOptions, SessionError, SessionRequest, Sessions};
use corral_proto::OperationId;

const PATIENCE: Duration = Duration::from_secs(60);

fn options(lost: OnSandboxLost) -> RunOptions {
    RunOptions {
        request: SessionRequest {
            prompt: Some("go".into()),
            ..SessionRequest::default()
        },
        // Never reached: the scripted model answers.
        base_url: Some("http://model.invalid/v1".into()),
        api: Some(Api::Responses),
        until_idle: true,
        worker_lost_after: Some(PATIENCE),
        on_sandbox_lost: Some(lost),
        ..RunOptions::default()
    }
}

/// Session store in a fresh directory, its requests answered by `model`.
fn sessions_for(model: &std::sync::Arc<ScriptedModel>) -> Result<(tempfile::TempDir, Sessions)> {
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path()).with_models(model.maker());
    Ok((dir, store))
}

fn keep() -> RunEnd {
    RunEnd {
        export: None,
        keep_sandbox: true,
    }
}

/// The operations the workers `ws` started, once there are `n`.
async fn started(ws: &[&FakeApi], n: usize) -> Result<Vec<OperationId>> {
    for _ in 0..10_000 {
        let ops: Vec<OperationId> = ws.iter().flat_map(|w| w.started()).collect();
        if ops.len() >= n {
            return Ok(ops);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("{n} operations never started")
}

/// Every event of the run and how it ended.
async fn finish(mut run: Run) -> Result<(Vec<Event>, RunOutcome, Run)> {
    let mut events = Vec::new();
    while let Some(e) = run.events.recv().await {
        events.push(e);
    }
    let outcome = (&mut run.task).await??;
    Ok((events, outcome, run))
}

fn replacements(events: &[Event]) -> Vec<(Option<String>, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::SandboxReplaced { worker, reason, .. } => Some((worker.clone(), reason.clone())),
            _ => None,
        })
        .collect()
}

fn started_on(events: &[Event]) -> Option<Option<String>> {
    events.iter().find_map(|e| match e {
        Event::SessionStarted { worker, .. } => Some(worker.clone()),
        _ => None,
    })
}

#[tokio::test(start_paused = true)]
async fn a_sandbox_lost_mid_call_goes_on_in_a_fresh_one_and_its_call_runs_once() -> Result<()> {
    let fleet = FakeFleet::new(&["w1", "w2"]);
    let model = ScriptedModel::new(vec![bash_calls(&[("c1", "make")])]);
    let (_dir, store) = sessions_for(&model)?;
    let id = Sessions::new_id();
    let run = runner::run(
        &store,
        &fleet,
        &id,
        options(OnSandboxLost::NewSandbox),
        keep(),
    )
    .await?;
    let (w1, w2) = (fleet.worker("w1"), fleet.worker("w2"));
    let ops = started(&[w1], 1).await?;
    let lost = w1.sandboxes();
    w1.lose(&lost[0], "the host went away");
    let (events, outcome, run) = finish(run).await?;
    ensure!(
        outcome.summary.ending == Ending::Done,
        "{:?}",
        outcome.summary
    );
    ensure!(started_on(&events) == Some(Some("w1".into())));
    let replaced = replacements(&events);
    ensure!(replaced.len() == 1, "{replaced:?}");
    ensure!(replaced[0].1.contains("the host went away"), "{replaced:?}");
    // A fresh sandbox (where placement put it: its worker still answers);
    // the call ran once, on the lost one, and nothing ran since.
    let mut all = w1.sandboxes();
    all.extend(w2.sandboxes());
    ensure!(all.len() == 2 && all.contains(&lost[0]), "{all:?}");
    ensure!(w1.submits(&ops[0]) == 1 && w1.started().len() + w2.started().len() == 1);
    // The model heard of the loss in that call's one result (the model
    // refuses a request where a call has none, or two).
    let last = model.requests().pop().context("no request")?;
    ensure!(
        format!("{:?}", last.input).contains("the host went away"),
        "{last:?}"
    );
    // No request went out for the lost call in the lost sandbox: two in
    // all, the run's turns counted across its sandboxes.
    let s = &outcome.summary;
    ensure!(s.run_turns == 2 && s.turns == 2, "{s:?}");
    ensure!(model.requests().len() == 2);
    // The run is over: its inbox says so.
    ensure!(matches!(
        run.send(Inbox::Stop(StopMode::Hard)).await,
        Err(SessionError::Gone(_))
    ));
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_worker_down_less_than_the_patience_is_waited_for_and_one_down_longer_is_left()
-> Result<()> {
    let fleet = FakeFleet::new(&["w1", "w2"]);
    let model = ScriptedModel::new(vec![bash_calls(&[("c1", "make")])]);
    let (_dir, store) = sessions_for(&model)?;
    let (w1, w2) = (fleet.worker("w1"), fleet.worker("w2"));
    // Down for 30 s of the 60 s patience: the call goes on where it was.
    let id = Sessions::new_id();
    let run = runner::run(
        &store,
        &fleet,
        &id,
        options(OnSandboxLost::NewSandbox),
        keep(),
    )
    .await?;
    let ops = started(&[w1], 1).await?;
    w1.go_down();
    tokio::time::sleep(Duration::from_secs(30)).await;
    w1.come_back();
    let sandbox = w1.sandboxes()[0].clone();
    w1.exit(&sandbox, &ops[0], 3);
    let (events, outcome, _) = finish(run).await?;
    ensure!(
        outcome.summary.ending == Ending::Done,
        "{:?}",
        outcome.summary
    );
    ensure!(replacements(&events).is_empty(), "{events:?}");
    ensure!(w1.submits(&ops[0]) == 1 && w2.sandboxes().is_empty());
    let exit = events.iter().find_map(|e| match e {
        Event::ToolResult { exit_code, .. } => Some(*exit_code),
        _ => None,
    });
    ensure!(exit == Some(Some(3)), "{events:?}");

    // Down for good: the sandbox is taken for lost once the patience is
    // over, not before, and the run goes on on the worker that answers.
    let model = ScriptedModel::new(vec![bash_calls(&[("c1", "make")])]);
    let (_dir, store) = sessions_for(&model)?;
    let id = Sessions::new_id();
    let run = runner::run(
        &store,
        &fleet,
        &id,
        options(OnSandboxLost::NewSandbox),
        keep(),
    )
    .await?;
    started(&[w1], 2).await?;
    let down_at = tokio::time::Instant::now();
    w1.go_down();
    let (events, outcome, _) = finish(run).await?;
    ensure!(
        outcome.summary.ending == Ending::Done,
        "{:?}",
        outcome.summary
    );
    let replaced = replacements(&events);
    ensure!(
        replaced.len() == 1 && replaced[0].0.as_deref() == Some("w2"),
        "{replaced:?}"
    );
    ensure!(replaced[0].1.contains("unreachable"), "{replaced:?}");
    let waited = down_at.elapsed();
    ensure!(
        waited >= PATIENCE && waited < PATIENCE + Duration::from_secs(30),
        "{waited:?}"
    );
    ensure!(w2.sandboxes().len() == 1 && w2.started().is_empty());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_resume_waits_for_its_worker_and_goes_elsewhere_only_when_it_is_gone() -> Result<()> {
    let fleet = FakeFleet::new(&["w1", "w2"]).with_patience(Duration::from_secs(20));
    let model = ScriptedModel::new(Vec::new());
    let (_dir, store) = sessions_for(&model)?;
    let (w1, w2) = (fleet.worker("w1"), fleet.worker("w2"));
    let id = Sessions::new_id();
    let (_, first, _) = finish(
        runner::run(
            &store,
            &fleet,
            &id,
            options(OnSandboxLost::NewSandbox),
            keep(),
        )
        .await?,
    )
    .await?;
    ensure!(first.summary.ending == Ending::Done);
    let again = || {
        let mut o = options(OnSandboxLost::NewSandbox);
        o.request.prompt = Some("again".into());
        o
    };

    // Its worker back within the patience: resumed there.
    w1.go_down();
    let back = {
        let w1 = w1.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            w1.come_back();
        })
    };
    let t0 = tokio::time::Instant::now();
    let (events, outcome, _) =
        finish(runner::run(&store, &fleet, &id, again(), keep()).await?).await?;
    back.await?;
    ensure!(
        t0.elapsed() >= Duration::from_secs(10),
        "{:?}",
        t0.elapsed()
    );
    ensure!(
        outcome.summary.ending == Ending::Done,
        "{:?}",
        outcome.summary
    );
    ensure!(started_on(&events) == Some(Some("w1".into())), "{events:?}");
    ensure!(w2.sandboxes().is_empty());

    // A session that fails with its sandbox is not moved: its worker's
    // absence is the run's error, at once.
    let strict = Sessions::new_id();
    finish(
        runner::run(
            &store,
            &fleet,
            &strict,
            options(OnSandboxLost::Fail),
            keep(),
        )
        .await?,
    )
    .await?;
    w1.go_down();
    let t0 = tokio::time::Instant::now();
    let Err(e) = runner::run(&store, &fleet, &strict, again(), keep()).await else {
        bail!("resumed on a worker that is down");
    };
    ensure!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    ensure!(e.to_string().contains("w1"), "{e}");

    // Gone past the patience: the session goes on in a fresh sandbox on
    // the worker that answers, its history whole.
    let t0 = tokio::time::Instant::now();
    let (events, outcome, _) =
        finish(runner::run(&store, &fleet, &id, again(), keep()).await?).await?;
    let waited = t0.elapsed();
    ensure!(
        waited >= Duration::from_secs(15) && waited <= Duration::from_secs(25),
        "{waited:?}"
    );
    ensure!(
        outcome.summary.ending == Ending::Done,
        "{:?}",
        outcome.summary
    );
    ensure!(started_on(&events) == Some(Some("w2".into())), "{events:?}");
    ensure!(w2.sandboxes().len() == 1);
    let last = model.requests().pop().context("no request")?;
    let seen = format!("{:?}", last.input);
    ensure!(
        seen.matches("text: \"again\"").count() == 2 && seen.contains("text: \"go\""),
        "{seen}"
    );
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_run_takes_at_most_its_bound_of_fresh_sandboxes() -> Result<()> {
    let fleet = FakeFleet::new(&["w1", "w2"]);
    let script = (1..=MAX_REPLACEMENTS + 2)
        .map(|i| bash_calls(&[(&format!("c{i}"), "make")]))
        .collect();
    let model = ScriptedModel::new(script);
    let (_dir, store) = sessions_for(&model)?;
    let (w1, w2) = (fleet.worker("w1"), fleet.worker("w2"));
    let id = Sessions::new_id();
    let run = runner::run(
        &store,
        &fleet,
        &id,
        options(OnSandboxLost::NewSandbox),
        keep(),
    )
    .await?;
    let mut lost = Vec::new();
    for n in 1..=MAX_REPLACEMENTS + 1 {
        // Each sandbox is lost as soon as its call runs.
        started(&[w1, w2], n).await?;
        let (w, live) = [w1, w2]
            .into_iter()
            .flat_map(|w| w.sandboxes().into_iter().map(move |s| (w, s)))
            .find(|(_, s)| !lost.contains(s))
            .context("no live sandbox")?;
        w.lose(&live, &format!("loss {n}"));
        lost.push(live);
    }
    let (events, outcome, _) = finish(run).await?;
    let s = &outcome.summary;
    ensure!(s.ending == Ending::Failed, "{s:?}");
    ensure!(
        s.sandbox_lost
            .as_deref()
            .is_some_and(|r| r.contains(&format!("loss {}", MAX_REPLACEMENTS + 1))),
        "{s:?}"
    );
    ensure!(
        replacements(&events).len() == MAX_REPLACEMENTS,
        "{events:?}"
    );
    ensure!(w1.sandboxes().len() + w2.sandboxes().len() == MAX_REPLACEMENTS + 1);
    // One request in each sandbox, none after a loss.
    ensure!(model.requests().len() == MAX_REPLACEMENTS + 1);
    Ok(())
}
