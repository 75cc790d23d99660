//! Volumes (see [`crate::volumes`]) as clients make, list and remove them.

use corral_proto::pb;

use super::Worker;
use crate::error::Result;
use crate::volumes::{Holders, Volume};

fn to_pb(v: &Volume, h: &Holders, used_bytes: u64) -> pb::Volume {
    pb::Volume {
        name: v.name.clone(),
        size_bytes: v.size_bytes,
        used_bytes,
        created_at_unix_ms: v.created_at_ms,
        writer: h
            .writer
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        readers: h.readers.iter().map(ToString::to_string).collect(),
    }
}

impl Worker {
    /// Makes `tenant`'s volume `name` (0 bytes: the worker's default
    /// size), or answers the one there of that size.
    pub async fn create_volume(
        &self,
        tenant: Option<&str>,
        name: &str,
        size_bytes: u64,
    ) -> Result<pb::Volume> {
        let vols = &self.inner.volumes;
        let (v, _made) = vols.create(tenant, name, size_bytes, self.now_ms()).await?;
        let h = vols
            .list(tenant)
            .into_iter()
            .find(|(k, _)| k.id == v.id)
            .map(|(_, h)| h)
            .unwrap_or_default();
        Ok(to_pb(&v, &h, vols.used_bytes(&v)))
    }

    /// `tenant`'s volumes, by name.
    pub fn list_volumes(&self, tenant: Option<&str>) -> Vec<pb::Volume> {
        let vols = &self.inner.volumes;
        vols.list(tenant)
            .iter()
            .map(|(v, h)| to_pb(v, h, vols.used_bytes(v)))
            .collect()
    }

    /// Removes `tenant`'s volume `name` and its files: whether there was
    /// one.
    pub async fn delete_volume(&self, tenant: Option<&str>, name: &str) -> Result<bool> {
        Ok(self.inner.volumes.delete(tenant, name).await?)
    }
}
