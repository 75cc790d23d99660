//! Tenants and their keys, for a front door (`corral serve --tenants DIR`):
//! who may call it, for which tenant, with which scopes.
//!
//! A key is `corral_<ID>_<SECRET>` (12 and 64 hex digits); it is shown
//! once, when it is made, and only the SHA-256 of the whole key is kept, in
//! `DIR/keys/<ID>.json` with its tenant, scopes, and times. The directory is
//! the data: `corral admin --tenants DIR key create|ls|revoke` writes it
//! (each file whole, by rename), a front door reads it and, through
//! [`watch`], every change within [`POLL`] (a revoked key is refused from
//! then on); in Kubernetes it is a Secret mounted as a volume. A directory
//! that does not read whole (a file that does not parse, an unknown scope)
//! leaves the last good set of keys in force, and the front door says so.
//!
//! Scopes: `read` (an auditor: list, inspect, logs, timelines; never a
//! command or a file), `run` (sandboxes and sessions; includes `read`),
//! `admin` (every tenant, and keys; includes both).
//!
//! Quotas are data of the same directory: `DIR/quotas/<TENANT>.json`
//! (`corral admin --tenants DIR quota set --tenant T sandboxes=20
//! creates_per_minute=60`), read and watched with the keys.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How often a front door looks at its tenants' directory.
pub const POLL: Duration = Duration::from_millis(250);

const PREFIX: &str = "corral_";
const ID_LEN: usize = 12;
const SECRET_LEN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Malformed { path: String, why: String },
    #[error("{0}")]
    Invalid(String),
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TenantsError + '_ {
    move |source| TenantsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What a key allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// List, inspect, read logs and timelines: never a command or a file.
    Read,
    /// Make and use sandboxes and sessions (and read them).
    Run,
    /// Every tenant's, and the keys.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Run, Scope::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Run => "run",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Result<Self, TenantsError> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                TenantsError::Invalid(format!("unknown scope {s:?}: read, run or admin"))
            })
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A key as the directory keeps it: never the key itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: String,
    pub tenant: String,
    pub scopes: BTreeSet<Scope>,
    /// SHA-256 of the whole key, in hex.
    pub sha256: String,
    pub created_unix_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_unix_ms: Option<i64>,
}

/// Who is calling: a key's tenant, id and scopes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    pub key_id: String,
    pub scopes: BTreeSet<Scope>,
}

impl Principal {
    /// Whether the key allows `scope` (`admin` includes `run`, which
    /// includes `read`).
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes.iter().any(|s| *s >= scope)
    }
}

/// Why a presented key was refused (each says so to its client; none
/// says whether a key of that id exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no key: present one as `authorization: Bearer corral_...`")]
    Missing,
    #[error("not a Corral key (corral_<12 hex>_<64 hex>)")]
    Malformed,
    #[error("the key is unknown or revoked")]
    Unknown,
    #[error("the key has expired")]
    Expired,
}

