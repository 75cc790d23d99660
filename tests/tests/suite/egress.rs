//! Egress by policy, end to end: a real worker (its flags), real sandboxes
//! of the Debian image with network none, real clients in them (python3,
//! git, curl), upstream servers on 127.0.0.2 with a test CA, and names
//! served by a DNS server of the test's own. Nothing leaves loopback: the
//! internal and metadata addresses are refused before any connection.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_e2e::egress::{Pki, Upstream, pki};
use corral_e2e::{WorkerProcess, binary, free_port, run_shell, unique_id};
use corral_harness::client::WorkerClient;
use corral_proto::egress::Rule;
use corral_proto::event::EgressDecision;
use corral_proto::reason::Reason;
use corral_proto::{EventKind, OperationSpec, SandboxId, SandboxSpec, WriteFileSpec};
use futures_util::StreamExt;

use super::fleet::{sample, scrape};

/// Where the upstream servers listen (exempted with
/// --egress-allow-internal, as an operator exempts a package mirror).
const UPSTREAM_IP: &str = "127.0.0.2";

/// The probe: speaks to the sandbox's proxy directly, so each answer's
/// status and `X-Corral-Egress` header can be read, and for a tunnel that
/// is let through, says whether TLS with `SNI` got through.
const PROBE: &str = r#"
import socket, ssl, sys
def ask(head, sni=None):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(head.encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    lines = data.split(b"\r\n")
    status = lines[0].split(b" ")[1].decode() if b" " in lines[0] else "none"
    egress = "-"
    for l in lines:
        if l.lower().startswith(b"x-corral-egress:"):
            egress = l.split(b":", 1)[1].strip().decode()
    tls = "-"
    if sni is not None and status == "200":
        ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
        ctx.check_hostname = False
        try:
            t = ctx.wrap_socket(s, server_hostname=sni)
            t.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            tls = "ok" if b"hello from upstream" in t.recv(4096) + t.recv(4096) else "no-greeting"
        except (ssl.SSLError, OSError) as e:
            tls = "closed"
    print(f"status={status} egress={egress} tls={tls}")
kind = sys.argv[1]
if kind == "connect":
    ask(f"CONNECT {sys.argv[2]} HTTP/1.1\r\nHost: {sys.argv[2]}\r\n\r\n", sys.argv[3] if len(sys.argv) > 3 else None)
elif kind == "get":
    ask(f"GET {sys.argv[2]} HTTP/1.1\r\nHost: {sys.argv[3]}\r\nConnection: close\r\n\r\n")
elif kind == "raw":
    ask(sys.argv[2].encode().decode("unicode_escape"))
"#;

/// A GET of `http://HOST:PORT/hello` through the proxy `$HTTP_PROXY`
/// names, by bash's /dev/tcp: the answer, head and body.
const GET_SH: &str = r#"proxy=${HTTP_PROXY#http://}
exec 3<>"/dev/tcp/${proxy%:*}/${proxy##*:}" || exit 1
printf 'GET http://%s/hello HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "$1" "$1" >&3
cat <&3
"#;

/// A worker with egress, the DNS server and upstreams it reaches.
struct Net {
    worker: WorkerProcess,
    client: WorkerClient,
    metrics_port: u16,
    up: Upstream,
    pki: Pki,
    args: Vec<String>,
    _dns: tokio::task::JoinHandle<()>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl Drop for Net {
    fn drop(&mut self) {
        self.worker.kill9();
        corral_e2e::remove_containers_of(&self.worker.worker_id);
    }
}

/// Names the test's DNS server answers: `pkg.test`, `other.test`,
/// `sub.test` the upstream; `internal.test` an RFC 1918 address;
/// `meta.test` the metadata address; `rebind.test` the upstream at first,
/// then the metadata address.
async fn start() -> Result<Net> {
    start_with(&[]).await
}

/// [`start`], the worker given `extra` flags too.
async fn start_with(extra: &[&str]) -> Result<Net> {
    let lookups = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&lookups);
    let (dns, dns_task) = corral_worker::dns::testing::serve(move |name, qtype| {
        let ip = |s: &str| s.parse::<IpAddr>().into_iter().collect::<Vec<_>>();
        match (name, qtype) {
            ("pkg.test" | "other.test" | "sub.test", 1) => ip(UPSTREAM_IP),
            ("internal.test", 1) => ip("10.20.30.40"),
            ("meta.test", 1) => ip("169.254.169.254"),
            ("rebind.test", 1) => {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    ip(UPSTREAM_IP)
                } else {
                    ip("169.254.169.254")
                }
            }
            _ => vec![],
        }
    })
    .await?;
    let files = tempfile::tempdir()?;
    git_repo(files.path())?;
    let pki = pki(&["pkg.test", "other.test"])?;
    let up = Upstream::start(UPSTREAM_IP, files.path(), &pki).await?;
    let state = tempfile::tempdir()?;
    let metrics_port = free_port()?;
    let mut args = vec![
        "--allow-image".to_string(),
        "corral-debian:latest".into(),
        "--allow-egress".into(),
        "*".into(),
        "--egress-allow-internal".into(),
        "127.0.0.0/8".into(),
        "--egress-resolver".into(),
        dns.to_string(),
        "--metrics-listen".into(),
        format!("127.0.0.1:{metrics_port}"),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let worker = spawn(state.path(), &unique_id("eg"), free_port()?, &args)?;
    let client = worker.client().await?;
    Ok(Net {
        worker,
        client,
        metrics_port,
        up,
        pki,
        args,
        _dns: dns_task,
        _dirs: (files, state),
    })
}

fn spawn(state: &std::path::Path, id: &str, port: u16, args: &[String]) -> Result<WorkerProcess> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    WorkerProcess::spawn(state, id, port, &[], &args)
}

