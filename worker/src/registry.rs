//! Templates carried between workers by an OCI registry (`--registry
//! HOST:PORT`): a template built on one worker is pushed as
//! `HOST:PORT/corral-templates:<owner>.<name>` (the owner its tenant, `_`
//! for the operator's), what its sandboxes start with in the image's
//! `corral.template` label; another worker asks the registry, through its
//! engine, for the tag's digest at each create of the template, and pulls
//! by that digest what it does not have. A name built again moves the tag,
//! so no worker serves an older build under it.

use std::collections::HashMap;

use bollard::Docker;
use bollard::query_parameters::{
    CommitContainerOptionsBuilder, CreateContainerOptionsBuilder, CreateImageOptionsBuilder,
    PushImageOptionsBuilder, RemoveContainerOptionsBuilder,
};
use corral_proto::template::TemplateStart;
use futures_util::StreamExt;

/// The repository of templates in a registry.
const REPOSITORY: &str = "corral-templates";
/// The label that carries a template's start and readiness.
const LABEL: &str = "corral.template";

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry {registry}: {what}")]
    Failed { registry: String, what: String },
}

/// A template as the registry has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// `HOST:PORT/corral-templates@sha256:...`: what a sandbox runs.
    pub image: String,
    pub digest: String,
    pub start: TemplateStart,
    /// It carries a snapshot's workspace.
    pub seeded: bool,
}

/// The fleet's registry, reached through this worker's engine.
pub struct Registry {
    docker: Docker,
    address: String,
}

impl RegistryError {
    /// The same failure, saying that the template stays on this worker.
    pub fn kept_here(self) -> Self {
        let RegistryError::Failed { registry, what } = self;
        RegistryError::Failed {
            registry,
            what: format!("{what}; the template is kept on this worker alone"),
        }
    }
}

impl Registry {
    pub fn new(docker: Docker, address: String) -> Self {
        Self { docker, address }
    }

    fn failed(&self, what: impl std::fmt::Display) -> RegistryError {
        RegistryError::Failed {
            registry: self.address.clone(),
            what: what.to_string(),
        }
    }

    /// The tag of `tenant`'s template `name`.
    fn tag(tenant: Option<&str>, name: &str) -> String {
        format!("{}.{name}", tenant.unwrap_or("_"))
    }

    fn repository(&self) -> String {
        format!("{}/{REPOSITORY}", self.address)
    }

