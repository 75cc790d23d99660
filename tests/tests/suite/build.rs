//! Images built on the worker's engine (`BuildImage`, `--allow-build`):
//! named by their inputs and built once, bases checked against the image
//! policy before anything runs, a failed step named, and a sandbox of the
//! image starting its commands in the image's WORKDIR.

use anyhow::{Context, Result, bail};
use corral_e2e::Harness;
use corral_proto::pb::worker_client::WorkerClient as Raw;
use corral_proto::{Reason, SandboxSpec, pb};
use futures_util::StreamExt;
use tonic::Code;

/// The context as a tar stream: (path, mode, bytes); names written as
/// given, `..` and all, as a hostile client may.
fn context(files: &[(&str, u32, &[u8])]) -> std::io::Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, mode, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(*mode);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, *data)?;
    }
    b.into_inner()
}

struct Built {
    outcome: pb::BuildImageResult,
    output: String,
}

async fn build(url: &str, dockerfile: &str, tar: Vec<u8>) -> Result<Built, tonic::Status> {
    let mut raw = Raw::connect(url.to_string())
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut reqs = vec![pb::BuildImageRequest {
        dockerfile: dockerfile.into(),
        timeout_ms: 120_000,
        ..Default::default()
    }];
    for piece in tar.chunks(256 << 10) {
        reqs.push(pb::BuildImageRequest {
            data: bytes::Bytes::copy_from_slice(piece),
            ..Default::default()
        });
    }
    reqs.push(pb::BuildImageRequest {
        eof: true,
        ..Default::default()
    });
    let mut events = raw
        .build_image(tokio_stream::iter(reqs))
        .await?
        .into_inner();
    let mut output = String::new();
    while let Some(ev) = events.next().await {
        match ev?.kind {
            Some(pb::build_image_event::Kind::Output(text)) => output.push_str(&text),
            Some(pb::build_image_event::Kind::Done(outcome)) => {
                return Ok(Built { outcome, output });
            }
            None => {}
        }
    }
    Err(tonic::Status::internal("the stream ended without a result"))
}

