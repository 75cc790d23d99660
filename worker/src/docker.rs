//! The Docker side of a sandbox, through the Engine API (bollard): the
//! supervisor volume, hardened containers, attach, inspect, removal.

use std::collections::HashMap;
use std::time::Duration;

use bollard::Docker;
use bollard::container::AttachContainerResults;
use bollard::models::{
    ContainerCreateBody, ContainerSummary, HostConfig, HostConfigLogConfig, Mount, MountType,
    VolumeCreateRequest,
};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use corral_proto::limits::{TMP_DIR, WORKSPACE_DIR};
use corral_proto::{NetworkMode, SandboxId, SandboxSpec};
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::error::{Result, WorkerError};
use crate::initbin::InitBinary;
use crate::uids::{LABEL_UID, UidRange};

/// Starts from a checkpoint tried again after the engine's spurious
/// "already exists" (see [`DockerRuntime::restore`]).
const RESTORE_TRIES: u32 = 5;

/// The name of a sandbox's checkpoint on the engine (one a container).
pub const CHECKPOINT: &str = "corral";

pub const LABEL_MANAGED: &str = "corral.managed";
pub const LABEL_WORKER: &str = "corral.worker";
pub const LABEL_SANDBOX: &str = "corral.sandbox";
/// The state directory of the worker that made a container: two workers
/// that happen to share an id (and an engine) never take each other's
/// containers for their own.
pub const LABEL_STATE_DIR: &str = "corral.state-dir";
/// Where the supervisor volume is mounted (read-only) in every sandbox.
pub const INIT_DIR: &str = "/.corral";
/// Where the supervisor writes the sandbox user's `passwd` and `group`
/// (a small tmpfs of its own; Corral's images link `/etc/passwd` there).
pub const USERS_DIR: &str = "/run/corral";

/// What of an image's own configuration a sandbox of it keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// Its WORKDIR, when it names one.
    pub workdir: Option<String>,
    /// It sets HOME.
    pub home: bool,
}

/// How old another build's supervisor volume must be before a worker's
/// start removes it.
const OLD_INIT_VOLUME: Duration = Duration::from_secs(7 * 24 * 3600);

/// Hardened defaults; a sandbox spec can change each one, explicitly.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub image: String,
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_limit: u32,
    pub workspace_bytes: u64,
    pub tmp_bytes: u64,
    /// OCI runtime of sandboxes that name none (`None`: the engine's).
    pub runtime: Option<String>,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            image: corral_proto::sandbox::DEFAULT_IMAGE.into(),
            memory_bytes: 1 << 30,
            cpu_millis: 1000,
            pids_limit: 256,
            workspace_bytes: 1 << 30,
            tmp_bytes: 256 << 20,
            runtime: None,
        }
    }
}

pub struct DockerRuntime {
    docker: Docker,
    worker_id: String,
    /// The worker's state directory, as its containers' labels name it.
    state_dir: String,
    init: InitBinary,
    pub defaults: Defaults,
    /// The uids sandboxes' commands run as, one each.
    uids: UidRange,
    init_volume_ready: Mutex<bool>,
}

/// Connects to the engine at `host` (`unix:///path` or `tcp://host:port`),
/// or where `DOCKER_HOST` / the default socket says, and checks it answers.
pub async fn connect(host: Option<&str>) -> Result<Docker> {
    let docker = match host {
        Some(h) if h.starts_with("unix://") || h.starts_with('/') => Docker::connect_with_unix(
            h.trim_start_matches("unix://"),
            120,
            bollard::API_DEFAULT_VERSION,
        )?,
        Some(h) => Docker::connect_with_http(h, 120, bollard::API_DEFAULT_VERSION)?,
        None => Docker::connect_with_defaults()?,
    };
    docker.ping().await?;
    Ok(docker)
}

fn is_not_found(e: &bollard::errors::Error) -> bool {
    matches!(
        e,
        bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// The sandbox id a container is labelled with ("" when it has none).
pub fn sandbox_label(c: &ContainerSummary) -> String {
    c.labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SANDBOX))
        .cloned()
        .unwrap_or_default()
}

pub fn container_name(worker_id: &str, id: &SandboxId) -> String {
    format!("corral-{worker_id}-{id}")
}

/// What the supervisor of a sandbox needs to run its commands as the
/// sandbox user and stop them (to change user, and to signal them), and to
/// do file operations for the sandbox user where a runtime ignores its
/// switch of filesystem user (gVisor): to write past permissions and give
/// what it made to that user. Under runc, that switch drops the file
/// capabilities while an operation runs. A command loses all of them when
/// it starts (it changes user, and with `no-new-privileges` cannot get them
/// back).
pub const SUPERVISOR_CAPABILITIES: &[&str] = &[
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_CHOWN",
];

