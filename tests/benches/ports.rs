//! The way in against dialling the server from inside the sandbox, in one
//! run: the same client (curl) fetches from the same server (Python's
//! `http.server` in a sandbox of the Debian image), once inside the
//! sandbox's own network namespace (its loopback, directly), once on the
//! host through the worker's port listener (HTTP routing and the token
//! check, a connection dialled inside by the sandbox's ingress relay and
//! handed to the worker). The worker runs in its own process, as deployed.
//!
//! - a 1 KiB GET, 200 requests on one keep-alive connection, twice: what
//!   the listener adds to a request;
//! - the same, a new connection each time (`Connection: close`): what a
//!   dial into the sandbox adds;
//! - 10,000 1 KiB GETs, 50 at once on keep-alive connections (curl
//!   `--parallel`, against an HTTP/1.1 server): requests a second;
//! - a 1 GiB download (curl's `speed_download`), five runs each,
//!   interleaved.
//!
//! Run: `cargo bench -p corral-e2e --bench ports` after `deploy/build.sh`.
//! Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::process::Command;

use anyhow::{Context, Result, bail};
use corral_e2e::{WorkerProcess, free_port, run_shell, unique_id};
use corral_proto::pb::PortAccess;
use corral_proto::{OperationId, OperationSpec, SandboxId, SandboxSpec, ShellSpec};

/// The concurrent run's server: one thread, epoll, every request (any
/// method, any path) answered with 1 KiB, connections kept.
const FAST_SERVER: &str = r#"
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/epoll.h>
#include <sys/socket.h>
static char reply[4096];
static int reply_len;
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int head = snprintf(reply, sizeof reply, "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 1024\r\n\r\n");
    memset(reply + head, 'x', 1024);
    reply_len = head + 1024;
    int l = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1024)) return 1;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = l}, evs[256];
    epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev);
    static char buf[65536];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == l) {
                int c;
                while ((c = accept4(l, 0, 0, SOCK_NONBLOCK)) >= 0) {
                    struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
                }
                continue;
            }
            ssize_t r = read(fd, buf, sizeof buf);
            if (r <= 0) { close(fd); continue; }
            int asked = 0;
            for (ssize_t j = 3; j < r; j++)
                if (buf[j] == '\n' && buf[j - 1] == '\r' && buf[j - 2] == '\n' && buf[j - 3] == '\r') asked++;
            for (int k = 0; k < asked; k++)
                if (write(fd, reply, reply_len) != reply_len) { close(fd); break; }
        }
    }
}
"#;

const REQUESTS: usize = 200;
const BYTES: u64 = 1 << 30;
/// Requests of the concurrent run, and how many at once.
const MANY: usize = 10_000;
const AT_ONCE: usize = 50;
const RUNS: usize = 5;

fn pct(mut v: Vec<f64>, p: usize) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * p / 100).min(v.len() - 1)]
}

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

/// curl's `what` for each of `urls`, one line each.
fn curl_args(what: &str, urls: &[String], headers: &[String]) -> Vec<String> {
    let mut a = vec!["-s".to_string(), "-f".into()];
    for h in headers {
        a.push("-H".into());
        a.push(h.clone());
    }
    a.push("-w".into());
    a.push(format!("%{{{what}}}\\n"));
    for u in urls {
        a.push(u.clone());
        a.push("-o".into());
        a.push("/dev/null".into());
    }
    a
}

fn quote(args: &[String]) -> String {
    args.iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::main]
