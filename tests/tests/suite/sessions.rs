//! The harness's front door on its own, without the command line: start,
//! resume after a crash, fork and remove, on a real worker (in-process)
//! with a scripted model server on loopback.

use std::time::Duration;

use anyhow::{Result, bail};
use corral_e2e::Harness;
use corral_e2e::model::{ModelServer, responses};
use corral_harness::agent::{Ending, Event, Inbox, Record, StopMode, Summary};
use corral_harness::llm::Api;
use corral_harness::session::LogError;
use corral_harness::sessions::{RunOptions, SessionError, SessionHandle, SessionRequest, Sessions};
use corral_harness::worker_api::{ApiError, WorkerApi};
use corral_proto::Outcome;

fn bash(cmd: &str) -> String {
    serde_json::json!({ "command": cmd }).to_string()
}

fn options(model: &ModelServer, prompt: Option<&str>) -> RunOptions {
    RunOptions {
        request: SessionRequest {
            prompt: prompt.map(String::from),
            ..SessionRequest::default()
        },
        base_url: Some(model.url.clone()),
        api: Some(Api::Responses),
        api_key: Some("k".into()),
        until_idle: true,
        ..RunOptions::default()
    }
}

/// Every event of the session, and how it ended. Events are read while
/// the session runs, as a caller would: a full event channel must not be
/// what ends it.
async fn finish(mut handle: SessionHandle) -> Result<(Vec<Event>, Summary)> {
    let mut events = Vec::new();
    let summary = tokio::time::timeout(Duration::from_secs(60), async {
        let mut open = true;
        let summary = loop {
            tokio::select! {
                r = &mut handle.task => break r??,
                e = handle.events.recv(), if open => match e {
                    Some(e) => events.push(e),
                    None => open = false,
                },
            }
        };
        while let Ok(e) = handle.events.try_recv() {
            events.push(e);
        }
        Ok::<_, anyhow::Error>(summary)
    })
    .await??;
    Ok((events, summary))
}

