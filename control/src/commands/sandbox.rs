//! `corral sandbox`: create, list, remove and reset sandboxes. Exits 0,
//! or 125 when it fails.

use std::io::Write;

use corral_proto::{NetworkMode, SandboxId, SandboxSpec, SandboxState};

use crate::cli::{ConnArgs, Network, SandboxCommand};
use corral_harness::client::WorkerClient;
use corral_harness::placement::Attempt;

use crate::connect::{ConnectError, connect, connect_to, place, worker_urls};

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn main(conn: &ConnArgs, cmd: SandboxCommand) -> u8 {
    match sandbox_command(conn, cmd).await {
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

/// The workers a command talks to.
enum Workers<'a> {
    One(WorkerClient),
    Many(&'a ConnArgs, Vec<String>),
}

impl Workers<'_> {
    /// The client of the worker that has sandbox `id` (each is asked).
    async fn for_sandbox(&self, id: &SandboxId) -> Result<WorkerClient, Error> {
        match self {
            Workers::One(c) => Ok(c.clone()),
            Workers::Many(conn, _) => Ok(crate::connect::connect_for(conn, id).await?),
        }
    }

    /// Every sandbox of every worker, each with its worker's client. Of
    /// several workers, those that answer are listed and the others named
    /// in a warning; with one, its failure is the command's.
    async fn sandboxes(&self) -> Result<Vec<(WorkerClient, corral_proto::SandboxInfo)>, Error> {
        match self {
            Workers::One(c) => Ok(c
                .list_sandboxes()
                .await?
                .into_iter()
                .map(|sb| (c.clone(), sb))
                .collect()),
            Workers::Many(conn, urls) => {
                let asked = urls.iter().map(|u| async move {
                    let ask = async {
                        let c = connect_to(conn, Some(u)).await?;
                        let listed = c.list_sandboxes().await?;
                        Ok::<_, Error>((c, listed))
                    };
                    let limit = crate::connect::ASK_TIMEOUT;
                    tokio::time::timeout(limit, ask).await.unwrap_or_else(|_| {
                        Err(Error::Invalid(format!(
                            "no answer within {} s",
                            limit.as_secs()
                        )))
                    })
                });
                let mut all = Vec::new();
                let mut silent = Vec::new();
                for (url, listed) in urls.iter().zip(futures_util::future::join_all(asked).await) {
                    match listed {
                        Ok((c, list)) => all.extend(list.into_iter().map(|sb| (c.clone(), sb))),
                        Err(e) => silent.push(format!("{url}: {e}")),
                    }
                }
                if all.is_empty() && silent.len() == urls.len() {
                    return Err(Error::Invalid(format!(
                        "no worker answered: {}",
                        silent.join("; ")
                    )));
                }
                for s in &silent {
                    super::warn(&format!(
                        "warning: not listed, the worker did not answer: {s}"
                    ));
                }
                all.sort_by(|(_, a), (_, b)| {
                    (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id))
                });
                Ok(all)
            }
        }
    }

    /// The sandboxes named, each with its worker's client, or (`all`)
    /// every sandbox of every worker.
    async fn named_or_all(
        &self,
        ids: &[String],
        all: bool,
    ) -> Result<Vec<(WorkerClient, SandboxId)>, Error> {
        if all {
            return Ok(self
                .sandboxes()
                .await?
                .into_iter()
                .map(|(c, sb)| (c, sb.id))
                .collect());
        }
        let mut found = Vec::new();
        for id in ids {
            let id = sandbox_id(id)?;
            found.push((self.for_sandbox(&id).await?, id));
        }
        Ok(found)
    }
}

fn sandbox_id(s: &str) -> Result<SandboxId, Error> {
    SandboxId::new(s).map_err(|e| Error::Invalid(e.to_string()))
}

