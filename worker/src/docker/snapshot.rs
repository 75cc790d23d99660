//! A sandbox saved as an image (`SnapshotSandbox`): its image with its
//! workspace, which lives in memory and no commit sees, carried at
//! [`SEED_FILE`] for the sandboxes made from it to start with: the tar its
//! supervisor made, kept as one file (the engine never unpacks it: what a
//! sandbox wrote is its own supervisor's to unpack, by its own rules).

use std::path::Path;

use bollard::query_parameters::{
    CommitContainerOptionsBuilder, CreateContainerOptionsBuilder,
    DownloadFromContainerOptionsBuilder, RemoveContainerOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use futures_util::{Stream, StreamExt};

use super::*;

/// Where a snapshot's image keeps the workspace it was saved with.
pub const SEED_FILE: &str = "/.corral-seed/workspace.tar";
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
    /// contents) at [`SEED_FILE`]: the new image's name
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
            // One archive for the engine: the seed's directory and the
            // workspace's tar as a file in it, streamed.
            let size = tokio::fs::metadata(workspace)
                .await
                .map_err(|e| WorkerError::state(workspace, e))?
                .len();
            let header = |path: &str, kind: tar::EntryType, size: u64, mode: u32| {
                let mut h = tar::Header::new_ustar();
                let _ = h.set_path(path);
                h.set_entry_type(kind);
                h.set_mode(mode);
                h.set_size(size);
                h.set_cksum();
                bytes::Bytes::copy_from_slice(h.as_bytes())
            };
            let mut head = Vec::new();
            head.extend_from_slice(&header(
                ".corral-seed/",
                tar::EntryType::Directory,
                0,
                0o755,
            ));
            head.extend_from_slice(&header(
                ".corral-seed/workspace.tar",
                tar::EntryType::Regular,
                size,
                0o644,
            ));
            let pad = (512 - size % 512) % 512;
            let mut tail = vec![0u8; usize::try_from(pad).unwrap_or(0)];
            tail.extend_from_slice(&[0u8; 1024]);
            let file = tokio::fs::File::open(workspace)
                .await
                .map_err(|e| WorkerError::state(workspace, e))?;
            let body = futures_util::stream::once(async move { Ok(bytes::Bytes::from(head)) })
                .chain(file_stream(file))
                .chain(futures_util::stream::once(async move {
                    Ok(bytes::Bytes::from(tail))
                }));
            self.docker
                .upload_to_container(
                    &made.id,
                    Some(UploadToContainerOptionsBuilder::default().path("/").build()),
                    bollard::body_try_stream(body),
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
    /// its contents (the file [`SEED_FILE`], out of the engine's archive of
    /// it).
    pub fn seed(
        &self,
        container: &str,
    ) -> impl Stream<Item = Result<bytes::Bytes>> + Send + 'static {
        let archive = self
            .docker
            .download_from_container(
                container,
                Some(
                    DownloadFromContainerOptionsBuilder::default()
                        .path(SEED_FILE)
                        .build(),
                ),
            )
            .map(|r| r.map_err(WorkerError::from));
        one_file(archive)
    }
}

/// The data of the first entry of a tar stream (a regular file's), the
/// rest left.
fn one_file(
    archive: impl Stream<Item = Result<bytes::Bytes>> + Send + 'static,
) -> impl Stream<Item = Result<bytes::Bytes>> + Send + 'static {
    struct State<S> {
        archive: std::pin::Pin<Box<S>>,
        header: Vec<u8>,
        /// Bytes of the file still to give (`None`: its header not read).
        left: Option<u64>,
    }
    let state = State {
        archive: Box::pin(archive),
        header: Vec::new(),
        left: None,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if st.left == Some(0) {
                return None;
            }
            let mut chunk = match st.archive.next().await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Some((Err(e), st)),
                None => {
                    let early =
                        WorkerError::NotApplicable("the snapshot's workspace ended early".into());
                    return Some((
                        Err(early),
                        State {
                            left: Some(0),
                            ..st
                        },
                    ));
                }
            };
            if st.left.is_none() {
                let want = 512 - st.header.len();
                let take = want.min(chunk.len());
                st.header.extend_from_slice(&chunk[..take]);
                chunk = chunk.slice(take..);
                if st.header.len() < 512 {
                    continue;
                }
                let size = tar::Header::from_byte_slice(&st.header)
                    .entry_size()
                    .map_err(|e| {
                        WorkerError::NotApplicable(format!("the snapshot's workspace: {e}"))
                    });
                match size {
                    Ok(n) => st.left = Some(n),
                    Err(e) => {
                        return Some((
                            Err(e),
                            State {
                                left: Some(0),
                                ..st
                            },
                        ));
                    }
                }
            }
            let left = st.left.unwrap_or(0);
            if chunk.is_empty() {
                continue;
            }
            let give = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
            st.left = Some(left - give as u64);
            return Some((Ok(chunk.slice(..give)), st));
        }
    })
}
