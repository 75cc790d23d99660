//! Egress through the worker against going straight to the server, in one
//! run: the same client (curl) fetches from the same upstream on 127.0.0.2,
//! once from a sandbox (network none; its loopback proxy, corral-init's
//! relay, the worker's Unix socket, the worker's decision and connection;
//! the worker is the release binary in its own process, as deployed) and
//! once on the host, directly.
//!
//! - time to the first byte of a small answer, over a new connection each
//!   time (curl's `time_starttransfer`, 200 requests in one curl process):
//!   what the proxy path adds to a connection;
//! - the same over HTTPS (CONNECT, the ClientHello's name checked; curl's
//!   `time_appconnect`, the TLS handshake done);
//! - a 200 MB download (curl's `speed_download`), fifteen runs each, interleaved
//!   (`CORRAL_EGRESS_BENCH_BYTES` sets another size, to profile a longer
//!   transfer).
//!
//! Run: `cargo bench -p corral-e2e --bench egress` after `deploy/build.sh`
//! (the static corral-init, the Debian image with curl). Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::process::Command;

use anyhow::{Context, Result, bail};
use corral_e2e::egress::{Upstream, pki};
use corral_e2e::{WorkerProcess, free_port, run_shell, unique_id};
use corral_proto::{SandboxId, SandboxSpec};

const REQUESTS: usize = 200;
const BYTES: u64 = 200_000_000;
const RUNS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// curl's per-transfer figures of `what` (seconds), one line each.
fn figures(out: &str) -> Result<Vec<f64>> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse::<f64>()
                .with_context(|| format!("not a figure: {l:?}"))
        })
        .collect()
}

fn curl_args(what: &str, urls: &[String], ca: &str) -> Vec<String> {
    let mut a = vec![
        "-s".to_string(),
        "--cacert".into(),
        ca.into(),
        "-o".into(),
        "/dev/null".into(),
        "-w".into(),
        format!("%{{{what}}}\\n"),
    ];
    for u in urls {
        a.push(u.clone());
        a.push("-o".into());
        a.push("/dev/null".into());
    }
    a
}

