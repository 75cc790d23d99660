//! Volumes on a real worker process and engine: written in one sandbox
//! and read in the next after the first is gone and the worker restarted;
//! a second writer refused, readers beside the writer; the size enforced
//! by the filesystem (ENOSPC in the sandbox, the sandbox and the worker
//! unharmed); a hostile sandbox's links (hard, symbolic, absolute) reaching
//! nothing outside, on the sandbox's side or the host's; a volume in use
//! kept; bad names refused; `corral volume cp` in and out.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use corral_e2e::{WorkerProcess, binary, free_port, run_shell, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::volume::VolumeMount;
use corral_proto::{Reason, SandboxId, SandboxSpec, pb};

fn with(mounts: &[&str]) -> Result<SandboxSpec> {
    Ok(SandboxSpec {
        volumes: mounts
            .iter()
            .map(|m| VolumeMount::parse(m))
            .collect::<Result<_, _>>()?,
        ..SandboxSpec::default()
    })
}

async fn volumes(c: &WorkerClient) -> Result<Vec<pb::Volume>> {
    Ok(c.raw()
        .list_volumes(pb::ListVolumesRequest {})
        .await?
        .into_inner()
        .volumes)
}

fn reason_of(e: &corral_harness::client::ClientError) -> Option<Reason> {
    e.reason()
}

async fn corral(w: &WorkerProcess, args: &[&str]) -> Result<std::process::Output> {
    Ok(tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&w.url)
        .arg("--token-file")
        .arg(w.token_file())
        .args(args)
        .env_remove("CORRAL_WORKER")
        .env_remove("CORRAL_IMAGE")
        .kill_on_drop(true)
        .output()
        .await?)
}

/// Unmounts what is mounted below a directory (a test that fails leaves
/// its worker's volumes mounted: its worker is killed, not stopped).
struct Unmounts(std::path::PathBuf);

