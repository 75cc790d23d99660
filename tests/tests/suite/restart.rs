//! A worker that dies loses nothing: a command's output and exit code
//! arrive complete through `corral exec`, running sandboxes are re-adopted,
//! and containers without a worker record are removed.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

use corral_e2e::{WorkerProcess, binary, free_port, unique_id};
use corral_proto::{SandboxId, SandboxSpec};

#[tokio::test]
async fn sigkill_the_worker_mid_command_and_the_output_arrives_complete() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("r"), free_port()?);
    let mut worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;

    let mut exec = Command::new(binary("corral")?)
        .args([
            "--worker",
            &worker.url,
            "--token-file",
            worker.token_file().to_str().unwrap(),
            "exec",
            "--sandbox",
            sb.as_str(),
            "--",
        ])
        .args([
            "sh",
            "-c",
            "for i in $(seq 1 300); do echo line $i; echo err $i >&2; sleep 0.01; done; exit 3",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = exec.stdout.take().expect("stdout");
    let stderr = exec.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap_or_default();
            let _ = tx.send(line.clone());
            lines.push(line);
        }
        lines
    });
    let err_reader = std::thread::spawn(move || {
        std::io::BufReader::new(stderr)
            .lines()
            .map(|l| l.unwrap_or_default())
            .collect::<Vec<_>>()
    });
    // Let it get going, then kill the worker without warning.
    for _ in 0..20 {
        rx.recv_timeout(Duration::from_secs(30))?;
    }
    worker.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let worker2 = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;

    let status = tokio::task::spawn_blocking(move || exec.wait()).await??;
    let lines = reader.join().expect("reader");
    let err_lines = err_reader.join().expect("err reader");
    let expected: Vec<String> = (1..=300).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, expected, "stdout lost or repeated lines");
    let expected_err: Vec<String> = (1..=300).map(|i| format!("err {i}")).collect();
    assert_eq!(err_lines, expected_err, "stderr lost or repeated lines");
    assert_eq!(status.code(), Some(3));

    // The sandbox was re-adopted and still works.
    let client = worker2.client().await?;
    let info = client.get_sandbox(&sb).await?;
    assert_eq!(info.state, corral_proto::SandboxState::Ready);
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

#[tokio::test]
async fn a_sandbox_whose_record_is_gone_is_removed_on_start() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("o"), free_port()?);
    let mut worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker.client().await?;
    let keep = SandboxId::new(unique_id("keep"))?;
    let orphan = SandboxId::new(unique_id("orphan"))?;
    client
        .create_sandbox(Some(&keep), SandboxSpec::default())
        .await?;
    let orphan_container = client
        .create_sandbox(Some(&orphan), SandboxSpec::default())
        .await?
        .container_id;
    worker.kill9();
    std::fs::remove_file(
        state
            .path()
            .join("sandboxes")
            .join(format!("{orphan}.json")),
    )?;

    let worker2 = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker2.client().await?;
    let ids: Vec<String> = client
        .list_sandboxes()
        .await?
        .into_iter()
        .map(|s| s.id.to_string())
        .collect();
    assert_eq!(ids, vec![keep.to_string()]);
    let docker = bollard::Docker::connect_with_defaults()?;
    let gone = docker.inspect_container(&orphan_container, None).await;
    assert!(
        matches!(
            gone,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404,
                ..
            })
        ),
        "the orphan container is still there: {gone:?}"
    );
    // The kept one works.
    let op = corral_proto::OperationId::random();
    client
        .submit(
            &keep,
            &op,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new("echo alive")),
        )
        .await?;
    let (_, r) = corral_e2e::collect(&client, &keep, &op, 0).await?;
    assert_eq!(r.stdout.to_lossy_string(), "alive\n");
    client.destroy_sandbox(&keep).await?;
    Ok(())
}

#[tokio::test]
async fn sigterm_stops_the_worker_cleanly_and_sandboxes_survive_it() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("g"), free_port()?);
    let mut worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    // An open watch stream must not keep the worker from stopping.
    let _watch = client.watch(&sb, 0, None).await?;
    let code = tokio::task::spawn_blocking(move || {
        let code = worker.terminate(Duration::from_secs(15));
        (worker, code)
    })
    .await?;
    let (worker, code) = code;
    assert_eq!(code?, Some(0));
    let _stopped = worker; // its Drop removes containers: keep it to the end
    let worker2 = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = worker2.client().await?;
    assert_eq!(
        client.get_sandbox(&sb).await?.state,
        corral_proto::SandboxState::Ready
    );
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