fn cap_add(spec: &SandboxSpec) -> Option<Vec<String>> {
    let mut caps = spec.add_capabilities.clone();
    if !spec.run_as_root {
        for c in SUPERVISOR_CAPABILITIES {
            if !caps.iter().any(|x| x == c) {
                caps.push((*c).to_string());
            }
        }
    }
    (!caps.is_empty()).then_some(caps)
}

impl DockerRuntime {
    pub fn new(docker: Docker, worker_id: String, init: InitBinary, defaults: Defaults) -> Self {
        Self {
            docker,
            worker_id,
            state_dir: String::new(),
            init,
            defaults,
            uids: crate::uids::DEFAULT,
            init_volume_ready: Mutex::new(false),
        }
    }

    /// The range sandboxes' uids are taken from.
    pub fn with_uids(mut self, uids: UidRange) -> Self {
        self.uids = uids;
        self
    }

    pub fn uids(&self) -> UidRange {
        self.uids
    }

    /// Does the engine map container uids into a user namespace (rootless
    /// Docker, `userns-remap`)? Then only 0–65535 exist in containers.
    pub async fn remaps_uids(&self) -> bool {
        match self.docker.info().await {
            Ok(info) => info.security_options.unwrap_or_default().iter().any(|o| {
                o.split(',')
                    .any(|kv| kv == "name=rootless" || kv == "name=userns")
            }),
            Err(e) => {
                tracing::warn!(error = %e, "could not ask the engine whether it remaps uids");
                false
            }
        }
    }

    pub fn docker(&self) -> &Docker {
        &self.docker
    }

