//! `corral.v1.Admin` on a front door: the tenants' keys and quotas, for
//! `admin` keys (`corral admin --url URL`). Each call works on the
//! directory the front door serves (`--tenants DIR`) as `corral admin
//! --tenants DIR` does offline, so every replica reading it sees the change
//! within a second; each is audited with its subject (`key:ID`,
//! `tenant:NAME`), never a key.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use corral_harness::audit::AuditLog;
use corral_harness::tenants::{self, Keys, Principal, Scope, TenantsError, wire};
use corral_proto::{Reason, pb};
use tonic::{Code, Request, Response, Status};

use super::front::{caller, need};

pub struct AdminService {
    /// The tenants' directory (None: the front door serves none).
    dir: Option<PathBuf>,
    /// What this replica reads of it, read again at once after a change.
    keys: Option<Keys>,
    audit: Option<AuditLog>,
}

fn status(code: Code, reason: Reason, message: impl Into<String>) -> Status {
    corral_proto::reason::status(code, reason, None, message.into())
}

/// A refusal of the directory's: bad input is the caller's; a directory
/// it may not write (a Kubernetes Secret is mounted read-only) is said so.
fn tenants_status(dir: &Path, e: TenantsError) -> Status {
    match e {
        TenantsError::Invalid(why) => status(
            Code::InvalidArgument,
            Reason::InvalidArgument,
            tenants::redact(&why),
        ),
        TenantsError::Io { ref source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied
            ) =>
        {
            status(
                Code::FailedPrecondition,
                Reason::NotApplicable,
                format!(
                    "{e}: this front door cannot change its tenants' directory {} (read-only here, as a Kubernetes Secret is): change the keys where they are kept, e.g. `corral admin --tenants DIR` and `kubectl create secret`",
                    dir.display()
                ),
            )
        }
        other => status(
            Code::Internal,
            Reason::Internal,
            tenants::redact(&other.to_string()),
        ),
    }
}

impl AdminService {
    pub fn new(dir: Option<PathBuf>, keys: Option<Keys>, audit: Option<AuditLog>) -> Self {
        Self { dir, keys, audit }
    }

    /// A change to the directory by `change`, in force on this replica
    /// before it is answered.
    async fn changing<T>(
        &self,
        change: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let seen = self.keys.as_ref().map(Keys::before_change);
        let done = change.await?;
        if let (Some(keys), Some(seen)) = (&self.keys, seen) {
            keys.look_now(seen).await;
        }
        Ok(done)
    }

    /// `work` on the tenants' directory for an admin caller, off the
    /// runtime's threads; audited as `call` about `subject`.
    async fn on_dir<T, F>(
        &self,
        who: &Principal,
        call: &str,
        subject: &str,
        work: F,
    ) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Path) -> Result<T, TenantsError> + Send + 'static,
    {
        let r = async {
            need(who, Scope::Admin, call)?;
            let dir = self.dir.clone().ok_or_else(|| {
                status(
                    Code::FailedPrecondition,
                    Reason::NotApplicable,
                    "this front door serves no tenants: start it with --tenants DIR",
                )
            })?;
            tokio::task::spawn_blocking(move || work(&dir).map_err(|e| tenants_status(&dir, e)))
                .await
                .map_err(|e| status(Code::Internal, Reason::Internal, e.to_string()))?
        }
        .await;
        super::audited(
            self.audit.as_ref(),
            who,
            call,
            super::About::Subject(subject),
            r,
        )
        .await
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn create_key(
        &self,
        req: Request<pb::CreateKeyRequest>,
    ) -> Result<Response<pb::CreateKeyResponse>, Status> {
        let who = caller(&req)?;
        let req = req.into_inner();
        let subject = format!("tenant:{}", tenants::redact(&req.tenant));
        let made = self
            .changing(self.on_dir(&who, "CreateKey", &subject, move |dir| {
                let scopes = req
                    .scopes
                    .iter()
                    .map(|s| wire::scope_of(*s))
                    .collect::<Result<BTreeSet<_>, _>>()?;
                let ttl = (req.ttl_ms > 0).then(|| Duration::from_millis(req.ttl_ms));
                let (key, record) = tenants::create_key(dir, &req.tenant, scopes, ttl)?;
                Ok(pb::CreateKeyResponse {
                    key,
                    info: Some(wire::key_info(&record)),
                })
            }))
            .await?;
        Ok(Response::new(made))
    }

    async fn list_keys(
        &self,
        req: Request<pb::ListKeysRequest>,
    ) -> Result<Response<pb::ListKeysResponse>, Status> {
        let who = caller(&req)?;
        self.on_dir(&who, "ListKeys", "", |dir| {
            Ok(pb::ListKeysResponse {
                keys: tenants::list(dir)?.iter().map(wire::key_info).collect(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn revoke_key(
        &self,
        req: Request<pb::RevokeKeyRequest>,
    ) -> Result<Response<pb::RevokeKeyResponse>, Status> {
        let who = caller(&req)?;
        let id = req.into_inner().id;
        // A whole key given for its id is cut to its id, here and in the log.
        let id = tenants::key_id(&id).map_or(id.clone(), str::to_string);
        let subject = format!("key:{}", tenants::redact(&id));
        let revoked = self
            .changing(self.on_dir(&who, "RevokeKey", &subject, move |dir| {
                if tenants::revoke(dir, &id)? {
                    Ok(pb::RevokeKeyResponse {})
                } else {
                    Err(TenantsError::Invalid(format!(
                        "no key {id} (`corral admin key ls` lists them)"
                    )))
                }
            }))
            .await?;
        Ok(Response::new(revoked))
    }

    async fn set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::TenantQuota>, Status> {
        let who = caller(&req)?;
        let req = req.into_inner();
        let subject = format!("tenant:{}", tenants::redact(&req.tenant));
        let set = self
            .changing(self.on_dir(&who, "SetQuota", &subject, move |dir| {
                let q = tenants::set_quota(dir, &req.tenant, &req.quotas)?;
                Ok(wire::tenant_quota(&req.tenant, &q))
            }))
            .await?;
        Ok(Response::new(set))
    }

    async fn list_quotas(
        &self,
        req: Request<pb::ListQuotasRequest>,
    ) -> Result<Response<pb::ListQuotasResponse>, Status> {
        let who = caller(&req)?;
        self.on_dir(&who, "ListQuotas", "", |dir| {
            Ok(pb::ListQuotasResponse {
                quotas: tenants::quotas(dir)?
                    .iter()
                    .map(|(t, q)| wire::tenant_quota(t, q))
                    .collect(),
            })
        })
        .await
        .map(Response::new)
    }
}
