//! Live forks on a real worker and a real engine: children get the
//! parent's writable trees as they were at one instant (while a process of
//! the parent keeps writing), run on their own, and go cleanly; what cannot
//! be forked is refused with its reason and leaves nothing; a worker killed
//! in the middle of a fork thaws the parent and removes the half-made
//! children when it starts again.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::{WorkerProcess, collect, free_port, run_shell, stdout_of, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::reason::Reason;
use corral_proto::{OperationId, OperationSpec, Outcome, SandboxId, SandboxSpec, ShellSpec};

const DEBIAN: &str = "corral-debian:latest";

/// Fills /workspace with ~100 MiB: 10,000 small files in 100 folders, three
/// large ones, a sparse one, links (symbolic and hard), modes (set-id and
/// sticky bits included), a FIFO and a file in /tmp.
const POPULATE: &str = r#"
import os, random
random.seed(7)
os.chdir("/workspace")
os.mkdir("wa")
for d in range(100):
    os.makedirs(f"tree/d{d:03}", exist_ok=True)
    for f in range(100):
        p = f"tree/d{d:03}/f{f:03}"
        with open(p, "wb") as fh:
            fh.write(random.randbytes(random.randint(1, 8192)))
        os.chmod(p, random.choice([0o600, 0o644, 0o755, 0o4750, 0o2711]))
for i in range(3):
    with open(f"big{i}", "wb") as fh:
        for _ in range(21):
            fh.write(random.randbytes(1 << 20))
with open("sparse", "wb") as fh:
    fh.seek(64 << 20)
    fh.write(b"end")
for i in range(10):
    os.symlink(f"tree/d{i:03}/f000", f"link{i}")
    os.link(f"tree/d{i:03}/f001", f"hard{i}")
os.symlink("/etc/passwd", "abs")
os.symlink("nowhere", "dangling")
os.mkdir("sticky"); os.chmod("sticky", 0o1777)
os.mkfifo("fifo", 0o640)
os.utime("tree/d000/f000", ns=(1_000_000_000_123_456_789, 1_000_000_000_987_654_321))
os.mkdir("wb")
with open("/tmp/scratch", "w") as fh:
    fh.write("in /tmp\n")
print("populated")
"#;

/// Appends line N to wa/a.txt, then to wb/b.txt, until wa/stop exists: at
/// any instant a.txt has the lines 0..n and b.txt 0..n or 0..n-1. The two
/// folders were made first and last, so a copy that does not freeze the
/// writer reads one long before the other.
/// Exits 0 with the count written, or 1 at the first error.
const WRITER: &str = r#"
import os, sys, time
a = open("/workspace/wa/a.txt", "a"); b = open("/workspace/wb/b.txt", "a")
i = 0
try:
    while not os.path.exists("/workspace/wa/stop"):
        a.write(f"{i}\n"); a.flush()
        b.write(f"{i}\n"); b.flush()
        i += 1
        if i % 50 == 0:
            time.sleep(0.001)
except Exception as e:
    print("writer failed:", e); sys.exit(1)
print("wrote", i)
"#;

/// One line per entry of /workspace and /tmp (but the writer's folders):
/// path, type, mode, owner (`me` for the sandbox's own
/// user), size, modification time in ns, and the sha256 of a file, the
/// target of a link, or the first path of a hard-linked file.
const LISTING: &str = r#"
import hashlib, os, stat
me = os.getuid()
first = {}
def who(i):
    return "me" if i == me else str(i)
for top in ("/workspace", "/tmp"):
    for root, dirs, files in os.walk(top):
        dirs.sort()
        if root == "/workspace":
            dirs[:] = [d for d in dirs if d not in ("wa", "wb")]
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        for p in [root] + [os.path.join(root, n) for n in sorted(files + links)]:
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            extra = ""
            if stat.S_ISREG(kind):
                if st.st_nlink > 1 and st.st_ino in first:
                    extra = "hardlink-to " + first[st.st_ino]
                else:
                    first[st.st_ino] = p
                    h = hashlib.sha256()
                    with open(p, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            h.update(chunk)
                    extra = h.hexdigest()
            elif stat.S_ISLNK(kind):
                extra = "-> " + os.readlink(p)
            link = stat.S_ISLNK(kind)
            print(p, oct(kind), "-" if link else oct(stat.S_IMODE(st.st_mode)), who(st.st_uid),
                  who(st.st_gid), st.st_size, "-" if link else st.st_mtime_ns, extra)
"#;

/// A python3 command line (not a here-document: the shell would make a
/// file of it in /tmp, which the listings compare).
fn python(script: &str) -> String {
    assert!(!script.contains('\''), "the script is quoted with '");
    format!("python3 -c '{script}'")
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        image: Some(DEBIAN.into()),
        ..SandboxSpec::default()
    }
}

