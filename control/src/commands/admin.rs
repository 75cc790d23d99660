//! `corral admin`: what an operator does. `key create|ls|revoke` and
//! `quota set|ls` work on a front door's tenants' directory (`--tenants
//! DIR`), offline, or through a running front door (`--url URL`, with an
//! admin key in `CORRAL_API_KEY`); `audit verify` exits 0 when the log's
//! chain is whole, 1 when it is broken (naming the first line that is),
//! 125 when the log cannot be read.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use corral_harness::audit::{AuditError, verify};
use corral_harness::control::{AdminClient, ControlError};
use corral_harness::tenants::{self, KeyRecord, Quota, Scope, TenantsError, wire};
use corral_proto::Reason;

use crate::cli::{AdminArgs, AdminCommand, AuditCommand, ConnArgs, KeyCommand, QuotaCommand};

/// Where the keys and quotas are changed.
enum Tenants {
    /// The directory itself.
    Dir(PathBuf),
    /// A running front door, which changes the one it serves.
    Front(AdminClient),
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Tenants(#[from] TenantsError),
    #[error(transparent)]
    Front(#[from] ControlError),
}

impl Error {
    fn exit_code(&self) -> u8 {
        match self {
            Error::Tenants(TenantsError::Invalid(_)) => super::EXIT_USAGE,
            Error::Front(e) if e.reason() == Some(Reason::InvalidArgument) => super::EXIT_USAGE,
            _ => super::EXIT_CORRAL_ERROR,
        }
    }
}

impl Tenants {
    async fn create_key(
        &self,
        tenant: &str,
        scopes: BTreeSet<Scope>,
        ttl: Option<Duration>,
    ) -> Result<(String, KeyRecord), Error> {
        match self {
            Tenants::Dir(dir) => Ok(tenants::create_key(dir, tenant, scopes, ttl)?),
            Tenants::Front(c) => {
                let made = c
                    .create_key(corral_proto::pb::CreateKeyRequest {
                        tenant: tenant.to_string(),
                        scopes: scopes.iter().map(|s| wire::scope(*s) as i32).collect(),
                        ttl_ms: ttl.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
                    })
                    .await?;
                let info = made.info.ok_or_else(|| TenantsError::Malformed {
                    path: "the front door's answer".into(),
                    why: "no key info".into(),
                })?;
                Ok((made.key, wire::record_of(info)?))
            }
        }
    }

    async fn list(&self) -> Result<Vec<KeyRecord>, Error> {
        match self {
            Tenants::Dir(dir) => Ok(tenants::list(dir)?),
            Tenants::Front(c) => Ok(c
                .list_keys()
                .await?
                .into_iter()
                .map(wire::record_of)
                .collect::<Result<_, _>>()?),
        }
    }

    async fn revoke(&self, id: &str) -> Result<(), Error> {
        // A whole key given for its id: its id (the secret is never echoed).
        let id = tenants::key_id(id).unwrap_or(id);
        match self {
            Tenants::Dir(dir) => {
                if tenants::revoke(dir, id)? {
                    Ok(())
                } else {
                    Err(TenantsError::Invalid(format!(
                        "no key {id} in {} (`corral admin key ls` lists them)",
                        dir.display()
                    ))
                    .into())
                }
            }
            Tenants::Front(c) => Ok(c.revoke_key(id).await?),
        }
    }

    async fn set_quota(&self, tenant: &str, quotas: &[String]) -> Result<Quota, Error> {
        match self {
            Tenants::Dir(dir) => Ok(tenants::set_quota(dir, tenant, quotas)?),
            Tenants::Front(c) => Ok(wire::quota_of(c.set_quota(tenant, quotas).await?).1),
        }
    }

    async fn quotas(&self) -> Result<Vec<(String, Quota)>, Error> {
        match self {
            Tenants::Dir(dir) => Ok(tenants::quotas(dir)?),
            Tenants::Front(c) => Ok(c
                .list_quotas()
                .await?
                .into_iter()
                .map(wire::quota_of)
                .collect()),
        }
    }
}

pub async fn main(conn: &ConnArgs, args: &AdminArgs) -> u8 {
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
            let place = match (&args.tenants, &args.url) {
                (Some(dir), _) => Tenants::Dir(dir.clone()),
                (None, Some(url)) => {
                    let creds = match super::remote::service_credentials(conn, None) {
                        Ok(c) => c,
                        Err(why) => {
                            super::warn(&why);
                            return super::EXIT_USAGE;
                        }
                    };
                    if creds.token.is_none() {
                        super::warn(
                            "which key? set CORRAL_API_KEY to an admin key of the front door (`corral admin --tenants DIR key create --scope admin`)",
                        );
                        return super::EXIT_USAGE;
                    }
                    match AdminClient::connect(url, &creds).await {
                        Ok(c) => Tenants::Front(c),
                        Err(e) => {
                            super::report(&e);
                            return super::EXIT_CORRAL_ERROR;
                        }
                    }
                }
                (None, None) => {
                    super::warn(
                        "which tenants? --tenants DIR (or CORRAL_TENANTS): the directory the front door serves (corral serve --tenants DIR), or --url URL (or CORRAL_URL) of a running front door with an admin key in CORRAL_API_KEY",
                    );
                    return super::EXIT_USAGE;
                }
            };
            let done = match &args.command {
                AdminCommand::Key(cmd) => key(&place, cmd).await,
                AdminCommand::Quota(cmd) => quota(&place, cmd).await,
                AdminCommand::Audit(_) => Ok(()),
            };
            match done {
                Ok(()) => 0,
                Err(e) => {
                    super::report(&e);
                    e.exit_code()
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

async fn key(place: &Tenants, cmd: &KeyCommand) -> Result<(), Error> {
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
            let (key, record) = place.create_key(tenant, scopes, *expires).await?;
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
            let all = place.list().await?;
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
            place.revoke(id).await?;
            let _ = writeln!(out, "revoked {}", tenants::key_id(id).unwrap_or(id));
        }
    }
    Ok(())
}

fn quota_json(tenant: &str, q: &Quota) -> serde_json::Value {
    serde_json::json!({
        "tenant": tenant,
        "sandboxes": q.sandboxes,
        "memory_bytes": q.memory_bytes,
        "cpu_millis": q.cpu_millis,
        "pids": q.pids,
        "sessions": q.sessions,
        "creates_per_minute": q.creates_per_minute,
    })
}

async fn quota(place: &Tenants, cmd: &QuotaCommand) -> Result<(), Error> {
    let mut out = std::io::stdout();
    let shown = |v: Option<String>| v.unwrap_or_else(|| "-".to_string());
    let n = |v: Option<u64>| shown(v.map(|n| n.to_string()));
    match cmd {
        QuotaCommand::Set { tenant, quotas } => {
            let q = place.set_quota(tenant, quotas).await?;
            let _ = writeln!(out, "{}", quota_json(tenant, &q));
        }
        QuotaCommand::Ls { json } => {
            let all = place.quotas().await?;
            if *json {
                let v: Vec<_> = all.iter().map(|(t, q)| quota_json(t, q)).collect();
                let _ = writeln!(out, "{}", serde_json::Value::Array(v));
            } else {
                let _ = writeln!(
                    out,
                    "{:<20}  {:>9}  {:>9}  {:>6}  {:>7}  {:>8}  CREATES_PER_MINUTE",
                    "TENANT", "SANDBOXES", "MEMORY", "CPUS", "PIDS", "SESSIONS"
                );
                for (t, q) in &all {
                    let _ = writeln!(
                        out,
                        "{t:<20}  {:>9}  {:>9}  {:>6}  {:>7}  {:>8}  {}",
                        n(q.sandboxes),
                        shown(q.memory_bytes.map(gib)),
                        shown(q.cpu_millis.map(|m| format!("{}", m as f64 / 1000.0))),
                        n(q.pids),
                        n(q.sessions),
                        n(q.creates_per_minute)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Bytes as the largest whole unit that divides them (`64g`, `1536m`).
fn gib(bytes: u64) -> String {
    for (unit, shift) in [("t", 40), ("g", 30), ("m", 20), ("k", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}
