//! `corral admin`: what an operator does. `key create|ls|revoke` work on a
//! front door's tenants' directory (`--tenants DIR`), offline; `audit
//! verify` exits 0 when the log's chain is whole, 1 when it is broken
//! (naming the first line that is), 125 when the log cannot be read.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use corral_harness::audit::{AuditError, verify};
use corral_harness::tenants::{self, KeyRecord, Scope, TenantsError};

use crate::cli::{AdminArgs, AdminCommand, AuditCommand, KeyCommand, QuotaCommand};

pub fn main(args: &AdminArgs) -> u8 {
    match &args.command {
        AdminCommand::Audit(AuditCommand::Verify { file }) => match verify(file) {
            Ok(n) => {
                let _ = writeln!(
                    std::io::stdout(),
                    "{}: {n} records, the chain is whole",
                    file.display()
                );
                0
            }
            Err(e @ AuditError::Broken { .. }) => {
                super::report(&e);
                1
            }
            Err(e) => {
                super::report(&e);
                super::EXIT_CORRAL_ERROR
            }
        },
        AdminCommand::Key(_) | AdminCommand::Quota(_) => {
            let Some(dir) = &args.tenants else {
                super::warn(
                    "which tenants? --tenants DIR (or CORRAL_TENANTS): the directory the front door serves (corral serve --tenants DIR)",
                );
                return super::EXIT_USAGE;
            };
            let done = match &args.command {
                AdminCommand::Key(cmd) => key(dir, cmd),
                AdminCommand::Quota(cmd) => quota(dir, cmd),
                AdminCommand::Audit(_) => Ok(()),
            };
            match done {
                Ok(()) => 0,
                Err(e @ TenantsError::Invalid(_)) => {
                    super::report(&e);
                    super::EXIT_USAGE
                }
                Err(e) => {
                    super::report(&e);
                    super::EXIT_CORRAL_ERROR
                }
            }
        }
    }
}

fn when(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn record_json(r: &KeyRecord) -> serde_json::Value {
    serde_json::json!({
        "id": r.id,
        "tenant": r.tenant,
        "scopes": r.scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        "created": when(r.created_unix_ms),
        "expires": r.expires_unix_ms.map(when),
    })
}

fn key(dir: &Path, cmd: &KeyCommand) -> Result<(), TenantsError> {
    let mut out = std::io::stdout();
    match cmd {
        KeyCommand::Create {
            tenant,
            scopes,
            expires,
            json,
        } => {
            let scopes = scopes
                .iter()
                .map(|s| Scope::parse(s.trim()))
                .collect::<Result<BTreeSet<_>, _>>()?;
            let (key, record) = tenants::create_key(dir, tenant, scopes, *expires)?;
            let _ = if *json {
                let mut v = record_json(&record);
                v["key"] = serde_json::Value::String(key);
                writeln!(out, "{v}")
            } else {
                writeln!(out, "{key}")
            };
            if !*json {
                super::warn(&format!(
                    "key {} for tenant {}: shown this once, keep it now",
                    record.id, record.tenant
                ));
            }
        }
        KeyCommand::Ls { json } => {
            let all = tenants::list(dir)?;
            if *json {
                let v: Vec<_> = all.iter().map(record_json).collect();
                let _ = writeln!(out, "{}", serde_json::Value::Array(v));
            } else {
                let _ = writeln!(
                    out,
                    "{:<12}  {:<20}  {:<14}  {:<20}  EXPIRES",
                    "ID", "TENANT", "SCOPES", "CREATED"
                );
                for r in &all {
                    let scopes: Vec<&str> = r.scopes.iter().map(|s| s.as_str()).collect();
                    let _ = writeln!(
                        out,
                        "{:<12}  {:<20}  {:<14}  {:<20}  {}",
                        r.id,
                        r.tenant,
                        scopes.join(","),
                        when(r.created_unix_ms),
                        r.expires_unix_ms.map_or_else(|| "never".into(), when)
                    );
                }
            }
        }
        KeyCommand::Revoke { id } => {
            if tenants::revoke(dir, id)? {
                let _ = writeln!(out, "revoked {id}");
            } else {
                return Err(TenantsError::Invalid(format!(
                    "no key {id} in {} (`corral admin key ls` lists them)",
                    dir.display()
                )));
            }
        }
    }
    Ok(())
}

fn quota_json(tenant: &str, q: &tenants::Quota) -> serde_json::Value {
    serde_json::json!({
        "tenant": tenant,
        "sandboxes": q.sandboxes,
        "creates_per_minute": q.creates_per_minute,
    })
}

fn quota(dir: &Path, cmd: &QuotaCommand) -> Result<(), TenantsError> {
    let mut out = std::io::stdout();
    let shown = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |n| n.to_string());
    match cmd {
        QuotaCommand::Set { tenant, quotas } => {
            let q = tenants::set_quota(dir, tenant, quotas)?;
            let _ = writeln!(out, "{}", quota_json(tenant, &q));
        }
        QuotaCommand::Ls { json } => {
            let all = tenants::quotas(dir)?;
            if *json {
                let v: Vec<_> = all.iter().map(|(t, q)| quota_json(t, q)).collect();
                let _ = writeln!(out, "{}", serde_json::Value::Array(v));
            } else {
                let _ = writeln!(
                    out,
                    "{:<20}  {:>9}  CREATES_PER_MINUTE",
                    "TENANT", "SANDBOXES"
                );
                for (t, q) in &all {
                    let _ = writeln!(
                        out,
                        "{t:<20}  {:>9}  {}",
                        shown(q.sandboxes),
                        shown(q.creates_per_minute)
                    );
                }
            }
        }
    }
    Ok(())
}
