//! Sandboxes are hardened by default (read back through the Docker API and
//! checked from inside), and loosening is explicit.

use std::collections::HashMap;

use corral_e2e::{Harness, WorkerProcess, free_port, unique_id};
use corral_proto::{NetworkMode, SandboxId, SandboxSpec};

async fn inspect(id: &str) -> anyhow::Result<bollard::models::ContainerInspectResponse> {
    let docker = bollard::Docker::connect_with_defaults()?;
    Ok(docker.inspect_container(id, None).await?)
}

#[tokio::test]
async fn the_container_is_hardened_by_default() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let info = h.client.get_sandbox(&sb).await?;
    let c = inspect(&info.container_id).await?;
    let hc = c.host_config.clone().unwrap_or_default();
    let cfg = c.config.clone().unwrap_or_default();
    assert_eq!(hc.network_mode.as_deref(), Some("none"));
    assert_eq!(hc.cap_drop, Some(vec!["ALL".to_string()]));
    // Only what the supervisor needs to run commands as the sandbox user
    // and stop them; every command starts without them.
    assert_eq!(
        hc.cap_add,
        Some(
            corral_worker::docker::SUPERVISOR_CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .collect()
        )
    );
    assert!(
        hc.security_opt
            .unwrap_or_default()
            .iter()
            .any(|o| o.starts_with("no-new-privileges"))
    );
    assert_eq!(hc.readonly_rootfs, Some(true));
    // Commands run as a uid of the sandbox's own, out of every host
    // account's way, named on the container.
    let labels = cfg.labels.clone().unwrap_or_default();
    let uid: u32 = labels.get("corral.uid").expect("a uid label").parse()?;
    let range = corral_worker::uids::DEFAULT;
    assert!((range.first..=range.last).contains(&uid), "{uid}");
    let tmpfs: HashMap<String, String> = hc.tmpfs.unwrap_or_default();
    assert!(
        tmpfs
            .get("/run/corral")
            .is_some_and(|o| o.contains("size=65536") && o.contains("noexec")),
        "{tmpfs:?}"
    );
    assert!(
        tmpfs.get("/tmp").is_some_and(|o| o.contains("size=")),
        "{tmpfs:?}"
    );
    assert!(
        tmpfs
            .get("/workspace")
            .is_some_and(|o| o.contains("size=") && o.contains(&format!("uid={uid},gid={uid}"))),
        "{tmpfs:?}"
    );
    assert_eq!(hc.pids_limit, Some(256));
    // 1 GiB of working memory on top of the tmpfs mounts (1 GiB and 256 MiB).
    let limit = (1 << 30) + (1 << 30) + (256 << 20);
    assert_eq!(hc.memory, Some(limit));
    assert_eq!(hc.memory_swap, Some(limit));
    assert_eq!(hc.nano_cpus, Some(1_000_000_000));
    assert_eq!(hc.privileged, Some(false));
    assert_eq!(hc.log_config.and_then(|l| l.typ).as_deref(), Some("none"));
    assert!(
        hc.binds.unwrap_or_default().is_empty(),
        "no bind mounts (no Docker socket)"
    );
    assert_eq!(cfg.user.as_deref(), Some("0:0"), "the supervisor's user");
    assert_eq!(
        cfg.cmd,
        Some(vec!["--command-uid".to_string(), uid.to_string()])
    );
    let labels = cfg.labels.unwrap_or_default();
    assert_eq!(labels.get("corral.worker"), Some(&h.worker_id));
    assert_eq!(
        labels.get("corral.sandbox").map(String::as_str),
        Some(sb.as_str())
    );
    let mounts = c.mounts.unwrap_or_default();
    assert!(
        mounts
            .iter()
            .all(|m| m.rw != Some(true) || m.destination.as_deref() != Some("/.corral"))
    );

    // And from inside.
    let r = h
        .run(
            &sb,
            "id -u; whoami; touch /etc/x 2>/dev/null && echo rootfs-writable || echo rootfs-ro; \
             grep -E '^(CapEff|CapPrm|CapInh|CapAmb|NoNewPrivs)' /proc/self/status; \
             tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; \
             echo ok > /tmp/t && cat /tmp/t; ls /var/run/docker.sock 2>&1 | grep -c 'No such'",
        )
        .await?;
    assert_eq!(
        r.stdout.to_lossy_string(),
        format!(
            "{uid}\nsandbox\nrootfs-ro\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\nlo\nok\n1\n"
        )
    );
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn loosening_is_explicit_per_sandbox() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            network: NetworkMode::Bridge,
            run_as_root: true,
            writable_rootfs: true,
            pids_limit: Some(99),
            memory_bytes: Some(300 << 20),
            cpu_millis: Some(500),
            add_capabilities: vec!["CAP_CHOWN".into()],
            ..Default::default()
        })
        .await?;
    let c = inspect(&h.client.get_sandbox(&sb).await?.container_id).await?;
    let hc = c.host_config.unwrap_or_default();
    assert_eq!(hc.network_mode.as_deref(), Some("bridge"));
    assert_eq!(hc.readonly_rootfs, Some(false));
    assert_eq!(hc.pids_limit, Some(99));
    assert_eq!(hc.memory, Some((300 << 20) + (1 << 30) + (256 << 20)));
    assert_eq!(hc.nano_cpus, Some(500_000_000));
    assert_eq!(hc.cap_add, Some(vec!["CAP_CHOWN".to_string()]));
    assert_eq!(c.config.and_then(|c| c.user).as_deref(), Some("0:0"));
    let r = h.run(&sb, "id -u; touch /etc/x && echo writable").await?;
    assert_eq!(r.stdout.to_lossy_string(), "0\nwritable\n");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn nothing_from_the_workers_environment_reaches_a_sandbox() -> anyhow::Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("e"),
        free_port()?,
        &[
            ("CORRAL_TEST_SECRET", "s3cr3t-canary"),
            ("AWS_SECRET_ACCESS_KEY", "s3cr3t-canary"),
        ],
        &[],
    )?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(Some(&sb), SandboxSpec::default())
        .await?;
    let op = corral_proto::OperationId::random();
    client
        .submit(
            &sb,
            &op,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new(
                "env; cat /proc/1/environ",
            )),
        )
        .await?;
    let (_, r) = corral_e2e::collect(&client, &sb, &op, 0).await?;
    let all = format!(
        "{}{}",
        r.stdout.to_lossy_string(),
        r.stderr.to_lossy_string()
    );
    assert!(all.contains("PATH="), "{all}");
    assert!(
        !all.contains("s3cr3t-canary"),
        "worker secret leaked: {all}"
    );
    client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// The worker decides what a sandbox may be: a client asking for root, a