/// The writer's two files in a sandbox: (a's lines, b's lines), each
/// checked to be 0, 1, 2, ... in order.
async fn writer_files(client: &WorkerClient, id: &SandboxId) -> Result<(Vec<u64>, Vec<u64>)> {
    let out = run_shell(
        client,
        id,
        "cat /workspace/wa/a.txt; echo ==; cat /workspace/wb/b.txt",
    )
    .await?;
    let (a, b) = out.split_once("==\n").context("no separator")?;
    let parse = |t: &str| -> Result<Vec<u64>> {
        let v: Vec<u64> = t
            .lines()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("a torn line in {t:?}"))?;
        ensure!(
            v.iter().enumerate().all(|(i, n)| *n == i as u64),
            "lines out of order"
        );
        Ok(v)
    };
    Ok((parse(a)?, parse(b)?))
}

fn children_of(worker_id: &str) -> Result<Vec<String>> {
    let out = std::process::Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=corral.worker={worker_id}"),
        ])
        .output()?;
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .map(String::from)
        .collect())
}

#[tokio::test]
async fn eight_children_get_a_busy_parents_trees_as_they_were_at_one_instant() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("fk"), free_port()?, &[], &[])?;
    let client = worker.client().await?;
    let parent = SandboxId::new(unique_id("parent"))?;
    client.create_sandbox(Some(&parent), spec()).await?;
    let out = run_shell(&client, &parent, &python(POPULATE)).await?;
    ensure!(out.contains("populated"), "{out}");
    let size = run_shell(&client, &parent, "du -sm /workspace | cut -f1").await?;
    let mib: u64 = size.trim().parse()?;
    ensure!((100..200).contains(&mib), "{mib} MiB in /workspace");

    // A writer that keeps going through the fork.
    let writer = OperationId::random();
    let after = client.get_sandbox(&parent).await?.last_seq;
    client
        .submit(
            &parent,
            &writer,
            OperationSpec::Shell(ShellSpec::new(python(WRITER))),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while writer_files(&client, &parent)
        .await
        .map_or(0, |(a, _)| a.len())
        < 1000
    {
        ensure!(Instant::now() < deadline, "the writer never got going");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let ids: Vec<SandboxId> = (0..8)
        .map(|i| SandboxId::new(unique_id(&format!("child{i}"))))
        .collect::<Result<_, _>>()?;
    let forked = client.fork_sandbox(&parent, &ids, 0).await?;
    let got: Vec<SandboxId> = forked.children.iter().map(|c| c.id.clone()).collect();
    assert_eq!(got, ids);
    assert!(forked.frozen > Duration::ZERO, "{forked:?}");
    assert!(forked.copied_bytes >= 100 << 20, "{forked:?}");
    assert!(forked.copied_entries > 10_000, "{forked:?}");
    assert_eq!(forked.left_out, 0, "{forked:?}");
    for c in &forked.children {
        assert_eq!(c.spec.image, spec().image);
        assert_eq!(c.running_operations, 0);
        assert!(
            client.list_operations(&c.id).await?.is_empty(),
            "a child started with none"
        );
    }

    // The writer went on and never saw an error.
    let written_before = writer_files(&client, &parent).await?.0.len();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (a, _) = writer_files(&client, &parent).await?;
    assert!(a.len() > written_before, "the parent's writer stopped");
    run_shell(&client, &parent, "touch /workspace/wa/stop").await?;
    let (events, result) = collect(&client, &parent, &writer, after).await?;
    let said = String::from_utf8_lossy(&stdout_of(&events)).into_owned();
    assert_eq!(result.outcome, Outcome::Exited { code: 0 }, "{said}");
    assert!(said.starts_with("wrote "), "{said}");

    // Every child has the parent's static trees exactly, and the writer's
    // files as they were at one instant: b at most one line behind a, a
    // no longer than the parent's.
    let (parent_a, _) = writer_files(&client, &parent).await?;
    let listing = run_shell(&client, &parent, &python(LISTING)).await?;
    ensure!(
        listing.lines().count() > 10_100,
        "{} lines",
        listing.lines().count()
    );
    ensure!(
        listing.contains("/workspace/tree/d000/f000 0o100000"),
        "{}",
        &listing[..500]
    );
    let mut at_freeze = HashSet::new();
    for c in &ids {
        let theirs = run_shell(&client, c, &python(LISTING)).await?;
        if theirs != listing {
            let diff: Vec<_> = listing
                .lines()
                .zip(theirs.lines())
                .filter(|(a, b)| a != b)
                .take(5)
                .collect();
            bail!("child {c} differs from the parent: {diff:?}");
        }
        let (ca, cb) = writer_files(&client, c).await?;
        assert!(
            ca.len() == cb.len() || ca.len() == cb.len() + 1,
            "child {c}: a has {} lines, b {}: not one instant",
            ca.len(),
            cb.len()
        );
        assert!(ca.len() <= parent_a.len() && ca.len() >= 1000);
        at_freeze.insert(ca.len());
    }
    assert_eq!(at_freeze.len(), 1, "the children differ: {at_freeze:?}");

    // They run on their own: what one does no other sees.
    run_shell(
        &client,
        &ids[0],
        "echo mine > /workspace/only-child0; rm /workspace/big0",
    )
    .await?;
    let seen = run_shell(
        &client,
        &ids[1],
        "ls /workspace/only-child0 /workspace/big0 2>&1",
    )
    .await?;
    assert!(
        seen.contains("No such file") && seen.contains("/workspace/big0\n"),
        "{seen}"
    );
    let seen = run_shell(
        &client,
        &parent,
        "ls /workspace/only-child0 2>&1; ls /workspace/big0",
    )
    .await?;
    assert!(
        seen.contains("No such file") && seen.contains("/workspace/big0"),
        "{seen}"
    );

    // And go cleanly.
    for c in ids.iter().chain([&parent]) {
        assert!(client.destroy_sandbox(c).await?);
    }
    assert!(client.list_sandboxes().await?.is_empty());
    assert_eq!(children_of(&worker.worker_id)?, Vec::<String>::new());
    Ok(())
}

#[tokio::test]
async fn what_cannot_be_forked_is_refused_with_its_reason_and_leaves_nothing() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("fk"),
        free_port()?,
        &[],
        &["--allow-runtime", "runsc", "--allow-writable-rootfs"],
    )?;
    let client = worker.client().await?;
    let check =
        |r: std::result::Result<_, corral_harness::client::ClientError>, want: Reason| match r {
            Ok(f) => panic!("forked: {f:?}"),
            Err(e) => assert_eq!(e.reason(), Some(want), "{e}"),
        };
    let child = SandboxId::new(unique_id("child"))?;
    let gvisor = SandboxId::new(unique_id("gvisor"))?;
    client
        .create_sandbox(
            Some(&gvisor),
            SandboxSpec {
                runtime: Some("runsc".into()),
                ..SandboxSpec::default()
            },
        )
        .await?;
    check(
        client
            .fork_sandbox(&gvisor, std::slice::from_ref(&child), 0)
            .await,
        Reason::NotApplicable,
    );
    let writable = SandboxId::new(unique_id("writable"))?;
    client
        .create_sandbox(
            Some(&writable),
            SandboxSpec {
                writable_rootfs: true,
                ..SandboxSpec::default()
            },
        )
        .await?;
    check(
        client
            .fork_sandbox(&writable, std::slice::from_ref(&child), 0)
            .await,
        Reason::NotApplicable,
    );
    check(
        client
            .fork_sandbox(&SandboxId::new(unique_id("nobody"))?, &[], 1)
            .await,
        Reason::SandboxNotFound,
    );

    // A parent that holds what a sandbox may plant: links out of it, a
    // socket, a FIFO, names that are not text.
    let parent = SandboxId::new(unique_id("parent"))?;
    client.create_sandbox(Some(&parent), spec()).await?;
    let planted = run_shell(
        &client,
        &parent,
        &python(
            r#"
import os, socket
os.chdir("/workspace")
os.symlink("/etc", "etc")
os.symlink("../../../../..", "up")
os.mkfifo("fifo")
socket.socket(socket.AF_UNIX).bind("/workspace/sock")
open(b"/workspace/bad\xffname\nline", "w").write("odd\n")
print("planted")
"#,
        ),
    )
    .await?;
    ensure!(planted.contains("planted"), "{planted}");
    check(
        client.fork_sandbox(&parent, &[], 0).await,
        Reason::InvalidArgument,
    );
    check(
        client.fork_sandbox(&parent, &[], 101).await,
        Reason::InvalidArgument,
    );
    check(
        client
            .fork_sandbox(&parent, std::slice::from_ref(&parent), 0)
            .await,
        Reason::InvalidArgument,
    );
    // A child whose id is taken: refused, and that sandbox is untouched.
    check(
        client
            .fork_sandbox(&parent, std::slice::from_ref(&writable), 0)
            .await,
        Reason::Conflict,
    );
    let mut ours: Vec<SandboxId> = client
        .list_sandboxes()
        .await?
        .into_iter()
        .map(|s| s.id)
        .collect();
    ours.sort();
    let mut want = vec![gvisor.clone(), writable.clone(), parent.clone()];
    want.sort();
    assert_eq!(ours, want, "a refused fork left a child");

    let forked = client
        .fork_sandbox(&parent, std::slice::from_ref(&child), 0)
        .await?;
    assert_eq!(forked.left_out, 1, "{forked:?}");
    assert!(forked.notes[0].contains("sock"), "{forked:?}");
    let seen = run_shell(
        &client,
        &child,
        "cd /workspace; readlink etc up; ls etc | head -3; test -p fifo && echo fifo; test -e sock || echo no-sock; cat bad*",
    )
    .await?;
    let parent_etc = run_shell(&client, &child, "ls /etc | head -3").await?;
    assert_eq!(
        seen,
        format!("/etc\n../../../../..\n{parent_etc}fifo\nno-sock\nodd\n"),
        "links stay links that name the child's own places"
    );
    for id in [&child, &parent, &gvisor, &writable] {
        client.destroy_sandbox(id).await?;
    }
    assert_eq!(children_of(&worker.worker_id)?, Vec::<String>::new());
    Ok(())
}