impl Drop for Unmounts {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.0) else {
            return;
        };
        let mut mounted: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        // The read-only views (`<id>.ro`) before what they view.
        mounted.sort_by(|a, b| b.cmp(a));
        for p in mounted {
            let _ = std::process::Command::new("umount")
                .arg(&p)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_outlives_its_sandboxes_and_its_worker_and_holds_its_size() -> Result<()> {
    let state = tempfile::tempdir()?;
    // Dropped after the worker: what a failed run left mounted goes.
    let _unmounts = Unmounts(state.path().join("volumes"));
    let (wid, port) = (unique_id("vol"), free_port()?);
    let mut worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let c = worker.client().await?;

    // Bad names, a size out of bounds, a volume that is not there.
    for bad in ["../x", "a/b", "Data", ""] {
        let s = c
            .raw()
            .create_volume(pb::CreateVolumeRequest {
                name: bad.into(),
                size_bytes: 0,
            })
            .await
            .err()
            .with_context(|| format!("{bad:?} was made"))?;
        ensure!(s.code() == tonic::Code::InvalidArgument, "{bad:?}: {s:?}");
    }
    let s = c
        .raw()
        .create_volume(pb::CreateVolumeRequest {
            name: "huge".into(),
            size_bytes: 1 << 50,
        })
        .await
        .err()
        .context("a 1 PiB volume was made")?;
    ensure!(s.message().contains("--max-volume-size"), "{s:?}");
    let e = c
        .create_sandbox(None, with(&["nothing:/data"])?)
        .await
        .err()
        .context("a sandbox of a missing volume")?;
    ensure!(reason_of(&e) == Some(Reason::NoSuchVolume), "{e}");

    // A volume of 16 MiB, made twice (the same again is a no-op, another
    // size a conflict).
    let made = |size: u64| {
        let mut raw = c.raw();
        async move {
            raw.create_volume(pb::CreateVolumeRequest {
                name: "data".into(),
                size_bytes: size,
            })
            .await
        }
    };
    let v = made(16 << 20).await?.into_inner();
    ensure!(v.size_bytes == 16 << 20 && v.writer.is_empty(), "{v:?}");
    made(16 << 20).await?;
    let s = made(32 << 20).await.err().context("another size")?;
    ensure!(s.code() == tonic::Code::AlreadyExists, "{s:?}");

    // The writer: its files are its own, and the size is the
    // filesystem's: past it a write fails, and the sandbox goes on.
    let a = c.create_sandbox(None, with(&["data:/data"])?).await?.id;
    let out = run_shell(
        &c,
        &a,
        "cd /data && echo kept > note && echo secret > private && chmod 600 private && \
         id -u && stat -c %u . && \
         (dd if=/dev/zero of=fill bs=1M count=40 2>&1; echo dd=$?) | grep -E 'No space|dd='; rm fill; echo alive",
    )
    .await?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(lines.len() == 5, "{out}");
    ensure!(
        lines[0] == lines[1],
        "the volume is not the writer's: {out}"
    );
    ensure!(
        lines[2].contains("No space left on device") && lines[3] != "dd=0",
        "{out}"
    );
    ensure!(lines[4] == "alive", "{out}");

    // A second writer is refused, naming the first; a reader is not, and
    // cannot write.
    let e = c
        .create_sandbox(None, with(&["data:/data"])?)
        .await
        .err()
        .context("a second writer")?;
    ensure!(reason_of(&e) == Some(Reason::VolumeInUse), "{e}");
    ensure!(e.to_string().contains(a.as_str()), "{e}");
    let r = c.create_sandbox(None, with(&["data:/seen:ro"])?).await?.id;
    let out = run_shell(&c, &r, "cat /seen/note; touch /seen/x 2>&1; true").await?;
    ensure!(
        out.starts_with("kept\n") && out.contains("Read-only file system"),
        "{out}"
    );
    // Readers' mounts keep nosuid and nodev, as the writer's do.
    for (s, at) in [(&a, "/data"), (&r, "/seen")] {
        let line = run_shell(&c, s, &format!("grep ' {at} ' /proc/self/mountinfo")).await?;
        let opts = line.split_whitespace().nth(5).unwrap_or_default();
        ensure!(
            opts.contains("nosuid") && opts.contains("nodev"),
            "{at}: {line}"
        );
    }
    let listed = volumes(&c).await?;
    ensure!(listed.len() == 1, "{listed:?}");
    ensure!(listed[0].writer == a.as_str(), "{listed:?}");
    ensure!(listed[0].readers == vec![r.to_string()], "{listed:?}");
    ensure!(listed[0].used_bytes > 0, "{listed:?}");
    // In use: kept.
    let s = c
        .raw()
        .delete_volume(pb::DeleteVolumeRequest {
            name: "data".into(),
        })
        .await
        .err()
        .context("a volume in use was removed")?;
    ensure!(
        corral_proto::reason::of(&s) == Some(Reason::VolumeInUse),
        "{s:?}"
    );

    // A hostile writer: a hard link out of the volume cannot be made; a
    // symbolic one names a place in whichever sandbox follows it, and
    // the worker follows none (a host file it names keeps its owner when
    // the volume is given to the next writer).
    let canary = tempfile::NamedTempFile::new()?;
    let canary_path = canary.path().display().to_string();
    let out = run_shell(
        &c,
        &a,
        &format!(
            "cd /data && (ln /etc/passwd hard 2>&1 || true) && ln -s {canary_path} host && \
             ln -s / top && ln -s ../../etc up && echo planted"
        ),
    )
    .await?;
    ensure!(
        out.contains("Invalid cross-device link") && out.ends_with("planted\n"),
        "{out}"
    );
    // Files through the sandbox's own file calls: under the volume yes,
    // through a link out of it no.
    let cp_out = tempfile::tempdir()?;
    let got = corral(
        &worker,
        &[
            "cp",
            &format!("{a}:/data/note"),
            cp_out.path().to_str().context("path")?,
        ],
    )
    .await?;
    ensure!(got.status.success(), "{got:?}");
    ensure!(std::fs::read_to_string(cp_out.path().join("note"))? == "kept\n");
    let escaped = corral(
        &worker,
        &[
            "cp",
            &format!("{a}:/data/up/passwd"),
            cp_out.path().to_str().context("path")?,
        ],
    )
    .await?;
    ensure!(!escaped.status.success(), "{escaped:?}");

    c.destroy_sandbox(&a).await?;
    c.destroy_sandbox(&r).await?;

    // The worker restarts; the next sandbox finds what the first wrote,
    // and as its writer owns it (the private file too).
    worker.terminate(Duration::from_secs(30))?;
    drop(worker);
    let worker = WorkerProcess::spawn(state.path(), &wid, port, &[], &[])?;
    let c = worker.client().await?;
    let b = c
        .create_sandbox(None, with(&["data:/workspace/w"])?)
        .await?
        .id;
    let out = run_shell(
        &c,
        &b,
        "cd /workspace && echo own > mine.txt && cat w/note w/private && echo more >> w/note && \
         cat w/note && [ $(stat -c %u w/private) = $(id -u) ] && echo mine",
    )
    .await?;
    ensure!(out == "kept\nsecret\nkept\nmore\nmine\n", "{out}");
    let meta = std::fs::metadata(canary.path())?;
    ensure!(
        meta.uid() == nix::unistd::getuid().as_raw(),
        "a host file a sandbox linked to changed owner: {}",
        meta.uid()
    );
    ensure!(
        std::fs::metadata("/etc")?.uid() == 0,
        "the host's /etc changed owner"
    );

    // A fork's children get the workspace and read the parent's volume
    // (mounted inside it): nothing of it copied, nothing of it emptied.
    let child = SandboxId::new(unique_id("child"))?;
    let forked = c.fork_sandbox(&b, std::slice::from_ref(&child), 1).await?;
    ensure!(forked.children.len() == 1);
    let out = run_shell(
        &c,
        &child,
        "cd /workspace && cat mine.txt w/note; touch w/x 2>&1; true",
    )
    .await?;
    ensure!(
        out.starts_with("own\nkept\nmore\n") && out.contains("Read-only"),
        "{out}"
    );
    ensure!(run_shell(&c, &b, "cat /workspace/w/note").await? == "kept\nmore\n");
    c.destroy_sandbox(&child).await?;

    // `corral volume cp` in and out, through a sandbox of its own: in is
    // refused while another writes; out reads beside it.
    let src = tempfile::tempdir()?;
    std::fs::write(src.path().join("in.txt"), "from the host\n")?;
    let into = corral(
        &worker,
        &[
            "volume",
            "cp",
            src.path().join("in.txt").to_str().context("path")?,
            "data:/in.txt",
        ],
    )
    .await?;
    ensure!(!into.status.success(), "{into:?}");
    ensure!(
        String::from_utf8_lossy(&into.stderr).contains("one writer at a time"),
        "{into:?}"
    );
    c.destroy_sandbox(&b).await?;
    let into = corral(
        &worker,
        &[
            "volume",
            "cp",
            src.path().join("in.txt").to_str().context("path")?,
            "data:/in.txt",
        ],
    )
    .await?;
    ensure!(into.status.success(), "{into:?}");
    let back = tempfile::tempdir()?;
    let out = corral(
        &worker,
        &[
            "volume",
            "cp",
            "data:/",
            back.path().join("all").to_str().context("path")?,
        ],
    )
    .await?;
    ensure!(out.status.success(), "{out:?}");
    ensure!(std::fs::read_to_string(back.path().join("all/in.txt"))? == "from the host\n");
    ensure!(std::fs::read_to_string(back.path().join("all/note"))? == "kept\nmore\n");
    // The copies' sandboxes are gone.
    ensure!(c.list_sandboxes().await?.is_empty());

    // Removed with everything in it, its files gone from the state
    // directory.
    let ls = corral(&worker, &["volume", "ls", "--json"]).await?;
    let listed: serde_json::Value = serde_json::from_slice(&ls.stdout)?;
    ensure!(listed[0]["name"] == "data", "{listed}");
    let rm = corral(&worker, &["volume", "rm", "data"]).await?;
    ensure!(rm.status.success(), "{rm:?}");
    ensure!(volumes(&c).await?.is_empty());
    let left: Vec<_> = std::fs::read_dir(state.path().join("volumes"))?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    ensure!(left.is_empty(), "{left:?}");
    Ok(())
}

/// `corral volume move`: a volume goes from one worker to another with its
/// size, files, modes and links; refused while a sandbox writes to it or
/// where the other worker has one of its name; gone from the first after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_moves_to_another_worker_with_its_files() -> Result<()> {
    let (sa, sb) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let _ua = Unmounts(sa.path().join("volumes"));
    let _ub = Unmounts(sb.path().join("volumes"));
    let a = WorkerProcess::spawn(sa.path(), &unique_id("mva"), free_port()?, &[], &[])?;
    let b = WorkerProcess::spawn(sb.path(), &unique_id("mvb"), free_port()?, &[], &[])?;
    let (ca, cb) = (a.client().await?, b.client().await?);
    ca.raw()
        .create_volume(pb::CreateVolumeRequest {
            name: "moving".into(),
            size_bytes: 24 << 20,
        })
        .await?;
    let writer = ca.create_sandbox(None, with(&["moving:/data"])?).await?.id;
    let out = run_shell(
        &ca,
        &writer,
        "cd /data && mkdir -p d/e && echo one > d/a.txt && chmod 640 d/a.txt && \
         ln -s d/a.txt link && head -c 3000000 /dev/urandom > big && sha256sum big > sum && \
         mkfifo pipe && echo made",
    )
    .await?;
    ensure!(out == "made\n", "{out}");
    let b_token = b.token_file();
    let b_token = b_token.to_str().context("path")?;
    let move_args = [
        "volume",
        "move",
        "moving",
        "--to",
        b.url.as_str(),
        "--to-token-file",
        b_token,
    ];
    // Its writer still runs: refused, nothing made on b.
    let refused = corral(&a, &move_args).await?;
    ensure!(!refused.status.success(), "{refused:?}");
    ensure!(
        String::from_utf8_lossy(&refused.stderr).contains("nobody writes to it"),
        "{refused:?}"
    );
    ensure!(volumes(&cb).await?.is_empty());
    ca.destroy_sandbox(&writer).await?;
    // b has one of that name: refused, neither touched.
    cb.raw()
        .create_volume(pb::CreateVolumeRequest {
            name: "moving".into(),
            size_bytes: 0,
        })
        .await?;
    let refused = corral(&a, &move_args).await?;
    ensure!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("has a volume moving already"),
        "{refused:?}"
    );
    cb.raw()
        .delete_volume(pb::DeleteVolumeRequest {
            name: "moving".into(),
        })
        .await?;

    let moved = corral(&a, &move_args).await?;
    ensure!(moved.status.success(), "{moved:?}");
    let said = String::from_utf8_lossy(&moved.stdout);
    ensure!(
        said.contains("moved moving to") && said.contains("pipe"),
        "{said}"
    );
    ensure!(volumes(&ca).await?.is_empty(), "the old copy stayed");
    let on_b = volumes(&cb).await?;
    ensure!(
        on_b.len() == 1 && on_b[0].name == "moving" && on_b[0].size_bytes >= 20 << 20,
        "{on_b:?}"
    );
    let reader = cb.create_sandbox(None, with(&["moving:/data"])?).await?.id;
    let out = run_shell(
        &cb,
        &reader,
        "cd /data && cat link && stat -c %a d/a.txt && [ -d d/e ] && echo dir && \
         sha256sum -c sum && [ ! -e pipe ] && echo no-fifo && \
         [ $(stat -c %u big) = $(id -u) ] && echo mine",
    )
    .await?;
    ensure!(out == "one\n640\ndir\nbig: OK\nno-fifo\nmine\n", "{out}");
    cb.destroy_sandbox(&reader).await?;
    Ok(())
}