/// A bare repository served over git's dumb HTTP: `repo.git` with one
/// commit holding `README`.
fn git_repo(root: &std::path::Path) -> Result<()> {
    let work = root.join("work");
    std::fs::create_dir(&work)?;
    std::fs::write(work.join("README"), "served through the worker\n")?;
    let git = |dir: &std::path::Path, args: &[&str]| -> Result<()> {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", root)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()?;
        if !out.status.success() {
            bail!("git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    git(&work, &["init", "-q"])?;
    git(&work, &["add", "README"])?;
    git(&work, &["commit", "-qm", "one"])?;
    git(root, &["clone", "-q", "--bare", "work", "repo.git"])?;
    git(&root.join("repo.git"), &["update-server-info"])?;
    Ok(())
}

impl Net {
    /// SIGKILL, and the same worker again (state, id, port, flags).
    async fn restart(&mut self) -> Result<()> {
        self.worker.kill9();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (state, id, port) = (
            self.worker.state_dir.clone(),
            self.worker.worker_id.clone(),
            self.worker.port,
        );
        let fresh = spawn(&state, &id, port, &self.args)?;
        // The old one's drop removes the worker's containers: forgotten,
        // its process is gone already.
        std::mem::forget(std::mem::replace(&mut self.worker, fresh));
        self.client = self.worker.client().await?;
        Ok(())
    }

    fn rules(&self, rules: &[String]) -> Result<Vec<Rule>> {
        Ok(corral_proto::egress::parse_rules(rules, false)?)
    }

    /// A Debian sandbox with `rules`, the CA and the probe in its workspace.
    async fn sandbox(&self, rules: &[String]) -> Result<SandboxId> {
        self.sandbox_as(rules, |_| {}).await
    }

    /// [`Self::sandbox`], its spec changed by `tweak` first.
    async fn sandbox_as(
        &self,
        rules: &[String],
        tweak: impl FnOnce(&mut SandboxSpec),
    ) -> Result<SandboxId> {
        let id = SandboxId::new(unique_id("sb"))?;
        let mut spec = SandboxSpec {
            image: Some("corral-debian:latest".into()),
            egress: self.rules(rules)?,
            env: [
                ("SSL_CERT_FILE", "/workspace/ca.pem"),
                ("GIT_SSL_CAINFO", "/workspace/ca.pem"),
                ("CURL_CA_BUNDLE", "/workspace/ca.pem"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..SandboxSpec::default()
        };
        tweak(&mut spec);
        self.client.create_sandbox(Some(&id), spec).await?;
        self.write(&id, "/workspace/ca.pem", self.pki.ca_pem.as_bytes())
            .await?;
        self.write(&id, "/workspace/probe.py", PROBE.as_bytes())
            .await?;
        Ok(id)
    }

    async fn write(&self, sb: &SandboxId, path: &str, data: &[u8]) -> Result<()> {
        let spec = OperationSpec::WriteFile(WriteFileSpec::new(
            path,
            bytes::Bytes::copy_from_slice(data),
        ));
        let op = corral_proto::OperationId::random();
        let after = self.client.get_sandbox(sb).await?.last_seq;
        self.client.submit(sb, &op, spec).await?;
        let (_, r) = corral_e2e::collect(&self.client, sb, &op, after).await?;
        if !r.outcome.is_success() {
            bail!("writing {path}: {r:?}");
        }
        Ok(())
    }

    async fn sh(&self, sb: &SandboxId, cmd: &str) -> Result<String> {
        run_shell(&self.client, sb, cmd).await
    }

    /// curl in the sandbox gets the upstream's /hello over HTTP and HTTPS.
    async fn curl_hello(&self, sb: &SandboxId) -> Result<()> {
        let (p, s) = (self.up.http.port(), self.up.https.port());
        for url in [
            format!("http://pkg.test:{p}/hello"),
            format!("https://pkg.test:{s}/hello"),
        ] {
            let got = self.sh(sb, &format!("curl -sS {url} 2>&1")).await?;
            ensure!(got.trim() == "hello from upstream", "{url}: {got}");
        }
        Ok(())
    }

    /// The probe's line for these arguments.
    async fn probe(&self, sb: &SandboxId, args: &str) -> Result<String> {
        Ok(self
            .sh(sb, &format!("python3 /workspace/probe.py {args} 2>&1"))
            .await?
            .trim()
            .to_string())
    }

    /// Every egress event of the sandbox so far: (host, port, decision,
    /// reason).
    async fn egress_events(
        &self,
        sb: &SandboxId,
    ) -> Result<Vec<(String, u16, EgressDecision, String)>> {
        let last = self.client.get_sandbox(sb).await?.last_seq;
        let mut stream = self.client.watch(sb, 0, None).await?;
        let mut out = Vec::new();
        while let Some(e) = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .context("events")?
        {
            let e = e?;
            if let EventKind::Egress(g) = &e.kind {
                out.push((g.host.clone(), g.port, g.decision, g.reason.clone()));
            }
            if e.seq >= last {
                break;
            }
        }
        Ok(out)
    }

    /// The sandbox's `blocked` egress events, once there are at least
    /// `n` (an event travels through the supervisor's journal, so it may
    /// land just after the command that caused it ends).
    async fn blocked_events(
        &self,
        sb: &SandboxId,
        n: usize,
    ) -> Result<Vec<(String, u16, EgressDecision, String)>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let blocked: Vec<_> = self
                .egress_events(sb)
                .await?
                .into_iter()
                .filter(|(_, _, d, _)| *d == EgressDecision::Blocked)
                .collect();
            if blocked.len() >= n || Instant::now() > deadline {
                return Ok(blocked);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn metric(&self, decision: &str, reason: &str) -> Result<f64> {
        let text = scrape(self.metrics_port).await?;
        Ok(sample(
            &text,
            &format!(
                "corral_egress_connections_total{{decision=\"{decision}\",reason=\"{reason}\"}}"
            ),
        )
        .unwrap_or(0.0))
    }
}

/// Under gVisor a sandbox's socket cannot be handed to the worker (its
/// network stack is gVisor's own): the relay carries the bytes, and the
/// worker decides as it does for any sandbox.
#[tokio::test]
async fn under_gvisor_the_relay_carries_what_the_policy_allows() -> Result<()> {
    let net = start_with(&["--allow-runtime", "runsc"]).await?;
    let (p, s) = (net.up.http.port(), net.up.https.port());
    let sb = net
        .sandbox_as(&[format!("pkg.test:{p}"), format!("pkg.test:{s}")], |s| {
            s.runtime = Some("runsc".into());
        })
        .await?;
    net.curl_hello(&sb).await?;
    // 8 MiB, whole, through the carried path.
    let out = net
        .sh(
            &sb,
            &format!("curl -sS http://pkg.test:{p}/bytes/8388608 | wc -c"),
        )
        .await?;
    assert_eq!(out.trim(), "8388608");
    // Refused as anywhere: another port, another name.
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} pkg.test"))
            .await?,
        "status=200 egress=- tls=ok"
    );
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} other.test"))
            .await?,
        "status=200 egress=- tls=closed",
        "a ClientHello naming another host"
    );
    assert_eq!(
        net.probe(&sb, "connect pkg.test:9").await?,
        "status=403 egress=blocked; reason=port tls=-"
    );
    let out = net.probe(&sb, "connect other.test:443 other.test").await?;
    assert!(
        out.starts_with("status=403 egress=blocked; reason=not_allowed"),
        "{out}"
    );
    net.client.destroy_sandbox(&sb).await?;
    Ok(())
}

/// A sandbox made with the proxy and no rule reaches nothing until given a
/// policy; a policy emptied later keeps the proxy; both across a worker
/// restart (an emptied one came back without its proxy: 503).
#[tokio::test]
async fn a_closed_sandbox_keeps_its_proxy_to_be_opened_later_across_restarts() -> Result<()> {
    let mut net = start().await?;
    let s = net.up.https.port();
    let open = net.rules(&[format!("pkg.test:{s}")])?;
    let sb = net.sandbox_as(&[], |s| s.egress_proxy = true).await?;
    let env = net.sh(&sb, "echo $HTTPS_PROXY").await?;
    assert_eq!(env.trim(), "http://127.0.0.1:3128");
    let tunnel = format!("connect pkg.test:{s} pkg.test");
    let blocked = "status=403 egress=blocked; reason=not_allowed tls=-";
    let opened = "status=200 egress=- tls=ok";
    assert_eq!(net.probe(&sb, &tunnel).await?, blocked);
    net.restart().await?;
    assert_eq!(net.probe(&sb, &tunnel).await?, blocked);
    net.client.set_sandbox_egress(&sb, &open).await?;
    assert_eq!(net.probe(&sb, &tunnel).await?, opened);
    // Emptied, then the worker restarted: still closed, not gone.
    net.client.set_sandbox_egress(&sb, &[]).await?;
    assert_eq!(net.probe(&sb, &tunnel).await?, blocked);
    net.restart().await?;
    assert_eq!(net.probe(&sb, &tunnel).await?, blocked);
    net.client.set_sandbox_egress(&sb, &open).await?;
    assert_eq!(net.probe(&sb, &tunnel).await?, opened);
    Ok(())
}

#[tokio::test]
async fn allowed_names_are_reached_over_http_and_https_by_python_git_and_curl() -> Result<()> {
    let net = start().await?;
    let (p, s) = (net.up.http.port(), net.up.https.port());
    let sb = net
        .sandbox(&[format!("pkg.test:{p}"), format!("pkg.test:{s}")])
        .await?;
    let py = |url: String| {
        format!(
            "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"{url}\").read().decode().strip())' 2>&1"
        )
    };
    assert_eq!(
        net.sh(&sb, &py(format!("http://pkg.test:{p}/hello")))
            .await?
            .trim(),
        "hello from upstream"
    );
    assert_eq!(
        net.sh(&sb, &py(format!("https://pkg.test:{s}/hello")))
            .await?
            .trim(),
        "hello from upstream"
    );
    net.curl_hello(&sb).await?;
    for (n, url) in [
        format!("http://pkg.test:{p}/repo.git"),
        format!("https://pkg.test:{s}/repo.git"),
    ]
    .iter()
    .enumerate()
    {
        let out = net
            .sh(
                &sb,
                &format!("git clone -q {url} /workspace/c{n} 2>&1 && cat /workspace/c{n}/README"),
            )
            .await?;
        assert_eq!(out.trim(), "served through the worker", "{url}: {out}");
    }
    // Each went through the worker, and says so.
    let events = net.egress_events(&sb).await?;
    assert!(
        events
            .iter()
            .any(|(h, port, d, _)| h == "pkg.test" && *port == s && *d == EgressDecision::Allowed),
        "{events:?}"
    );
    assert!(net.metric("allowed", "").await? >= 6.0);
    // A reset kills every process but the supervisor, the relay too: it is
    // started again on the port the supervisor kept.
    net.client.reset_sandbox(&sb).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = net
            .sh(&sb, &format!("curl -sS http://pkg.test:{p}/hello 2>&1"))
            .await?;
        if out.trim() == "hello from upstream" {
            break;
        }
        if Instant::now() > deadline {
            bail!("no egress after a reset: {out}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test]
async fn everything_else_is_refused_with_its_reason_in_the_answer_the_event_and_the_metric()
-> Result<()> {
    let net = start().await?;
    let (p, s) = (net.up.http.port(), net.up.https.port());
    let grpc = net.worker.port;
    let m = net.metrics_port;
    let sb = net
        .sandbox(&[
            format!("pkg.test:{p}"),
            format!("pkg.test:{s}"),
            format!("*.sub.test:{s}"),
            format!("internal.test:{p}"),
            format!("rebind.test:{p}"),
            format!("meta.test:{p}"),
            "169.254.169.254/32:80".into(),
            format!("127.0.0.1/32:{grpc}"),
            format!("127.0.0.1/32:{m}"),
            format!("[::1/128]:{p}"),
        ])
        .await?;
    // The tunnel asked for, with the right name, goes through.
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} pkg.test"))
            .await?,
        "status=200 egress=- tls=ok"
    );
    // Each refusal: its reason in the 403, an event naming its host and
    // port, and one more in the metric of its reason.
    let refused: Vec<(String, &str, &str, u16)> = vec![
        (
            format!("connect other.test:{s}"),
            "not_allowed",
            "other.test",
            s,
        ),
        (
            format!("connect pkg.test:{}", s.wrapping_add(1).max(1)),
            "port",
            "pkg.test",
            s.wrapping_add(1).max(1),
        ),
        (
            format!("connect sub.test:{s}"),
            "not_allowed",
            "sub.test",
            s,
        ),
        (
            format!("connect {UPSTREAM_IP}:{s}"),
            "not_allowed",
            UPSTREAM_IP,
            s,
        ),
        (
            format!("connect internal.test:{p}"),
            "internal_address",
            "internal.test",
            p,
        ),
        (
            format!("connect meta.test:{p}"),
            "internal_address",
            "meta.test",
            p,
        ),
        (
            "connect 169.254.169.254:80".to_string(),
            "internal_address",
            "169.254.169.254",
            80,
        ),
        (
            format!("connect 127.0.0.1:{grpc}"),
            "internal_address",
            "127.0.0.1",
            grpc,
        ),
        (
            format!("connect 127.0.0.1:{m}"),
            "internal_address",
            "127.0.0.1",
            m,
        ),
        (format!("connect [::1]:{p}"), "internal_address", "::1", p),
        (
            format!("get http://pkg.test:{p}/hello other.test"),
            "host_mismatch",
            "pkg.test",
            p,
        ),
    ];
    let mut seen = 0;
    for (args, reason, host, port) in &refused {
        let before = net.metric("blocked", reason).await?;
        assert_eq!(
            net.probe(&sb, args).await?,
            format!("status=403 egress=blocked; reason={reason} tls=-"),
            "{args}"
        );
        assert_eq!(net.metric("blocked", reason).await?, before + 1.0, "{args}");
        let events = net.blocked_events(&sb, seen + 1).await?;
        let new: Vec<_> = events.iter().skip(seen).collect();
        assert_eq!(
            new,
            [&(
                host.to_string(),
                *port,
                EgressDecision::Blocked,
                reason.to_string()
            )],
            "{args}"
        );
        seen += 1;
    }
    // A name whose answer turns internal between two lookups: the second
    // connection is refused, never made.
    assert_eq!(
        net.probe(
            &sb,
            &format!("get http://rebind.test:{p}/hello rebind.test:{p}")
        )
        .await?,
        "status=200 egress=- tls=-"
    );
    let before = net.metric("blocked", "internal_address").await?;
    assert_eq!(
        net.probe(
            &sb,
            &format!("get http://rebind.test:{p}/hello rebind.test:{p}")
        )
        .await?,
        "status=403 egress=blocked; reason=internal_address tls=-"
    );
    assert_eq!(
        net.metric("blocked", "internal_address").await?,
        before + 1.0
    );
    // A tunnel whose TLS names another host: let in, then closed.
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} other.test"))
            .await?,
        "status=200 egress=- tls=closed"
    );
    assert_eq!(net.metric("blocked", "sni_mismatch").await?, 1.0);
    let blocked_now = net.blocked_events(&sb, seen + 2).await?;
    let blocked: Vec<_> = blocked_now
        .iter()
        .skip(seen)
        .map(|(h, port, _, r)| (h.as_str(), *port, r.as_str()))
        .collect();
    let events = net.egress_events(&sb).await?;
    assert_eq!(
        blocked,
        [
            ("rebind.test", p, "internal_address"),
            ("pkg.test", s, "sni_mismatch")
        ]
    );
    // No way around the proxy: no resolver, no route, no proxy variables.
    let around = net
        .sh(
            &sb,
            &format!(
                "getent hosts pkg.test >/dev/null && echo resolved; \
                 python3 -c 'import socket; socket.create_connection((\"192.0.2.1\", 80), timeout=5)' 2>/dev/null && echo raw; \
                 python3 -c 'import socket; socket.create_connection((\"{UPSTREAM_IP}\", {p}), timeout=5)' 2>/dev/null && echo upstream; \
                 env -u HTTP_PROXY -u http_proxy -u HTTPS_PROXY -u https_proxy curl -sS -m 5 http://pkg.test:{p}/hello >/dev/null 2>&1 && echo direct; \
                 python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b\"x\", (\"192.0.2.53\", 53))' 2>/dev/null && echo udp; \
                 echo done"
            ),
        )
        .await?;
    assert_eq!(around.trim(), "done", "{around}");
    // Nothing the sandbox did around the proxy reached it.
    let after = net.egress_events(&sb).await?;
    assert_eq!(after.len(), events.len(), "{after:?}");
    Ok(())
}

#[tokio::test]
async fn an_address_range_is_reached_over_https_and_a_rate_bounds_what_moves() -> Result<()> {
    let net = start_with(&["--egress-max-bytes-per-second", "1m"]).await?;
    let (p, s) = (net.up.http.port(), net.up.https.port());
    let sb = net
        .sandbox(&[
            format!("{UPSTREAM_IP}/32:{s}"),
            format!("{UPSTREAM_IP}/32:{p}"),
        ])
        .await?;
    // TLS names no address: a range's HTTPS goes through without a name
    // (the certificate is for names, so curl is told not to check it).
    assert_eq!(
        net.sh(
            &sb,
            &format!("curl -sS -k https://{UPSTREAM_IP}:{s}/hello 2>&1")
        )
        .await?
        .trim(),
        "hello from upstream"
    );
    // 3 MiB at 1 MiB a second, after a second's burst: two seconds at
    // least, however fast loopback is.
    let out = net
        .sh(
            &sb,
            &format!(
                "curl -sS -o /dev/null -w '%{{size_download}} %{{time_total}}' http://{UPSTREAM_IP}:{p}/bytes/3145728 2>&1"
            ),
        )
        .await?;
    let (size, secs) = out
        .trim()
        .split_once(' ')
        .with_context(|| format!("curl said {out:?}"))?;
    assert_eq!(size, "3145728", "{out}");
    let secs: f64 = secs.parse()?;
    assert!(secs >= 1.8, "3 MiB at 1 MiB/s in {secs} s");
    // Counted as it moved.
    let text = scrape(net.metrics_port).await?;
    let inward = sample(&text, "corral_egress_bytes_total{direction=\"in\"}").unwrap_or(0.0);
    assert!(inward >= 3145728.0, "{inward}");
    Ok(())
}

#[tokio::test]
async fn a_pool_member_claimed_with_rules_is_served_them_at_once_and_so_are_its_forks() -> Result<()>
{
    let net = start_with(&["--pool", "corral-sandbox:latest=3"]).await?;
    let p = net.up.http.port();
    let ready = |n: u32| {
        let client = net.client.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let pool = client.worker_info().await?.pools[0].clone();
                if pool.ready >= n {
                    return Ok::<_, anyhow::Error>(pool);
                }
                if Instant::now() > deadline {
                    bail!("the pool never filled: {pool:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    ready(3).await?;
    let spec = SandboxSpec {
        egress: net.rules(&[format!("pkg.test:{p}")])?,
        ..SandboxSpec::default()
    };
    let sb = net.client.create_sandbox(None, spec).await?;
    // A claim, not a cold create.
    let pool = net.client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (1, 0), "{pool:?}");
    // A request to the proxy its environment names, by bash's /dev/tcp
    // (the image's wget wants a resolver); nothing else is reached.
    let get = |host: &str| format!("bash /workspace/get.sh {host}:{p}");
    net.write(&sb.id, "/workspace/get.sh", GET_SH.as_bytes())
        .await?;
    let out = net.sh(&sb.id, &get("pkg.test")).await?;
    assert!(
        out.starts_with("HTTP/1.1 200") && out.ends_with("hello from upstream\n"),
        "{out}"
    );
    let out = net.sh(&sb.id, &get("other.test")).await?;
    assert!(
        out.starts_with("HTTP/1.1 403") && out.contains("reason=not_allowed"),
        "{out}"
    );
    let events = net.blocked_events(&sb.id, 1).await?;
    assert!(
        events.contains(&(
            "other.test".into(),
            p,
            EgressDecision::Blocked,
            "not_allowed".into()
        )),
        "{events:?}"
    );
    // A member claimed without rules has no proxy at all.
    ready(2).await?;
    let plain = net
        .client
        .create_sandbox(None, SandboxSpec::default())
        .await?;
    net.write(&plain.id, "/workspace/get.sh", GET_SH.as_bytes())
        .await?;
    let out = net
        .sh(
            &plain.id,
            &format!("HTTP_PROXY=http://127.0.0.1:3128 bash /workspace/get.sh pkg.test:{p} 2>&1; echo \"[$HTTP_PROXY]\""),
        )
        .await?;
    assert!(
        out.contains("Connection refused") && out.ends_with("[]\n"),
        "{out}"
    );
    // A fork of the sandbox with rules: its children come from the pool
    // and are served the parent's rules.
    ready(3).await?;
    let forked = net.client.fork_sandbox(&sb.id, &[], 2).await?;
    let pool = net.client.worker_info().await?.pools[0].clone();
    assert_eq!((pool.claims, pool.misses), (4, 0), "{pool:?}");
    for child in &forked.children {
        let out = net.sh(&child.id, &get("pkg.test")).await?;
        assert!(out.ends_with("hello from upstream\n"), "{out}");
    }
    // Each is removed with its socket directory.
    for id in [&sb.id, &plain.id]
        .into_iter()
        .chain(forked.children.iter().map(|c| &c.id))
    {
        net.client.destroy_sandbox(id).await?;
        assert!(
            !net.worker
                .state_dir
                .join("egress")
                .join(id.as_str())
                .exists(),
            "{id}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_name_nobody_resolves_is_refused_as_such() -> Result<()> {
    let net = start().await?;
    let p = net.up.http.port();
    let sb = net.sandbox(&[format!("gone.test:{p}")]).await?;
    assert_eq!(
        net.probe(&sb, &format!("connect gone.test:{p}")).await?,
        "status=403 egress=blocked; reason=resolve_failed tls=-"
    );
    assert_eq!(net.metric("blocked", "resolve_failed").await?, 1.0);
    assert_eq!(
        net.blocked_events(&sb, 1).await?,
        [(
            "gone.test".to_string(),
            p,
            EgressDecision::Blocked,
            "resolve_failed".to_string()
        )]
    );
    Ok(())
}

/// A mail server on the upstream address: it speaks first (its
/// greeting), as SMTP, FTP and MySQL servers do, and sends each message it
/// is given on the channel.
async fn mail_server() -> Result<(u16, tokio::sync::mpsc::Receiver<String>)> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind((UPSTREAM_IP, 0)).await?;
    let port = l.local_addr()?.port();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let mut lines = tokio::io::BufReader::new(r).lines();
                w.write_all(b"220 mail.test ESMTP\r\n").await?;
                while let Some(line) = lines.next_line().await? {
                    let verb = line.get(..4).unwrap_or("").to_ascii_uppercase();
                    let answer: &[u8] = match verb.as_str() {
                        "EHLO" | "HELO" => b"250 mail.test\r\n",
                        "MAIL" | "RCPT" => b"250 ok\r\n",
                        "DATA" => {
                            w.write_all(b"354 go on\r\n").await?;
                            let mut message = String::new();
                            while let Some(l) = lines.next_line().await? {
                                if l == "." {
                                    break;
                                }
                                message.push_str(&l);
                                message.push('\n');
                            }
                            let _ = tx.send(message).await;
                            b"250 queued\r\n"
                        }
                        "QUIT" => {
                            w.write_all(b"221 bye\r\n").await?;
                            break;
                        }
                        _ => b"500 what\r\n",
                    };
                    w.write_all(answer).await?;
                }
                anyhow::Ok(())
            });
        }
    });
    Ok((port, rx))
}

