//! The audit log's pace: records a minute written by many callers at once
//! through one log (its writer's queue, JSON, SHA-256 chain, a flush per
//! batch), against the same lines appended to a file with no chain, in one
//! run; then `verify` over what was written.
//!
//! Run: `cargo bench -p corral-e2e --bench audit`. Prints Markdown.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use corral_harness::audit::{AuditLog, Entry, verify};

const RECORDS: usize = 200_000;
const CALLERS: usize = 16;

fn entry(i: usize) -> Entry {
    Entry {
        tenant: "team-a".into(),
        key: "k-3f9a".into(),
        call: "StartSession".into(),
        session: Some(format!("s-{i:08}")),
        sandbox: Some(format!("sb-{i:08}")),
        subject: None,
        outcome: "ok".into(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("audit.log");
    let (log, writer) = AuditLog::open(&path)?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in (c..RECORDS).step_by(CALLERS) {
                log.record(entry(i)).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    drop(log);
    writer.finish().await?;
    let chained = started.elapsed();

    // The same lines, no chain: JSON appended through one buffered file.
    let plain = dir.path().join("plain.log");
    let started = Instant::now();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&plain)?);
    for i in 0..RECORDS {
        serde_json::to_writer(&mut f, &entry(i))?;
        f.write_all(b"\n")?;
    }
    f.flush()?;
    let unchained = started.elapsed();

    let started = Instant::now();
    let n = verify(&path)?;
    let verified = started.elapsed();
    assert_eq!(n as usize, RECORDS);
    let per_min = |d: std::time::Duration| RECORDS as f64 / d.as_secs_f64() * 60.0;
    println!("| audit log ({RECORDS} records, {CALLERS} callers) | records a minute |");
    println!("|---|---|");
    println!("| chained, through the log | {:.0} |", per_min(chained));
    println!(
        "| plain JSON lines, one writer, no chain | {:.0} |",
        per_min(unchained)
    );
    println!("| verify | {:.0} |", per_min(verified));
    println!(
        "\nThe chain costs {:.2}x the plain writes' time.",
        chained.as_secs_f64() / unchained.as_secs_f64()
    );
    Ok(())
}