async fn main() -> Result<()> {
    let state = tempfile::tempdir()?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let worker = WorkerProcess::spawn(
        state.path(),
        &unique_id("ptb"),
        free_port()?,
        &[("CORRAL_LOG", "warn")],
        &[
            "--ports-listen",
            &listen,
            "--allow-image",
            "corral-debian:latest",
        ],
    )?;
    let token = worker.token();
    let client = worker.client().await?;
    let sb = SandboxId::new(unique_id("sb"))?;
    client
        .create_sandbox(
            Some(&sb),
            SandboxSpec {
                image: Some("corral-debian:latest".into()),
                cpu_millis: Some(2000),
                ..SandboxSpec::default()
            },
        )
        .await?;
    run_shell(
        &client,
        &sb,
        &format!("head -c 1024 /dev/zero > /workspace/small && head -c {BYTES} /dev/zero > /workspace/big"),
    )
    .await?;
    client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new(
                "cd /workspace && exec python3 -m http.server 8000 --bind 127.0.0.1",
            )),
        )
        .await?;
    // For the concurrent run, a server that is not the bottleneck (Python's
    // serves a few hundred requests a second): a small epoll server in C,
    // built in the sandbox, answering every request with 1 KiB, keep-alive.
    let built = run_shell(
        &client,
        &sb,
        &format!("cat > /tmp/fast.c <<'EOF'\n{FAST_SERVER}\nEOF\ngcc -O2 -o /tmp/fast /tmp/fast.c && echo built"),
    )
    .await?;
    if !built.contains("built") {
        bail!("the C server did not build: {built}");
    }
    client
        .submit(
            &sb,
            &OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("exec /tmp/fast 8001")),
        )
        .await?;
    let e = client
        .expose_port(&sb, 8000, PortAccess::Private, None)
        .await?;
    let e11 = client
        .expose_port(&sb, 8001, PortAccess::Private, None)
        .await?;
    let through = e.url.trim_end_matches('/').to_string();
    let through11 = e11.url.trim_end_matches('/').to_string();
    let direct = "http://127.0.0.1:8000".to_string();
    let auth = vec![format!("Authorization: Bearer {token}")];
    let close = |mut h: Vec<String>| {
        h.push("Connection: close".into());
        h
    };
    let host_curl = |args: Vec<String>| -> Result<String> {
        let out = Command::new("curl").args(&args).output()?;
        if !out.status.success() {
            bail!("curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?)
    };
    let in_sandbox = |args: Vec<String>| {
        let (client, sb) = (&client, &sb);
        async move { run_shell(client, sb, &format!("curl {}", quote(&args))).await }
    };
    // Up, both ways.
    for _ in 0..100 {
        if host_curl(curl_args("http_code", &[format!("{through}/small")], &auth)).is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let urls = |base: &str, name: &str| -> Vec<String> {
        (0..REQUESTS).map(|_| format!("{base}/{name}")).collect()
    };
    let (mut d_keep, mut t_keep, mut d_new, mut t_new) = (vec![], vec![], vec![], vec![]);
    for _ in 0..2 {
        d_keep.extend(figures(
            &in_sandbox(curl_args("time_total", &urls(&direct, "small"), &[])).await?,
        )?);
        t_keep.extend(figures(&host_curl(curl_args(
            "time_total",
            &urls(&through, "small"),
            &auth,
        ))?)?);
        d_new.extend(figures(
            &in_sandbox(curl_args(
                "time_total",
                &urls(&direct, "small"),
                &close(vec![]),
            ))
            .await?,
        )?);
        t_new.extend(figures(&host_curl(curl_args(
            "time_total",
            &urls(&through, "small"),
            &close(auth.clone()),
        ))?)?);
    }
    // 50 at once, keep-alive: requests a second (the wall time of the
    // whole curl run, taken by the shell that runs it, on either side).
    let timed = |args: &[String]| {
        format!(
            "s=$(date +%s%N); curl {} > /dev/null || exit 1; e=$(date +%s%N); echo $(( (e - s) / 1000 ))",
            quote(args)
        )
    };
    let parallel = |headers: &[String], config: &str| {
        let mut a = vec![
            "-s".to_string(),
            "-f".into(),
            "--parallel".into(),
            "--parallel-immediate".into(),
            "--parallel-max".into(),
            AT_ONCE.to_string(),
        ];
        for h in headers {
            a.push("-H".into());
            a.push(h.clone());
        }
        a.push("--config".into());
        a.push(config.to_string());
        a
    };
    let url_list = |base: &str| -> String {
        (0..MANY)
            .map(|_| format!("url = \"{base}/small\"\noutput = \"/dev/null\"\n"))
            .collect()
    };
    run_shell(
        &client,
        &sb,
        // Written by the sandbox itself: one command's argument holds at
        // most 128 KiB.
        &format!(
            "for i in $(seq {MANY}); do printf 'url = \"http://127.0.0.1:8001/small\"\\noutput = \"/dev/null\"\\n'; done > /tmp/urls"
        ),
    )
    .await?;
    let host_urls = state.path().join("urls");
    std::fs::write(&host_urls, url_list(&through11))?;
    let host_urls = host_urls.display().to_string();
    let (mut d_rps, mut t_rps) = (vec![], vec![]);
    for _ in 0..3 {
        let us: f64 = run_shell(&client, &sb, &timed(&parallel(&[], "/tmp/urls")))
            .await?
            .trim()
            .parse()?;
        d_rps.push(MANY as f64 / (us / 1e6));
        let out = Command::new("sh")
            .arg("-c")
            .arg(timed(&parallel(&auth, &host_urls)))
            .output()?;
        let us: f64 = String::from_utf8(out.stdout)?.trim().parse()?;
        t_rps.push(MANY as f64 / (us / 1e6));
    }
    let (mut d_big, mut t_big) = (vec![], vec![]);
    for _ in 0..RUNS {
        d_big.extend(figures(
            &in_sandbox(curl_args("speed_download", &[format!("{direct}/big")], &[])).await?,
        )?);
        t_big.extend(figures(&host_curl(curl_args(
            "speed_download",
            &[format!("{through}/big")],
            &auth,
        ))?)?);
    }
    let ms = |v: f64| v * 1000.0;
    println!(
        "| 1 KiB GET, {REQUESTS}x2, curl | inside the sandbox | through the listener | overhead |"
    );
    println!("|---|---|---|---|");
    for (what, d, t) in [
        (
            "keep-alive, p50",
            pct(d_keep.clone(), 50),
            pct(t_keep.clone(), 50),
        ),
        ("keep-alive, p99", pct(d_keep, 99), pct(t_keep, 99)),
        (
            "new connection, p50",
            pct(d_new.clone(), 50),
            pct(t_new.clone(), 50),
        ),
        ("new connection, p99", pct(d_new, 99), pct(t_new, 99)),
    ] {
        println!(
            "| {what} | {:.3} ms | {:.3} ms | +{:.3} ms |",
            ms(d),
            ms(t),
            ms(t - d)
        );
    }
    println!();
    println!(
        "| {MANY} 1 KiB GETs, {AT_ONCE} at once, keep-alive (median of 3) | inside the sandbox | through the listener | ratio |"
    );
    println!("|---|---|---|---|");
    let (d, t) = (pct(d_rps, 50), pct(t_rps, 50));
    println!("| curl --parallel | {d:.0}/s | {t:.0}/s | {:.2}x |", t / d);
    let mib = |v: f64| v / (1 << 20) as f64;
    let (d, t) = (pct(d_big, 50), pct(t_big, 50));
    println!();
    println!(
        "| {} GiB download, median of {RUNS} | inside the sandbox | through the listener | ratio |",
        BYTES >> 30
    );
    println!("|---|---|---|---|");
    println!(
        "| curl | {:.0} MiB/s | {:.0} MiB/s | {:.2}x |",
        mib(d),
        mib(t),
        t / d
    );
    client.destroy_sandbox(&sb).await?;
    drop(worker);
    Ok(())
}