/// writable root, a network, a capability or another image is refused
/// with PERMISSION_DENIED naming the flag that allows it, and the policy is
/// shown in WorkerInfo.
#[tokio::test]
async fn the_workers_policy_refuses_what_its_operator_did_not_allow() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let asks = [
        (
            SandboxSpec {
                run_as_root: true,
                ..Default::default()
            },
            "--allow-root",
        ),
        (
            SandboxSpec {
                writable_rootfs: true,
                ..Default::default()
            },
            "--allow-writable-rootfs",
        ),
        (
            SandboxSpec {
                network: NetworkMode::Bridge,
                ..Default::default()
            },
            "--allow-network",
        ),
        (
            SandboxSpec {
                add_capabilities: vec!["CAP_CHOWN".into()],
                ..Default::default()
            },
            "--allow-cap CAP_CHOWN",
        ),
        (
            SandboxSpec {
                image: Some("busybox:latest".into()),
                ..Default::default()
            },
            "--allow-image busybox:latest",
        ),
        // Ceilings: more processes than the host has, and a workspace so
        // large it would lift the memory limit (which covers the tmpfs).
        (
            SandboxSpec {
                pids_limit: Some(4_000_000),
                ..Default::default()
            },
            "--max-pids",
        ),
        (
            SandboxSpec {
                workspace_bytes: Some(1 << 50),
                ..Default::default()
            },
            "--max-workspace",
        ),
        (
            SandboxSpec {
                tmp_bytes: Some(1 << 50),
                ..Default::default()
            },
            "--max-tmp",
        ),
        (
            SandboxSpec {
                memory_bytes: Some(1 << 50),
                ..Default::default()
            },
            "--max-memory",
        ),
    ];
    for (spec, flag) in asks {
        let err = h.client.create_sandbox(None, spec).await.unwrap_err();
        let corral_harness::client::ClientError::Status(s) = err else {
            panic!("not a status: {err}");
        };
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{}", s.message());
        assert!(s.message().contains(flag), "{}", s.message());
        // Said for programs too: the reason and the flag, in metadata.
        assert_eq!(
            corral_proto::reason::of(&s),
            Some(corral_proto::Reason::PolicyDenied)
        );
        let name = flag.split(' ').next();
        assert_eq!(corral_proto::reason::flag_of(&s).as_deref(), name);
    }
    assert!(
        h.client.list_sandboxes().await?.is_empty(),
        "nothing was made"
    );
    let info = h.client.worker_info().await?;
    assert_eq!(info.policy, corral_proto::SandboxPolicy::default());
    h.stop().await;
    Ok(())
}

