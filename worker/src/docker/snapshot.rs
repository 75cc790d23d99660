//! A sandbox saved as an image (`SnapshotSandbox`): its image with its
//! workspace, which lives in memory and no commit sees, carried at
//! [`SEED_DIR`] for the sandboxes made from it to start with.

use std::path::Path;

use bollard::query_parameters::{
    CommitContainerOptionsBuilder, CreateContainerOptionsBuilder,
    DownloadFromContainerOptionsBuilder, RemoveContainerOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use futures_util::{Stream, StreamExt};

use super::*;

/// Where a snapshot's image keeps the workspace it was saved with.
pub const SEED_DIR: &str = "/.corral-seed/workspace";
/// The label of an image that carries a workspace.
pub const SEED_LABEL: &str = "corral.seed";
/// The label naming the image a snapshot was made on.
pub const BASE_LABEL: &str = "corral.seed.base";

/// A file read as a stream of pieces, for the engine.
fn file_stream(file: tokio::fs::File) -> impl Stream<Item = std::io::Result<bytes::Bytes>> {
    futures_util::stream::unfold(file, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    })
}

impl DockerRuntime {
    /// `image` with `workspace` (a tar of a sandbox's workspace's
    /// contents) at [`SEED_DIR`]: the new image's name
    /// (`corral-snapshot:<hex>`). Made from the image, not from the
    /// sandbox's container, whose configuration (its environment, what a
    /// client gave it) no commit could leave out.
    pub async fn snapshot(&self, image: &str, workspace: &Path) -> Result<String> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let mut orig = self
            .docker
            .inspect_image(image)
            .await
            .map_err(|e| self.image_error(e, image))?
            .config
            .unwrap_or_default();
        // A snapshot's sandbox is saved on its snapshot's own base: never
        // on the earlier workspace (what was removed since would come
        // back, and stay in a lower layer).
        let base = orig
            .labels
            .as_ref()
            .and_then(|l| l.get(BASE_LABEL))
            .cloned()
            .unwrap_or_else(|| image.to_string());
        if base != image {
            orig = self
                .docker
                .inspect_image(&base)
                .await
                .map_err(|e| self.image_error(e, &base))?
                .config
                .unwrap_or_default();
        }
        let image = base.as_str();
        // The engine makes no container of an image without a command.
        let no_command = orig.cmd.as_ref().is_none_or(Vec::is_empty)
            && orig.entrypoint.as_ref().is_none_or(Vec::is_empty);
        let made = self
            .docker
            .create_container(
                Some(CreateContainerOptionsBuilder::default().build()),
                ContainerCreateBody {
                    image: Some(image.to_string()),
                    cmd: no_command.then(|| vec!["sh".to_string()]),
                    network_disabled: Some(true),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| self.image_error(e, image))?;
        let done = async {
            // The seed's directories, then the workspace into them.
            let mut dirs = tar::Builder::new(Vec::new());
            for d in [".corral-seed/", ".corral-seed/workspace/"] {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                h.set_cksum();
                dirs.append_data(&mut h, d, std::io::empty())
                    .map_err(|e| WorkerError::Config(format!("a snapshot's directories: {e}")))?;
            }
            let dirs = dirs
                .into_inner()
                .map_err(|e| WorkerError::Config(format!("a snapshot's directories: {e}")))?;
            self.docker
                .upload_to_container(
                    &made.id,
                    Some(UploadToContainerOptionsBuilder::default().path("/").build()),
                    bollard::body_full(dirs.into()),
                )
                .await?;
            let file = tokio::fs::File::open(workspace)
                .await
                .map_err(|e| WorkerError::state(workspace, e))?;
            self.docker
                .upload_to_container(
                    &made.id,
                    Some(
                        UploadToContainerOptionsBuilder::default()
                            .path(SEED_DIR)
                            .build(),
                    ),
                    bollard::body_try_stream(file_stream(file)),
                )
                .await?;
            self.docker
                .commit_container(
                    CommitContainerOptionsBuilder::default()
                        .container(&made.id)
                        .repo("corral-snapshot")
                        .tag(&tag)
                        .pause(false)
                        .build(),
                    bollard::models::ContainerConfig {
                        labels: Some(HashMap::from([
                            (SEED_LABEL.into(), "workspace".into()),
                            (BASE_LABEL.into(), image.to_string()),
                        ])),
                        ..Default::default()
                    },
                )
                .await?;
            Ok::<_, WorkerError>(())
        }
        .await;
        let _ = self
            .docker
            .remove_container(
                &made.id,
                Some(RemoveContainerOptionsBuilder::default().force(true).build()),
            )
            .await;
        done?;
        Ok(format!("corral-snapshot:{tag}"))
    }

    /// Whether `image` carries a workspace to start with.
    pub async fn seeded(&self, image: &str) -> Result<bool> {
        let inspected = self
            .docker
            .inspect_image(image)
            .await
            .map_err(|e| self.image_error(e, image))?;
        Ok(inspected
            .config
            .and_then(|c| c.labels)
            .is_some_and(|l| l.contains_key(SEED_LABEL)))
    }

    /// The workspace a snapshot's `container` was made with, as a tar of
    /// its contents.
    pub fn seed(
        &self,
        container: &str,
    ) -> impl Stream<Item = Result<bytes::Bytes>> + Send + 'static {
        self.docker
            .download_from_container(
                container,
                Some(
                    DownloadFromContainerOptionsBuilder::default()
                        .path(&format!("{SEED_DIR}/."))
                        .build(),
                ),
            )
            .map(|r| r.map_err(WorkerError::from))
    }
}