#[tokio::test]
async fn a_server_that_speaks_first_is_reached_through_a_tunnel() -> Result<()> {
    let net = start().await?;
    let (port, mut mail) = mail_server().await?;
    let sb = net.sandbox(&[format!("{UPSTREAM_IP}/32:{port}")]).await?;
    net.write(
        &sb,
        "/workspace/mail.txt",
        b"Subject: hello\r\n\r\nsent from the sandbox\r\n",
    )
    .await?;
    // curl tunnels SMTP through the proxy, then waits for the server's
    // greeting before it says a word: the tunnel must not wait for the
    // client's first bytes (it did, until the head timeout closed it, 10
    // s on: curl gives up before that).
    let out = net
        .sh(
            &sb,
            &format!(
                "curl -sS --max-time 8 -p -x \"$HTTP_PROXY\" smtp://{UPSTREAM_IP}:{port} \
                 --mail-from a@sandbox.test --mail-rcpt b@mail.test -T /workspace/mail.txt 2>&1; echo rc=$?"
            ),
        )
        .await?;
    assert_eq!(out.trim(), "rc=0", "{out}");
    let message = tokio::time::timeout(Duration::from_secs(10), mail.recv())
        .await?
        .context("no message")?;
    assert!(message.contains("sent from the sandbox"), "{message}");
    // Allowed when the tunnel was connected (the event may land just after
    // the command).
    let allowed = (
        UPSTREAM_IP.to_string(),
        port,
        EgressDecision::Allowed,
        String::new(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !net.egress_events(&sb).await?.contains(&allowed) {
        ensure!(Instant::now() < deadline, "no allowed event");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_replaced_policy_applies_at_once_and_cuts_what_it_no_longer_allows() -> Result<()> {
    let mut net = start().await?;
    let (p, s) = (net.up.http.port(), net.up.https.port());
    let sb = net.sandbox(&[format!("pkg.test:{p}")]).await?;
    // A download that never ends, in the background.
    let op = corral_proto::OperationId::random();
    let mut shell = corral_proto::ShellSpec::new(format!(
        "curl -sS http://pkg.test:{p}/stream > /dev/null; echo \"curl ended $?\""
    ));
    shell.timeout_ms = Some(120_000);
    let after = net.client.get_sandbox(&sb).await?.last_seq;
    net.client
        .submit(&sb, &op, OperationSpec::Shell(shell))
        .await?;
    // Under way: the sandbox reports the connection allowed.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !net
        .egress_events(&sb)
        .await?
        .iter()
        .any(|e| e.2 == EgressDecision::Allowed)
    {
        if Instant::now() > deadline {
            bail!("the download never started");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Replaced by the CLI: only the HTTPS port now.
    let asked = Instant::now();
    let out = tokio::process::Command::new(binary("corral")?)
        .args([
            "--worker",
            &net.worker.url,
            "sandbox",
            "egress",
            sb.as_str(),
        ])
        .arg(format!("pkg.test:{s}"))
        .env("CORRAL_TOKEN_FILE", net.worker.token_file())
        .env_remove("CORRAL_WORKER")
        .output()
        .await?;
    let answered = Instant::now();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{sb}: egress pkg.test:{s}")
    );
    let cut = tokio::time::timeout(Duration::from_secs(10), net.up.cuts.recv())
        .await
        .context("the download was never cut")?
        .context("no cut")?;
    // Measured from the answer of the call (the CLI's start-up is not the
    // worker's doing); the server sees the cut on its next write.
    let after_answer = cut.saturating_duration_since(answered);
    eprintln!(
        "cut {:?} after the call was answered ({:?} after it was asked)",
        after_answer,
        cut.saturating_duration_since(asked)
    );
    assert!(
        after_answer < Duration::from_millis(100),
        "cut {after_answer:?} after the policy changed"
    );
    let (_, r) = corral_e2e::collect(&net.client, &sb, &op, after).await?;
    assert!(r.outcome.is_success(), "{r:?}");
    // New connections follow the new policy at once.
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{p}")).await?,
        "status=403 egress=blocked; reason=port tls=-"
    );
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} pkg.test"))
            .await?,
        "status=200 egress=- tls=ok"
    );
    let events = net.egress_events(&sb).await?;
    assert!(
        events.iter().any(|(h, port, d, r)| h == "pkg.test"
            && *port == p
            && *d == EgressDecision::Closed
            && r == "port"),
        "{events:?}"
    );
    assert!(net.metric("closed", "port").await? >= 1.0);
    // A worker killed and started again keeps the new policy and serves
    // it on the same socket path.
    net.restart().await?;
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{s} pkg.test"))
            .await?,
        "status=200 egress=- tls=ok"
    );
    assert_eq!(
        net.probe(&sb, &format!("connect pkg.test:{p}")).await?,
        "status=403 egress=blocked; reason=port tls=-"
    );
    Ok(())
}

#[tokio::test]
async fn what_the_worker_does_not_allow_is_refused_naming_the_flag() -> Result<()> {
    let state = tempfile::tempdir()?;
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("eg"),
        free_port()?,
        &[],
        &["--allow-egress", "*.pypi.org,files.pythonhosted.org"],
    )?;
    let client = worker.client().await?;
    let ask = |rules: &[&str]| SandboxSpec {
        egress: corral_proto::egress::parse_rules(rules, false).unwrap(),
        ..SandboxSpec::default()
    };
    for rules in [&["pypi.org"][..], &["github.com"], &["*.pypi.org:22"]] {
        let e = client
            .create_sandbox(None, ask(rules))
            .await
            .expect_err("beyond the bound");
        assert_eq!(e.reason(), Some(Reason::PolicyDenied), "{e}");
        assert_eq!(e.flag().as_deref(), Some("--allow-egress"), "{e}");
        assert!(e.to_string().contains("--allow-egress"), "{e}");
    }
    // Within it: made, and shown with its rules.
    let sb = client
        .create_sandbox(None, ask(&["files.pypi.org", "files.pythonhosted.org:443"]))
        .await?;
    assert_eq!(sb.spec.egress.len(), 2);
    // A replacement is bounded as a create is.
    let e = client
        .set_sandbox_egress(
            &sb.id,
            &corral_proto::egress::parse_rules(&["evil.test"], false)?,
        )
        .await
        .expect_err("beyond the bound");
    assert_eq!(e.flag().as_deref(), Some("--allow-egress"), "{e}");
    // The command line asks the same, and says which flag would allow it.
    let corral = |args: &[&str]| {
        std::process::Command::new(binary("corral").unwrap())
            .args(["--worker", &worker.url])
            .args(args)
            .env("CORRAL_TOKEN_FILE", worker.token_file())
            .env_remove("CORRAL_WORKER")
            .output()
    };
    for args in [
        &["sandbox", "create", "--egress", "github.com"][..],
        &[
            "exec",
            "--egress",
            "files.pypi.org",
            "--egress",
            "github.com",
            "--",
            "true",
        ],
    ] {
        let out = corral(args)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.contains("--allow-egress"), "{args:?}: {stderr}");
    }
    let out = corral(&[
        "exec",
        "--egress",
        "files.pypi.org",
        "--",
        "sh",
        "-c",
        "echo $HTTPS_PROXY $http_proxy",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "http://127.0.0.1:3128 http://127.0.0.1:3128"
    );
    // So does a run whose request asks for more than the worker allows,
    // before any model is asked.
    let sessions = tempfile::tempdir()?;
    let req = sessions.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::json!({"prompt": "x", "network": {"egress": ["github.com"]}}).to_string(),
    )?;
    let out = corral(&[
        "run",
        "--json",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--image",
        "corral-sandbox:latest",
        "--sessions-dir",
        sessions.path().to_str().unwrap(),
        "--request",
        req.to_str().unwrap(),
    ])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--allow-egress"), "{stderr}");
    let out = corral(&["sandbox", "create", "--egress", "files.pypi.org:443"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let made = SandboxId::new(String::from_utf8_lossy(&out.stdout).trim())?;
    let rules: Vec<String> = client
        .get_sandbox(&made)
        .await?
        .spec
        .egress
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(rules, ["files.pypi.org:443"]);
    // --egress-proxy: the proxy, no rule; a policy given later is taken.
    let out = corral(&["sandbox", "create", "--egress-proxy"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let closed = SandboxId::new(String::from_utf8_lossy(&out.stdout).trim())?;
    let info = client.get_sandbox(&closed).await?;
    assert!(info.spec.egress_proxy && info.spec.egress.is_empty());
    client
        .set_sandbox_egress(
            &closed,
            &corral_proto::egress::parse_rules(&["files.pypi.org"], false)?,
        )
        .await?;
    // A sandbox made without egress has no proxy to change.
    let plain = client.create_sandbox(None, SandboxSpec::default()).await?;
    let e = client
        .set_sandbox_egress(&plain.id, &[])
        .await
        .expect_err("no proxy");
    assert_eq!(e.reason(), Some(Reason::InvalidArgument), "{e}");
    // Egress is for a sandbox without a network; `*` is a worker's word.
    let mut bridged = ask(&["files.pypi.org"]);
    bridged.network = corral_proto::NetworkMode::Bridge;
    assert!(client.create_sandbox(None, bridged).await.is_err());
    let raw = corral_proto::pb::SandboxSpec {
        egress: vec!["*".into()],
        ..Default::default()
    };
    assert!(corral_proto::SandboxSpec::try_from(raw).is_err());
    for sb in client.list_sandboxes().await? {
        client.destroy_sandbox(&sb.id).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_hostile_sandbox_harms_neither_the_worker_nor_its_neighbour() -> Result<()> {
    let net = start().await?;
    let p = net.up.http.port();
    let hostile = net.sandbox(&[format!("pkg.test:{p}")]).await?;
    let neighbour = net.sandbox(&[format!("pkg.test:{p}")]).await?;
    // Things handed to the worker's socket that are not connections; a
    // thousand connections at once, held open; a CONNECT line that never
    // ends; a megabyte of headers.
    let flood = format!(
        r#"
import os, socket, time
# Straight to the worker's socket, things handed over that are not a
# connection: a pipe, a listening socket, fifty descriptors, none.
def hand(fds):
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.connect("/run/corral-egress/proxy.sock")
    socket.send_fds(u, [b"\0"], fds)
    return u
r, w = os.pipe()
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen()
zero = os.open("/dev/zero", os.O_RDONLY)
kept = [hand([r]), hand([lst.fileno()]), hand([zero] * 50), hand([])]
# A connection of its own handed over: the policy still decides.
a = socket.create_connection(lst.getsockname(), timeout=30)
b, _ = lst.accept()
kept.append(hand([b.fileno()]))
b.close()
a.sendall(b"GET http://elsewhere.test/ HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n")
print("handed", a.recv(4096).split(b"\r\n")[0].decode())
slow = socket.create_connection(("127.0.0.1", 3128), timeout=30)
slow.sendall(b"CONNECT pkg.te")
big = socket.create_connection(("127.0.0.1", 3128), timeout=30)
try:
    big.sendall(b"GET http://pkg.test:{p}/hello HTTP/1.1\r\n" + b"X-A: " + b"a" * (1 << 20) + b"\r\n\r\n")
except OSError:
    pass
answer = b""
try:
    while b"\r\n\r\n" not in answer:
        chunk = big.recv(4096)
        if not chunk:
            break
        answer += chunk
except OSError:
    pass
# A thousand connects started at once, then waited for together.
import selectors
sel = selectors.DefaultSelector()
pending = []
for i in range(1000):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", 3128))
    sel.register(s, selectors.EVENT_WRITE)
    pending.append(s)
held = []
deadline = time.time() + 30
while len(held) < 1000 and time.time() < deadline:
    for key, _ in sel.select(timeout=1):
        sel.unregister(key.fileobj)
        if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            held.append(key.fileobj)
print("held", len(held))
# The CONNECT line that never ended is closed by its deadline, unanswered.
slow.settimeout(20)
try:
    print("slow", slow.recv(100))
except OSError as e:
    print("slow", type(e).__name__)
print("big", answer.split(b"\r\n")[0].decode(), [l.decode() for l in answer.split(b"\r\n") if l.lower().startswith(b"x-corral-egress")])
open("/workspace/flood-ready", "w").close()
import os
for _ in range(600):
    if os.path.exists("/workspace/flood-stop"):
        break
    time.sleep(0.1)
"#
    );
    net.write(&hostile, "/workspace/flood.py", flood.as_bytes())
        .await?;
    let op = corral_proto::OperationId::random();
    let after = net.client.get_sandbox(&hostile).await?.last_seq;
    net.client
        .submit(
            &hostile,
            &op,
            OperationSpec::Shell(corral_proto::ShellSpec::new("python3 /workspace/flood.py")),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while net
        .sh(&hostile, "test -e /workspace/flood-ready && echo y")
        .await?
        .trim()
        != "y"
    {
        if Instant::now() > deadline {
            bail!("the flood never got going");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // While the flood holds its connections: the neighbour reaches its
    // host, the worker answers, the hostile sandbox's own commands run.
    let hello = net
        .sh(
            &neighbour,
            &format!("curl -sS -m 10 http://pkg.test:{p}/hello 2>&1"),
        )
        .await?;
    assert_eq!(hello.trim(), "hello from upstream");
    assert_eq!(net.sh(&hostile, "echo alive").await?.trim(), "alive");
    net.client.list_sandboxes().await?;
    net.sh(&hostile, "touch /workspace/flood-stop").await?;
    let (events, r) = corral_e2e::collect(&net.client, &hostile, &op, after).await?;
    assert!(r.outcome.is_success(), "{r:?}");
    let out = String::from_utf8_lossy(&corral_e2e::stdout_of(&events)).into_owned();
    assert!(out.contains("held 1000"), "{out}");
    assert!(
        out.contains(
            "big HTTP/1.1 400 Bad Request ['X-Corral-Egress: blocked; reason=bad_request']"
        ),
        "{out}"
    );
    assert!(out.contains("slow b''"), "{out}");
    assert!(out.contains("handed HTTP/1.1 403"), "{out}");
    // The bound refused what was over it, and said so: in the metric and
    // on the sandbox's event stream.
    assert!(net.metric("blocked", "too_many_connections").await? >= 1.0);
    let events = net.egress_events(&hostile).await?;
    assert!(
        events
            .iter()
            .any(|(_, _, d, r)| *d == EgressDecision::Blocked && r == "too_many_connections"),
        "{:?}",
        &events[..events.len().min(5)]
    );
    assert!(net.metric("blocked", "bad_request").await? >= 1.0);
    // Once the flood is gone, the hostile sandbox is served again.
    assert_eq!(
        net.sh(
            &hostile,
            &format!("curl -sS -m 10 http://pkg.test:{p}/hello 2>&1")
        )
        .await?
        .trim(),
        "hello from upstream"
    );
    Ok(())
}

#[tokio::test]
async fn a_run_reaches_what_its_request_names_and_records_each_decision() -> Result<()> {
    use corral_e2e::model::{ModelServer, responses};
    use corral_harness::agent::Record;
    use corral_harness::session::log::SessionLog;
    let net = start().await?;
    let p = net.up.http.port();
    let command = format!(
        "curl -sS http://pkg.test:{p}/hello; curl -sS -o /dev/null -w 'other %{{http_code}}' http://other.test:{p}/hello"
    );
    let args = serde_json::json!({ "command": command }).to_string();
    let model = ModelServer::start(vec![
        responses::calls(&[("c1", "Bash", &args)]),
        responses::text("done"),
    ])
    .await;
    let sessions = tempfile::tempdir()?;
    let req = sessions.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::json!({
            "prompt": "fetch the greeting",
            "network": {"egress": [format!("pkg.test:{p}")]}
        })
        .to_string(),
    )?;
    let token = net.worker.token_file();
    let run = corral_e2e::run::corral_run_env(
        &model,
        &net.worker.url,
        sessions.path(),
        &["--session", "net", "--request", req.to_str().unwrap()],
        &[
            ("CORRAL_TOKEN_FILE", token.to_str().unwrap()),
            ("CORRAL_IMAGE", "corral-debian:latest"),
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let result = &run.of_type("tool_result")[0]["text"];
    let text = result.as_str().unwrap_or_default();
    assert!(text.contains("hello from upstream"), "{text}");
    assert!(text.contains("other 403"), "{text}");
    // Each decision is in the JSON events...
    let egress = run.of_type("egress");
    assert!(
        egress
            .iter()
            .any(|e| e["host"] == "pkg.test" && e["decision"] == "allowed"),
        "{egress:?}"
    );
    assert!(
        egress.iter().any(|e| e["host"] == "other.test"
            && e["decision"] == "blocked"
            && e["reason"] == "not_allowed"),
        "{egress:?}"
    );
    // ... and in the session's log.
    let records: Vec<Record> = SessionLog::<Record>::records(sessions.path(), "net")?
        .map(|r| r.map(|(_, r)| r))
        .collect::<Result<_, _>>()?;
    assert!(
        records.iter().any(
            |r| matches!(r, Record::Egress { host, decision, reason, .. }
            if host == "other.test"
                && *decision == corral_proto::event::EgressDecision::Blocked
                && reason == "not_allowed")
        ),
        "{records:?}"
    );
    // The model was told what it can reach.
    let first = &model.received()[0].body;
    let bash = first["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "Bash"))
        .context("no Bash tool")?;
    let description = bash["description"].as_str().unwrap_or_default();
    assert!(
        description.contains(&format!("pkg.test:{p}")),
        "{description}"
    );
    // A rule the worker does not allow, or `*`, is refused before any run.
    std::fs::write(
        &req,
        serde_json::json!({"prompt": "x", "network": {"egress": ["*"]}}).to_string(),
    )?;
    let run = corral_e2e::run::corral_run_env(
        &model,
        &net.worker.url,
        sessions.path(),
        &["--request", req.to_str().unwrap()],
        &[("CORRAL_TOKEN_FILE", token.to_str().unwrap())],
    )
    .await?;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("network.egress"), "{}", run.stderr);
    Ok(())
}

/// A keep-alive front end on the upstream's address: it answers every
/// request of a connection with the Host it was sent and its path, as a
/// shared front end routes by Host. Its port.
async fn front_end() -> Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind((UPSTREAM_IP, 0)).await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut chunk).await {
                            Ok(n) if n > 0 && buf.len() < 65536 => {
                                buf.extend_from_slice(&chunk[..n]);
                                continue;
                            }
                            _ => return,
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let header = |name: &str| {
                        head.lines()
                            .filter_map(|l| l.split_once(':'))
                            .find(|(n, _)| n.eq_ignore_ascii_case(name))
                            .map(|(_, v)| v.trim().to_string())
                    };
                    let host = header("host").unwrap_or_default();
                    let len: usize = header("content-length")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    let mut rest = buf.split_off(end + 4);
                    while rest.len() < len {
                        match s.read(&mut chunk).await {
                            Ok(n) if n > 0 => rest.extend_from_slice(&chunk[..n]),
                            _ => return,
                        }
                    }
                    buf = rest.split_off(len);
                    let body = format!("host={host} path={path}\n");
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// What a proxied connection of the sandbox gets back for `raw`, its parts
/// (between lines `---`) sent one at a time, each once the answers to the
/// one before have come (read until the proxy closes, or is quiet for a
/// second).
const RAW: &str = r#"
import os, socket, sys
proxy = os.environ["http_proxy"].split("//")[1].rstrip("/")
host, port = proxy.rsplit(":", 1)
s = socket.create_connection((host, int(port)))
s.settimeout(1)
out = b""
for part in sys.stdin.buffer.read().split(b"\n---\n"):
    try:
        s.sendall(part.replace(b"\n", b"\r\n"))
    except OSError:
        break
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except OSError:
        pass
sys.stdout.write(out.decode("latin-1"))
"#;

/// Every request a plain-HTTP connection carries is checked, not only its
/// first: a pipelined or keep-alive request for another host, a request
/// smuggled by ambiguous framing, and plain HTTP inside a CONNECT tunnel
/// naming another host never reach the allowed server, while keep-alive to
/// the allowed host goes on working.
#[tokio::test]
async fn every_request_of_a_plain_http_connection_is_checked() -> Result<()> {
    let net = start().await?;
    let fe = front_end().await?;
    let sb = net.sandbox(&[format!("pkg.test:{fe}")]).await?;
    net.write(&sb, "/workspace/raw.py", RAW.as_bytes()).await?;
    let send = |raw: String| {
        let net = &net;
        let sb = sb.clone();
        async move {
            let cmd = format!("printf '%s' '{raw}' | python3 /workspace/raw.py");
            net.sh(&sb, &cmd).await
        }
    };
    let ok = |what: &str| format!("host=pkg.test:{fe} path={what}");
    let req = |url: &str, host: &str| format!("GET {url} HTTP/1.1\nHost: {host}:{fe}\n\n");
    let (a, b) = (
        format!("http://pkg.test:{fe}/a"),
        format!("http://pkg.test:{fe}/b"),
    );
    // Keep-alive to the allowed host: every answer comes, pipelined or not.
    let got = send(format!("{}{}", req(&a, "pkg.test"), req(&b, "pkg.test"))).await?;
    ensure!(got.contains(&ok("/a")) && got.contains(&ok("/b")), "{got}");
    let got = send(format!(
        "{}\n---\n{}",
        req(&a, "pkg.test"),
        req(&b, "pkg.test")
    ))
    .await?;
    ensure!(got.contains(&ok("/a")) && got.contains(&ok("/b")), "{got}");
    // A second request for another host, or the allowed URL with another
    // Host (fronting), pipelined or after the first answer: never sent.
    let other = format!("http://other.test:{fe}/b");
    for second in [req(&other, "other.test"), req(&b, "other.test")] {
        let got = send(format!("{}{second}", req(&a, "pkg.test"))).await?;
        ensure!(!got.contains("host=other.test"), "{got}");
        ensure!(got.contains("reason=host_mismatch"), "{got}");
        let got = send(format!("{}\n---\n{second}", req(&a, "pkg.test"))).await?;
        ensure!(got.contains(&ok("/a")), "{got}");
        ensure!(!got.contains("host=other.test"), "{got}");
    }
    // A request smuggled in a body by Content-Length against chunked.
    let got = send(format!(
        "POST {a} HTTP/1.1\nHost: pkg.test:{fe}\nContent-Length: 48\nTransfer-Encoding: chunked\n\n0\n\nGET /b HTTP/1.1\nHost: other.test:{fe}\n\n"
    ))
    .await?;
    ensure!(got.contains("reason=bad_request"), "{got}");
    ensure!(!got.contains("host="), "{got}");
    // Plain HTTP in a tunnel: the tunnel's host only, request after request.
    let connect = format!("CONNECT pkg.test:{fe} HTTP/1.1\nHost: pkg.test:{fe}\n\n");
    let got = send(format!(
        "{connect}\n---\n{}{}",
        req("/a", "pkg.test"),
        req("/b", "pkg.test")
    ))
    .await?;
    ensure!(got.contains(&ok("/a")) && got.contains(&ok("/b")), "{got}");
    let got = send(format!("{connect}\n---\n{}", req("/a", "other.test"))).await?;
    ensure!(!got.contains("host="), "{got}");
    let got = send(format!(
        "{connect}\n---\n{}\n---\n{}",
        req("/a", "pkg.test"),
        req("/b", "other.test")
    ))
    .await?;
    ensure!(
        got.contains(&ok("/a")) && !got.contains("host=other.test"),
        "{got}"
    );
    // Each refusal is an egress event that says why.
    let events = net.egress_events(&sb).await?;
    ensure!(
        events
            .iter()
            .any(|(_, _, d, r)| *d == EgressDecision::Blocked && r == "host_mismatch"),
        "{events:?}"
    );
    ensure!(
        events
            .iter()
            .any(|(_, _, d, r)| *d == EgressDecision::Blocked && r == "bad_request"),
        "{events:?}"
    );
    Ok(())
}
