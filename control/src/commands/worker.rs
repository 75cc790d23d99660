//! `corral worker`: what a worker says of itself, and its drain. Exits 0,
//! or 125 when it fails.

use std::io::Write;

use corral_proto::WorkerInfo;

use crate::cli::{ConnArgs, WorkerCommand};
use crate::connect::{ConnectError, connect};
use crate::view::printable;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {0} s")]
    Silent(u64),
}

pub async fn main(conn: &ConnArgs, cmd: &WorkerCommand) -> u8 {
    match worker_command(conn, cmd).await {
        Ok(()) => 0,
        // Its reader went away (`| head`): quietly, as SIGPIPE would.
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

async fn worker_command(conn: &ConnArgs, cmd: &WorkerCommand) -> Result<(), Error> {
    // The local worker drained would take no sandbox again until it is
    // undrained (a drain survives restarts): only when named.
    if matches!(cmd, WorkerCommand::Drain) && conn.worker.is_none() {
        return Err(ConnectError::Usage(
            "corral worker drain: name the worker to drain with --worker (or CORRAL_WORKER); the local worker drained would refuse every new sandbox, across restarts, until `corral worker undrain`".into(),
        )
        .into());
    }
    let urls = crate::connect::worker_urls(conn).await?;
    // `worker info` of several workers: each one, in the order given;
    // a drain is for one worker at a time.
    if let (WorkerCommand::Info { json }, true) = (cmd, urls.len() > 1) {
        return info_of_each(conn, &urls, *json).await;
    }
    let worker = connect(conn).await?;
    let (info, json) = match cmd {
        WorkerCommand::Info { json } => (worker.worker_info().await?, *json),
        WorkerCommand::Drain => (worker.drain(true).await?, false),
        WorkerCommand::Undrain => (worker.drain(false).await?, false),
    };
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", to_json(&info))?;
    } else {
        for (k, v) in lines(&info) {
            // A worker's own words (its id, versions, images): shown,
            // never obeyed.
            writeln!(out, "{:<11} {}", format!("{k}:"), printable(&v))?;
        }
    }
    Ok(())
}

/// `worker info` of each worker of `urls`: a block (or a JSON object in
/// an array) each; one that does not answer is said to, and fails the
/// command once all are shown.
async fn info_of_each(conn: &ConnArgs, urls: &[String], json: bool) -> Result<(), Error> {
    let asked = urls.iter().map(|u| async move {
        let ask = async {
            let c = crate::connect::connect_to(conn, Some(u)).await?;
            Ok::<_, Error>(c.worker_info().await?)
        };
        let limit = crate::connect::ASK_TIMEOUT;
        tokio::time::timeout(limit, ask)
            .await
            .unwrap_or_else(|_| Err(Error::Silent(limit.as_secs())))
    });
    let answers = futures_util::future::join_all(asked).await;
    let mut out = std::io::stdout().lock();
    let mut failed = None;
    let mut list = Vec::new();
    for (i, (url, answer)) in urls.iter().zip(answers).enumerate() {
        match answer {
            Ok(info) if json => {
                let mut v = to_json(&info);
                v["url"] = url.clone().into();
                list.push(v);
            }
            Ok(info) => {
                if i > 0 {
                    writeln!(out)?;
                }
                writeln!(out, "{:<11} {url}", "address:")?;
                for (k, v) in lines(&info) {
                    writeln!(out, "{:<11} {}", format!("{k}:"), printable(&v))?;
                }
            }
            Err(e) => {
                super::warn(&format!("{url}: {e}"));
                failed = Some(e);
            }
        }
    }
    if json {
        writeln!(out, "{}", serde_json::Value::Array(list))?;
    }
    failed.map_or(Ok(()), Err)
}

fn drain_text(info: &WorkerInfo) -> String {
    if !info.draining {
        return "no".into();
    }
    let left = i64::try_from(info.drain_deadline_ms).unwrap_or(i64::MAX) - now_ms();
    if left <= 0 {
        "yes (deadline passed: what was left is removed)".into()
    } else {
        format!(
            "yes (what is left is removed in {})",
            humantime::format_duration(std::time::Duration::from_secs((left / 1000) as u64))
        )
    }
}

fn lines(info: &WorkerInfo) -> Vec<(&'static str, String)> {
    vec![
        ("id", info.worker_id.clone()),
        ("version", info.version.clone()),
        ("docker", info.docker_version.clone()),
        (
            "sandboxes",
            format!("{} of {}", info.sandboxes, info.max_sandboxes),
        ),
        ("running", info.running_operations.to_string()),
        ("draining", drain_text(info)),
        ("image", info.default_image.clone()),
        (
            "runtime",
            info.default_runtime
                .clone()
                .unwrap_or_else(|| "the engine's default".into()),
        ),
        ("allows", allows(&info.policy)),
        ("at most", ceilings(&info.policy.ceilings)),
        ("pools", pools_text(&info.pools)),
    ]
}

fn pools_text(pools: &[corral_proto::PoolInfo]) -> String {
    if pools.is_empty() {
        return "none".into();
    }
    pools
        .iter()
        .map(|p| {
            let up_to = if p.max_size > 0 {
                format!(", up to {} as demand asks", p.max_size)
            } else {
                String::new()
            };
            format!(
                "{} ({} of {} ready{up_to}; {} claimed, {} missed; last made in {} ms)",
                p.template, p.ready, p.size, p.claims, p.misses, p.last_refill_ms
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a sandbox may ask for beyond the hardened default, as the flags
/// of `corral sandbox create` say it.
fn allows(p: &corral_proto::SandboxPolicy) -> String {
    let mut parts = Vec::new();
    if p.allow_root {
        parts.push("--root".to_string());
    }
    if p.allow_writable_rootfs {
        parts.push("--writable-rootfs".to_string());
    }
    if p.allow_network {
        parts.push("--network bridge".to_string());
    }
    if !p.allowed_capabilities.is_empty() {
        parts.push(format!("capabilities {}", p.allowed_capabilities.join(",")));
    }
    if p.allow_any_image {
        parts.push("any image".to_string());
    } else if !p.allowed_images.is_empty() {
        parts.push(format!("images {}", p.allowed_images.join(",")));
    }
    if !p.allowed_runtimes.is_empty() {
        parts.push(format!("runtimes {}", p.allowed_runtimes.join(",")));
    }
    if !p.allowed_egress.is_empty() {
        let rules: Vec<String> = p.allowed_egress.iter().map(ToString::to_string).collect();
        parts.push(format!("egress within {}", rules.join(",")));
    }
    if parts.is_empty() {
        "nothing beyond the default (its image and Corral's own)".into()
    } else {
        parts.join("; ")
    }
}

fn ceilings(c: &corral_proto::Ceilings) -> String {
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30));
    format!(
        "memory {}, {} CPUs, {} processes, workspace {}, /tmp {}",
        gib(c.memory_bytes),
        f64::from(c.cpu_millis) / 1000.0,
        c.pids,
        gib(c.workspace_bytes),
        gib(c.tmp_bytes)
    )
}

fn policy_json(p: &corral_proto::SandboxPolicy) -> serde_json::Value {
    serde_json::json!({
        "allow_root": p.allow_root,
        "allow_writable_rootfs": p.allow_writable_rootfs,
        "allow_network": p.allow_network,
        "allowed_capabilities": p.allowed_capabilities,
        "allowed_images": p.allowed_images,
        "allow_any_image": p.allow_any_image,
        "allowed_runtimes": p.allowed_runtimes,
        "allowed_egress": p.allowed_egress.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "ceilings": {
            "memory_bytes": p.ceilings.memory_bytes,
            "cpu_millis": p.ceilings.cpu_millis,
            "pids": p.ceilings.pids,
            "workspace_bytes": p.ceilings.workspace_bytes,
            "tmp_bytes": p.ceilings.tmp_bytes,
        },
    })
}

fn to_json(info: &WorkerInfo) -> serde_json::Value {
    serde_json::json!({
        "worker_id": info.worker_id,
        "version": info.version,
        "docker_version": info.docker_version,
        "max_sandboxes": info.max_sandboxes,
        "sandboxes": info.sandboxes,
        "running_operations": info.running_operations,
        "draining": info.draining,
        "drain_deadline_ms": info.drain_deadline_ms,
        "default_image": info.default_image,
        "default_runtime": info.default_runtime,
        "policy": policy_json(&info.policy),
        "pools": info.pools.iter().map(|p| serde_json::json!({
            "template": p.template,
            "image": p.image,
            "size": p.size,
            "max_size": p.max_size,
            "ready": p.ready,
            "claims": p.claims,
            "misses": p.misses,
            "last_refill_ms": p.last_refill_ms,
        })).collect::<Vec<_>>(),
    })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}