    /// Pushes `image` as `tenant`'s template `name` with `start`: its
    /// digest in the registry.
    pub async fn publish(
        &self,
        tenant: Option<&str>,
        name: &str,
        image: &str,
        start: &TemplateStart,
        seeded: bool,
    ) -> Result<String, RegistryError> {
        let label = serde_json::to_string(start).map_err(|e| self.failed(e))?;
        // The image with its label: a commit of a container never started.
        let made = self
            .docker
            .create_container(
                Some(CreateContainerOptionsBuilder::default().build()),
                bollard::models::ContainerCreateBody {
                    image: Some(image.to_string()),
                    // Never run; the engine wants a command all the same.
                    cmd: Some(vec!["true".into()]),
                    labels: Some(HashMap::from([("corral.publishing".into(), "1".into())])),
                    network_disabled: Some(true),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| self.failed(format!("the image {image}: {e}")))?;
        let tag = Self::tag(tenant, name);
        let repo = self.repository();
        let committed = self
            .docker
            .commit_container(
                CommitContainerOptionsBuilder::default()
                    .container(&made.id)
                    .repo(&repo)
                    .tag(&tag)
                    .pause(false)
                    .build(),
                bollard::models::ContainerConfig {
                    labels: Some(
                        [(LABEL.to_string(), label)]
                            .into_iter()
                            .chain(seeded.then(|| {
                                (
                                    crate::docker::snapshot::SEED_LABEL.to_string(),
                                    "workspace".to_string(),
                                )
                            }))
                            .collect(),
                    ),
                    ..Default::default()
                },
            )
            .await;
        let _ = self
            .docker
            .remove_container(
                &made.id,
                Some(RemoveContainerOptionsBuilder::default().force(true).build()),
            )
            .await;
        committed.map_err(|e| self.failed(format!("labelling {image}: {e}")))?;
        let mut pushed = self.docker.push_image(
            &repo,
            Some(PushImageOptionsBuilder::default().tag(&tag).build()),
            None,
        );
        while let Some(step) = pushed.next().await {
            let step = step.map_err(|e| self.failed(format!("pushing: {e}")))?;
            if let Some(e) = step.error_detail.and_then(|d| d.message) {
                return Err(self.failed(format!("pushing: {e}")));
            }
        }
        let digest = self.digest_of(tenant, name).await?.ok_or_else(|| {
            self.failed("the template was pushed, and the registry does not have it")
        })?;
        tracing::info!(template = %name, %digest, registry = %self.address, "template pushed");
        Ok(digest)
    }

    /// The digest the registry has for `tenant`'s template `name` (`None`:
    /// it has none).
    pub async fn digest_of(
        &self,
        tenant: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, RegistryError> {
        let reference = format!("{}:{}", self.repository(), Self::tag(tenant, name));
        match self.docker.inspect_registry_image(&reference, None).await {
            Ok(d) => Ok(d.descriptor.digest),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404 | 401 | 403,
                ..
            }) => Ok(None),
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Removes `digest` (a template's manifest) from the registry, so that
    /// no worker takes the template again. The registry must allow it
    /// (`storage.delete.enabled`) and be spoken to in plain HTTP (one on
    /// loopback); an answer other than removed or not there is an error.
    pub async fn withdraw(&self, digest: &str) -> Result<(), RegistryError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let request = format!(
            "DELETE /v2/{REPOSITORY}/manifests/{digest} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.address
        );
        let talk = async {
            let mut conn = tokio::net::TcpStream::connect(&self.address).await?;
            conn.write_all(request.as_bytes()).await?;
            let mut answer = Vec::new();
            conn.take(8 << 10).read_to_end(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        let answer = tokio::time::timeout(std::time::Duration::from_secs(30), talk)
            .await
            .map_err(|_| self.failed("removing the template: no answer within 30 s"))?
            .map_err(|e| self.failed(format!("removing the template: {e}")))?;
        let status = String::from_utf8_lossy(&answer)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        match status.split_whitespace().nth(1) {
            Some("202" | "200" | "404") => Ok(()),
            Some("405") => Err(self.failed(
                "it does not allow removals (its storage.delete.enabled): the template is kept",
            )),
            _ => Err(self.failed(format!(
                "removing the template: it answered {status:?} (a registry spoken to in plain HTTP, on loopback, is needed)"
            ))),
        }
    }

    /// Pulls the image of `digest` (unless the engine has it) and reads
    /// what its sandboxes start with.
    pub async fn fetch(&self, digest: &str) -> Result<Published, RegistryError> {
        let image = format!("{}@{digest}", self.repository());
        if self.docker.inspect_image(&image).await.is_err() {
            let mut pulled = self.docker.create_image(
                Some(
                    CreateImageOptionsBuilder::default()
                        .from_image(&image)
                        .build(),
                ),
                None,
                None,
            );
            while let Some(step) = pulled.next().await {
                let step = step.map_err(|e| self.failed(format!("pulling {image}: {e}")))?;
                if let Some(e) = step.error_detail.and_then(|d| d.message) {
                    return Err(self.failed(format!("pulling {image}: {e}")));
                }
            }
        }
        let inspected = self
            .docker
            .inspect_image(&image)
            .await
            .map_err(|e| self.failed(format!("{image}: {e}")))?;
        let mut labels = inspected.config.and_then(|c| c.labels).unwrap_or_default();
        let seeded = labels.contains_key(crate::docker::snapshot::SEED_LABEL);
        let label = labels
            .remove(LABEL)
            .ok_or_else(|| self.failed(format!("{image} carries no {LABEL} label")))?;
        let start: TemplateStart = serde_json::from_str(&label)
            .map_err(|e| self.failed(format!("{image}'s {LABEL} label: {e}")))?;
        Ok(Published {
            image,
            digest: digest.to_string(),
            start,
            seeded,
        })
    }
}
