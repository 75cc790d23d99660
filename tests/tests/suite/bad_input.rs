//! Bad input gets a clear error and changes nothing.

use corral_e2e::{Harness, WorkerProcess, free_port, unique_id};
use corral_harness::client::{ClientError, WorkerClient};
use corral_proto::{
    FileErrorKind, OperationId, OperationSpec, Outcome, ReadFileSpec, SandboxId, SandboxSpec,
    ShellSpec, WriteFileSpec,
};

fn code(e: ClientError) -> (tonic::Code, String) {
    match e {
        ClientError::Status(s) => (s.code(), s.message().to_string()),
        other => panic!("expected a status, got {other}"),
    }
}

#[tokio::test]
async fn invalid_commands_ids_and_unknown_sandboxes() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let submit = |cmd: &str| {
        let spec = OperationSpec::Shell(ShellSpec::new(cmd));
        let c = h.client.clone();
        let sb = sb.clone();
        async move { c.submit(&sb, &OperationId::random(), spec).await }
    };
    let (c, m) = code(submit("echo a\0b").await.unwrap_err());
    assert_eq!(
        (c, m.as_str()),
        (
            tonic::Code::InvalidArgument,
            "invalid `command`: contains a NUL byte at offset 6"
        )
    );
    let empty = submit("").await.unwrap_err();
    assert_eq!(empty.reason(), Some(corral_proto::Reason::InvalidArgument));
    let (c, m) = code(empty);
    assert_eq!(
        (c, m.as_str()),
        (
            tonic::Code::InvalidArgument,
            "invalid `command`: empty command"
        )
    );

    let nosuch = SandboxId::new("no-such-sandbox")?;
    let unknown = h.client.get_sandbox(&nosuch).await.unwrap_err();
    assert_eq!(
        unknown.reason(),
        Some(corral_proto::Reason::SandboxNotFound)
    );
    let (c, m) = code(unknown);
    assert_eq!(
        (c, m.as_str()),
        (tonic::Code::NotFound, "unknown sandbox no-such-sandbox")
    );
    let spec = OperationSpec::Shell(ShellSpec::new("true"));
    let (c, _) = code(
        h.client
            .submit(&nosuch, &OperationId::random(), spec)
            .await
            .unwrap_err(),
    );
    assert_eq!(c, tonic::Code::NotFound);
    let (c, _) = code(h.client.watch(&nosuch, 0, None).await.err().unwrap());
    assert_eq!(c, tonic::Code::NotFound);
    assert!(
        !h.client.destroy_sandbox(&nosuch).await?,
        "destroying an unknown sandbox is a no-op"
    );

    // Ids that are not ids.
    let bad = corral_proto::pb::GetSandboxRequest {
        id: "a/../etc".into(),
    };
    let mut pbc = corral_proto::pb::worker_client::WorkerClient::connect(h.url.clone()).await?;
    let e = pbc.get_sandbox(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("'/'"), "{}", e.message());

    // Too big to write.
    let big = OperationSpec::WriteFile(WriteFileSpec {
        path: "big".into(),
        data: bytes::Bytes::from(vec![0u8; (8 << 20) + 1]),
        mode: 0o644,
        append: false,
        stream: false,
    });
    let (c, _) = code(
        h.client
            .submit(&sb, &OperationId::random(), big)
            .await
            .unwrap_err(),
    );
    assert_eq!(c, tonic::Code::InvalidArgument);
    // Larger than any request may be (a write's data and a command's
    // room): refused before it is decoded, not held as 40 MiB.
    let huge = OperationSpec::WriteFile(WriteFileSpec {
        path: "huge".into(),
        data: bytes::Bytes::from(vec![0u8; corral_proto::limits::MAX_REQUEST_BYTES + 1]),
        mode: 0o644,
        append: false,
        stream: false,
    });
    let (c, m) = code(
        h.client
            .submit(&sb, &OperationId::random(), huge)
            .await
            .unwrap_err(),
    );
    assert_eq!(c, tonic::Code::OutOfRange, "{m}");
    assert!(m.contains("over this call's limit"), "{m}");
    // A call that carries no file data has a small limit of its own: a
    // create of 3 MiB (a write could be that large) is refused unread.
    let mut raw = corral_proto::pb::worker_client::WorkerClient::connect(h.url.clone()).await?;
    let spec = corral_proto::pb::SandboxSpec {
        env: [("BIG".to_string(), "x".repeat(3 << 20))].into(),
        ..Default::default()
    };
    let refused = raw
        .create_sandbox(corral_proto::pb::CreateSandboxRequest {
            id: String::new(),
            spec: Some(spec),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");
    assert!(
        refused.message().contains(&format!(
            "limit of {} bytes",
            corral_worker::budget::MAX_OTHER_REQUEST_BYTES
        )),
        "{refused:?}"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn duplicate_ids_are_idempotent_or_refused() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let id = SandboxId::new(unique_id("dup"))?;
    let a = h
        .client
        .create_sandbox(Some(&id), SandboxSpec::default())
        .await?;
    let b = h
        .client
        .create_sandbox(Some(&id), SandboxSpec::default())
        .await?;
    assert_eq!(
        a.container_id, b.container_id,
        "same id and spec: the same sandbox"
    );
    let other = SandboxSpec {
        pids_limit: Some(77),
        ..Default::default()
    };
    let (c, _) = code(h.client.create_sandbox(Some(&id), other).await.unwrap_err());
    assert_eq!(c, tonic::Code::AlreadyExists);

    // The same operation id twice runs once.
    let op = OperationId::random();
    let spec = OperationSpec::Shell(ShellSpec::new("echo x >> /workspace/count"));
    h.client.submit(&id, &op, spec.clone()).await?;
    h.client.submit(&id, &op, spec).await?;
    corral_e2e::collect(&h.client, &id, &op, 0).await?;
    let r = h.run(&id, "wc -l < /workspace/count").await?;
    assert_eq!(r.stdout.to_lossy_string().trim(), "1");
    let (c, _) = code(
        h.client
            .submit(
                &id,
                &op,
                OperationSpec::Shell(ShellSpec::new("echo different")),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!(c, tonic::Code::AlreadyExists);
    h.stop().await;
    Ok(())
}

/// Asserts that a ReadFile of `path` is refused as outside the roots.
async fn read_is_outside(
    h: &Harness,
    sb: &corral_proto::SandboxId,
    path: &str,
) -> anyhow::Result<()> {
    let read = OperationSpec::ReadFile(ReadFileSpec {
        path: path.into(),
        offset: 0,
        limit: 100,
        stream: false,
    });
    let r = h.run_spec(sb, read).await?.1;
    assert!(
        matches!(
            r.outcome,
            Outcome::FileError {
                kind: FileErrorKind::OutsideSandboxRoots,
                ..
            }
        ),
        "{path}: {:?}",
        r.outcome
    );
    Ok(())
}

#[tokio::test]
async fn file_paths_cannot_escape_the_sandbox_roots() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    h.run(&sb, "ln -s /etc /workspace/etc-link").await?;
    for path in [
        "../etc/passwd",
        "/etc/passwd",
        "/workspace/../etc/passwd",
        "etc-link/passwd",
        "/.corral/corral-init",
    ] {
        read_is_outside(&h, &sb, path).await?;
        let write = OperationSpec::WriteFile(WriteFileSpec {
            path: path.into(),
            data: bytes::Bytes::from_static(b"x"),
            mode: 0o644,
            append: false,
            stream: false,
        });
        let r = h.run_spec(&sb, write).await?.1;
        assert!(
            matches!(
                r.outcome,
                Outcome::FileError {
                    kind: FileErrorKind::OutsideSandboxRoots,
                    ..
                }
            ),
            "{path}: {:?}",
            r.outcome
        );
    }
    // Magic links of /proc: the supervisor's own line to the worker, and a
    // command's. The kernel refuses to follow them out of the workspace.
    h.run(
        &sb,
        "ln -s /proc/1/fd/1 /workspace/init-out; ln -s /proc/self/fd/0 /workspace/self-in",
    )
    .await?;
    for path in ["init-out", "self-in"] {
        read_is_outside(&h, &sb, path).await?;
    }
    let read = OperationSpec::ReadFile(ReadFileSpec {
        path: "missing".into(),
        offset: 0,
        limit: 100,
        stream: false,
    });
    let r = h.run_spec(&sb, read).await?.1;
    assert!(
        matches!(
            r.outcome,
            Outcome::FileError {
                kind: FileErrorKind::NotFound,
                ..
            }
        ),
        "{:?}",
        r.outcome
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn calls_without_the_right_token_are_unauthenticated() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let token_file = state.path().join("token");
    std::fs::write(&token_file, "right-token-0123456789\n")?;
    std::fs::set_permissions(
        &token_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    let token_arg = token_file.to_string_lossy().to_string();
    let worker = WorkerProcess::spawn(
        &state.path().join("state"),
        &unique_id("a"),
        free_port()?,
        &[],
        &["--token-file", &token_arg],
    )?;
    let none = WorkerClient::connect(&worker.url, None).await?;
    let (c, m) = code(none.list_sandboxes().await.unwrap_err());
    assert_eq!(c, tonic::Code::Unauthenticated);
    assert!(
        m.starts_with("missing bearer token") && m.contains("--token-file"),
        "{m}"
    );
    let wrong = WorkerClient::connect(&worker.url, Some("wrong-token")).await?;
    let (c, m) = code(wrong.list_sandboxes().await.unwrap_err());
    assert_eq!(c, tonic::Code::Unauthenticated);
    assert!(
        m.starts_with("wrong bearer token") && m.contains("state directory"),
        "{m}"
    );
    let right = WorkerClient::connect(&worker.url, Some("right-token-0123456789")).await?;
    assert!(right.list_sandboxes().await?.is_empty());
    assert_eq!(right.worker_info().await?.worker_id, worker.worker_id);
    Ok(())
}

/// A worker on loopback is no open door for other local users: with no
/// --token-file it makes a token (readable by its owner only) and requires
/// it; health answers anyone, reflection only with the token.
#[tokio::test]
async fn a_local_client_without_the_token_is_refused() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("l"), free_port()?, &[], &[])?;
    let mode = std::fs::metadata(worker.token_file())?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the token file is its owner's alone");
    let stranger = WorkerClient::connect(&worker.url, None).await?;
    let (c, _) = code(
        stranger
            .create_sandbox(None, corral_proto::SandboxSpec::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(c, tonic::Code::Unauthenticated);
    let channel = tonic::transport::Endpoint::from_shared(worker.url.clone())?
        .connect()
        .await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await?;
    assert_eq!(
        status.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let refused = reflection
        .server_reflection_info(futures_util::stream::iter([request]))
        .await;
    assert_eq!(
        refused.map(|_| ()).unwrap_err().code(),
        tonic::Code::Unauthenticated,
        "reflection needs the token"
    );
    // The owner's client finds the token and gets in.
    let owner = worker.client().await?;
    assert!(owner.list_sandboxes().await?.is_empty());
    Ok(())
}

/// The worker raises its open-file limit to the hard limit at start, so
/// idle connections do not exhaust a low soft limit (1,024 is common).
#[test]
fn the_worker_raises_its_open_file_limit() -> anyhow::Result<()> {
    use std::io::BufRead;
    let state = tempfile::tempdir()?;
    let wid = unique_id("f");
    let port = free_port()?;
    // Started with a soft limit of 512 (the hard limit stays as it is).
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -Sn 512 && exec \"$0\" \"$@\"")
        .arg(corral_e2e::binary("corral-worker")?)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--worker-id",
            &wid,
        ])
        .arg("--state-dir")
        .arg(state.path())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id()));
    let _ = child.kill();
    let _ = child.wait();
    corral_e2e::remove_containers_of(&wid);
    assert!(line.contains("listening on"), "{line}");
    let limits = limits?;
    let fields: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .ok_or_else(|| anyhow::anyhow!("no open-file line in {limits}"))?
        .split_whitespace()
        .collect();
    // "Max open files  SOFT  HARD  files"
    assert_ne!(fields[3], "512", "the soft limit was not raised");
    assert_eq!(fields[3], fields[4]);
    Ok(())
}

/// An environment variable too long for the kernel to start a program with
/// is refused at once, for a sandbox and for a command, instead of a
/// sandbox that never starts.
#[tokio::test]
async fn an_environment_too_large_to_exec_is_refused_at_once() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let big: std::collections::BTreeMap<String, String> =
        [("BIG".to_string(), "x".repeat(200 * 1024))].into();
    let started = std::time::Instant::now();
    let err = h
        .client
        .create_sandbox(
            None,
            corral_proto::SandboxSpec {
                env: big.clone(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    let (c, m) = code(err);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    assert!(m.contains("BIG"), "{m}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    let sb = h.sandbox().await?;
    let mut shell = corral_proto::ShellSpec::new("true");
    shell.env = big;
    let err = h
        .client
        .submit(
            &sb,
            &corral_proto::OperationId::random(),
            corral_proto::OperationSpec::Shell(shell),
        )
        .await
        .unwrap_err();
    assert_eq!(code(err).0, tonic::Code::InvalidArgument);
    h.stop().await;
    Ok(())
}