    /// Names the worker's state directory in the labels of what it makes.
    pub fn with_state_dir(mut self, dir: &std::path::Path) -> Self {
        self.state_dir = std::fs::canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf())
            .display()
            .to_string();
        self
    }

    /// The supervisor binary on this host (also the fork's copy helper).
    pub fn init_path(&self) -> &std::path::Path {
        &self.init.path
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn init_volume(&self) -> String {
        format!("corral-init-{}", self.init.digest)
    }

    /// Makes sure the volume holding this exact supervisor binary exists.
    /// Docker will not copy into a read-only container, so the binary goes
    /// into a volume (through a helper container) and every sandbox mounts
    /// that volume read-only. An existing volume is trusted; a sandbox that
    /// then fails to start for want of the binary (another worker was still
    /// installing it) triggers [`install_init`](Self::install_init) and one retry.
    async fn ensure_init_volume(&self, image: &str) -> Result<()> {
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

    async fn run_installer(&self, helper: &str, tmp_name: &str) -> Result<()> {
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

    fn image_error(&self, e: bollard::errors::Error, image: &str) -> WorkerError {
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
        let mut cmd = if spec.run_as_root {
            vec![]
        } else {
            vec!["--command-uid".into(), uid.to_string()]
        };
        if egress {
            cmd.push("--egress".into());
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
            let body = self.container_body(id, spec, uid, egress_dir, &image_config);
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
    async fn uid_taken_elsewhere(&self, uid: u32, ours: &str) -> Result<bool> {
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

    pub async fn attach(&self, container: &str) -> Result<AttachContainerResults> {
        let opts = AttachContainerOptionsBuilder::default()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .logs(false)
            .build();
        Ok(self.docker.attach_container(container, Some(opts)).await?)
    }

    /// Is the container running? `None` when it does not exist.
    pub async fn running(&self, container: &str) -> Result<Option<bool>> {
        match self.docker.inspect_container(container, None).await {
            Ok(info) => Ok(Some(info.state.and_then(|s| s.running).unwrap_or(false))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The container's first process as the host sees it, and what a fork
    /// needs to know of it.
    pub async fn process(&self, container: &str) -> Result<ContainerProcess> {
        let info = self.docker.inspect_container(container, None).await?;
        let state = info.state.unwrap_or_default();
        let pid = state
            .pid
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0);
        let uid = info
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(LABEL_UID))
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        let host = info.host_config.unwrap_or_default();
        Ok(ContainerProcess {
            pid: pid.filter(|_| state.running.unwrap_or(false)),
            paused: state.paused.unwrap_or(false),
            uid,
            runtime: host.runtime.unwrap_or_default(),
            writable_rootfs: !host.readonly_rootfs.unwrap_or(false),
        })
    }

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

    /// What the container uses now: memory (less the page cache that can
    /// be dropped, as `docker stats` counts it), CPU over one sampling
    /// interval of the engine, processes.
    pub async fn stats(&self, container: &str) -> Result<ContainerUsage> {
        let options = bollard::query_parameters::StatsOptions {
            stream: false,
            one_shot: false,
        };
        let mut stream = self.docker.stats(container, Some(options));
        let s = match stream.next().await {
            Some(r) => r?,
            None => return Ok(ContainerUsage::default()),
        };
        let mem = s.memory_stats.unwrap_or_default();
        let inactive = mem
            .stats
            .as_ref()
            .and_then(|m| {
                m.get("inactive_file")
                    .or_else(|| m.get("total_inactive_file"))
            })
            .copied()
            .unwrap_or(0);
        // Tmpfs pages: cgroup v2 counts them as `shmem`; v1 has them in
        // `cache` but on no file list (they are swap-backed).
        let stat = |k: &str| mem.stats.as_ref().and_then(|m| m.get(k)).copied();
        let shmem = stat("shmem").unwrap_or_else(|| {
            stat("cache").unwrap_or(0).saturating_sub(
                stat("active_file").unwrap_or(0) + stat("inactive_file").unwrap_or(0),
            )
        });
        let cpu = s.cpu_stats.unwrap_or_default();
        let pre = s.precpu_stats.unwrap_or_default();
        let total = |c: &bollard::models::ContainerCpuStats| {
            c.cpu_usage
                .as_ref()
                .and_then(|u| u.total_usage)
                .unwrap_or(0)
        };
        let cpu_delta = total(&cpu).saturating_sub(total(&pre)) as f64;
        let system_delta = cpu
            .system_cpu_usage
            .unwrap_or(0)
            .saturating_sub(pre.system_cpu_usage.unwrap_or(0)) as f64;
        let cpus = f64::from(cpu.online_cpus.unwrap_or(1).max(1));
        let pids = s.pids_stats.unwrap_or_default();
        Ok(ContainerUsage {
            memory_bytes: mem.usage.unwrap_or(0).saturating_sub(inactive),
            memory_limit_bytes: mem.limit.unwrap_or(0),
            files_bytes: shmem,
            cpu_percent: if system_delta > 0.0 {
                cpu_delta / system_delta * cpus * 100.0
            } else {
                0.0
            },
            cpu_total_ns: total(&cpu),
            pids: pids.current.unwrap_or(0),
            pids_limit: pids.limit.unwrap_or(0),
        })
    }

    /// Why a container stopped, in words, from its state.
    pub async fn exit_reason(&self, container: &str) -> String {
        match self.docker.inspect_container(container, None).await {
            Ok(info) => {
                let s = info.state.unwrap_or_default();
                if s.oom_killed == Some(true) {
                    "the sandbox's supervisor was killed: out of memory".into()
                } else if let Some(err) = s.error.filter(|e| !e.is_empty()) {
                    format!("container stopped: {err}")
                } else {
                    format!(
                        "container stopped with exit code {}",
                        s.exit_code.unwrap_or(-1)
                    )
                }
            }
            Err(e) if is_not_found(&e) => "container removed".into(),
            Err(e) => format!("container state unknown: {e}"),
        }
    }

    /// Force-removes a container; absent is fine.
    pub async fn remove_container(&self, container: &str) -> Result<()> {
        let opts = RemoveContainerOptionsBuilder::default()
            .force(true)
            .v(true)
            .build();
        match self.docker.remove_container(container, Some(opts)).await {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409, ..
            }) => {
                // Removal already in progress.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Containers labelled as this worker's, running or not.
    pub async fn list_owned(&self) -> Result<Vec<ContainerSummary>> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_WORKER}={}", self.worker_id)],
        )]);
        let opts = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let all = self.docker.list_containers(Some(opts)).await?;
        // Made by a worker of this id with another state directory: not
        // ours to adopt or remove. (No label: made before labels named
        // the state directory, by this worker.)
        Ok(all
            .into_iter()
            .filter(|c| {
                let theirs = c
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(LABEL_STATE_DIR))
                    .is_some_and(|d| *d != self.state_dir);
                if theirs {
                    tracing::debug!(
                        container = c.id.as_deref().unwrap_or(""),
                        "a container of another worker with this worker's id; left alone"
                    );
                }
                !theirs
            })
            .collect())
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

    pub async fn version(&self) -> String {
        self.docker
            .version()
            .await
            .ok()
            .and_then(|v| v.version)
            .unwrap_or_default()
    }
}

/// A container's first process and how it runs (see
/// [`DockerRuntime::process`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerProcess {
    /// Its pid in the host's (the engine's) PID namespace; `None` when it
    /// does not run.
    pub pid: Option<u32>,
    pub paused: bool,
    /// The sandbox user's uid (0 for a sandbox whose commands run as root).
    pub uid: u32,
    /// The OCI runtime ("" for the engine's default).
    pub runtime: String,
    pub writable_rootfs: bool,
}

/// What a container uses (see [`DockerRuntime::stats`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContainerUsage {
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// Tmpfs pages (the cgroup's `shmem`): the sandbox's files.
    pub files_bytes: u64,
    pub cpu_percent: f64,
    pub cpu_total_ns: u64,
    pub pids: u64,
    pub pids_limit: u64,
}
