//! Templates: images this worker built, kept under a name with what a
//! sandbox made from them starts with (`BuildImage` with a `template`),
//! each tenant's names its own (the operator's, with no tenant, too). They
//! live in one file of the state directory, written before a build or a
//! removal is answered, so they outlive a restart of the worker.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use corral_proto::template::TemplateStart;

/// One template.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Template {
    /// Whose it is (`None`: the operator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub name: String,
    pub image: String,
    #[serde(default)]
    pub start: TemplateStart,
    pub created_at_ms: i64,
    /// Its digest in the fleet's registry (`--registry`), once pushed
    /// there or pulled from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_digest: Option<String>,
    /// Its image carries a workspace its sandboxes start with (a
    /// snapshot's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub seeded: bool,
}

type Key = (String, String);

fn key(tenant: Option<&str>, name: &str) -> Key {
    (tenant.unwrap_or_default().to_string(), name.to_string())
}

/// The worker's templates (one lock, held for short sections only).
pub struct Templates {
    file: PathBuf,
    all: Mutex<BTreeMap<Key, Template>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Templates {
    /// Those kept in `file` (none if it is missing; an unreadable one is
    /// said and set aside, never half-read).
    pub fn load(file: PathBuf) -> Self {
        let all = match std::fs::read(&file) {
            Ok(b) => match serde_json::from_slice::<Vec<Template>>(&b) {
                Ok(all) => all
                    .into_iter()
                    .map(|t| (key(t.tenant.as_deref(), &t.name), t))
                    .collect(),
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "unreadable templates, set aside");
                    let _ = std::fs::rename(&file, file.with_extension("json.unreadable"));
                    BTreeMap::new()
                }
            },
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(file = %file.display(), error = %e, "templates not read");
                }
                BTreeMap::new()
            }
        };
        Self {
            file,
            all: Mutex::new(all),
        }
    }

    fn keep(&self, all: &BTreeMap<Key, Template>) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(&all.values().collect::<Vec<_>>())
            .map_err(std::io::Error::other)?;
        crate::state::write_synced(&self.file, &json)
    }

    /// Keeps `t` under its name (one of the name before is replaced),
    /// written before this returns.
    pub fn put(&self, t: Template) -> std::io::Result<()> {
        let mut all = lock(&self.all);
        let k = key(t.tenant.as_deref(), &t.name);
        let old = all.insert(k.clone(), t);
        if let Err(e) = self.keep(&all) {
            match old {
                Some(old) => all.insert(k, old),
                None => all.remove(&k),
            };
            return Err(e);
        }
        Ok(())
    }

    /// Whether `tenant` may keep `name` as well as what it has (one more,
    /// or one it has again), under `most`.
    pub fn has_room(&self, tenant: Option<&str>, name: &str, most: usize) -> bool {
        let all = lock(&self.all);
        let mine = tenant.unwrap_or_default();
        all.contains_key(&key(tenant, name)) || all.keys().filter(|(t, _)| t == mine).count() < most
    }

    pub fn get(&self, tenant: Option<&str>, name: &str) -> Option<Template> {
        lock(&self.all).get(&key(tenant, name)).cloned()
    }

    /// `tenant`'s templates, by name.
    pub fn list(&self, tenant: Option<&str>) -> Vec<Template> {
        let mine = tenant.unwrap_or_default();
        lock(&self.all)
            .iter()
            .filter(|((t, _), _)| t == mine)
            .map(|(_, t)| t.clone())
            .collect()
    }

    /// Forgets `tenant`'s `name`: whether there was one.
    pub fn remove(&self, tenant: Option<&str>, name: &str) -> std::io::Result<bool> {
        let mut all = lock(&self.all);
        let k = key(tenant, name);
        let Some(old) = all.remove(&k) else {
            return Ok(false);
        };
        if let Err(e) = self.keep(&all) {
            all.insert(k, old);
            return Err(e);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(tenant: Option<&str>, name: &str, image: &str) -> Template {
        Template {
            tenant: tenant.map(str::to_string),
            name: name.into(),
            image: image.into(),
            start: TemplateStart::default(),
            created_at_ms: 1,
            registry_digest: None,
            seeded: false,
        }
    }

    #[test]
    fn templates_are_each_tenants_own_and_outlive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("templates.json");
        let ts = Templates::load(file.clone());
        ts.put(t(None, "web", "i1")).unwrap();
        ts.put(t(Some("acme"), "web", "i2")).unwrap();
        ts.put(t(Some("acme"), "web", "i3")).unwrap();
        assert_eq!(ts.get(None, "web").unwrap().image, "i1");
        assert_eq!(ts.get(Some("acme"), "web").unwrap().image, "i3");
        assert!(ts.get(Some("bolt"), "web").is_none());
        assert_eq!(ts.list(Some("acme")).len(), 1);
        assert!(ts.list(Some("bolt")).is_empty());
        assert!(!ts.remove(Some("bolt"), "web").unwrap());
        let again = Templates::load(file.clone());
        assert_eq!(again.get(Some("acme"), "web").unwrap().image, "i3");
        assert!(again.remove(None, "web").unwrap());
        assert!(Templates::load(file.clone()).get(None, "web").is_none());
        // A torn file is set aside, not half-read.
        std::fs::write(&file, b"[{\"name\":").unwrap();
        assert!(Templates::load(file).list(None).is_empty());
        assert!(dir.path().join("templates.json.unreadable").exists());
    }
}