/// The SHA-256 of `bytes`, in lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The id of a key as presented, if it is shaped as one.
pub fn key_id(key: &str) -> Option<&str> {
    let rest = key.strip_prefix(PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    (is_hex(id, ID_LEN) && is_hex(secret, SECRET_LEN)).then_some(id)
}

/// `text` with every key in it, or what starts as one, cut to its id
/// (`corral_<id>_…`): for what is logged or echoed of a caller's words.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(PREFIX) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // Anything shaped as a key's start: a key, or one mistyped.
        let id = tail[PREFIX.len()..end]
            .split_once('_')
            .map(|(id, _)| id)
            .filter(|id| is_hex(id, ID_LEN));
        match id {
            Some(id) => {
                out.push_str(PREFIX);
                out.push_str(id);
                out.push_str("_…");
                rest = &tail[end..];
            }
            None => {
                out.push_str(PREFIX);
                rest = &tail[PREFIX.len()..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// A caller's word as an error may echo it: keys cut to their ids, and
/// at most 160 characters.
pub fn shown(text: &str) -> String {
    let text = redact(text);
    match text.char_indices().nth(160) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// Refuses to change a directory that does not read whole: front doors
/// keep their last good keys while it does not, so a key revoked there
/// would go on working (and one made, not yet).
fn readable(dir: &Path) -> Result<(), TenantsError> {
    if !dir.exists() {
        return Ok(());
    }
    KeySet::load(dir).map(|_| ()).map_err(|e| {
        TenantsError::Invalid(format!(
            "the tenants' directory does not read whole, so front doors keep their last good keys and would not see this change: {e} (fix or remove that file first)"
        ))
    })
}

/// The longest a key may be made for.
const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What a tenant may hold at once, and how fast it may make sandboxes; a
/// quota not given does not limit. Memory, CPUs and processes count each
/// sandbox's limits (what it asked for, or its worker's default), not what
/// it uses now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Sandboxes it has at once, on all the workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u64>,
    /// The memory limits of its sandboxes, summed, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// The CPU limits of its sandboxes, summed, in thousandths of a CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    /// The process limits of its sandboxes, summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// Sessions it runs at once on the front door.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    /// Sandboxes it makes (creates and forks' children) in any 60 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creates_per_minute: Option<u64>,
}

impl Quota {
    /// The quotas' names, as `quota set` takes them (memory as a size like
    /// `64g`, cpus as a number like `8` or `0.5`).
    pub const NAMES: [&'static str; 6] = [
        "sandboxes",
        "memory",
        "cpus",
        "pids",
        "sessions",
        "creates_per_minute",
    ];

    /// Sets `name` to `value` (None: no limit), written as `quota set`
    /// takes it.
    pub fn set(&mut self, name: &str, value: Option<&str>) -> Result<(), TenantsError> {
        let bad = |e: String| {
            TenantsError::Invalid(shown(&format!("{name}={}: {e}", value.unwrap_or(""))))
        };
        let count = |v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| format!("{v:?} is not a whole number (or none)"))
        };
        let parsed =
            |f: &dyn Fn(&str) -> Result<u64, String>| value.map(f).transpose().map_err(bad);
        match name.replace('-', "_").as_str() {
            "sandboxes" => self.sandboxes = parsed(&count)?,
            "memory" => self.memory_bytes = parsed(&corral_proto::units::parse_size)?,
            "cpus" => self.cpu_millis = parsed(&corral_proto::units::parse_cpus)?,
            "pids" => self.pids = parsed(&count)?,
            "sessions" => self.sessions = parsed(&count)?,
            "creates_per_minute" => self.creates_per_minute = parsed(&count)?,
            other => {
                return Err(TenantsError::Invalid(format!(
                    "unknown quota {:?}: {}",
                    shown(other),
                    Self::NAMES.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Whether any quota bounds the sandboxes a tenant makes (all but
    /// `sessions`).
    pub fn limits_sandboxes(&self) -> bool {
        Quota {
            sessions: None,
            ..self.clone()
        } != Quota::default()
    }

    pub fn is_empty(&self) -> bool {
        *self == Quota::default()
    }
}

/// Keys and quotas on the wire (`corral.v1.Admin`): a key's digest never
/// leaves the front door.
pub mod wire {
    use super::{KeyRecord, Quota, Scope, TenantsError};
    use corral_proto::pb;

    pub fn scope(s: Scope) -> pb::KeyScope {
        match s {
            Scope::Read => pb::KeyScope::Read,
            Scope::Run => pb::KeyScope::Run,
            Scope::Admin => pb::KeyScope::Admin,
        }
    }

    pub fn scope_of(v: i32) -> Result<Scope, TenantsError> {
        match pb::KeyScope::try_from(v) {
            Ok(pb::KeyScope::Read) => Ok(Scope::Read),
            Ok(pb::KeyScope::Run) => Ok(Scope::Run),
            Ok(pb::KeyScope::Admin) => Ok(Scope::Admin),
            _ => Err(TenantsError::Invalid(format!(
                "scope {v}: not one of read, run, admin"
            ))),
        }
    }

    pub fn key_info(r: &KeyRecord) -> pb::KeyInfo {
        pb::KeyInfo {
            id: r.id.clone(),
            tenant: r.tenant.clone(),
            scopes: r.scopes.iter().map(|s| scope(*s) as i32).collect(),
            created_unix_ms: r.created_unix_ms,
            expires_unix_ms: r.expires_unix_ms.unwrap_or(0),
        }
    }

    /// A key as a front door describes it (without its digest).
    pub fn record_of(k: pb::KeyInfo) -> Result<KeyRecord, TenantsError> {
        Ok(KeyRecord {
            id: k.id,
            tenant: k.tenant,
            scopes: k
                .scopes
                .into_iter()
                .map(scope_of)
                .collect::<Result<_, _>>()?,
            sha256: String::new(),
            created_unix_ms: k.created_unix_ms,
            expires_unix_ms: (k.expires_unix_ms != 0).then_some(k.expires_unix_ms),
        })
    }

    pub fn tenant_quota(tenant: &str, q: &Quota) -> pb::TenantQuota {
        pb::TenantQuota {
            tenant: tenant.to_string(),
            sandboxes: q.sandboxes,
            memory_bytes: q.memory_bytes,
            cpu_millis: q.cpu_millis,
            pids: q.pids,
            sessions: q.sessions,
            creates_per_minute: q.creates_per_minute,
        }
    }

    pub fn quota_of(q: pb::TenantQuota) -> (String, Quota) {
        (
            q.tenant,
            Quota {
                sandboxes: q.sandboxes,
                memory_bytes: q.memory_bytes,
                cpu_millis: q.cpu_millis,
                pids: q.pids,
                sessions: q.sessions,
                creates_per_minute: q.creates_per_minute,
            },
        )
    }
}

/// The keys and quotas of a directory, read whole.
#[derive(Debug, Default, Clone)]
pub struct KeySet {
    by_id: HashMap<String, KeyRecord>,
    quotas: HashMap<String, Quota>,
}

impl KeySet {
    /// Reads `dir/keys/*.json` and `dir/quotas/*.json`; any file that does
    /// not parse fails it all.
    pub fn load(dir: &Path) -> Result<Self, TenantsError> {
        let by_id = list(dir)?.into_iter().map(|r| (r.id.clone(), r)).collect();
        let quotas = quotas(dir)?.into_iter().collect();
        Ok(Self { by_id, quotas })
    }

    /// `tenant`'s quota, if it has one.
    pub fn quota(&self, tenant: &str) -> Option<&Quota> {
        self.quotas.get(tenant)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The caller a presented key names, at `now_ms`.
    pub fn authenticate(&self, presented: &str, now_ms: i64) -> Result<Principal, AuthError> {
        if presented.is_empty() {
            return Err(AuthError::Missing);
        }
        let id = key_id(presented).ok_or(AuthError::Malformed)?;
        let record = self.by_id.get(id).ok_or(AuthError::Unknown)?;
        // Digests compared, not keys: how long this takes says nothing of
        // the key.
        if sha256_hex(presented.as_bytes()) != record.sha256 {
            return Err(AuthError::Unknown);
        }
        if record.expires_unix_ms.is_some_and(|t| t <= now_ms) {
            return Err(AuthError::Expired);
        }
        Ok(Principal {
            tenant: record.tenant.clone(),
            key_id: record.id.clone(),
            scopes: record.scopes.clone(),
        })
    }
}

fn keys_dir(dir: &Path) -> PathBuf {
    dir.join("keys")
}

fn quotas_dir(dir: &Path) -> PathBuf {
    dir.join("quotas")
}

/// The JSON files of `dir` (none when it is not there), each as its name
/// without `.json`, its path and its parsed contents; entries whose names
/// start with a dot (Kubernetes' own `..data`, files being written) are
/// left out. A file that does not parse fails them all.
fn json_files<T: serde::de::DeserializeOwned>(
    dir: &Path,
) -> Result<Vec<(String, PathBuf, T)>, TenantsError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".json") else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        let text = std::fs::read(&path).map_err(io(&path))?;
        let parsed = serde_json::from_slice(&text).map_err(|e| TenantsError::Malformed {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        out.push((stem.to_string(), path, parsed));
    }
    Ok(out)
}

fn malformed(path: &Path, why: String) -> TenantsError {
    TenantsError::Malformed {
        path: path.display().to_string(),
        why,
    }
}

/// Every tenant's quota in `dir`, by tenant.
pub fn quotas(dir: &Path) -> Result<Vec<(String, Quota)>, TenantsError> {
    let mut out = Vec::new();
    for (tenant, path, quota) in json_files::<Quota>(&quotas_dir(dir))? {
        if !corral_proto::sandbox::is_tenant_name(&tenant) {
            return Err(malformed(
                &path,
                "not a tenant's name (1-63 characters of [a-z0-9-])".into(),
            ));
        }
        out.push((tenant, quota));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Sets `tenant`'s quotas by `NAME=VALUE` (VALUE a number, or `none` for
/// no limit), over what it had; returns the quota now.
pub fn set_quota(dir: &Path, tenant: &str, assignments: &[String]) -> Result<Quota, TenantsError> {
    if !corral_proto::sandbox::is_tenant_name(tenant) {
        return Err(TenantsError::Invalid(format!(
            "tenant {:?}: 1-63 characters of [a-z0-9-], starting with a letter or digit",
            shown(tenant)
        )));
    }
    if assignments.is_empty() {
        return Err(TenantsError::Invalid(format!(
            "which quotas? NAME=VALUE ({}; VALUE a number, a size like 64g for memory, or none)",
            Quota::NAMES.join(", ")
        )));
    }
    readable(dir)?;
    let mut quota = quotas(dir)?
        .into_iter()
        .find(|(t, _)| t == tenant)
        .map(|(_, q)| q)
        .unwrap_or_default();
    for a in assignments {
        let (name, value) = a.split_once('=').ok_or_else(|| {
            TenantsError::Invalid(format!(
                "{:?}: NAME=VALUE (VALUE a number, a size, or none)",
                shown(a)
            ))
        })?;
        let value = match value.trim() {
            "none" => None,
            v => Some(v),
        };
        quota.set(name.trim(), value)?;
    }
    private_dir(dir)?;
    let qdir = quotas_dir(dir);
    private_dir(&qdir)?;
    let path = qdir.join(format!("{tenant}.json"));
    if quota.is_empty() {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&path)(e)),
        }
    } else {
        let text =
            serde_json::to_vec_pretty(&quota).map_err(|e| TenantsError::Invalid(e.to_string()))?;
        write_whole(&path, &text)?;
    }
    Ok(quota)
}

/// Every key of `dir`, by id.
pub fn list(dir: &Path) -> Result<Vec<KeyRecord>, TenantsError> {
    if !dir.is_dir() {
        return Err(malformed(dir, "not a directory".into()));
    }
    let mut out = Vec::new();
    for (id, path, record) in json_files::<KeyRecord>(&keys_dir(dir))? {
        let bad = |why: String| malformed(&path, why);
        if record.id != id || !is_hex(&record.id, ID_LEN) {
            return Err(bad(format!(
                "its id {:?} is not its file's name ({id}), or not {ID_LEN} hex digits",
                record.id
            )));
        }
        if !corral_proto::sandbox::is_tenant_name(&record.tenant) {
            return Err(bad(format!(
                "tenant {:?}: 1-63 characters of [a-z0-9-]",
                record.tenant
            )));
        }
        if record.scopes.is_empty() {
            return Err(bad("no scope".into()));
        }
        if !is_hex(&record.sha256, 64) {
            return Err(bad("sha256: not 64 hex digits".into()));
        }
        out.push(record);
    }
    out.sort_by(|a, b| {
        (&a.tenant, a.created_unix_ms, &a.id).cmp(&(&b.tenant, b.created_unix_ms, &b.id))
    });
    Ok(out)
}

/// Makes a key for `tenant` with `scopes`, valid for `ttl` (None: until
/// revoked): returns the key, shown this once, and what is kept of it.
pub fn create_key(
    dir: &Path,
    tenant: &str,
    scopes: BTreeSet<Scope>,
    ttl: Option<Duration>,
) -> Result<(String, KeyRecord), TenantsError> {
    if !corral_proto::sandbox::is_tenant_name(tenant) {
        return Err(TenantsError::Invalid(format!(
            "tenant {:?}: 1-63 characters of [a-z0-9-], starting with a letter or digit",
            shown(tenant)
        )));
    }
    if scopes.is_empty() {
        return Err(TenantsError::Invalid(
            "a key needs a scope: read, run or admin".into(),
        ));
    }
    let created = now_ms();
    let expires = match ttl {
        None => None,
        Some(t) => Some(
            i64::try_from(t.as_millis())
                .ok()
                .and_then(|ms| created.checked_add(ms))
                .filter(|_| t <= MAX_TTL)
                .ok_or_else(|| {
                    TenantsError::Invalid(format!(
                        "a key valid for {} s: at most 100 years (or none: until revoked)",
                        t.as_secs()
                    ))
                })?,
        ),
    };
    readable(dir)?;
    let id = uuid::Uuid::new_v4().simple().to_string()[..ID_LEN].to_string();
    let secret = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let key = format!("{PREFIX}{id}_{secret}");
    let record = KeyRecord {
        id: id.clone(),
        tenant: tenant.to_string(),
        scopes,
        sha256: sha256_hex(key.as_bytes()),
        created_unix_ms: created,
        expires_unix_ms: expires,
    };
    let keys = keys_dir(dir);
    private_dir(dir)?;
    private_dir(&keys)?;
    let text =
        serde_json::to_vec_pretty(&record).map_err(|e| TenantsError::Invalid(e.to_string()))?;
    write_whole(&keys.join(format!("{id}.json")), &text)?;
    Ok((key, record))
}

/// Revokes key `id`: whether there was one. A front door refuses it within
/// [`POLL`] of this.
pub fn revoke(dir: &Path, id: &str) -> Result<bool, TenantsError> {
    // A whole key given where its id is asked for: its id (the secret is
    // never echoed).
    let id = key_id(id).unwrap_or(id);
    if !is_hex(id, ID_LEN) {
        return Err(TenantsError::Invalid(format!(
            "{:?} is not a key's id ({ID_LEN} hex digits; `corral admin key ls` shows them)",
            shown(id)
        )));
    }
    readable(dir)?;
    let path = keys_dir(dir).join(format!("{id}.json"));
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(&path)(e)),
    }
}

fn private_dir(dir: &Path) -> Result<(), TenantsError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io(dir)(e)),
    }
}

/// Writes `path` whole or not at all (a reader sees the old file or the
/// new one), readable by its owner alone.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), TenantsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_file_name(format!(
        ".{}.{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("key"),
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// What the directory looks like: when it changes, it is read again.
fn fingerprint(dir: &Path) -> Vec<(String, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let keys = keys_dir(dir);
    let quotas = quotas_dir(dir);
    for d in [dir.to_path_buf(), keys.clone(), quotas.clone()] {
        if let Ok(m) = std::fs::metadata(&d) {
            out.push((d.display().to_string(), m.ino(), m.mtime(), m.mtime_nsec()));
        }
    }
    for d in [&keys, &quotas] {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        for e in entries.flatten() {
            // Through links: a Kubernetes Secret swaps what its names lead to.
            if let Ok(m) = std::fs::metadata(e.path()) {
                out.push((
                    e.path().display().to_string(),
                    m.ino() ^ m.size(),
                    m.mtime(),
                    m.mtime_nsec(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// The keys a front door checks callers against, kept current.
#[derive(Clone)]
pub struct Keys {
    current: tokio::sync::watch::Receiver<Arc<KeySet>>,
    /// Asks the watcher to read the directory at once.
    look: Arc<tokio::sync::Notify>,
}

impl Keys {
    /// The keys as they are now.
    pub fn current(&self) -> Arc<KeySet> {
        self.current.borrow().clone()
    }

    /// Keys that never change (a test's).
    pub fn fixed(set: KeySet) -> Self {
        let (_tx, current) = tokio::sync::watch::channel(Arc::new(set));
        Self {
            current,
            look: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Taken before a change made here to the directory: see
    /// [`Keys::look_now`].
    pub fn before_change(&self) -> Seen {
        let mut seen = self.current.clone();
        seen.mark_unchanged();
        Seen(seen)
    }

    /// After a change made here to the directory (`since` taken before
    /// it): has it read at once, and waits (a second at most) until a read
    /// after `since` is in force, so that a key just made works and one
    /// just revoked fails on this replica before the call that changed it
    /// is answered.
    pub async fn look_now(&self, since: Seen) {
        let Seen(mut next) = since;
        self.look.notify_one();
        let _ = tokio::time::timeout(Duration::from_secs(1), next.changed()).await;
    }
}

/// The keys as they were before a change (see [`Keys::before_change`]).
pub struct Seen(tokio::sync::watch::Receiver<Arc<KeySet>>);

/// Reads `dir` now (an error if it does not read whole) and then every
/// [`POLL`] while `stop` is not canceled: a change takes effect once the
/// directory reads whole again; until then the last good keys stay, and
/// the reason is logged once.
pub fn watch(
    dir: PathBuf,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(Keys, tokio::task::JoinHandle<()>), TenantsError> {
    let mut seen = fingerprint(&dir);
    let first = KeySet::load(&dir)?;
    tracing::info!(dir = %dir.display(), keys = first.len(), "tenants' keys read");
    let (tx, current) = tokio::sync::watch::channel(Arc::new(first));
    let look = Arc::new(tokio::sync::Notify::new());
    let asked = look.clone();
    let task = tokio::spawn(async move {
        let mut failing: Option<String> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(POLL) => {}
                () = asked.notified() => {}
            }
            let now = fingerprint(&dir);
            if now == seen {
                continue;
            }
            match KeySet::load(&dir) {
                Ok(set) => {
                    seen = now;
                    if failing.take().is_some() {
                        tracing::info!(dir = %dir.display(), "the tenants' directory reads whole again");
                    }
                    tracing::info!(keys = set.len(), "tenants' keys read again");
                    let _ = tx.send(Arc::new(set));
                }
                Err(e) => {
                    let why = e.to_string();
                    if failing.as_deref() != Some(why.as_str()) {
                        tracing::error!(error = %why, "the tenants' directory does not read whole: the last good keys stay in force");
                        failing = Some(why);
                    }
                    // Read again at the next look, changed or not (a file
                    // caught half written by a hand editor).
                }
            }
        }
    });
    Ok((Keys { current, look }, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scopes(s: &[Scope]) -> BTreeSet<Scope> {
        s.iter().copied().collect()
    }

    #[test]
    fn a_key_is_kept_as_its_digest_and_names_its_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let (key, record) = create_key(dir.path(), "acme", scopes(&[Scope::Run]), None).unwrap();
        let text =
            std::fs::read_to_string(dir.path().join("keys").join(format!("{}.json", record.id)))
                .unwrap();
        assert!(!text.contains(key.split('_').nth(2).unwrap()), "{text}");
        let set = KeySet::load(dir.path()).unwrap();
        let who = set.authenticate(&key, now_ms()).unwrap();
        assert_eq!(who.tenant, "acme");
        assert!(who.allows(Scope::Read) && who.allows(Scope::Run) && !who.allows(Scope::Admin));
        // One character off: unknown, as a key never made.
        let mut wrong = key.clone();
        let last = wrong.pop().unwrap();
        wrong.push(if last == '0' { '1' } else { '0' });
        assert_eq!(set.authenticate(&wrong, now_ms()), Err(AuthError::Unknown));
        assert_eq!(
            set.authenticate("hunter2", now_ms()),
            Err(AuthError::Malformed)
        );
        assert_eq!(set.authenticate("", now_ms()), Err(AuthError::Missing));
        assert!(revoke(dir.path(), &record.id).unwrap());
        let set = KeySet::load(dir.path()).unwrap();
        assert_eq!(set.authenticate(&key, now_ms()), Err(AuthError::Unknown));
    }

    #[test]
    fn an_expired_key_is_refused_as_expired() {
        let dir = tempfile::tempdir().unwrap();
        let (key, record) = create_key(
            dir.path(),
            "acme",
            scopes(&[Scope::Read]),
            Some(Duration::from_secs(60)),
        )
        .unwrap();
        let set = KeySet::load(dir.path()).unwrap();
        let expires = record.expires_unix_ms.unwrap();
        assert!(set.authenticate(&key, expires - 1).is_ok());
        assert_eq!(set.authenticate(&key, expires), Err(AuthError::Expired));
    }

    #[test]
    fn bad_input_is_refused_and_a_bad_file_fails_the_whole_read() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Scope::parse("write").is_err());
        assert!(create_key(dir.path(), "Acme!", scopes(&[Scope::Run]), None).is_err());
        assert!(create_key(dir.path(), "acme", BTreeSet::new(), None).is_err());
        assert!(revoke(dir.path(), "../../etc/passwd").is_err());
        create_key(dir.path(), "acme", scopes(&[Scope::Run]), None).unwrap();
        std::fs::write(
            dir.path().join("keys").join("0123456789ab.json"),
            r#"{"id":"0123456789ab","tenant":"acme","scopes":["write"],"sha256":"00","created_unix_ms":0}"#,
        )
        .unwrap();
        let e = KeySet::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("0123456789ab.json"), "{e}");
    }

    #[test]
    fn a_directory_that_does_not_read_whole_is_not_changed() {
        let dir = tempfile::tempdir().unwrap();
        let (key, record) = create_key(dir.path(), "acme", scopes(&[Scope::Run]), None).unwrap();
        // A quota file of a newer release (a field this one does not know).
        std::fs::create_dir_all(dir.path().join("quotas")).unwrap();
        let bad = dir.path().join("quotas").join("zeta.json");
        std::fs::write(&bad, r#"{"sandboxes": 2, "gpus": 1}"#).unwrap();
        // A revoke here would be no revoke at all for a front door, which
        // keeps its last good keys: refused, naming the file.
        let e = revoke(dir.path(), &record.id).unwrap_err().to_string();
        assert!(
            e.contains("zeta.json") && e.contains("does not read whole"),
            "{e}"
        );
        assert!(create_key(dir.path(), "bolt", scopes(&[Scope::Run]), None).is_err());
        assert!(set_quota(dir.path(), "acme", &["sandboxes=1".to_string()]).is_err());
        std::fs::remove_file(&bad).unwrap();
        // A whole key given for its id revokes it; its secret is echoed nowhere.
        assert!(revoke(dir.path(), &key).unwrap());
        let e = revoke(dir.path(), &format!("{key}x"))
            .unwrap_err()
            .to_string();
        assert!(!e.contains(key.split('_').nth(2).unwrap()), "{e}");
    }

    #[test]
    fn keys_in_text_are_cut_to_their_ids() {
        let key = format!("corral_0123456789ab_{}", "f".repeat(64));
        assert_eq!(
            redact(&format!("tenant {key:?} and {key}.")),
            "tenant \"corral_0123456789ab_…\" and corral_0123456789ab_…."
        );
        assert_eq!(
            redact("corral_ no key corral_12"),
            "corral_ no key corral_12"
        );
    }

    #[test]
    fn a_key_valid_too_long_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for ttl in [
            Duration::from_millis(u64::MAX),
            Duration::from_secs(200 * 365 * 86_400),
        ] {
            assert!(create_key(dir.path(), "acme", scopes(&[Scope::Run]), Some(ttl)).is_err());
        }
        let (_, r) = create_key(
            dir.path(),
            "acme",
            scopes(&[Scope::Run]),
            Some(Duration::from_secs(30 * 86_400)),
        )
        .unwrap();
        assert!(r.expires_unix_ms.unwrap() > r.created_unix_ms);
    }

    #[test]
    fn quotas_are_set_by_name_and_a_bad_one_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let set = |a: &[&str]| {
            set_quota(
                dir.path(),
                "acme",
                &a.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
        };
        let q = set(&["sandboxes=20", "creates-per-minute=60"]).unwrap();
        assert_eq!((q.sandboxes, q.creates_per_minute), (Some(20), Some(60)));
        let q = set(&["memory=64g", "cpus=2.5", "pids=4096", "sessions=3"]).unwrap();
        assert_eq!(
            (q.memory_bytes, q.cpu_millis, q.pids, q.sessions),
            (Some(64 << 30), Some(2500), Some(4096), Some(3))
        );
        assert!(set(&["memory=lots"]).is_err());
        assert!(set(&["cpus=-1"]).is_err());
        assert!(set(&["gpus=1"]).is_err());
        assert!(set(&["sandboxes=-1"]).is_err());
        assert!(set(&["sandboxes"]).is_err());
        let q = set(&["creates_per_minute=none"]).unwrap();
        assert_eq!((q.sandboxes, q.creates_per_minute), (Some(20), None));
        let keys = KeySet::load(dir.path()).unwrap();
        assert_eq!(keys.quota("acme").and_then(|q| q.sandboxes), Some(20));
        assert!(keys.quota("bolt").is_none());
        std::fs::write(
            dir.path().join("quotas").join("bolt.json"),
            r#"{"sandbox": 3}"#,
        )
        .unwrap();
        assert!(
            KeySet::load(dir.path()).is_err(),
            "an unknown quota's name is refused"
        );
    }

    #[tokio::test]
    async fn a_revoked_key_is_refused_after_one_poll_and_a_bad_directory_keeps_the_last_good_keys()
    {
        let dir = tempfile::tempdir().unwrap();
        let (a, ra) = create_key(dir.path(), "acme", scopes(&[Scope::Run]), None).unwrap();
        let (b, _) = create_key(dir.path(), "bolt", scopes(&[Scope::Run]), None).unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let (keys, task) = watch(dir.path().to_path_buf(), stop.clone()).unwrap();
        assert!(keys.current().authenticate(&a, now_ms()).is_ok());
        revoke(dir.path(), &ra.id).unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while keys.current().authenticate(&a, now_ms()).is_ok() {
            assert!(std::time::Instant::now() < until, "never revoked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A file that does not parse: the keys read last stay.
        std::fs::write(dir.path().join("keys").join("ffffffffffff.json"), "{").unwrap();
        tokio::time::sleep(POLL * 3).await;
        assert!(keys.current().authenticate(&b, now_ms()).is_ok());
        stop.cancel();
        task.await.unwrap();
    }
}