/// The escape that took a host: CAP_SYS_ADMIN and the cgroup v1
/// `release_agent` file. CAP_SYS_ADMIN is refused at create time whatever
/// the policy; a sandbox loosened as far as a policy can go (root, a
/// writable root, Docker's default capabilities) cannot mount a cgroup
/// hierarchy to reach `release_agent`.
#[tokio::test]
async fn the_release_agent_escape_is_refused_at_create_and_fails_inside() -> anyhow::Result<()> {
    let h = Harness::start_with(|c| c.policy = corral_worker::policy::permissive()).await?;
    let err = h
        .client
        .create_sandbox(
            None,
            SandboxSpec {
                run_as_root: true,
                add_capabilities: vec!["CAP_SYS_ADMIN".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    let corral_harness::client::ClientError::Status(s) = err else {
        panic!("not a status: {err}");
    };
    assert_eq!(s.code(), tonic::Code::PermissionDenied);
    assert!(s.message().contains("never granted"), "{}", s.message());
    // No flag allows it.
    assert_eq!(corral_proto::reason::flag_of(&s), None);
    let caps = corral_worker::policy::DOCKER_DEFAULT_CAPABILITIES
        .iter()
        .map(|c| c.to_string())
        .collect();
    let sb = h
        .sandbox_with(SandboxSpec {
            run_as_root: true,
            writable_rootfs: true,
            add_capabilities: caps,
            ..Default::default()
        })
        .await?;
    let marker = format!("/tmp/corral-escape-{}", unique_id("x"));
    let payload = format!(
        "mkdir -p /tmp/cg && mount -t cgroup -o memory cgroup /tmp/cg && \
         mkdir -p /tmp/cg/x && echo 1 > /tmp/cg/x/notify_on_release && \
         echo 'touch {marker}' > /tmp/cg/release_agent && echo MOUNTED || echo REFUSED"
    );
    let r = h.run(&sb, &payload).await?;
    let out = r.stdout.to_lossy_string();
    assert!(out.contains("REFUSED") && !out.contains("MOUNTED"), "{out}");
    assert!(!std::path::Path::new(&marker).exists());
    h.stop().await;
    Ok(())
}

/// Under memory pressure the OOM killer takes a command before the
/// supervisor: every command (as the sandbox's user) starts with the
/// highest score (it may lower it as far as the supervisor's own, no
/// further: the sandbox has no CAP_SYS_RESOURCE); its keeper, root's, is
/// neither its to signal nor to read.
#[tokio::test]
async fn a_command_is_the_oom_killers_first_choice_and_its_keeper_out_of_reach()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let r = h
        .run(
            &sb,
            "cat /proc/self/oom_score_adj; id -u; \
             cat /proc/$PPID/comm; stat -c %u /proc/$PPID; kill -KILL $PPID 2>&1; \
             cat /proc/$PPID/environ 2>&1 | head -c 80; echo",
        )
        .await?;
    let out = r.stdout.to_lossy_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "1000", "{out}");
    assert_ne!(lines[1], "0", "commands run as the sandbox's user: {out}");
    assert_eq!(lines[2..4], ["corral-keeper", "0"], "{out}");
    assert!(lines[4].contains("not permitted"), "{out}");
    assert!(lines[5].contains("denied"), "{out}");
    Ok(())
}

/// A command cannot stop its own supervisor, nor write into its line to
/// the worker: `kill -TERM 1` (and INT, HUP, KILL) and writes to
/// `/proc/1/fd/*` from inside change nothing, and the sandbox goes on
/// serving.
#[tokio::test]
async fn signals_to_the_supervisor_from_inside_change_nothing() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let r = h
        .run(
            &sb,
            "kill -TERM 1; kill -INT 1; kill -HUP 1; kill -KILL 1; sleep 0.5; echo still",
        )
        .await?;
    assert_eq!(r.stdout.to_lossy_string(), "still\n", "{r:?}");
    // The supervisor is another user's process: not even allowed to try.
    assert!(
        r.stderr.to_lossy_string().contains("not permitted"),
        "{r:?}"
    );
    let r = h
        .run(&sb, "stat -c %u /proc/1; ls /proc/1/fd 2>&1 | head -1")
        .await?;
    let out = r.stdout.to_lossy_string();
    assert!(out.starts_with("0\n") && out.contains("denied"), "{out}");
    // Files the supervisor writes for the model belong to the sandbox user.
    let write = corral_proto::OperationSpec::WriteFile(corral_proto::WriteFileSpec {
        path: "sub/made.txt".into(),
        data: bytes::Bytes::from_static(b"x"),
        mode: 0o644,
        append: false,
        stream: false,
    });
    h.run_spec(&sb, write).await?;
    let r = h
        .run(
            &sb,
            "stat -c %u /workspace/sub /workspace/sub/made.txt; id -u",
        )
        .await?;
    let out = r.stdout.to_lossy_string();
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines.len() == 3 && lines[0] == lines[2] && lines[1] == lines[2] && lines[2] != "1000",
        "{out}"
    );
    let r = h
        .run(
            &sb,
            "for fd in 0 1 2; do printf 'forged' > /proc/1/fd/$fd 2>/dev/null && echo wrote-$fd; done; echo done",
        )
        .await?;
    assert_eq!(r.stdout.to_lossy_string(), "done\n", "{r:?}");
    let r = h.run(&sb, "echo serving").await?;
    assert_eq!(r.stdout.to_lossy_string(), "serving\n");
    assert!(matches!(
        h.client.get_sandbox(&sb).await?.state,
        corral_proto::SandboxState::Ready
    ));
    h.stop().await;
    Ok(())
}

/// io_uring and AF_VSOCK are closed in every sandbox, on top of the
/// engine's seccomp profile (the supervisor reports what a command meets).
#[tokio::test]
async fn io_uring_and_vsock_are_closed_inside() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let r = h
        .run(&sb, "/.corral/corral-init --check-restrictions")
        .await?;
    let out = r.stdout.to_lossy_string();
    assert!(
        out.contains("io_uring_setup: refused (Function not implemented)"),
        "{out}"
    );
    assert!(out.contains("socket(AF_VSOCK): refused"), "{out}");
    assert!(!out.contains("allowed"), "{out}");
    // Ordinary programs are untouched.
    let r = h.run(&sb, "echo fine").await?;
    assert_eq!(r.stdout.to_lossy_string(), "fine\n");
    h.stop().await;
    Ok(())
}