fn paused(container: &str) -> bool {
    std::process::Command::new("docker")
        .args(["inspect", "-f", "{{.State.Paused}}", container])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
        .unwrap_or(false)
}

#[tokio::test]
async fn a_worker_killed_mid_fork_thaws_the_parent_and_removes_the_half_made_children() -> Result<()>
{
    let state = tempfile::tempdir()?;
    let worker_id = unique_id("fk");
    let port = free_port()?;
    let mut worker = WorkerProcess::spawn(state.path(), &worker_id, port, &[], &[])?;
    let client = worker.client().await?;
    let parent = SandboxId::new(unique_id("parent"))?;
    let info = client.create_sandbox(Some(&parent), spec()).await?;
    // Enough to copy that the freeze lasts long enough to be seen.
    run_shell(
        &client,
        &parent,
        "for i in 1 2 3 4; do head -c 100M /dev/urandom > /workspace/big$i; done; echo ok",
    )
    .await?;
    let forking = {
        let client = client.clone();
        let parent = parent.clone();
        tokio::spawn(async move { client.fork_sandbox(&parent, &[], 2).await })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !paused(&info.container_id) {
        ensure!(Instant::now() < deadline, "the parent was never frozen");
        ensure!(
            !forking.is_finished(),
            "the fork ended before it was seen frozen"
        );
        // The fork runs on this thread too.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    worker.kill9();
    let r = forking.await?;
    ensure!(r.is_err(), "the fork finished: {r:?}");
    ensure!(paused(&info.container_id), "nothing thawed the parent yet");

    // The first is kept until the end: dropping it removes its
    // worker's containers.
    let worker2 = WorkerProcess::spawn(state.path(), &worker_id, port, &[], &[])?;
    let client = worker.client().await?;
    let left: Vec<SandboxId> = client
        .list_sandboxes()
        .await?
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(left, vec![parent.clone()], "only the parent is left");
    assert!(!paused(&info.container_id), "the parent was thawed");
    assert_eq!(
        children_of(&worker2.worker_id)?,
        vec![info.container_id[..12].to_string()],
        "the children's containers are gone"
    );
    let out = run_shell(&client, &parent, "ls /workspace | wc -l; echo alive").await?;
    assert_eq!(out, "4\nalive\n");
    drop(worker);
    client.destroy_sandbox(&parent).await?;
    Ok(())
}

#[tokio::test]
async fn a_client_that_goes_away_mid_fork_leaves_the_parent_thawed_and_the_children_whole()
-> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(state.path(), &unique_id("fk"), free_port()?, &[], &[])?;
    let client = worker.client().await?;
    let parent = SandboxId::new(unique_id("parent"))?;
    let info = client.create_sandbox(Some(&parent), spec()).await?;
    run_shell(
        &client,
        &parent,
        "for i in 1 2 3 4; do head -c 100M /dev/urandom > /workspace/big$i; done; sha256sum /workspace/big* > /tmp/sums",
    )
    .await?;
    let forking = {
        let client = client.clone();
        let parent = parent.clone();
        tokio::spawn(async move { client.fork_sandbox(&parent, &[], 2).await })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !paused(&info.container_id) {
        ensure!(Instant::now() < deadline, "the parent was never frozen");
        ensure!(
            !forking.is_finished(),
            "the fork ended before it was seen frozen"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The call is dropped: its stream is reset.
    forking.abort();
    let deadline = Instant::now() + Duration::from_secs(60);
    let children = loop {
        let all = client.list_sandboxes().await?;
        if all.len() == 3 && !paused(&info.container_id) {
            // Done when no child's record names the parent any more.
            let records = std::fs::read_dir(state.path().join("sandboxes"))?
                .map(|e| std::fs::read_to_string(e?.path()).map_err(anyhow::Error::from))
                .collect::<Result<Vec<_>>>()?;
            if records.iter().all(|r| !r.contains("forking_from")) {
                break all;
            }
        }
        ensure!(
            Instant::now() < deadline,
            "the fork never finished: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for c in children.iter().filter(|c| c.id != parent) {
        let out = run_shell(&client, &c.id, "sha256sum -c /tmp/sums | grep -c OK").await?;
        assert_eq!(out, "4\n", "child {} is whole", c.id);
        client.destroy_sandbox(&c.id).await?;
    }
    client.destroy_sandbox(&parent).await?;
    Ok(())
}

#[tokio::test]
async fn the_command_line_forks_into_pool_members_and_prints_each_child() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("fk"),
        free_port()?,
        &[],
        &["--pool", "corral-sandbox:latest=3"],
    )?;
    let client = worker.client().await?;
    // The pool is full before the parent claims a member, and again after.
    let pool_ready = |n: u32| {
        let client = client.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let pool = client.worker_info().await?.pools[0].clone();
                if pool.ready >= n {
                    return Ok::<_, anyhow::Error>(pool);
                }
                ensure!(Instant::now() < deadline, "the pool never filled: {pool:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    pool_ready(3).await?;
    let parent = client.create_sandbox(None, SandboxSpec::default()).await?;
    run_shell(
        &client,
        &parent.id,
        "mkdir -p /workspace/d && echo from-the-parent > /workspace/d/f && ln -s d/f /workspace/l && chmod 0750 /workspace/d",
    )
    .await?;
    pool_ready(3).await?;
    let corral = |args: &[&str]| {
        std::process::Command::new(corral_e2e::binary("corral").unwrap())
            .args(["--worker", &worker.url])
            .args(args)
            .env("CORRAL_TOKEN_FILE", worker.token_file())
            .env_remove("CORRAL_WORKER")
            .output()
    };
    let out = corral(&["sandbox", "fork", parent.id.as_str(), "--count", "2"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout)?;
    let children: Vec<SandboxId> = stdout
        .lines()
        .map(|l| SandboxId::new(l.trim()))
        .collect::<Result<_, _>>()?;
    assert_eq!(children.len(), 2, "{stdout}");
    // Both children were pool members (claims: the parent and the two).
    let pool = client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (3, 0), "{pool:?}");
    for child in &children {
        assert_ne!(child, &parent.id);
        let out = run_shell(
            &client,
            child,
            "cat /workspace/l; stat -c %a /workspace/d; readlink /workspace/l",
        )
        .await?;
        assert_eq!(out, "from-the-parent\n750\nd/f\n", "{child}");
    }
    // Each child is its own: a write in one is not in the other or the
    // parent.
    run_shell(&client, &children[0], "echo mine > /workspace/d/f").await?;
    for other in [&children[1], &parent.id] {
        assert_eq!(
            run_shell(&client, other, "cat /workspace/d/f").await?,
            "from-the-parent\n"
        );
    }
    // --json names the children too.
    let out = corral(&["sandbox", "fork", parent.id.as_str(), "--json"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["parent"], parent.id.as_str(), "{json}");
    assert_eq!(json["children"].as_array().map(Vec::len), Some(1), "{json}");
    assert!(
        json["frozen_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{json}"
    );
    for sb in client.list_sandboxes().await? {
        client.destroy_sandbox(&sb.id).await?;
    }
    Ok(())
}
