//! The worker as a service: standard health checking and reflection,
//! capacity, lost sandboxes, zombie reaping, background processes.

use std::time::Duration;

use corral_e2e::{Harness, collect};
use corral_harness::client::ClientError;
use corral_proto::{
    EventKind, OperationId, OperationSpec, Outcome, SandboxSpec, SandboxState, ShellSpec,
};
use futures_util::StreamExt;

#[tokio::test]
async fn health_and_reflection_are_served() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let channel = tonic::transport::Endpoint::from_shared(h.url.clone())?
        .connect()
        .await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let resp = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "corral.v1.Worker".into(),
        })
        .await?
        .into_inner();
    assert_eq!(
        resp.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let mut refl = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = refl
        .server_reflection_info(tokio_stream::iter([req]))
        .await?
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) = stream
        .next()
        .await
        .transpose()?
        .and_then(|r| r.message_response)
    else {
        anyhow::bail!("no service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"corral.v1.Worker".to_string()), "{names:?}");
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn capacity_is_enforced_with_a_clear_error() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| c.max_sandboxes = 1).await?;
    h.sandbox().await?;
    let Err(ClientError::Status(s)) = h
        .sandbox()
        .await
        .map_err(|e| e.downcast::<ClientError>().expect("client error"))
    else {
        anyhow::bail!("a second sandbox was created");
    };
    assert_eq!(s.code(), tonic::Code::ResourceExhausted);
    assert_eq!(s.message(), "this worker is at its capacity of 1 sandboxes");
    assert_eq!(
        corral_proto::reason::of(&s),
        Some(corral_proto::Reason::AtCapacity)
    );
    assert!(ClientError::Status(s).is_refusal());
    let info = h.client.worker_info().await?;
    assert_eq!((info.sandboxes, info.max_sandboxes), (1, 1));
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_killed_container_is_a_lost_sandbox_and_its_operations_say_so() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let op = OperationId::random();
    h.client
        .submit(
            &sb,
            &op,
            OperationSpec::Shell(ShellSpec::new("echo up; sleep 300")),
        )
        .await?;
    let mut events = h.client.watch(&sb, 0, Some(&op)).await?;
    while let Some(e) = events.next().await {
        if matches!(e?.kind, EventKind::Output { .. }) {
            break;
        }
    }
    let container = h.client.get_sandbox(&sb).await?.container_id;
    let docker = bollard::Docker::connect_with_defaults()?;
    docker
        .kill_container(
            &container,
            None::<bollard::query_parameters::KillContainerOptions>,
        )
        .await?;

    let (_, r) = collect(&h.client, &sb, &op, 0).await?;
    assert!(
        matches!(&r.outcome, Outcome::SandboxLost { reason } if reason.contains("exit code")),
        "{:?}",
        r.outcome
    );
    let info = h.client.get_sandbox(&sb).await?;
    assert!(
        matches!(info.state, SandboxState::Lost(_)),
        "{:?}",
        info.state
    );
    let Err(ClientError::Status(s)) = h
        .client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("true")),
        )
        .await
    else {
        anyhow::bail!("submitted to a lost sandbox");
    };
    assert_eq!(s.code(), tonic::Code::FailedPrecondition);
    assert!(h.client.destroy_sandbox(&sb).await?);
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn orphans_are_reaped_and_background_processes_outlive_their_command() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    // Orphans: children whose parent exits first are reparented to PID 1.
    let r = h
        .run(
            &sb,
            "for i in 1 2 3 4 5; do (sleep 0.1 &); done; sleep 0.5; echo done",
        )
        .await?;
    assert!(r.outcome.is_success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = h
        .run(
            &sb,
            "for f in /proc/[0-9]*/stat; do cut -d' ' -f3 $f; done | grep -c Z || true",
        )
        .await?;
    assert_eq!(r.stdout.to_lossy_string().trim(), "0", "zombies left");

    // A background process that keeps writing to the command's output does
    // not hold the command open, and, kept, is not killed by its end.
    let mut keep = ShellSpec::new(
        "(while true; do echo tick; sleep 0.05; done) & echo $! > /tmp/bg; echo started",
    );
    keep.keep_background = true;
    let (_, r) = h.run_spec(&sb, OperationSpec::Shell(keep)).await?;
    assert_eq!(r.outcome, Outcome::Exited { code: 0 });
    assert!(r.stdout.to_lossy_string().contains("started\n"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = h.run(&sb, "kill -0 $(cat /tmp/bg) && echo alive").await?;
    assert_eq!(r.stdout.to_lossy_string(), "alive\n");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_sandbox_spec_env_reaches_its_commands() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut spec = SandboxSpec::default();
    spec.env.insert("PROJECT".into(), "corral".into());
    let sb = h.sandbox_with(spec).await?;
    let r = h.run(&sb, "echo $PROJECT").await?;
    assert_eq!(r.stdout.to_lossy_string(), "corral\n");
    h.stop().await;
    Ok(())
}

/// A container removed behind the worker's back (`docker rm -f`) frees its
/// sandbox's slot at once, and the next sweep removes its record.
#[tokio::test]
async fn a_container_removed_behind_the_workers_back_frees_its_slot() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| {
        c.max_sandboxes = 1;
        c.sweep_interval = std::time::Duration::from_secs(2);
    })
    .await?;
    let sb = h.sandbox().await?;
    let container = h.client.get_sandbox(&sb).await?.container_id;
    let docker = bollard::Docker::connect_with_defaults()?;
    docker
        .remove_container(
            &container,
            Some(
                bollard::query_parameters::RemoveContainerOptionsBuilder::default()
                    .force(true)
                    .build(),
            ),
        )
        .await?;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let second = loop {
        match h.sandbox().await {
            Ok(id) => break id,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the slot was never freed: {e:#}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    let r = h.run(&second, "echo serving").await?;
    assert_eq!(r.stdout.to_lossy_string(), "serving\n");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match h.client.get_sandbox(&sb).await {
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => break,
            _ => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the lost sandbox was never removed"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }
    h.stop().await;
    Ok(())
}