async fn sandbox_command(conn: &ConnArgs, cmd: SandboxCommand) -> Result<(), Error> {
    // Several workers: a new sandbox is placed among them, a listing
    // covers them all; the rest is for one worker.
    let urls = worker_urls(conn).await?;
    let conn = if urls.len() > 1 {
        Workers::Many(conn, urls)
    } else {
        Workers::One(connect(conn).await?)
    };
    let mut stdout = std::io::stdout().lock();
    match cmd {
        SandboxCommand::Create {
            id,
            image,
            template,
            network,
            memory,
            memory_includes_files,
            cpus,
            pids,
            workspace_size,
            tmp_size,
            root,
            writable_rootfs,
            cap_add,
            env,
            label,
            volume,
            runtime,
            idle_timeout,
            ttl,
            egress,
            egress_proxy,
        } => {
            let id = id.as_deref().map(sandbox_id).transpose()?;
            let egress = corral_proto::egress::parse_rules(&egress, false)
                .map_err(|e| Error::Invalid(format!("--egress: {e}")))?;
            if let Some(c) = cpus
                && !(c > 0.0 && c <= 1024.0)
            {
                return Err(Error::Invalid(format!("--cpus {c}: must be above 0")));
            }
            // A template names its image: CORRAL_IMAGE's default is not
            // asked for beside it (an --image given is, and must match).
            let image = match (&template, image) {
                (Some(_), Some(i)) if std::env::var("CORRAL_IMAGE").ok().as_ref() == Some(&i) => {
                    None
                }
                (_, image) => image,
            };
            let spec = SandboxSpec {
                image,
                network: match network {
                    Network::None => NetworkMode::None,
                    Network::Bridge => NetworkMode::Bridge,
                },
                memory_bytes: memory,
                cpu_millis: cpus.map(|c| (c * 1000.0).round() as u32),
                pids_limit: pids,
                workspace_bytes: workspace_size,
                tmp_bytes: tmp_size,
                run_as_root: root,
                writable_rootfs,
                add_capabilities: cap_add,
                env: env.into_iter().collect(),
                runtime,
                idle_timeout_ms: idle_timeout.map(|d| d.as_millis() as u64),
                ttl_ms: ttl.map(|d| d.as_millis().max(1) as u64),
                memory_includes_files,
                labels: label.into_iter().collect(),
                egress,
                egress_proxy,
                template,
                volumes: volume,
            };
            spec.validate().map_err(|e| Error::Invalid(e.to_string()))?;
            let sb = match &conn {
                Workers::One(c) => c.create_sandbox(id.as_ref(), spec).await?,
                Workers::Many(c, urls) => {
                    // An id of its own, so a create repeated elsewhere
                    // never makes two.
                    let id = id.unwrap_or_else(SandboxId::random);
                    place(c, urls, &spec, |_, client| {
                        let (id, spec) = (id.clone(), spec.clone());
                        async move {
                            match client.create_sandbox(Some(&id), spec).await {
                                Ok(sb) => Ok(sb),
                                Err(e) if e.is_refusal() || e.is_transient() => {
                                    Err(Attempt::Refused(e.to_string()))
                                }
                                Err(e) => Err(Attempt::Failed(Error::Client(e))),
                            }
                        }
                    })
                    .await?
                }
            };
            writeln!(stdout, "{}", sb.id)?;
        }
        SandboxCommand::Ls { json, quiet, label } => {
            let all: Vec<corral_proto::SandboxInfo> = conn
                .sandboxes()
                .await?
                .into_iter()
                .map(|(_, sb)| sb)
                .filter(|sb| label.iter().all(|(k, v)| sb.spec.labels.get(k) == Some(v)))
                .collect();
            if quiet {
                for sb in &all {
                    writeln!(stdout, "{}", sb.id)?;
                }
            } else if json {
                let list: Vec<_> = all.iter().map(to_json).collect();
                writeln!(stdout, "{}", serde_json::Value::Array(list))?;
            } else {
                let now = now_ms();
                let mut rows = vec![
                    [
                        "ID",
                        "STATE",
                        "IMAGE",
                        "AGE",
                        "IDLE",
                        "RUNNING",
                        "WORKER",
                        "CONTAINER",
                    ]
                    .map(String::from),
                ];
                for sb in &all {
                    rows.push([
                        sb.id.to_string(),
                        state_name(&sb.state).to_string(),
                        sb.image.clone(),
                        ago(now, sb.created_at_unix_ms),
                        if sb.running_operations > 0 {
                            "-".into()
                        } else {
                            ago(now, sb.last_used_unix_ms)
                        },
                        sb.running_operations.to_string(),
                        sb.worker_id.clone(),
                        sb.container_id.chars().take(12).collect(),
                    ]);
                }
                write_table(&mut stdout, &rows)?;
            }
        }
        SandboxCommand::Inspect { id, json } => {
            let id = sandbox_id(&id)?;
            let worker = conn.for_sandbox(&id).await?;
            let sb = worker.get_sandbox(&id).await?;
            // What it uses now, unless it cannot be measured (a lost one).
            let usage = worker.sandbox_stats(&sb.id).await.ok();
            let mut v = to_json(&sb);
            if let Some(u) = &usage {
                v["usage"] = stats_json(u);
            }
            if json {
                writeln!(stdout, "{v}")?;
            } else {
                let now = now_ms();
                let spec = serde_json::to_string(&sb.spec).unwrap_or_default();
                for (k, val) in [
                    ("id", sb.id.to_string()),
                    ("state", state_text(&sb.state)),
                    ("image", sb.image.clone()),
                    ("worker", sb.worker_id.clone()),
                    ("container", sb.container_id.clone()),
                    ("age", ago(now, sb.created_at_unix_ms)),
                    ("idle", ago(now, sb.last_used_unix_ms)),
                    ("running", sb.running_operations.to_string()),
                    ("last event", sb.last_seq.to_string()),
                    (
                        "limits",
                        if sb.limits == corral_proto::Limits::default() {
                            "unknown".into()
                        } else {
                            format!(
                                "{:.1} MiB of memory, {} CPU{}, {} processes",
                                sb.limits.memory_bytes as f64 / f64::from(1u32 << 20),
                                f64::from(sb.limits.cpu_millis) / 1000.0,
                                if sb.limits.cpu_millis == 1000 { "" } else { "s" },
                                sb.limits.pids_limit
                            )
                        },
                    ),
                    (
                        "usage",
                        usage.as_ref().map_or("unknown".into(), |u| {
                            format!(
                                "{:.1} MiB of {:.1} MiB ({:.1} MiB of it files in /workspace and /tmp), {:.1}% CPU, {}/{} processes",
                                u.memory_bytes as f64 / f64::from(1u32 << 20),
                                u.memory_limit_bytes as f64 / f64::from(1u32 << 20),
                                u.files_bytes as f64 / f64::from(1u32 << 20),
                                u.cpu_percent,
                                u.pids,
                                u.pids_limit
                            )
                        }),
                    ),
                    ("spec", spec),
                ] {
                    // The worker's words (image, ids, a lost sandbox's
                    // reason): shown, never obeyed.
                    writeln!(
                        stdout,
                        "{:<11} {}",
                        format!("{k}:"),
                        crate::view::printable(&val)
                    )?;
                }
            }
        }
        SandboxCommand::Stats { ids, json } => {
            let ids = conn.named_or_all(&ids, ids.is_empty()).await?;
            // Each takes a sampling interval: all at once.
            let all =
                futures_util::future::join_all(ids.iter().map(|(w, id)| w.sandbox_stats(id))).await;
            let all: Vec<corral_proto::SandboxStats> = all.into_iter().collect::<Result<_, _>>()?;
            if json {
                let list: Vec<serde_json::Value> = all.iter().map(stats_json).collect();
                writeln!(stdout, "{}", serde_json::Value::Array(list))?;
            } else {
                let mib = |b: u64| format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20));
                // Processes' working memory and the tmpfs files apart: both
                // count against the limit.
                let mut rows = vec![
                    [
                        "ID", "MEMORY", "WORKING", "FILES", "LIMIT", "CPU", "PIDS", "",
                    ]
                    .map(String::from),
                ];
                for s in &all {
                    rows.push([
                        s.sandbox_id.to_string(),
                        mib(s.memory_bytes),
                        mib(s.memory_bytes.saturating_sub(s.files_bytes)),
                        mib(s.files_bytes),
                        mib(s.memory_limit_bytes),
                        format!("{:.1}%", s.cpu_percent),
                        format!("{}/{}", s.pids, s.pids_limit),
                        String::new(),
                    ]);
                }
                write_table(&mut stdout, &rows)?;
            }
        }
        SandboxCommand::Rm { ids, all } => {
            // Each one tried; the unknown ones named together at the end.
            let mut unknown = Vec::new();
            let found = if all {
                conn.named_or_all(&[], true).await?
            } else {
                let mut found = Vec::new();
                for id in &ids {
                    let id = sandbox_id(id)?;
                    match conn.for_sandbox(&id).await {
                        Ok(w) => found.push((w, id)),
                        Err(Error::Connect(ConnectError::Invalid(_))) => {
                            unknown.push(id.to_string())
                        }
                        Err(e) => return Err(e),
                    }
                }
                found
            };
            for (worker, id) in found {
                if !worker.destroy_sandbox(&id).await? {
                    unknown.push(id.to_string());
                }
            }
            if !unknown.is_empty() {
                return Err(Error::Invalid(format!(
                    "unknown sandbox {}",
                    unknown.join(", ")
                )));
            }
        }
        SandboxCommand::Prune { idle } => {
            let now = now_ms();
            for (worker, sb) in conn.sandboxes().await? {
                let unused_for = now.saturating_sub(sb.last_used_unix_ms);
                let lost = matches!(sb.state, SandboxState::Lost(_));
                let unused = sb.running_operations == 0 && unused_for >= idle.as_millis() as i64;
                if (lost || unused) && worker.destroy_sandbox(&sb.id).await? {
                    writeln!(stdout, "{}", sb.id)?;
                }
            }
        }
        SandboxCommand::Reset { id } => {
            let id = sandbox_id(&id)?;
            let killed = conn.for_sandbox(&id).await?.reset_sandbox(&id).await?;
            writeln!(stdout, "killed {killed} processes")?;
        }
        SandboxCommand::Fork {
            id,
            count,
            child_ids,
            json,
        } => {
            let id = sandbox_id(&id)?;
            let child_ids = child_ids
                .iter()
                .map(|c| sandbox_id(c))
                .collect::<Result<Vec<_>, _>>()?;
            let count = if child_ids.is_empty() { count } else { 0 };
            let f = conn
                .for_sandbox(&id)
                .await?
                .fork_sandbox(&id, &child_ids, count)
                .await?;
            if json {
                let v = serde_json::json!({
                    "parent": id.to_string(),
                    "children": f.children.iter().map(to_json).collect::<Vec<_>>(),
                    "frozen_ms": f.frozen.as_secs_f64() * 1000.0,
                    "copied_entries": f.copied_entries,
                    "copied_bytes": f.copied_bytes,
                    "left_out": f.left_out,
                    "notes": f.notes,
                });
                writeln!(stdout, "{v}")?;
            } else {
                for c in &f.children {
                    writeln!(stdout, "{}", c.id)?;
                }
                for n in &f.notes {
                    tracing::warn!(note = %n, "left out of the fork");
                }
            }
        }
        SandboxCommand::Checkpoint { id } => {
            let id = sandbox_id(&id)?;
            let sb = conn.for_sandbox(&id).await?.checkpoint_sandbox(&id).await?;
            writeln!(stdout, "{}: {}", sb.id, state_name(&sb.state))?;
        }
        SandboxCommand::Snapshot { id, name } => {
            let id = sandbox_id(&id)?;
            corral_proto::template::check_name(&name).map_err(|e| Error::Invalid(e.to_string()))?;
            let t = conn
                .for_sandbox(&id)
                .await?
                .raw()
                .snapshot_sandbox(corral_proto::pb::SnapshotSandboxRequest {
                    id: id.to_string(),
                    template: name,
                })
                .await
                .map_err(corral_harness::client::ClientError::from)?
                .into_inner();
            writeln!(stdout, "template {}: {}", t.name, t.image)?;
        }
        SandboxCommand::Restore { id } => {
            let id = sandbox_id(&id)?;
            let sb = conn.for_sandbox(&id).await?.restore_sandbox(&id).await?;
            writeln!(stdout, "{}: {}", sb.id, state_name(&sb.state))?;
        }
        SandboxCommand::Egress { id, rules } => {
            let id = sandbox_id(&id)?;
            let rules = corral_proto::egress::parse_rules(&rules, false)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            let sb = conn
                .for_sandbox(&id)
                .await?
                .set_sandbox_egress(&id, &rules)
                .await?;
            if sb.spec.egress.is_empty() {
                writeln!(stdout, "{id}: no egress allowed")?;
            } else {
                let list: Vec<String> = sb.spec.egress.iter().map(ToString::to_string).collect();
                writeln!(stdout, "{id}: egress {}", list.join(" "))?;
            }
        }
    }
    Ok(())
}

