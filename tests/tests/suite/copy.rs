//! `corral cp`: files and trees into and out of a sandbox, byte-exact with
//! their modes and times, links never followed out, and clean failures.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{Result, bail};
use corral_e2e::{Harness, binary};
use corral_proto::{SandboxId, SandboxSpec};

async fn corral(h: &Harness, args: &[&str]) -> Result<Output> {
    Ok(tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&h.url)
        .args(args)
        .env_remove("CORRAL_WORKER")
        .output()
        .await?)
}

async fn cp(h: &Harness, src: &str, dest: &str) -> Result<()> {
    let out = corral(h, &["cp", src, dest]).await?;
    if !out.status.success() {
        bail!(
            "corral cp {src} {dest}: {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The same listing on both sides: every path under the directory with its
/// mode and mtime, and each file's checksum.
const LISTING: &str = "find . | sort | xargs stat -c '%a %Y %n' && \
     find . -type f | sort | xargs sha256sum";

fn local_listing(dir: &Path) -> Result<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(LISTING)
        .current_dir(dir)
        .output()?;
    if !out.status.success() {
        bail!(
            "listing {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

async fn sandbox_listing(h: &Harness, sb: &SandboxId, dir: &str) -> Result<String> {
    // Streamed: the listing is longer than a result keeps.
    let (events, r) = h
        .run_spec(
            sb,
            corral_proto::OperationSpec::Shell(corral_proto::ShellSpec::new(format!(
                "cd {dir} && {LISTING}"
            ))),
        )
        .await?;
    if !r.outcome.is_success() {
        bail!("listing {dir}: {r:?}");
    }
    Ok(String::from_utf8(corral_e2e::stdout_of(&events))?)
}

/// Fails with the first lines that differ (listings are long).
fn same(what: &str, got: &str, want: &str) -> Result<()> {
    let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
    if let Some(i) = (0..g.len().max(w.len())).find(|&i| g.get(i) != w.get(i)) {
        bail!(
            "{what} differs at line {i} of {}: got {:?}, want {:?}",
            w.len(),
            g.get(i),
            w.get(i)
        );
    }
    Ok(())
}

fn sh(cmd: &str, dir: &Path) -> Result<()> {
    let status = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .status()?;
    if !status.success() {
        bail!("{cmd}: {status}");
    }
    Ok(())
}

#[tokio::test]
async fn a_large_file_and_ten_thousand_small_ones_go_in_and_out_byte_exact() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let local = tempfile::tempdir()?;
    let src = local.path().join("src");
    std::fs::create_dir(&src)?;
    // 200 MB of noise, and 10,000 small files in 100 directories, with
    // modes, times and a link that stays a link.
    sh(
        "head -c 200000000 /dev/urandom > big.bin && chmod 640 big.bin && \
         touch -d @1500000000 big.bin && \
         for d in $(seq 0 99); do mkdir tree$d; \
           for f in $(seq 0 99); do echo \"$d/$f\" > tree$d/f$f; done; \
           chmod 755 tree$d/f0; done && \
         ln -s ../big.bin tree0/link && touch -h -d @1400000000 tree0/link && \
         find . -type d -exec touch -d @1600000000 {} +",
        &src,
    )?;
    let sid = sb.as_str();
    cp(&h, src.to_str().unwrap(), &format!("{sid}:/workspace/in")).await?;
    let want = local_listing(&src)?;
    assert!(want.lines().count() > 20_000);
    same(
        "what went in",
        &sandbox_listing(&h, &sb, "/workspace/in").await?,
        &want,
    )?;
    let back = local.path().join("back");
    cp(&h, &format!("{sid}:in"), back.to_str().unwrap()).await?;
    same("what came out", &local_listing(&back)?, &want)?;
    assert_eq!(
        std::fs::read_link(back.join("tree0/link"))?,
        Path::new("../big.bin")
    );
    // Into a directory that exists: under the source's own name.
    cp(&h, &format!("{sid}:in/tree7"), back.to_str().unwrap()).await?;
    assert_eq!(std::fs::read_to_string(back.join("tree7/f3"))?, "7/3\n");
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn links_are_never_followed_out_and_a_full_workspace_fails_cleanly() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h
        .sandbox_with(SandboxSpec {
            workspace_bytes: Some(32 << 20),
            ..SandboxSpec::default()
        })
        .await?;
    let sid = sb.as_str();
    let local = tempfile::tempdir()?;
    std::fs::write(local.path().join("small"), "small\n")?;
    let small = local.path().join("small");
    let r = h
        .run(
            &sb,
            "ln -s /etc /workspace/etc-link && mkdir /workspace/d && \
             ln -s /etc/passwd /workspace/d/pw && echo in > /workspace/d/f",
        )
        .await?;
    assert!(r.outcome.is_success(), "{r:?}");
    // A link out of the roots is not a way in, nor a way out.
    for (src, dest) in [
        (
            small.to_str().unwrap().to_string(),
            format!("{sid}:etc-link/x"),
        ),
        (
            format!("{sid}:etc-link"),
            local.path().join("etc").display().to_string(),
        ),
    ] {
        let out = corral(&h, &["cp", &src, &dest]).await?;
        assert_eq!(out.status.code(), Some(125), "cp {src} {dest}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("outside"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // A link inside a tree comes out as a link; one standing where the
    // tree lands locally is replaced, not followed.
    let victim = tempfile::tempdir()?;
    let dest = local.path().join("dest");
    std::fs::create_dir(&dest)?;
    std::os::unix::fs::symlink(victim.path(), dest.join("d"))?;
    cp(&h, &format!("{sid}:d"), dest.to_str().unwrap()).await?;
    assert_eq!(
        std::fs::read_link(dest.join("d/pw"))?,
        Path::new("/etc/passwd")
    );
    assert_eq!(std::fs::read_to_string(dest.join("d/f"))?, "in\n");
    assert_eq!(
        std::fs::read_dir(victim.path())?.count(),
        0,
        "written through a link"
    );

    // More than the workspace holds: a clear error, and the sandbox goes on.
    let big = local.path().join("big");
    sh("head -c 67108864 /dev/zero > big", local.path())?;
    let out = corral(&h, &["cp", big.to_str().unwrap(), &format!("{sid}:big")]).await?;
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("No space left"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let r = h.run(&sb, "rm -f /workspace/big; echo fine").await?;
    assert_eq!(r.stdout.to_lossy_string(), "fine\n");
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

/// The API's one-call transfers: `Upload` takes a tar stream as fast as the
/// sandbox does, `Download` gives one back, and a client that goes away
/// mid-upload leaves nothing running.
#[tokio::test]
async fn the_api_moves_an_archive_in_and_out_in_one_call() -> Result<()> {
    use corral_harness::client::DownloadPart;
    use corral_proto::{ArchiveSpec, OperationId, Outcome};
    use futures_util::StreamExt;
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let local = tempfile::tempdir()?;
    let src = local.path().join("src");
    std::fs::create_dir_all(src.join("deep/er"))?;
    sh(
        "head -c 5000000 /dev/urandom > deep/er/blob && echo hi > a && chmod 700 a",
        &src,
    )?;
    let mut tar = Vec::new();
    corral_init::archive::pack_contents(&src, &mut tar).map_err(anyhow::Error::msg)?;
    let chunks: Vec<bytes::Bytes> = tar
        .chunks(256 * 1024)
        .map(bytes::Bytes::copy_from_slice)
        .collect();
    let done = h
        .client
        .upload(
            &sb,
            &OperationId::random(),
            "/workspace",
            futures_util::stream::iter(chunks),
        )
        .await?;
    assert_eq!(
        done.result.map(|r| r.outcome),
        Some(Outcome::Exited { code: 0 })
    );

    let mut parts = h
        .client
        .download(
            &sb,
            &OperationId::random(),
            ArchiveSpec::contents_of("/workspace"),
        )
        .await?;
    let (mut back, mut finished) = (Vec::new(), None);
    while let Some(part) = parts.next().await {
        match part? {
            DownloadPart::Data(d) => back.extend_from_slice(&d),
            DownloadPart::Finished(op) => finished = Some(op),
        }
    }
    let finished = finished.ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(
        finished.result.map(|r| r.outcome),
        Some(Outcome::Exited { code: 0 })
    );
    let out = local.path().join("out");
    corral_init::archive::unpack_contents(&out, "out", back.as_slice())
        .map_err(anyhow::Error::msg)?;
    // Contents moved, not the directory itself: its own line (its mtime is
    // when it was unpacked into) is left out.
    let inside = |l: String| {
        l.lines()
            .filter(|l| !l.ends_with(" ."))
            .collect::<Vec<_>>()
            .join("\n")
    };
    same(
        "what came back",
        &inside(local_listing(&out)?),
        &inside(local_listing(&src)?),
    )?;

    // A client gone mid-upload: its operation is canceled, not left waiting.
    let op = OperationId::random();
    let first = bytes::Bytes::from(tar[..512 * 1024].to_vec());
    let stalled =
        futures_util::stream::once(async move { first }).chain(futures_util::stream::pending());
    let client = h.client.clone();
    let (sb2, op2) = (sb.clone(), op.clone());
    let upload = tokio::spawn(async move { client.upload(&sb2, &op2, "/tmp", stalled).await });
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while h.client.operation(&sb, &op).await.is_err() {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "never submitted");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    upload.abort();
    // Its own time to be canceled, after the wait for its submit.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let ended = loop {
        let r = h.client.operation(&sb, &op).await?;
        if let Some(r) = r.result {
            break r;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the upload still runs"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(ended.outcome, Outcome::Canceled);

    // A piece over 1 MiB is refused, and ends the upload too.
    let op = OperationId::random();
    let big = bytes::Bytes::from(vec![0u8; 2 << 20]);
    let refused = h
        .client
        .upload(&sb, &op, "/tmp", futures_util::stream::iter([big]))
        .await;
    assert!(refused.is_err(), "{refused:?}");
    // The refusal answers at once; the cancel it sent ends the operation
    // a moment later.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let ended = loop {
        if let Some(r) = h.client.operation(&sb, &op).await?.result {
            break r;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the refused upload still runs"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(ended.outcome, Outcome::Canceled);
    h.client.destroy_sandbox(&sb).await?;
    h.stop().await;
    Ok(())
}

/// `corral cp SANDBOX:PATH -` writes the archive itself to stdout (as
/// `docker cp` does), never a directory named `-`; and refuses a terminal.
#[tokio::test]
async fn a_dash_as_destination_is_the_archive_on_stdout() -> Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let r = h
        .run(
            &sb,
            "mkdir -p /workspace/d && echo one > /workspace/d/a && echo two > /workspace/d/b",
        )
        .await?;
    assert!(r.outcome.is_success(), "{r:?}");
    let here = tempfile::tempdir()?;
    let out = tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&h.url)
        .args(["cp", &format!("{}:d", sb.as_str()), "-"])
        .current_dir(here.path())
        .env_remove("CORRAL_WORKER")
        .output()
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !here.path().join("-").exists(),
        "a file or directory named -"
    );
    let mut names: Vec<String> = tar::Archive::new(&out.stdout[..])
        .entries()?
        .map(|e| Ok(e?.path()?.display().to_string()))
        .collect::<Result<_>>()?;
    names.sort();
    assert_eq!(names, ["d", "d/a", "d/b"], "{names:?}");
    h.stop().await;
    Ok(())
}

/// An upload whose client goes away mid-file leaves no part of that file
/// in the sandbox: the file being written has no name until it is whole.
#[tokio::test]
async fn an_upload_cut_off_mid_file_leaves_no_part_of_it() -> Result<()> {
    use corral_proto::pb;
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(4 << 20);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(
        &mut header,
        "big.bin",
        std::io::Read::take(std::io::repeat(7), 4 << 20),
    )?;
    let archive = tar.into_inner()?;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::UploadRequest>(4);
    let op = corral_proto::OperationId::random();
    tx.send(pb::UploadRequest {
        sandbox_id: sb.to_string(),
        operation_id: op.to_string(),
        path: "/workspace/in".into(),
        ..Default::default()
    })
    .await?;
    let half = bytes::Bytes::copy_from_slice(&archive[..2 << 20]);
    for chunk in [half.slice(..1 << 20), half.slice(1 << 20..)] {
        tx.send(pb::UploadRequest {
            data: chunk,
            ..Default::default()
        })
        .await?;
    }
    let mut raw = pb::worker_client::WorkerClient::connect(h.url.clone()).await?;
    let call = tokio::spawn(async move {
        raw.upload(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    // Once the helper has taken the first half, the client goes.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let rec = h.client.operation(&sb, &op).await;
        if rec.is_ok_and(|r| r.input_bytes >= half.len() as u64) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the helper never took the first half");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    drop(tx);
    let answered = call.await?;
    assert!(
        answered.is_err(),
        "a cut upload is not a whole one: {answered:?}"
    );
    let r = h.run(&sb, "ls -A /workspace; echo end").await?;
    assert_eq!(
        r.stdout.to_lossy_string(),
        "end\n",
        "a part of the file is left"
    );
    h.stop().await;
    Ok(())
}
