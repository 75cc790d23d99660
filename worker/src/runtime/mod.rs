//! The seam between the worker's lifecycle and what runs its sandboxes:
//! [`Runtime`], what the worker asks of a container engine (make a
//! sandbox's container, attach to its supervisor, inspect, freeze, copy,
//! checkpoint, restore, remove). [`crate::docker::DockerRuntime`] is the
//! one the worker runs on; the tests of the lifecycle (capacity, pools,
//! drain, sweeps, and the races of checkpoint, restore, fork and removal)
//! run on a fake one, on paused time.

use std::path::Path;

use async_trait::async_trait;
use bollard::container::AttachContainerResults;
use bollard::models::ContainerSummary;
use corral_init::treecopy::Copied;
use corral_proto::{SandboxId, SandboxSpec};

use crate::docker::{ContainerProcess, ContainerUsage, DockerRuntime};
use crate::error::Result;

#[cfg(test)]
pub mod fake;

/// A directory of the host bound into a sandbox (a volume).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub source: std::path::PathBuf,
    pub target: String,
    pub read_only: bool,
}

/// What the worker asks of the engine that runs its sandboxes' containers.
/// A container is named by the id the runtime gave it.
#[async_trait]
pub trait Runtime: Send + Sync + 'static {
    /// The worker's id, as the names and labels of its containers carry it.
    fn worker_id(&self) -> &str;

    /// The engine's version, in its own words ("" when it does not say).
    async fn version(&self) -> String;

    /// Makes and starts sandbox `id`'s container, its supervisor as its
    /// first process, with the egress socket's directory mounted when
    /// there is one, and `volumes` bound where they go; returns the
    /// container's id. Named after the sandbox
    /// (see [`crate::docker::container_name`]) before the engine answers,
    /// so that a create given up midway can be undone by that name.
    async fn create(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        egress_dir: Option<&Path>,
        volumes: &[Bind],
    ) -> Result<String>;

    /// The supervisor's stdio: frames to it, frames and its log from it.
    async fn attach(&self, container: &str) -> Result<AttachContainerResults>;

    /// Whether the container runs; `None` when it does not exist.
    async fn running(&self, container: &str) -> Result<Option<bool>>;

    /// Why a container stopped, in words.
    async fn exit_reason(&self, container: &str) -> String;

    /// Removes a container, whatever its state; an absent one is fine.
    async fn remove_container(&self, container: &str) -> Result<()>;

    /// Every container this worker made, running or not.
    async fn list_owned(&self) -> Result<Vec<ContainerSummary>>;

    /// Freezes every process of the container.
    async fn pause(&self, container: &str) -> Result<()>;

    /// Thaws what [`Self::pause`] froze.
    async fn unpause(&self, container: &str) -> Result<()>;

    /// Whether checkpoints can be made (a refusal that says why).
    async fn checkpoints_supported(&self) -> Result<()>;

    /// Saves a running container's processes and memory and stops it.
    async fn checkpoint(&self, container: &str) -> Result<()>;

    /// Starts a container from what [`Self::checkpoint`] saved.
    async fn restore(&self, container: &str) -> Result<()>;

    /// The container's first process as the host sees it.
    async fn process(&self, container: &str) -> Result<ContainerProcess>;

    /// Why this worker cannot reach a container's processes to copy them,
    /// if it cannot (see [`crate::fork::out_of_sight`]).
    fn out_of_sight(&self, p: &ContainerProcess, container: &str) -> Option<String>;

    /// Copies the writable trees of one sandbox into another (a fork).
    async fn copy_trees(&self, from: &ContainerProcess, to: &ContainerProcess) -> Result<Copied>;

    /// What the container uses now.
    async fn stats(&self, container: &str) -> Result<ContainerUsage>;

    /// `image` with `workspace` (a tar of a sandbox's workspace's
    /// contents) for the sandboxes made from it to start with: the new
    /// image's name.
    async fn snapshot(&self, image: &str, workspace: &Path) -> Result<String>;

    /// The workspace a snapshot's container was made with, as a tar of its
    /// contents.
    fn seed(
        &self,
        container: &str,
    ) -> futures_util::stream::BoxStream<'static, Result<bytes::Bytes>>;
}

#[async_trait]
impl Runtime for DockerRuntime {
    fn worker_id(&self) -> &str {
        DockerRuntime::worker_id(self)
    }

    async fn version(&self) -> String {
        DockerRuntime::version(self).await
    }

    async fn create(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        egress_dir: Option<&Path>,
        volumes: &[Bind],
    ) -> Result<String> {
        DockerRuntime::create(self, id, spec, egress_dir, volumes).await
    }

    async fn attach(&self, container: &str) -> Result<AttachContainerResults> {
        DockerRuntime::attach(self, container).await
    }

    async fn running(&self, container: &str) -> Result<Option<bool>> {
        DockerRuntime::running(self, container).await
    }

    async fn exit_reason(&self, container: &str) -> String {
        DockerRuntime::exit_reason(self, container).await
    }

    async fn remove_container(&self, container: &str) -> Result<()> {
        DockerRuntime::remove_container(self, container).await
    }

    async fn list_owned(&self) -> Result<Vec<ContainerSummary>> {
        DockerRuntime::list_owned(self).await
    }

    async fn pause(&self, container: &str) -> Result<()> {
        DockerRuntime::pause(self, container).await
    }

    async fn unpause(&self, container: &str) -> Result<()> {
        DockerRuntime::unpause(self, container).await
    }

    async fn checkpoints_supported(&self) -> Result<()> {
        DockerRuntime::checkpoints_supported(self).await
    }

    async fn checkpoint(&self, container: &str) -> Result<()> {
        DockerRuntime::checkpoint(self, container).await
    }

    async fn restore(&self, container: &str) -> Result<()> {
        DockerRuntime::restore(self, container).await
    }

    async fn process(&self, container: &str) -> Result<ContainerProcess> {
        DockerRuntime::process(self, container).await
    }

    async fn snapshot(&self, image: &str, workspace: &Path) -> Result<String> {
        DockerRuntime::snapshot(self, image, workspace).await
    }

    fn seed(
        &self,
        container: &str,
    ) -> futures_util::stream::BoxStream<'static, Result<bytes::Bytes>> {
        use futures_util::StreamExt;
        DockerRuntime::seed(self, container).boxed()
    }

    fn out_of_sight(&self, p: &ContainerProcess, container: &str) -> Option<String> {
        crate::fork::out_of_sight(p, container)
    }

    async fn copy_trees(&self, from: &ContainerProcess, to: &ContainerProcess) -> Result<Copied> {
        crate::fork::copy(self.init_path(), from, to).await
    }

    async fn stats(&self, container: &str) -> Result<ContainerUsage> {
        DockerRuntime::stats(self, container).await
    }
}
