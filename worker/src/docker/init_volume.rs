//! The supervisor's volume: `corral-init` installed once per build into a
//! volume named by its content's hash, mounted read-only in every sandbox,
//! and volumes of older builds pruned.

use super::*;

impl DockerRuntime {
    pub(crate) fn init_volume(&self) -> String {
        format!("corral-init-{}", self.init.digest)
    }

    /// Makes sure the volume holding this exact supervisor binary exists.
    /// Docker will not copy into a read-only container, so the binary goes
    /// into a volume (through a helper container) and every sandbox mounts
    /// that volume read-only. An existing volume is trusted; a sandbox that
    /// then fails to start for want of the binary (another worker was still
    /// installing it) triggers [`install_init`](Self::install_init) and one retry.
    pub(crate) async fn ensure_init_volume(&self, image: &str) -> Result<()> {
        let mut ready = self.init_volume_ready.lock().await;
        if *ready {
            return Ok(());
        }
        let name = self.init_volume();
        match self.docker.inspect_volume(&name).await {
            Ok(_) => {
                *ready = true;
                return Ok(());
            }
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
        self.docker
            .create_volume(VolumeCreateRequest {
                name: Some(name.clone()),
                labels: Some(HashMap::from([(LABEL_MANAGED.into(), "1".into())])),
                ..Default::default()
            })
            .await?;
        self.install_init(image).await?;
        tracing::info!(volume = %name, "supervisor volume created");
        *ready = true;
        Ok(())
    }

    /// Copies the binary into the volume under a temporary name, then has it
    /// rename itself into place (`corral-init --install`), so the final name
    /// only ever holds a complete binary, whatever other workers do at the
    /// same time.
    pub async fn install_init(&self, image: &str) -> Result<()> {
        let volume = self.init_volume();
        let tag = &corral_proto::ids::random_uuid()[..8];
        let helper = format!("corral-init-install-{tag}");
        let tmp_name = format!(".corral-init.{tag}");
        let tmp_path = format!("{INIT_DIR}/{tmp_name}");
        let body = ContainerCreateBody {
            image: Some(image.into()),
            entrypoint: Some(vec![
                tmp_path.clone(),
                "--install".into(),
                tmp_path.clone(),
                format!("{INIT_DIR}/corral-init"),
            ]),
            cmd: Some(vec![]),
            user: Some("0:0".into()),
            labels: Some(HashMap::from([(LABEL_MANAGED.into(), "1".into())])),
            network_disabled: Some(true),
            host_config: Some(HostConfig {
                network_mode: Some("none".into()),
                mounts: Some(vec![Mount {
                    target: Some(INIT_DIR.into()),
                    source: Some(volume.clone()),
                    typ: Some(MountType::VOLUME),
                    ..Default::default()
                }]),
                log_config: Some(HostConfigLogConfig {
                    typ: Some("none".into()),
                    config: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let opts = CreateContainerOptionsBuilder::default()
            .name(&helper)
            .build();
        self.docker
            .create_container(Some(opts), body)
            .await
            .map_err(|e| self.image_error(e, image))?;
        let installed = self.run_installer(&helper, &tmp_name).await;
        let _ = self.remove_container(&helper).await;
        installed
    }

    pub(crate) async fn run_installer(&self, helper: &str, tmp_name: &str) -> Result<()> {
        let mut tar = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(self.init.bytes.len() as u64);
        // Readable and executable by all (gVisor reads a program to run
        // it). The archive helpers start as root and make themselves not
        // dumpable before they become the sandbox's user.
        header.set_mode(0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        let archive = tar
            .append_data(&mut header, tmp_name, self.init.bytes.as_slice())
            .and_then(|()| tar.into_inner())
            .map_err(|e| WorkerError::InitBinary(format!("packing: {e}")))?;
        let opts = UploadToContainerOptionsBuilder::default()
            .path(INIT_DIR)
            .build();
        self.docker
            .upload_to_container(helper, Some(opts), bollard::body_full(archive.into()))
            .await?;
        self.docker.start_container(helper, None).await?;
        let waited = self.docker.wait_container(helper, None).next().await;
        match waited {
            Some(Ok(r)) if r.status_code == 0 => Ok(()),
            Some(Ok(r)) => Err(WorkerError::InitBinary(format!(
                "installing into the volume failed with exit code {}",
                r.status_code
            ))),
            Some(Err(bollard::errors::Error::DockerContainerWaitError { code: 0, .. })) => Ok(()),
            Some(Err(e)) => Err(e.into()),
            None => Err(WorkerError::InitBinary("installer vanished".into())),
        }
    }

    /// Removes supervisor volumes of other builds that no container uses
    /// (Docker refuses to remove one in use, which is what we want).
    pub async fn prune_old_init_volumes(&self) {
        let filters = HashMap::from([("label".to_string(), vec![format!("{LABEL_MANAGED}=1")])]);
        let opts = bollard::query_parameters::ListVolumesOptionsBuilder::default()
            .filters(&filters)
            .build();
        let Ok(list) = self.docker.list_volumes(Some(opts)).await else {
            return;
        };
        let current = self.init_volume();
        let now = std::time::SystemTime::now();
        for v in list.volumes.unwrap_or_default() {
            // Another worker of another build may share this engine and
            // use its volume between its sandboxes: only a volume unused
            // for long goes (one in use is refused by the engine anyway).
            let old = v
                .created_at
                .as_deref()
                .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > OLD_INIT_VOLUME);
            if v.name.starts_with("corral-init-") && v.name != current && old {
                match self
                    .docker
                    .remove_volume(
                        &v.name,
                        None::<bollard::query_parameters::RemoveVolumeOptions>,
                    )
                    .await
                {
                    Ok(()) => tracing::info!(volume = %v.name, "removed an old supervisor volume"),
                    Err(e) => {
                        tracing::debug!(volume = %v.name, error = %e, "old supervisor volume kept")
                    }
                }
            }
        }
    }
}
