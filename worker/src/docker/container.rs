//! A sandbox's container: the image's configuration read, the hardened
//! container body made from a spec, and the container created and started
//! with a uid no other container holds.

use super::*;

impl DockerRuntime {
    /// What of an image's configuration a sandbox keeps: where its
    /// commands start, and whether it names their HOME.
    pub async fn image_config(&self, image: &str) -> Result<ImageConfig> {
        let inspected = self
            .docker
            .inspect_image(image)
            .await
            .map_err(|e| self.image_error(e, image))?;
        let config = inspected.config.unwrap_or_default();
        Ok(ImageConfig {
            workdir: config
                .working_dir
                .filter(|w| w.starts_with('/') && !w.contains('\0')),
            home: config
                .env
                .unwrap_or_default()
                .iter()
                .any(|e| e.starts_with("HOME=")),
        })
    }

    pub(crate) fn image_error(&self, e: bollard::errors::Error, image: &str) -> WorkerError {
        if is_not_found(&e) {
            WorkerError::NoSuchImage(image.into())
        } else {
            e.into()
        }
    }

    /// The container configuration of a sandbox whose commands run as
    /// `uid` (0 when it asked for root): every default hardened.
    /// `egress_dir`: the host directory of its egress proxy's socket,
    /// mounted read-only (the sandbox keeps network none); the proxy is
    /// served from the start if the spec has egress rules (a pool's member
    /// gets the directory only, and its proxy when a claim asks for it).
    pub fn container_body(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        uid: u32,
        egress_dir: Option<&std::path::Path>,
        volumes: &[crate::runtime::Bind],
        image_config: &ImageConfig,
    ) -> ContainerCreateBody {
        let d = &self.defaults;
        let image = spec.image.clone().unwrap_or_else(|| d.image.clone());
        let (tmp_bytes, workspace_bytes) = (
            spec.tmp_bytes.unwrap_or(d.tmp_bytes),
            spec.workspace_bytes.unwrap_or(d.workspace_bytes),
        );
        // The tmpfs mounts live in the sandbox's memory: the limit covers
        // them full on top of the working memory, so a full workspace fails
        // the write (ENOSPC) instead of OOM-killing the supervisor.
        // Unless the sandbox asks for docker's meaning: one limit for all.
        let working = spec.memory_bytes.unwrap_or(d.memory_bytes);
        let memory = if spec.memory_includes_files {
            working as i64
        } else {
            (working + tmp_bytes + workspace_bytes) as i64
        };
        let tmpfs = HashMap::from([
            (
                TMP_DIR.to_string(),
                format!("rw,exec,nosuid,nodev,size={tmp_bytes},mode=1777"),
            ),
            (
                WORKSPACE_DIR.to_string(),
                format!(
                    "rw,exec,nosuid,nodev,size={workspace_bytes},uid={uid},gid={uid},mode=0755"
                ),
            ),
            (
                USERS_DIR.to_string(),
                "rw,noexec,nosuid,nodev,size=65536,mode=0755".to_string(),
            ),
        ]);
        let mut env: Vec<String> = Vec::new();
        // HOME is the image's when it names one; else root's own where root
        // may write there (as `docker exec` would have it), and the
        // workspace otherwise (the engine would make it the supervisor's,
        // root's). USER and LOGNAME name the sandbox user, for the programs
        // that ask.
        let user = if spec.run_as_root { "root" } else { "sandbox" };
        let home = if image_config.home {
            None
        } else if spec.run_as_root && spec.writable_rootfs {
            Some("/root")
        } else {
            Some(WORKSPACE_DIR)
        };
        for (key, value) in [
            ("HOME", home),
            ("USER", Some(user)),
            ("LOGNAME", Some(user)),
        ] {
            if let Some(value) = value
                && !spec.env.contains_key(key)
            {
                env.push(format!("{key}={value}"));
            }
        }
        let egress = egress_dir.is_some() && spec.has_egress_proxy();
        if egress {
            env.extend(
                crate::proxy::proxy_env()
                    .filter(|(k, _)| !spec.env.contains_key(*k))
                    .map(|(k, v)| format!("{k}={v}")),
            );
        }
        env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        let mut mounts = vec![Mount {
            target: Some(INIT_DIR.into()),
            source: Some(self.init_volume()),
            typ: Some(MountType::VOLUME),
            read_only: Some(true),
            ..Default::default()
        }];
        if let Some(dir) = egress_dir {
            mounts.push(Mount {
                target: Some(crate::proxy::SANDBOX_DIR.into()),
                source: Some(dir.to_string_lossy().into_owned()),
                typ: Some(MountType::BIND),
                read_only: Some(true),
                ..Default::default()
            });
        }
        // Volumes: each one's filesystem, mounted on the host, bound here
        // (never device files nor set-id programs of it: the host mounted
        // it nodev,nosuid).
        mounts.extend(volumes.iter().map(|v| Mount {
            target: Some(v.target.clone()),
            source: Some(v.source.to_string_lossy().into_owned()),
            typ: Some(MountType::BIND),
            read_only: Some(v.read_only),
            ..Default::default()
        }));
        let mut cmd = if spec.run_as_root {
            vec![]
        } else {
            vec!["--command-uid".into(), uid.to_string()]
        };
        if egress {
            cmd.push("--egress".into());
        }
        for v in volumes {
            cmd.push("--root".into());
            cmd.push(v.target.clone());
        }
        let mut labels = HashMap::from([
            (LABEL_MANAGED.into(), "1".into()),
            (LABEL_WORKER.into(), self.worker_id.clone()),
            (LABEL_SANDBOX.into(), id.to_string()),
            (LABEL_STATE_DIR.into(), self.state_dir.clone()),
        ]);
        if uid != 0 {
            labels.insert(LABEL_UID.into(), uid.to_string());
        }
        ContainerCreateBody {
            image: Some(image),
            entrypoint: Some(vec![format!("{INIT_DIR}/corral-init")]),
            // The supervisor runs as root, its commands as the sandbox user:
            // no command can signal, trace or read it.
            cmd: Some(cmd),
            user: Some("0:0".into()),
            // Commands start where `docker exec` would: the image's WORKDIR
            // (Corral's images name the workspace), else the workspace.
            working_dir: Some(
                image_config
                    .workdir
                    .clone()
                    .unwrap_or_else(|| WORKSPACE_DIR.into()),
            ),
            env: Some(env),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            open_stdin: Some(true),
            stdin_once: Some(false),
            tty: Some(false),
            network_disabled: Some(spec.network == NetworkMode::None),
            labels: Some(labels),
            host_config: Some(HostConfig {
                network_mode: Some(
                    match spec.network {
                        NetworkMode::None => "none",
                        NetworkMode::Bridge => "bridge",
                    }
                    .into(),
                ),
                cap_drop: Some(vec!["ALL".into()]),
                cap_add: cap_add(spec),
                security_opt: Some(vec!["no-new-privileges".into()]),
                readonly_rootfs: Some(!spec.writable_rootfs),
                tmpfs: Some(tmpfs),
                mounts: Some(mounts),
                memory: Some(memory),
                memory_swap: Some(memory),
                nano_cpus: Some(i64::from(spec.cpu_millis.unwrap_or(d.cpu_millis)) * 1_000_000),
                pids_limit: Some(i64::from(spec.pids_limit.unwrap_or(d.pids_limit))),
                // The supervisor journals everything; Docker keeps no logs.
                log_config: Some(HostConfigLogConfig {
                    typ: Some("none".into()),
                    config: None,
                }),
                init: Some(false),
                runtime: spec.runtime.clone().or_else(|| d.runtime.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Creates and starts a sandbox's container; returns its id.
    pub async fn create(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        egress_dir: Option<&std::path::Path>,
        volumes: &[crate::runtime::Bind],
    ) -> Result<String> {
        let image = spec
            .image
            .clone()
            .unwrap_or_else(|| self.defaults.image.clone());
        self.ensure_init_volume(&image).await?;
        let image_config = self.image_config(&image).await?;
        let name = container_name(&self.worker_id, id);
        let opts = CreateContainerOptionsBuilder::default().name(&name).build();
        let mut attempts = 0;
        let created = loop {
            attempts += 1;
            let uid = if spec.run_as_root {
                0
            } else {
                self.uids.pick()
            };
            let body = self.container_body(id, spec, uid, egress_dir, volumes, &image_config);
            let created = match self
                .docker
                .create_container(Some(opts.clone()), body.clone())
                .await
            {
                Ok(c) => c,
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 409, ..
                }) => {
                    // A leftover of ours with that name (a create that
                    // crashed before its record was trusted): replace it.
                    self.remove_container(&name).await?;
                    self.docker
                        .create_container(Some(opts.clone()), body)
                        .await?
                }
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 400,
                    message,
                }) if message.contains("nknown runtime") => {
                    // The engine's words for a runtime it has not
                    // registered: said as such, with a reason.
                    let runtime = spec
                        .runtime
                        .clone()
                        .or_else(|| self.defaults.runtime.clone())
                        .unwrap_or_default();
                    return Err(WorkerError::NoSuchRuntime { runtime, message });
                }
                Err(e) => return Err(self.image_error(e, &image)),
            };
            let taken = if uid == 0 {
                Ok(false)
            } else {
                self.uid_taken_elsewhere(uid, &created.id).await
            };
            match taken {
                Ok(false) => break created,
                Ok(true) => {}
                Err(e) => {
                    // Not left behind unstarted.
                    let _ = self.remove_container(&created.id).await;
                    return Err(e);
                }
            }
            // Another container (any worker's) has this uid: made at the
            // same moment, or before. Ours goes; the other keeps it.
            tracing::info!(uid, sandbox = %id, "uid already taken on this engine; picking another");
            self.remove_container(&created.id).await?;
            if attempts >= 16 {
                return Err(WorkerError::NoFreeUid {
                    range: self.uids.to_string(),
                    tries: attempts,
                });
            }
        };
        if let Err(e) = self.docker.start_container(&created.id, None).await {
            // The supervisor may still be on its way into a volume another
            // worker created: install it ourselves and try once more.
            let retried = if e.to_string().contains("corral-init") {
                tracing::info!(error = %e, "supervisor missing from its volume; installing");
                match self.install_init(&image).await {
                    Ok(()) => self.docker.start_container(&created.id, None).await,
                    Err(install) => Err(bollard::errors::Error::IOError {
                        err: std::io::Error::other(install.to_string()),
                    }),
                }
            } else {
                Err(e)
            };
            if let Err(e) = retried {
                let _ = self.remove_container(&created.id).await;
                return Err(e.into());
            }
        }
        Ok(created.id)
    }

    /// Does a container other than `ours` carry the label of `uid`?
    pub(crate) async fn uid_taken_elsewhere(&self, uid: u32, ours: &str) -> Result<bool> {
        let opts = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&HashMap::from([(
                "label".to_string(),
                vec![format!("{LABEL_UID}={uid}")],
            )]))
            .build();
        let found = self.docker.list_containers(Some(opts)).await?;
        Ok(found.iter().any(|c| c.id.as_deref() != Some(ours)))
    }
}