#[tokio::test]
async fn a_session_starts_runs_its_calls_and_is_listed() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c1",
            "Bash",
            &bash("echo hi > /workspace/f; cat /workspace/f"),
        )]),
        responses::text("It says hi."),
    ])
    .await;
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    let new = store.prepare("s1", options(&model, Some("what does f say?")))?;
    assert!(new.config().worker.is_none());
    let handle = store.start(new, h.worker.clone()).await?;
    assert!(!handle.resumed);
    let sandbox = handle.config.sandbox_id.clone();
    let (events, summary) = finish(handle).await?;
    assert_eq!(summary.ending, Ending::Done);
    assert_eq!(summary.final_text, "It says hi.");
    assert_eq!((summary.turns, summary.tool_calls), (2, 1));
    assert!(
        matches!(&events[0], Event::SessionStarted { session_id, resumed: false, .. } if session_id == "s1"),
        "{:?}",
        events[0]
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::ToolResult { text, .. } if text.contains("hi")))
    );
    let file = h.run(&sandbox, "cat /workspace/f").await?;
    assert_eq!(file.stdout.to_lossy_string(), "hi\n");
    // The model saw the call's output.
    assert!(model.received()[1].text().contains("hi"));

    let listed = store.list()?;
    assert_eq!(listed.len(), 1);
    let brief = listed[0]
        .brief
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(brief.last_end, Some(Ending::Done));
    // What a listing shows is what the whole state says.
    let state = corral_harness::agent::replay(store.dir(), "s1")?;
    assert_eq!(*brief, corral_harness::agent::Brief::of(&state));
    let first = store.records("s1")?.next().transpose()?;
    assert!(matches!(first, Some((1, Record::Start { .. }))));
    // Starting it again is refused: it exists.
    let again = store.prepare("s1", options(&model, Some("again")));
    assert!(matches!(
        again,
        Err(SessionError::Log(LogError::AlreadyExists(_)))
    ));
    h.worker.destroy_sandbox(&sandbox).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_crashed_session_resumes_without_running_its_call_twice() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "c1",
            "Bash",
            &bash("sleep 2; echo ran >> /workspace/counter"),
        )]),
        responses::text("Counted."),
    ])
    .await;
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    let prompt = "count once";
    let new = store.prepare("crash", options(&model, Some(prompt)))?;
    let mut handle = store.start(new, h.worker.clone()).await?;
    let sandbox = handle.config.sandbox_id.clone();
    // Crash while the command runs (submitted, not done): the task is
    // gone, as a killed process.
    loop {
        match tokio::time::timeout(Duration::from_secs(30), handle.events.recv()).await? {
            Some(Event::ToolCall { .. }) => break,
            Some(_) => {}
            None => bail!("the session ended before its call"),
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while h.worker.info().running_operations == 0 {
        if tokio::time::Instant::now() > deadline {
            bail!("the call never ran");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.task.abort();
    let _ = (&mut handle.task).await;
    drop(handle);

    // The same prompt again resumes the run rather than asking anew.
    let stored = store.open("crash")?;
    assert_eq!(stored.config().map(|c| &c.sandbox_id), Some(&sandbox));
    let handle = store
        .resume(stored, h.worker.clone(), options(&model, Some(prompt)))
        .await?;
    assert!(handle.resumed);
    let (_, summary) = finish(handle).await?;
    assert_eq!(summary.ending, Ending::Done);
    assert_eq!(summary.final_text, "Counted.");
    let counter = h.run(&sandbox, "cat /workspace/counter").await?;
    assert_eq!(counter.outcome, Outcome::Exited { code: 0 });
    assert_eq!(
        counter.stdout.to_lossy_string(),
        "ran\n",
        "it ran exactly once"
    );
    assert_eq!(model.received().len(), 2, "nothing was asked twice");
    let inputs = store
        .records("crash")?
        .filter(|r| matches!(r, Ok((_, Record::Input { text, .. })) if text == prompt))
        .count();
    assert_eq!(inputs, 1, "the prompt is recorded once");
    h.worker.destroy_sandbox(&sandbox).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_fork_runs_in_its_own_sandbox_and_removal_takes_the_sandbox_along() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![
        responses::text("first answer"),
        responses::text("the fork's answer"),
    ])
    .await;
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    let new = store.prepare("parent", options(&model, Some("one")))?;
    let parent = store.start(new, h.worker.clone()).await?;
    let parent_sandbox = parent.config.sandbox_id.clone();
    let (_, summary) = finish(parent).await?;
    assert_eq!(summary.ending, Ending::Done);

    store.fork("parent", "child", None)?;
    assert!(matches!(
        store.fork("parent", "child2", Some(9)),
        Err(SessionError::NoSuchTurn {
            turn: 9,
            last: 1,
            ..
        })
    ));
    let child = store.open("child")?;
    let child_sandbox = child
        .config()
        .map(|c| c.sandbox_id.clone())
        .ok_or_else(|| anyhow::anyhow!("the fork has no start"))?;
    assert_ne!(child_sandbox, parent_sandbox);
    let handle = store
        .resume(child, h.worker.clone(), options(&model, Some("two")))
        .await?;
    let (_, summary) = finish(handle).await?;
    assert_eq!(summary.final_text, "the fork's answer");
    // The fork's request carries the parent's history.
    let got = model.received();
    assert!(got[1].text().contains("first answer") && got[1].text().contains("two"));
    h.worker.get_sandbox(&child_sandbox).await?;

    // A running session cannot be removed under itself.
    let idle = store
        .resume(
            store.open("parent")?,
            h.worker.clone(),
            RunOptions {
                until_idle: false,
                ..options(&model, None)
            },
        )
        .await?;
    assert!(matches!(
        store.open("parent"),
        Err(SessionError::Log(LogError::Locked(_)))
    ));
    idle.inputs.send(Inbox::Stop(StopMode::WhenIdle)).await?;
    let (_, summary) = finish(idle).await?;
    assert_eq!(summary.ending, Ending::Done);

    for (id, sandbox) in [("parent", &parent_sandbox), ("child", &child_sandbox)] {
        let stored = store.open(id)?;
        store.remove(stored, Some(h.worker.clone())).await?;
        assert!(matches!(
            WorkerApi::get_sandbox(&h.worker, sandbox).await,
            Err(ApiError::NotFound(_))
        ));
        assert!(matches!(
            store.open(id),
            Err(SessionError::Log(LogError::NotFound(_)))
        ));
    }
    assert!(store.list()?.is_empty());
    h.stop().await;
    Ok(())
}

/// A log made but never started (a crash between the two) can be removed,
/// and resuming it says so.
#[tokio::test]
async fn a_session_never_started_is_removable() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![]).await;
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    drop(corral_harness::session::SessionLog::<Record>::create(
        dir.path(),
        "bare",
    )?);
    let stored = store.open("bare")?;
    assert!(stored.config().is_none());
    let resumed = store
        .resume(stored, h.worker.clone(), options(&model, Some("hi")))
        .await;
    let Err(e) = resumed else {
        bail!("a session never started was resumed")
    };
    assert!(e.to_string().contains("corral session rm bare"), "{e}");
    store
        .remove(store.open("bare")?, Some(h.worker.clone()))
        .await?;
    assert!(!store.exists("bare")?);
    h.stop().await;
    Ok(())
}

/// Skills of many files are all copied in before the first turn (the
/// copies are read while they are added: nothing waits on a full channel).
#[tokio::test]
async fn a_session_with_many_skill_files_gets_them_all() -> Result<()> {
    let h = Harness::start().await?;
    let model = ModelServer::start(vec![responses::text("ready")]).await;
    let skills = tempfile::tempdir()?;
    let data = skills.path().join("many/data");
    std::fs::create_dir_all(&data)?;
    std::fs::write(
        skills.path().join("many/SKILL.md"),
        "---\nname: many\ndescription: many files\n---\nUse the data.\n",
    )?;
    const FILES: usize = 1_500;
    for i in 0..FILES {
        std::fs::write(data.join(format!("f{i:04}")), format!("{i}\n"))?;
    }
    let dir = tempfile::tempdir()?;
    let store = Sessions::new(dir.path());
    let new = store.prepare(
        "skilled",
        RunOptions {
            skills: Some(skills.path().to_path_buf()),
            ..options(&model, Some("go"))
        },
    )?;
    let handle = store.start(new, h.worker.clone()).await?;
    let sandbox = handle.config.sandbox_id.clone();
    let (_, summary) = finish(handle).await?;
    assert_eq!(summary.ending, Ending::Done);
    let count = h
        .run(
            &sandbox,
            "find /workspace/.corral/skills/many -type f | wc -l; cat /workspace/.corral/skills/many/data/f1499",
        )
        .await?;
    assert_eq!(
        count
            .stdout
            .to_lossy_string()
            .split_whitespace()
            .collect::<Vec<_>>(),
        [(FILES + 1).to_string().as_str(), "1499"]
    );
    h.worker.destroy_sandbox(&sandbox).await?;
    h.stop().await;
    Ok(())
}
