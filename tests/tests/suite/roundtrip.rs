//! Commands run and come back whole: output, exit codes, env, workdir,
//! files; many at once.

use corral_e2e::{Harness, stdout_of};
use corral_proto::{OperationSpec, Outcome, ReadFileSpec, ShellSpec, WriteFileSpec};

#[tokio::test]
async fn stdout_stderr_exit_code_env_and_workdir() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;

    let r = h.run(&sb, "echo out; echo err >&2; exit 7").await?;
    assert_eq!(r.outcome, Outcome::Exited { code: 7 });
    assert_eq!(&r.stdout.head[..], b"out\n");
    assert_eq!(&r.stderr.head[..], b"err\n");
    assert_eq!(r.stdout.total_bytes, 4);

    let mut spec = ShellSpec::new("mkdir -p sub && cd sub && pwd && echo \"$GREETING $HOME\"");
    spec.env.insert("GREETING".into(), "hi there".into());
    let r = h.run_spec(&sb, OperationSpec::Shell(spec)).await?.1;
    assert_eq!(r.outcome, Outcome::Exited { code: 0 });
    assert_eq!(
        r.stdout.to_lossy_string(),
        "/workspace/sub\nhi there /workspace\n"
    );

    let mut spec = ShellSpec::new("pwd; touch here");
    spec.workdir = Some("sub".into());
    let (events, r) = h.run_spec(&sb, OperationSpec::Shell(spec)).await?;
    assert_eq!(stdout_of(&events), b"/workspace/sub\n");
    assert!(r.outcome.is_success());

    // Non-interactive defaults, and no login shell.
    let r = h
        .run(
            &sb,
            "echo $PAGER $GIT_PAGER $GIT_TERMINAL_PROMPT $DEBIAN_FRONTEND; read x; echo read=$?",
        )
        .await?;
    assert_eq!(
        r.stdout.to_lossy_string(),
        "cat cat 0 noninteractive\nread=1\n"
    );

    // bash when asked.
    let mut spec = ShellSpec::new("echo ${BASH_VERSION:+bash}; [[ 1 == 1 ]] && echo ok");
    spec.use_bash = true;
    let r = h.run_spec(&sb, OperationSpec::Shell(spec)).await?.1;
    assert_eq!(r.stdout.to_lossy_string(), "bash\nok\n");

    // A missing working directory is a clear spawn failure, not an exit code.
    let mut spec = ShellSpec::new("true");
    spec.workdir = Some("/nope".into());
    let r = h.run_spec(&sb, OperationSpec::Shell(spec)).await?.1;
    assert!(
        matches!(&r.outcome, Outcome::SpawnFailed { reason } if reason.contains("/nope")),
        "{:?}",
        r.outcome
    );

    // Killed by a signal.
    let r = h.run(&sb, "kill -USR1 $$").await?;
    assert_eq!(r.outcome, Outcome::Signaled { signal: 10 });
    assert_eq!(r.outcome.exit_status(), 138);
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn files_are_written_and_read_back() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let write = OperationSpec::WriteFile(WriteFileSpec {
        path: "dir/hello.txt".into(),
        data: bytes_of("hello\nworld\n"),
        mode: 0o600,
        append: false,
        stream: false,
    });
    let r = h.run_spec(&sb, write).await?.1;
    assert_eq!(
        (r.outcome.clone(), r.bytes_written),
        (Outcome::Exited { code: 0 }, 12)
    );
    let r = h
        .run(&sb, "stat -c '%a %U' dir/hello.txt; cat dir/hello.txt")
        .await?;
    assert_eq!(r.stdout.to_lossy_string(), "600 sandbox\nhello\nworld\n");
    let read = OperationSpec::ReadFile(ReadFileSpec {
        path: "/workspace/dir/hello.txt".into(),
        offset: 6,
        limit: 5,
        stream: false,
    });
    let r = h.run_spec(&sb, read).await?.1;
    assert_eq!((&r.file_data[..], r.file_size), (&b"world"[..], 12));
    h.stop().await;
    Ok(())
}

fn bytes_of(s: &'static str) -> bytes::Bytes {
    bytes::Bytes::from_static(s.as_bytes())
}

#[tokio::test]
async fn fifty_concurrent_operations_in_one_sandbox_and_across_ten() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let one = h.sandbox().await?;
    let runs = (0..50).map(|i| {
        let (h, sb) = (&h, &one);
        async move {
            let r = h
                .run(
                    sb,
                    &format!(
                        "echo start {i}; sleep 0.2; echo end {i} >&2; exit {}",
                        i % 5
                    ),
                )
                .await?;
            anyhow::ensure!(
                r.outcome == Outcome::Exited { code: i % 5 },
                "op {i}: {:?}",
                r.outcome
            );
            anyhow::ensure!(
                r.stdout.to_lossy_string() == format!("start {i}\n"),
                "op {i} stdout"
            );
            anyhow::ensure!(
                r.stderr.to_lossy_string() == format!("end {i}\n"),
                "op {i} stderr"
            );
            Ok(())
        }
    });
    futures_util::future::try_join_all(runs).await?;

    let sandboxes = futures_util::future::try_join_all((0..10).map(|_| h.sandbox())).await?;
    let runs = (0..50).map(|i| {
        let (h, sb) = (&h, &sandboxes[i % 10]);
        async move {
            let r = h.run(sb, &format!("echo {i} > f{i}; cat f{i}")).await?;
            anyhow::ensure!(
                r.stdout.to_lossy_string() == format!("{i}\n"),
                "op {i}: {r:?}"
            );
            Ok(())
        }
    });
    futures_util::future::try_join_all(runs).await?;
    // Each sandbox saw exactly its five files.
    for sb in &sandboxes {
        let r = h.run(sb, "ls f* | wc -l").await?;
        assert_eq!(r.stdout.to_lossy_string().trim(), "5");
    }
    h.stop().await;
    Ok(())
}