async fn building_worker() -> Result<Harness> {
    Harness::start_with(|c| {
        c.policy.allow_build = true;
        c.build.max_context_bytes = 1 << 20;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_image_runs_its_commands_in_its_workdir_and_is_built_once() -> Result<()> {
    let h = building_worker().await?;
    // `USER root` as real Dockerfiles have it: the image knows its accounts.
    let dockerfile = b"FROM corral-debian:latest\nWORKDIR /app\nCOPY data.txt ./\nENV GREETING=hi\nUSER root\nRUN echo made > /app/made.txt && python3 -m pip --version\n";
    // Of this run only: the engine keeps what earlier runs built.
    let nonce = corral_e2e::unique_id("n");
    let tar = context(&[
        ("Dockerfile", 0o644, dockerfile),
        ("data.txt", 0o644, b"from the context\n"),
        ("nonce", 0o644, nonce.as_bytes()),
    ])?;
    // Two builds of the same inputs at once: one builds, the other waits
    // for it and finds the image.
    let (a, b) = tokio::join!(
        build(&h.url, "", tar.clone()),
        build(&h.url, "", tar.clone())
    );
    let (a, b) = (a?, b?);
    for x in [&a, &b] {
        assert!(
            x.outcome.failure.is_none(),
            "{:?}\n{}",
            x.outcome.failure,
            x.output
        );
    }
    assert_eq!(a.outcome.image, b.outcome.image);
    assert!(
        a.outcome.image.starts_with("corral-build:"),
        "{}",
        a.outcome.image
    );
    assert_eq!(
        [a.outcome.cached, b.outcome.cached]
            .iter()
            .filter(|c| !**c)
            .count(),
        1,
        "exactly one of two concurrent builds builds"
    );
    assert!(
        a.output.contains("Step 6/6") || b.output.contains("Step 6/6"),
        "{}{}",
        a.output,
        b.output
    );
    let again = build(&h.url, "Dockerfile", tar).await?;
    assert!(again.outcome.cached, "the same inputs build nothing");
    assert_eq!(again.outcome.image, a.outcome.image);

    // A sandbox of it: commands start in its WORKDIR, with its files and
    // environment; HOME is the workspace (the image names none).
    let sb = h
        .sandbox_with(SandboxSpec {
            image: Some(a.outcome.image.clone()),
            ..SandboxSpec::default()
        })
        .await?;
    let r = h
        .run(&sb, "pwd; cat data.txt made.txt; echo \"$GREETING $HOME\"")
        .await?;
    assert_eq!(
        String::from_utf8_lossy(&r.stdout.head),
        "/app\nfrom the context\nmade\nhi /workspace\n"
    );
    h.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_is_named_and_builds_nothing() -> Result<()> {
    let h = building_worker().await?;
    let tar = context(&[(
        "env/Dockerfile",
        0o644,
        b"FROM corral-debian:latest\nRUN echo before\nRUN echo failing >&2; exit 3\nRUN echo never\n",
    )])?;
    let b = build(&h.url, "env/Dockerfile", tar).await?;
    let f = b.outcome.failure.context("the build should fail")?;
    assert_eq!(f.kind, pb::build_failure::Kind::StepFailed as i32);
    assert_eq!((f.step, f.steps), (3, 4), "{f:?}");
    assert!(f.instruction.starts_with("RUN echo failing"), "{f:?}");
    assert!(f.message.contains("non-zero code: 3"), "{f:?}");
    assert!(b.outcome.image.is_empty());
    assert!(b.output.contains("failing"), "{}", b.output);

    // A context without the Dockerfile named.
    let tar = context(&[("Dockerfile", 0o644, b"FROM corral-debian:latest\n")])?;
    let b = build(&h.url, "other/Dockerfile", tar).await?;
    let f = b.outcome.failure.context("no such Dockerfile")?;
    assert_eq!(f.kind, pb::build_failure::Kind::Invalid as i32, "{f:?}");
    // A COPY of a file the context lacks.
    let tar = context(&[(
        "Dockerfile",
        0o644,
        b"FROM corral-debian:latest\nCOPY missing.txt /\n",
    )])?;
    let b = build(&h.url, "", tar).await?;
    let f = b.outcome.failure.context("a missing file")?;
    assert_eq!(f.step, 2, "{f:?}");
    h.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builds_are_bounded_by_the_worker_policy() -> Result<()> {
    // No --allow-build: refused, naming the flag.
    let plain = Harness::start().await?;
    let tar = context(&[("Dockerfile", 0o644, b"FROM corral-debian:latest\n")])?;
    let e = match build(&plain.url, "", tar.clone()).await {
        Ok(_) => bail!("a worker without --allow-build built"),
        Err(e) => e,
    };
    assert_eq!(e.code(), Code::PermissionDenied);
    assert_eq!(corral_proto::reason::of(&e), Some(Reason::PolicyDenied));
    assert_eq!(
        corral_proto::reason::flag_of(&e).as_deref(),
        Some("--allow-build")
    );
    plain.stop().await;

    let h = building_worker().await?;
    // A base the worker's image policy does not allow: refused before any
    // step runs.
    for dockerfile in [
        &b"FROM alpine:3.20\nRUN echo hi\n"[..],
        b"FROM corral-debian:latest AS one\nFROM one AS two\nFROM busybox\n",
    ] {
        let tar = context(&[("Dockerfile", 0o644, dockerfile)])?;
        let e = match build(&h.url, "", tar).await {
            Ok(b) => bail!("built from a base not allowed: {:?}", b.outcome),
            Err(e) => e,
        };
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert_eq!(
            corral_proto::reason::flag_of(&e).as_deref(),
            Some("--allow-image")
        );
    }
    // A base a build argument chooses cannot be checked.
    let tar = context(&[(
        "Dockerfile",
        0o644,
        b"ARG BASE=corral-debian:latest\nFROM $BASE\n",
    )])?;
    let e = build(&h.url, "", tar)
        .await
        .err()
        .context("an argument's base")?;
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A path out of the context.
    let tar = context(&[("Dockerfile", 0o644, b"FROM corral-debian:latest\n")])?;
    let e = build(&h.url, "../Dockerfile", tar)
        .await
        .err()
        .context("a path out")?;
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // A context over the bound (1 MiB here).
    let big = vec![7u8; 2 << 20];
    let tar = context(&[
        ("Dockerfile", 0o644, b"FROM corral-debian:latest\n"),
        ("big", 0o644, &big),
    ])?;
    let e = build(&h.url, "", tar)
        .await
        .err()
        .context("a big context")?;
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(
        corral_proto::reason::flag_of(&e).as_deref(),
        Some("--max-build-context")
    );
    // Not a tar stream at all.
    let e = build(&h.url, "", b"\x01not a tar".repeat(200))
        .await
        .err()
        .context("not a tar")?;
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // The names builds give are allowed (here, one nobody built), and only
    // those: `corral-build:5000/x` names a registry.
    let sb = h
        .sandbox_with(SandboxSpec {
            image: Some(format!("corral-build:{}", "0".repeat(32))),
            ..SandboxSpec::default()
        })
        .await;
    let e = sb.err().context("an image nobody built")?;
    assert!(
        format!("{e:#}").contains("not present"),
        "allowed, but not there: {e:#}"
    );
    let sb = h
        .sandbox_with(SandboxSpec {
            image: Some("corral-build:5000/evil".into()),
            ..SandboxSpec::default()
        })
        .await;
    let e = sb.err().context("a registry's image")?;
    assert!(
        format!("{e:#}").contains("--allow-image"),
        "a registry's image passed for a built one: {e:#}"
    );
    // A tar entry the engine would take for the Dockerfile, after the one
    // the worker would read.
    let tar = context(&[
        ("Dockerfile", 0o644, b"FROM corral-debian:latest\n"),
        ("a/../Dockerfile", 0o644, b"FROM alpine:3\n"),
    ])?;
    let e = build(&h.url, "", tar)
        .await
        .err()
        .context("the other Dockerfile")?;
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // ADD from a URL: the engine would fetch it itself.
    let tar = context(&[(
        "Dockerfile",
        0o644,
        b"FROM corral-debian:latest\nADD http://127.0.0.1:9/secret /s\n",
    )])?;
    let e = build(&h.url, "", tar)
        .await
        .err()
        .context("ADD from a URL")?;
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    h.stop().await;
    Ok(())
}

/// Clients that go away mid-build stop their builds: the build slots are
/// free again at once, and a later build goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_stops_its_build_and_frees_its_slot() -> Result<()> {
    let h = building_worker().await?;
    let nonce = corral_e2e::unique_id("n");
    let chatty = format!(
        "FROM corral-debian:latest\nRUN echo {nonce}; while true; do echo a line of output; done\n"
    );
    let mut gone = Vec::new();
    for i in 0..2 {
        let tar = context(&[
            ("Dockerfile", 0o644, chatty.as_bytes()),
            ("n", 0o644, format!("{nonce}{i}").as_bytes()),
        ])?;
        let url = h.url.clone();
        gone.push(tokio::spawn(async move { build(&url, "", tar).await }));
    }
    // Both are building (and printing) now; their clients go.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    for g in gone {
        g.abort();
    }
    let tar = context(&[
        (
            "Dockerfile",
            0o644,
            b"FROM corral-debian:latest\nRUN echo after\n",
        ),
        ("n", 0o644, nonce.as_bytes()),
    ])?;
    let after = tokio::time::timeout(std::time::Duration::from_secs(60), build(&h.url, "", tar))
        .await
        .context("a build after two abandoned ones waited on their slots")??;
    assert!(after.outcome.failure.is_none(), "{:?}", after.outcome);
    h.stop().await;
    Ok(())
}

/// A sandbox that removes the directory its commands start in still has
/// its files listed and copied: the helpers start at the root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_workdir_blocks_no_listing_or_copy() -> Result<()> {
    let h = building_worker().await?;
    let nonce = corral_e2e::unique_id("n");
    let tar = context(&[
        (
            "Dockerfile",
            0o644,
            b"FROM corral-debian:latest\nWORKDIR /workspace/proj\n",
        ),
        ("n", 0o644, nonce.as_bytes()),
    ])?;
    let built = build(&h.url, "", tar).await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            image: Some(built.outcome.image.clone()),
            ..SandboxSpec::default()
        })
        .await?;
    let r = h.run(&sb, "pwd && cd / && rmdir /workspace/proj").await?;
    assert_eq!(String::from_utf8_lossy(&r.stdout.head), "/workspace/proj\n");
    for spec in [
        corral_proto::OperationSpec::ListDir(corral_proto::ArchiveSpec::new("/etc")),
        corral_proto::OperationSpec::GetArchive(corral_proto::ArchiveSpec::new("/tmp")),
    ] {
        let (_, r) = h.run_spec(&sb, spec).await?;
        assert!(r.outcome.is_success(), "{r:?}");
    }
    h.stop().await;
    Ok(())
}
