//! Templates through the real `corral` binary: built from a Dockerfile
//! and its context with a start command and a readiness probe, a sandbox
//! of one handed out only once it is ready, the same inputs building
//! nothing, a failed step named, a start command that dies or a probe that
//! never holds refused with the sandbox gone, and a removed template
//! refused by name.

use std::process::Output;

use anyhow::{Context, Result, ensure};
use corral_e2e::{Harness, binary};
use corral_proto::{Reason, SandboxSpec};

async fn corral(h: &Harness, args: &[&str]) -> Result<Output> {
    Ok(tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&h.url)
        .args(args)
        .env_remove("CORRAL_WORKER")
        .env_remove("CORRAL_IMAGE")
        .kill_on_drop(true)
        .output()
        .await?)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A context directory: a Dockerfile and a nonce (so this run builds).
fn context(dockerfile: &str) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("Dockerfile"), dockerfile)?;
    std::fs::write(dir.path().join("nonce"), corral_e2e::unique_id("n"))?;
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templates_sandbox_is_handed_out_ready_and_a_broken_one_never() -> Result<()> {
    let h = Harness::start_with(|c| c.policy.allow_build = true).await?;
    let web = context(
        "FROM corral-debian:latest\nCOPY nonce /srv/nonce\nRUN echo ready > /srv/index.html\n",
    )?;
    let ctx = web.path().to_str().context("path")?;
    let build = [
        "template",
        "build",
        "web",
        ctx,
        "--start",
        "cd /srv && exec python3 -m http.server 8000",
        "--ready-http",
        "8000/index.html",
    ];
    let out = corral(&h, &build).await?;
    ensure!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    ensure!(
        text(&out.stdout).starts_with("template web: corral-build:"),
        "{}",
        text(&out.stdout)
    );
    ensure!(
        text(&out.stderr).contains("Step 3/3"),
        "the engine's output: {}",
        text(&out.stderr)
    );
    // The same inputs build nothing.
    let again = corral(&h, &build).await?;
    ensure!(
        again.status.success() && text(&again.stdout).contains("nothing built"),
        "{}",
        text(&again.stdout)
    );
    let ls = corral(&h, &["template", "ls", "--json"]).await?;
    let listed: serde_json::Value = serde_json::from_slice(&ls.stdout)?;
    ensure!(
        listed[0]["name"] == "web" && listed[0]["ready"] == "http 8000/index.html",
        "{listed}"
    );
    let one = corral(&h, &["template", "inspect", "web"]).await?;
    let one: serde_json::Value = serde_json::from_slice(&one.stdout)?;
    ensure!(one == listed[0], "{one} against {listed}");
    ensure!(
        corral(&h, &["template", "inspect", "nope"])
            .await?
            .status
            .code()
            == Some(1)
    );

    // Made from it: its server answers at once, nothing waited for here.
    let made = corral(&h, &["sandbox", "create", "--template", "web"]).await?;
    ensure!(made.status.success(), "{}", text(&made.stderr));
    let id = corral_proto::SandboxId::new(text(&made.stdout).trim())?;
    let page = h
        .run(&id, "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/index.html').read().decode(), end='')\"")
        .await?;
    ensure!(text(&page.stdout.head) == "ready\n", "{page:?}");
    let info = h.client.get_sandbox(&id).await?;
    ensure!(info.spec.template.as_deref() == Some("web"));

    // A start command that dies, a probe that never holds: refused, with
    // why, and no sandbox left of either.
    let before = h.client.list_sandboxes().await?.len();
    let dies = context("FROM corral-debian:latest\nCOPY nonce /nonce\n")?;
    let dies_ctx = dies.path().to_str().context("path")?;
    let out = corral(
        &h,
        &[
            "template",
            "build",
            "dies",
            dies_ctx,
            "--start",
            "echo bye >&2; exit 3",
            "--ready-port",
            "9",
        ],
    )
    .await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let refused = corral(&h, &["sandbox", "create", "--template", "dies"]).await?;
    ensure!(!refused.status.success());
    let said = text(&refused.stderr);
    ensure!(
        said.contains("start command ended (exit 3)") && said.contains("bye"),
        "{said}"
    );
    let out = corral(
        &h,
        &[
            "template",
            "build",
            "never",
            dies_ctx,
            "--ready-cmd",
            "false",
            "--ready-timeout",
            "2s",
            "-q",
        ],
    )
    .await?;
    ensure!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        text(&out.stderr)
    );
    let never = h
        .client
        .create_sandbox(
            None,
            SandboxSpec {
                template: Some("never".into()),
                ..SandboxSpec::default()
            },
        )
        .await
        .unwrap_err();
    let corral_harness::client::ClientError::Status(s) = &never else {
        anyhow::bail!("{never}");
    };
    ensure!(
        corral_proto::reason::of(s) == Some(Reason::TemplateNotReady),
        "{s:?}"
    );
    ensure!(s.message().contains("not ready within 2 s"), "{s:?}");
    ensure!(
        h.client.list_sandboxes().await?.len() == before,
        "a refused sandbox was left"
    );

    // A create given up on while its probe is tried (the client's
    // deadline) leaves nothing, and its id is free again at once after.
    let out = corral(
        &h,
        &[
            "template",
            "build",
            "slow",
            dies_ctx,
            "--ready-port",
            "9",
            "-q",
        ],
    )
    .await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let mut req = tonic::Request::new(corral_proto::pb::CreateSandboxRequest {
        id: "slow-1".into(),
        spec: Some(
            SandboxSpec {
                template: Some("slow".into()),
                ..SandboxSpec::default()
            }
            .into(),
        ),
    });
    req.set_timeout(std::time::Duration::from_secs(2));
    let given_up = h.client.raw().create_sandbox(req).await.unwrap_err();
    ensure!(
        given_up.code() == tonic::Code::DeadlineExceeded
            || given_up.code() == tonic::Code::Cancelled,
        "{given_up:?}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while h.client.list_sandboxes().await?.len() != before {
        ensure!(
            std::time::Instant::now() < deadline,
            "the given-up sandbox was left"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // A step that fails is named, and keeps no template.
    let broken = context("FROM corral-debian:latest\nRUN exit 7\n")?;
    let out = corral(
        &h,
        &[
            "template",
            "build",
            "broken",
            broken.path().to_str().context("path")?,
            "-q",
        ],
    )
    .await?;
    ensure!(out.status.code() == Some(1), "{out:?}");
    ensure!(
        text(&out.stderr).contains("step 2/2 (RUN exit 7)"),
        "{}",
        text(&out.stderr)
    );
    // Bad names and probes never reach the worker.
    for bad in [
        vec!["template", "build", "Bad/Name", ctx],
        vec!["template", "build", "x", ctx, "--ready-http", "0/"],
    ] {
        let out = corral(&h, &bad).await?;
        ensure!(out.status.code() == Some(2), "{bad:?}: {out:?}");
    }

    // In use (a sandbox of it runs): kept, saying so, unless forced.
    let kept = corral(&h, &["template", "rm", "web"]).await?;
    ensure!(
        kept.status.code() == Some(125)
            && text(&kept.stderr).contains("in use")
            && text(&kept.stderr).contains(id.as_str()),
        "{kept:?}"
    );
    // Removed: refused by name, while its sandboxes go on.
    ensure!(
        corral(&h, &["template", "rm", "web", "--force"])
            .await?
            .status
            .success()
    );
    ensure!(corral(&h, &["template", "rm", "web"]).await?.status.code() == Some(1));
    let gone = corral(&h, &["sandbox", "create", "--template", "web"]).await?;
    ensure!(
        text(&gone.stderr).contains("no template \"web\""),
        "{}",
        text(&gone.stderr)
    );
    ensure!(h.run(&id, "true").await?.outcome.is_success());
    h.stop().await;
    Ok(())
}

/// A command that prints the page the template's server serves.
const FETCH: &str = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/index.html').read().decode())\"";

/// Template `name`: a page (the context's nonce) served on port 8000 by its
/// start command, ready once the port accepts. Its context (the nonce in
/// it) is returned.
async fn served_site(h: &Harness, name: &str) -> Result<tempfile::TempDir> {
    let site = context("FROM corral-debian:latest\nCOPY nonce /srv/index.html\n")?;
    let out = corral(
        h,
        &[
            "template",
            "build",
            name,
            site.path().to_str().context("path")?,
            "--start",
            "cd /srv && exec python3 -m http.server 8000",
            "--ready-port",
            "8000",
            "-q",
        ],
    )
    .await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    Ok(site)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templates_pool_keeps_members_started_and_ready() -> Result<()> {
    let h = Harness::start_with(|c| {
        c.policy.allow_build = true;
        c.pools = vec!["template:pooled=1".parse().expect("a pool")];
    })
    .await?;
    // The pool waits for its template, then fills.
    let _site = served_site(&h, "pooled").await?;
    let ready = || async {
        let info = h.client.worker_info().await?;
        anyhow::Ok(info.pools.first().map_or(0, |p| p.ready))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while ready().await? < 1 {
        ensure!(
            std::time::Instant::now() < deadline,
            "the template's pool never filled"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // Claimed, its server already up: started once, in the member.
    let sb = h
        .client
        .create_sandbox(
            None,
            SandboxSpec {
                template: Some("pooled".into()),
                ..SandboxSpec::default()
            },
        )
        .await?
        .id;
    let info = h.client.worker_info().await?;
    ensure!(
        info.pools[0].claims == 1,
        "not claimed from the pool: {:?}",
        info.pools
    );
    let page = h.run(&sb, FETCH).await?;
    ensure!(page.outcome.is_success(), "{page:?}");
    let ops = h.client.list_operations(&sb).await?;
    let starts = ops
        .iter()
        .filter(|o| o.id.as_str() == corral_proto::template::START_OPERATION)
        .count();
    ensure!(starts == 1, "{ops:?}");
    h.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_run_works_in_a_sandbox_of_a_template() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    let h = Harness::start_with(|c| c.policy.allow_build = true).await?;
    let site = served_site(&h, "served").await?;
    let nonce = std::fs::read_to_string(site.path().join("nonce"))?;
    // The model's one command reaches the server the template started: it
    // was ready before the run's first turn.
    let model = ModelServer::start(vec![
        responses::calls(&[(
            "call_1",
            "Bash",
            &serde_json::json!({ "command": FETCH }).to_string(),
        )]),
        responses::text("fetched"),
    ])
    .await;
    let sessions = tempfile::tempdir()?;
    let run = corral_e2e::run::corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--template", "served", "fetch the page"],
    )
    .await?;
    ensure!(run.code == 0, "{}", run.stderr);
    let said = run.of_type("tool_result")[0]["text"].to_string();
    ensure!(said.contains(nonce.trim()), "{said}");
    // A template that does not exist: the run says so and records nothing.
    let run = corral_e2e::run::corral_run(
        &model,
        &h.url,
        sessions.path(),
        &["--template", "missing", "x"],
    )
    .await?;
    ensure!(
        run.code != 0 && run.stderr.contains("no template"),
        "{}",
        run.stderr
    );
    h.stop().await;
    Ok(())
}

/// Debian's `docker-registry`, serving on a loopback port of its own from
/// a directory of the test's; stopped when dropped.
struct Registry {
    child: std::process::Child,
    address: String,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let port = corral_e2e::free_port()?;
        let address = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  delete:\n    enabled: true\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {address}\n",
                dir.path().join("data").display()
            ),
        )?;
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("docker-registry (Debian's package) is needed")?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(&address).is_err() {
            ensure!(
                std::time::Instant::now() < deadline,
                "the registry did not listen"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(Self {
            child,
            address,
            _dir: dir,
        })
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn docker(args: &[&str]) -> std::process::Output {
    std::process::Command::new("docker")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("docker: {e}"))
}

/// Two workers and the fleet's registry: a template built through one
/// starts on the other (pulled by its digest, the first worker's copy of
/// it gone from the engine); built again under its name, the other serves
/// the new build at its next create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_built_on_one_worker_starts_on_another_through_the_registry() -> Result<()> {
    use corral_e2e::{WorkerProcess, free_port, unique_id};
    let registry = Registry::start()?;
    let (da, db) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let args = ["--registry", registry.address.as_str(), "--allow-build"];
    let a = WorkerProcess::spawn(da.path(), &unique_id("rega"), free_port()?, &[], &args)?;
    let b = WorkerProcess::spawn(db.path(), &unique_id("regb"), free_port()?, &[], &args[..2])?;
    let build = |w: &WorkerProcess, ctx: &std::path::Path| {
        let mut cmd = tokio::process::Command::new(binary("corral").expect("corral"));
        cmd.arg("--worker")
            .arg(&w.url)
            .arg("--token-file")
            .arg(w.token_file())
            .args(["template", "build", "web"])
            .arg(ctx)
            .args([
                "--start",
                "cd /srv && exec python3 -m http.server 8000",
                "--ready-http",
                "8000/v.txt",
                "--quiet",
            ])
            .env_remove("CORRAL_WORKER")
            .kill_on_drop(true);
        cmd
    };
    let fetch = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/v.txt').read().decode(), end='')\"";
    let spec = SandboxSpec {
        template: Some("web".into()),
        ..SandboxSpec::default()
    };
    let mut pulled = Vec::new();
    for version in ["one", "two"] {
        let ctx = context(&format!(
            "FROM corral-debian:latest\nCOPY nonce /srv/nonce\nRUN echo {version} > /srv/v.txt\n"
        ))?;
        let out = build(&a, ctx.path()).output().await?;
        ensure!(
            out.status.success(),
            "{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        // What the first worker's engine has of the pushed image goes: the
        // other worker must pull it.
        let tagged = format!("{}/corral-templates:_.web", registry.address);
        let gone = docker(&["rmi", &tagged]);
        ensure!(gone.status.success(), "{}", text(&gone.stderr));
        let cb = b.client().await?;
        let sb = cb.create_sandbox(None, spec.clone()).await?;
        let image = sb.image.clone();
        ensure!(
            image.starts_with(&format!("{}/corral-templates@sha256:", registry.address)),
            "{image}"
        );
        let page = corral_e2e::run_shell(&cb, &sb.id, fetch).await?;
        ensure!(page == format!("{version}\n"), "{version}: {page:?}");
        cb.destroy_sandbox(&sb.id).await?;
        pulled.push(image);
    }
    ensure!(pulled[0] != pulled[1], "{pulled:?}");
    // Removed through one worker: out of the registry, so neither takes
    // it again.
    let rm = tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&a.url)
        .arg("--token-file")
        .arg(a.token_file())
        .args(["template", "rm", "web"])
        .env_remove("CORRAL_WORKER")
        .output()
        .await?;
    ensure!(rm.status.success(), "{rm:?}");
    for w in [&a, &b] {
        let e = w
            .client()
            .await?
            .create_sandbox(None, spec.clone())
            .await
            .err()
            .context("a removed template was taken again")?;
        ensure!(
            e.reason() == Some(corral_proto::Reason::NoSuchTemplate),
            "{e}"
        );
    }
    drop(b);
    drop(a);
    for image in &pulled {
        let _ = docker(&["rmi", image]);
    }
    Ok(())
}

/// A worker whose pool is of a template it has never had fills the pool
/// from the fleet's registry once the template is built elsewhere, with
/// no create asking for it first; a sandbox of it is then a pool claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_pool_fills_from_the_registry_before_any_create() -> Result<()> {
    use corral_e2e::{WorkerProcess, free_port, unique_id};
    let registry = Registry::start()?;
    let (da, db) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let name = unique_id("pooled").to_lowercase();
    let pool = format!("template:{name}=1");
    let a = WorkerProcess::spawn(
        da.path(),
        &unique_id("rpa"),
        free_port()?,
        &[],
        &["--registry", registry.address.as_str(), "--allow-build"],
    )?;
    let b = WorkerProcess::spawn(
        db.path(),
        &unique_id("rpb"),
        free_port()?,
        &[],
        &[
            "--registry",
            registry.address.as_str(),
            "--pool",
            pool.as_str(),
        ],
    )?;
    let ctx = context("FROM corral-debian:latest\nCOPY nonce /srv/nonce\n")?;
    let out = tokio::process::Command::new(binary("corral")?)
        .arg("--worker")
        .arg(&a.url)
        .arg("--token-file")
        .arg(a.token_file())
        .args(["template", "build", &name])
        .arg(ctx.path())
        .args(["--start", "sleep infinity", "--quiet"])
        .env_remove("CORRAL_WORKER")
        .kill_on_drop(true)
        .output()
        .await?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let cb = b.client().await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let info = cb.worker_info().await?;
        let p = info.pools.first().context("no pool")?;
        if p.ready == 1 {
            ensure!(p.claims == 0 && p.misses == 0, "{p:?}");
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the pool did not fill from the registry: {p:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    let sb = cb
        .create_sandbox(
            None,
            SandboxSpec {
                template: Some(name.clone()),
                ..SandboxSpec::default()
            },
        )
        .await?;
    let image = sb.image.clone();
    ensure!(
        image.starts_with(&format!("{}/corral-templates@sha256:", registry.address)),
        "{image}"
    );
    let info = cb.worker_info().await?;
    ensure!(info.pools[0].claims == 1, "{:?}", info.pools[0]);
    let nonce = corral_e2e::run_shell(&cb, &sb.id, "cat /srv/nonce").await?;
    ensure!(
        nonce == std::fs::read_to_string(ctx.path().join("nonce"))?,
        "{nonce:?}"
    );
    cb.destroy_sandbox(&sb.id).await?;
    drop(b);
    drop(a);
    let _ = docker(&["rmi", &image]);
    Ok(())
}

/// A running sandbox saved as a template: each sandbox of it starts with
/// the workspace it had (files, modes, links; its user's now), not its
/// processes, nor the environment a client gave it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_saved_as_a_template_hands_its_workspace_to_the_next() -> Result<()> {
    let h = Harness::start().await?;
    let mut spec = SandboxSpec::default();
    spec.env.insert("SECRET".into(), "hunter2".into());
    let first = h.client.create_sandbox(None, spec).await?.id;
    let made = h
        .run(
            &first,
            "mkdir -p d/e && echo one > d/a.txt && chmod 600 d/a.txt && ln -s d/a.txt link && \
             truncate -s 10M d/sparse && ln -s ../x d/up && mkfifo d/pipe && \
             (sleep 1000 > /dev/null 2>&1 &) && echo made",
        )
        .await?;
    ensure!(text(&made.stdout.head) == "made\n", "{made:?}");
    let name = corral_e2e::unique_id("saved");
    let out = corral(&h, &["sandbox", "snapshot", first.as_str(), &name]).await?;
    ensure!(
        out.status.success() && text(&out.stdout).contains("corral-snapshot:"),
        "{out:?}"
    );
    let image = text(&out.stdout)
        .split_whitespace()
        .last()
        .context("no image")?
        .to_string();
    let next = corral(&h, &["sandbox", "create", "--template", &name]).await?;
    ensure!(next.status.success(), "{next:?}");
    let next = corral_proto::SandboxId::new(text(&next.stdout).trim())?;
    let seen = h
        .run(
            &next,
            "cat link; stat -c '%a %u' d/a.txt; id -u; [ -d d/e ] && echo dir; \
             [ $(stat -c %s d/sparse) = 10485760 ] && [ $(readlink d/up) = ../x ] || echo lost; \
             [ -e d/pipe ] && echo a FIFO came along; \
             echo two >> d/a.txt && cat d/a.txt; echo \"SECRET=$SECRET\"; \
             ps -o args | grep -c '[s]leep 1000'",
        )
        .await?;
    let lines: Vec<String> = text(&seen.stdout.head).lines().map(String::from).collect();
    ensure!(lines.len() == 8, "{lines:?}");
    ensure!(lines[0] == "one", "{lines:?}");
    let (mode, owner) = lines[1].split_once(' ').context("stat")?;
    ensure!(mode == "600" && owner == lines[2], "{lines:?}");
    ensure!(
        lines[3] == "dir" && lines[4] == "one" && lines[5] == "two",
        "{lines:?}"
    );
    ensure!(
        lines[6] == "SECRET=",
        "a client's environment went into the image: {lines:?}"
    );
    ensure!(lines[7] == "0", "a process came with the files: {lines:?}");
    // The sandbox it was saved from is as it was.
    let kept = h.run(&first, "cat d/a.txt").await?;
    ensure!(text(&kept.stdout.head) == "one\n");
    // Saved again from a sandbox of the snapshot: what it removed stays
    // removed.
    h.run(&next, "rm d/a.txt && echo new > n.txt").await?;
    let again = corral_e2e::unique_id("again");
    let out = corral(&h, &["sandbox", "snapshot", next.as_str(), &again]).await?;
    ensure!(out.status.success(), "{out:?}");
    let second_image = text(&out.stdout)
        .split_whitespace()
        .last()
        .context("no image")?
        .to_string();
    let third = corral(&h, &["sandbox", "create", "--template", &again]).await?;
    ensure!(third.status.success(), "{third:?}");
    let third = corral_proto::SandboxId::new(text(&third.stdout).trim())?;
    let seen = h.run(&third, "ls d; cat n.txt").await?;
    ensure!(
        !text(&seen.stdout.head).contains("a.txt") && text(&seen.stdout.head).ends_with("new\n"),
        "{seen:?}"
    );
    // Bad input: a name, a sandbox that is not there.
    let bad = corral(&h, &["sandbox", "snapshot", first.as_str(), "Bad/Name"]).await?;
    ensure!(
        !bad.status.success() && text(&bad.stderr).contains("a template's name"),
        "{bad:?}"
    );
    let none = corral(&h, &["sandbox", "snapshot", "nope", &name]).await?;
    ensure!(!none.status.success(), "{none:?}");
    for id in [&first, &next, &third] {
        h.client.destroy_sandbox(id).await?;
    }
    for (t, i) in [(&name, &image), (&again, &second_image)] {
        ensure!(corral(&h, &["template", "rm", t]).await?.status.success());
        let _ = std::process::Command::new("docker")
            .args(["rmi", i])
            .output();
    }
    h.stop().await;
    Ok(())
}

/// A worker keeps at most `--max-templates` templates of each tenant: one
/// more is refused by its count, a template built again under its name is
/// not one more, and a removed one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_as_many_templates_as_its_operator_says() -> Result<()> {
    let h = Harness::start_with(|c| {
        c.policy.allow_build = true;
        c.max_templates = 2;
    })
    .await?;
    let ctx = context("FROM corral-debian:latest\nCOPY nonce /nonce\n")?;
    let dir = ctx.path().to_str().context("path")?;
    let build = |name: &'static str| {
        let h = &h;
        async move { corral(h, &["template", "build", name, dir, "-q"]).await }
    };
    for name in ["one", "two", "two"] {
        let out = build(name).await?;
        ensure!(out.status.success(), "{name}: {}", text(&out.stderr));
    }
    let third = build("three").await?;
    ensure!(
        !third.status.success()
            && text(&third.stderr).contains("at most 2 templates are kept for each tenant"),
        "{}",
        text(&third.stderr)
    );
    let rm = corral(&h, &["template", "rm", "one"]).await?;
    ensure!(rm.status.success(), "{}", text(&rm.stderr));
    let third = build("three").await?;
    ensure!(third.status.success(), "{}", text(&third.stderr));
    h.stop().await;
    Ok(())
}