fn host_curl(args: &[String]) -> Result<String> {
    let out = Command::new("curl").args(args).output()?;
    if !out.status.success() {
        bail!("curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn quote(args: &[String]) -> String {
    args.iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::main]
async fn main() -> Result<()> {
    let files = tempfile::tempdir()?;
    let pki = pki(&["pkg.test"])?;
    let up = Upstream::start("127.0.0.2", files.path(), &pki).await?;
    let ca = files.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem)?;
    let (http, https) = (up.http.port(), up.https.port());
    // Names are the worker's to resolve: a DNS server of the bench's own.
    let (dns, _dns) = corral_worker::dns::testing::serve(|name, qtype| match (name, qtype) {
        ("pkg.test", 1) => "127.0.0.2".parse().into_iter().collect(),
        _ => Vec::new(),
    })
    .await?;
    // The worker as it is deployed: the release binary in its own process
    // (in the bench's process it would share a runtime with the upstream,
    // and hand bytes from one to the other on the same thread).
    let state = tempfile::tempdir()?;
    let resolver = dns.to_string();
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("egb"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &[
            "--allow-egress",
            "*",
            "--egress-allow-internal",
            "127.0.0.2/32",
            "--egress-resolver",
            &resolver,
        ],
    )?;
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(
            Some(&sb),
            SandboxSpec {
                image: Some("corral-debian:latest".into()),
                cpu_millis: Some(2000),
                egress: corral_proto::egress::parse_rules(
                    &[format!("pkg.test:{http}"), format!("pkg.test:{https}")],
                    false,
                )?,
                ..SandboxSpec::default()
            },
        )
        .await?;
    let write = corral_proto::OperationSpec::WriteFile(corral_proto::WriteFileSpec::new(
        "/workspace/ca.pem",
        pki.ca_pem.clone().into_bytes(),
    ));
    let op = corral_proto::OperationId::random();
    let after = client.get_sandbox(&sb).await?.last_seq;
    client.submit(&sb, &op, write).await?;
    corral_e2e::collect(&client, &sb, &op, after).await?;
    let sandbox_curl = |args: Vec<String>| {
        let (client, sb) = (&client, &sb);
        async move {
            let cmd = format!("curl {}", quote(&args));
            run_shell(client, sb, &cmd).await
        }
    };

    // The same URLs both ways: the host's curl is told where pkg.test is
    // (--resolve), the sandbox's asks its proxy, whose worker resolves it.
    let plain: Vec<String> = (0..REQUESTS)
        .map(|_| format!("http://pkg.test:{http}/hello"))
        .collect();
    let tls: Vec<String> = (0..REQUESTS)
        .map(|_| format!("https://pkg.test:{https}/hello"))
        .collect();
    let ca_host = ca.to_str().unwrap_or_default().to_string();
    let direct = |what: &str, urls: &[String]| {
        let mut a = curl_args(what, urls, &ca_host);
        for port in [http, https] {
            a.insert(0, format!("pkg.test:{port}:127.0.0.2"));
            a.insert(0, "--resolve".into());
        }
        host_curl(&a)
    };
    let mut direct_ttfb = Vec::new();
    let mut proxied_ttfb = Vec::new();
    let mut direct_tls = Vec::new();
    let mut proxied_tls = Vec::new();
    for _ in 0..2 {
        direct_ttfb.extend(figures(&direct("time_starttransfer", &plain)?)?);
        proxied_ttfb.extend(figures(
            &sandbox_curl(curl_args("time_starttransfer", &plain, "/workspace/ca.pem")).await?,
        )?);
        direct_tls.extend(figures(&direct("time_appconnect", &tls)?)?);
        proxied_tls.extend(figures(
            &sandbox_curl(curl_args("time_appconnect", &tls, "/workspace/ca.pem")).await?,
        )?);
    }
    let mut direct_speed = Vec::new();
    let mut proxied_speed = Vec::new();
    let bytes = match std::env::var("CORRAL_EGRESS_BENCH_BYTES") {
        Ok(v) => v.parse().context("CORRAL_EGRESS_BENCH_BYTES")?,
        Err(_) => BYTES,
    };
    let big = vec![format!("http://pkg.test:{http}/bytes/{bytes}")];
    for _ in 0..RUNS {
        direct_speed.extend(figures(&direct("speed_download", &big)?)?);
        proxied_speed.extend(figures(
            &sandbox_curl(curl_args("speed_download", &big, "/workspace/ca.pem")).await?,
        )?);
    }
    let ms = |v: f64| v * 1000.0;
    println!(
        "| {REQUESTS}x2 new connections, curl | direct (host) | through the worker | overhead |"
    );
    println!("|---|---|---|---|");
    let row = |what: &str, d: &[f64], p: &[f64]| {
        println!(
            "| {what} p50 | {:.3} ms | {:.3} ms | {:+.3} ms |",
            ms(median(d.to_vec())),
            ms(median(p.to_vec())),
            ms(median(p.to_vec()) - median(d.to_vec()))
        );
        println!(
            "| {what} p99 | {:.3} ms | {:.3} ms | {:+.3} ms |",
            ms(p99(d.to_vec())),
            ms(p99(p.to_vec())),
            ms(p99(p.to_vec()) - p99(d.to_vec()))
        );
    };
    row("HTTP, first byte", &direct_ttfb, &proxied_ttfb);
    row("HTTPS, handshake done", &direct_tls, &proxied_tls);
    println!();
    let mib = |v: f64| v / (1 << 20) as f64;
    let (d, p) = (median(direct_speed), median(proxied_speed));
    println!(
        "| {} MB download, median of {RUNS} | direct (host) | through the worker | ratio |",
        bytes / 1_000_000
    );
    println!("|---|---|---|---|");
    // The host's default congestion control paces the upstream's side of
    // both paths (the sandbox's side of a tunnel never paces): say which.
    let cc =
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap_or_default();
    println!(
        "| curl (host congestion control: {}) | {:.0} MiB/s | {:.0} MiB/s | {:.2}x |",
        cc.trim(),
        mib(d),
        mib(p),
        p / d
    );
    client.destroy_sandbox(&sb).await?;
    drop(worker);
    Ok(())
}