fn stats_json(s: &corral_proto::SandboxStats) -> serde_json::Value {
    serde_json::json!({
        "id": s.sandbox_id.to_string(),
        "memory_bytes": s.memory_bytes,
        "memory_limit_bytes": s.memory_limit_bytes,
        "files_bytes": s.files_bytes,
        "working_bytes": s.memory_bytes.saturating_sub(s.files_bytes),
        "cpu_percent": s.cpu_percent,
        "cpu_total_ns": s.cpu_total_ns,
        "pids": s.pids,
        "pids_limit": s.pids_limit,
    })
}

fn state_name(s: &SandboxState) -> &'static str {
    match s {
        SandboxState::Ready => "ready",
        SandboxState::Starting => "starting",
        SandboxState::Lost(_) => "lost",
        SandboxState::Checkpointed => "checkpointed",
    }
}

fn state_text(s: &SandboxState) -> String {
    match s {
        SandboxState::Lost(why) => format!("lost: {why}"),
        other => state_name(other).to_string(),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// How long ago `then` was, shortly: 45s, 12m, 3h, 2d.
fn ago(now: i64, then: i64) -> String {
    if then <= 0 {
        return "?".into();
    }
    let s = now.saturating_sub(then).max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

fn to_json(sb: &corral_proto::SandboxInfo) -> serde_json::Value {
    let (state, lost_reason) = match &sb.state {
        SandboxState::Lost(why) => ("lost", Some(why.clone())),
        other => (state_name(other), None),
    };
    serde_json::json!({
        "id": sb.id.to_string(),
        "state": state,
        "lost_reason": lost_reason,
        "image": sb.image,
        "worker_id": sb.worker_id,
        "container_id": sb.container_id,
        "created_at_unix_ms": sb.created_at_unix_ms,
        "last_used_unix_ms": sb.last_used_unix_ms,
        "running_operations": sb.running_operations,
        "last_seq": sb.last_seq,
        "limits": {
            "memory_bytes": sb.limits.memory_bytes,
            "cpu_millis": sb.limits.cpu_millis,
            "pids_limit": sb.limits.pids_limit,
        },
        "spec": sb.spec,
    })
}

/// Rows as aligned columns, two spaces apart (the last one not padded).
fn write_table(out: &mut impl Write, rows: &[[String; 8]]) -> std::io::Result<()> {
    // Cells escaped first, so that the columns are measured as shown.
    let rows: Vec<[String; 8]> = rows
        .iter()
        .map(|r| r.clone().map(|c| crate::view::printable(&c).into_owned()))
        .collect();
    let rows = rows.as_slice();
    let mut widths = [0usize; 8];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_line_up_and_ages_are_short() {
        let row = |a: &str, b: &str| {
            let mut r: [String; 8] = Default::default();
            r[0] = a.into();
            r[1] = b.into();
            r[7] = "end".into();
            r
        };
        let mut out = Vec::new();
        write_table(
            &mut out,
            &[row("ID", "STATE"), row("a-much-longer-id", "x")],
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].find("STATE"), lines[1].find('x'), "{text}");
        // A hostile cell is shown escaped, and its column still lines up.
        let mut out = Vec::new();
        write_table(
            &mut out,
            &[row("ID", "STATE"), row("a\x1b[2Jb", "x"), row("plain", "y")],
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains('\x1b'), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].find("STATE"), lines[1].find('x'), "{text}");
        assert_eq!(lines[0].find("STATE"), lines[2].find('y'), "{text}");
        assert_eq!(ago(10_000_000, 10_000_000 - 45_000), "45s");
        assert_eq!(ago(100_000_000, 100_000_000 - 3 * 3_600_000), "3h");
        assert_eq!(ago(10_000_000, 0), "?");
    }
}
