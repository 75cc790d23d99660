//! Freezing a container (a fork's copy) and checkpointing it with its
//! memory, then starting it again from the checkpoint (gVisor).

use super::*;

impl DockerRuntime {
    /// Freezes every process of the container (the cgroup freezer).
    pub async fn pause(&self, container: &str) -> Result<()> {
        Ok(self.docker.pause_container(container).await?)
    }

    /// Thaws what [`Self::pause`] froze.
    pub async fn unpause(&self, container: &str) -> Result<()> {
        Ok(self.docker.unpause_container(container).await?)
    }

    /// Whether the engine makes checkpoints: only in its experimental mode
    /// (a refusal that says so otherwise).
    pub async fn checkpoints_supported(&self) -> Result<()> {
        let info = self.docker.info().await?;
        if info.experimental_build != Some(true) {
            return Err(WorkerError::NotApplicable(
                "the Docker engine's experimental features are off, and checkpoints are one of them: set \"experimental\": true in its daemon.json and restart it".into(),
            ));
        }
        Ok(())
    }

    /// Saves a running container's processes and memory as checkpoint
    /// [`CHECKPOINT`] (an earlier one of that name is replaced) and stops
    /// it (see [`Self::checkpoints_supported`]).
    pub async fn checkpoint(&self, container: &str) -> Result<()> {
        let _ = self
            .docker
            .delete_checkpoint(container, CHECKPOINT, None)
            .await;
        let opts = bollard::container::CreateCheckpointOptions {
            checkpoint_id: CHECKPOINT.into(),
            checkpoint_dir: None,
            exit: true,
        };
        self.docker.create_checkpoint(container, opts).await?;
        // The engine answers before it has seen the container stop: a start
        // until then would be taken for one of a running container (and
        // answered "not modified") while it goes on stopping.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while self.running(container).await? == Some(true) {
            if tokio::time::Instant::now() > deadline {
                return Err(WorkerError::NotApplicable(format!(
                    "container {container} still runs 30 s after its checkpoint"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Starts a container [`Self::checkpoint`] stopped, from its
    /// checkpoint (its processes and memory back as they were), then
    /// deletes the checkpoint.
    pub async fn restore(&self, container: &str) -> Result<()> {
        // Bollard's start has no checkpoint option: a client of the same
        // engine whose starts name the checkpoint, for this one call.
        let from_checkpoint = self.docker.clone().with_request_modifier(|mut req| {
            if req.method() == "POST" && req.uri().path().ends_with("/start") {
                let uri = req.uri().to_string();
                let sep = if uri.contains('?') { '&' } else { '?' };
                if let Ok(with) = format!("{uri}{sep}checkpoint={CHECKPOINT}").parse() {
                    *req.uri_mut() = with;
                }
            }
            req
        });
        // The engine sometimes refuses a start from a checkpoint whose
        // content its containerd holds already (moby/moby#42900: "commit
        // failed: content ... already exists"), and takes it a moment
        // later: asked again, a few times. The engine says this in words
        // only, so its words are read here, at its edge.
        let mut tries = 0;
        loop {
            match from_checkpoint.start_container(container, None).await {
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 500,
                    message,
                }) if message.contains("already exists") && tries < RESTORE_TRIES => {
                    tries += 1;
                    tracing::warn!(container, %message, "the engine refused the restore (moby#42900); asking again");
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                r => {
                    r?;
                    break;
                }
            }
        }
        if self.running(container).await? != Some(true) {
            return Err(WorkerError::SandboxLost {
                id: container.to_string(),
                reason: self.exit_reason(container).await,
            });
        }
        if let Err(e) = self
            .docker
            .delete_checkpoint(container, CHECKPOINT, None)
            .await
        {
            tracing::warn!(container, error = %e, "a restored sandbox's checkpoint stays on the engine");
        }
        Ok(())
    }
}