#[tokio::test]
async fn a_container_made_behind_the_workers_back_is_swept_away() -> anyhow::Result<()> {
    let h =
        corral_e2e::Harness::start_with(|c| c.sweep_interval = Duration::from_millis(300)).await?;
    let kept = h.sandbox().await?;
    let docker = bollard::Docker::connect_with_defaults()?;
    let body = bollard::models::ContainerCreateBody {
        image: Some("corral-sandbox:latest".into()),
        cmd: Some(vec!["/bin/sleep".into(), "300".into()]),
        labels: Some(
            [
                ("corral.managed".to_string(), "1".to_string()),
                ("corral.worker".to_string(), h.worker_id.clone()),
                ("corral.sandbox".to_string(), "stray".to_string()),
            ]
            .into(),
        ),
        host_config: Some(bollard::models::HostConfig {
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let stray = docker
        .create_container(
            None::<bollard::query_parameters::CreateContainerOptions>,
            body,
        )
        .await?
        .id;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match docker.inspect_container(&stray, None).await {
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => break,
            _ if std::time::Instant::now() > deadline => {
                anyhow::bail!("the stray container is still there")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    // The worker's own sandbox is untouched.
    let r = h.run(&kept, "echo still here").await?;
    assert_eq!(r.stdout.to_lossy_string(), "still here\n");
    h.stop().await;
    Ok(())
}

/// A restarted worker re-attaches to a sandbox whose supervisor remembers
/// more than one frame holds (five 7 MiB reads): the Welcome comes in
/// pages, the worker puts them together, and every result is still there.
#[tokio::test]
async fn a_restarted_worker_reattaches_after_large_operations() -> anyhow::Result<()> {
    use corral_proto::{OperationId, OperationSpec, ReadFileSpec, ShellSpec};
    let state = tempfile::tempdir()?;
    let (wid, port) = (unique_id("rw"), free_port()?);
    let mut first = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = first.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let run = |spec: OperationSpec| {
        let client = client.clone();
        let sb = sb.clone();
        async move {
            let op = OperationId::random();
            let after = client.get_sandbox(&sb).await?.last_seq;
            client.submit(&sb, &op, spec).await?;
            let (_, result) = corral_e2e::collect(&client, &sb, &op, after).await?;
            anyhow::Ok((op, result))
        }
    };
    let (_, made) = run(OperationSpec::Shell(ShellSpec::new(
        "head -c 7340032 /dev/zero > /workspace/big",
    )))
    .await?;
    assert!(made.outcome.is_success(), "{made:?}");
    let mut reads = Vec::new();
    for _ in 0..5 {
        let (op, r) = run(OperationSpec::ReadFile(ReadFileSpec::new("/workspace/big"))).await?;
        assert_eq!(r.file_data.len(), 7 << 20);
        reads.push(op);
    }
    first.kill9();
    // Kept until the end: dropping a process removes its worker's
    // containers.
    let second = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let client = second.client().await?;
    for op in &reads {
        let record = client.operation(&sb, op).await?;
        let result = record
            .result
            .ok_or_else(|| anyhow::anyhow!("read {op} has no result after the restart"))?;
        assert_eq!(result.file_data.len(), 7 << 20);
    }
    let (_, after) = {
        let op = OperationId::random();
        let from = client.get_sandbox(&sb).await?.last_seq;
        client
            .submit(&sb, &op, OperationSpec::Shell(ShellSpec::new("echo alive")))
            .await?;
        corral_e2e::collect(&client, &sb, &op, from).await?
    };
    assert_eq!(after.stdout.to_lossy_string(), "alive\n");
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// Workers of two builds on one engine: a start does not take away the
/// other build's supervisor volume (it may use it for its next sandbox);
/// only one unused for a week goes.
#[tokio::test]
async fn a_start_leaves_another_builds_recent_supervisor_volume() -> anyhow::Result<()> {
    use std::collections::HashMap;
    let docker = bollard::Docker::connect_with_defaults()?;
    let name = format!("corral-init-{}", unique_id("other"));
    docker
        .create_volume(bollard::models::VolumeCreateRequest {
            name: Some(name.clone()),
            labels: Some(HashMap::from([(
                corral_worker::docker::LABEL_MANAGED.to_string(),
                "1".to_string(),
            )])),
            ..Default::default()
        })
        .await?;
    let h = corral_e2e::Harness::start().await?;
    let kept = docker.inspect_volume(&name).await;
    h.stop().await;
    let _ = docker
        .remove_volume(
            &name,
            None::<bollard::query_parameters::RemoveVolumeOptions>,
        )
        .await;
    kept.map_err(|e| anyhow::anyhow!("the other build's volume was removed: {e}"))?;
    Ok(())
}
