//! Images built on the worker's Docker engine from a client's Dockerfile
//! and context (`BuildImage`, on a worker started with `--allow-build`).
//!
//! The context arrives as a tar stream and is spooled to the state
//! directory while it is hashed; the image is named by that hash
//! (`corral-build:<digest>` of the Dockerfile's path and the context's
//! bytes), so the same inputs build nothing the second time and concurrent
//! builds of them wait for the first. Before anything is built, every base
//! image the Dockerfile names (`FROM`) must be one a sandbox of this worker
//! may name: a build reaches nothing a sandbox could not. Steps run under
//! the engine's default runtime with `--build-network` (none unless the
//! operator says otherwise), within `--build-memory` and `--max-build-time`.
//! A step that fails is an ordinary outcome, reported with its number and
//! instruction; the engine being away is an error.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::query_parameters::{BuildImageOptions, BuilderVersion};
use corral_proto::SandboxPolicy;
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::error::{Result, WorkerError};
use crate::policy::BUILT_IMAGES;

/// The operator's bounds on builds.
#[derive(Debug, Clone)]
pub struct BuildSettings {
    /// The network of the build's steps (`none` or `bridge`).
    pub network: String,
    /// The largest context taken.
    pub max_context_bytes: u64,
    /// The longest a build may take (a client may ask for less).
    pub max_time: Duration,
    /// Memory of each step's container.
    pub memory_bytes: u64,
    /// Builds run at once; more wait.
    pub concurrent: usize,
}

impl Default for BuildSettings {
    fn default() -> Self {
        Self {
            network: "none".into(),
            max_context_bytes: 512 << 20,
            max_time: Duration::from_secs(30 * 60),
            memory_bytes: 2 << 30,
            concurrent: 2,
        }
    }
}

/// What was asked, once the whole context is in.
#[derive(Debug)]
pub struct Request {
    pub dockerfile: String,
    pub timeout: Option<Duration>,
}

/// How a build ended, when it ended without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Built { image: String, cached: bool },
    Failed(Failure),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub step: u32,
    pub steps: u32,
    pub instruction: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    StepFailed,
    TimedOut,
    Invalid,
}

/// The largest Dockerfile read for its base images.
const MAX_DOCKERFILE_BYTES: u64 = 1 << 20;
/// The most of one piece of output sent as one event.
const MAX_OUTPUT_PIECE: usize = 64 << 10;

pub struct Builder {
    docker: Docker,
    dir: PathBuf,
    settings: BuildSettings,
    policy: SandboxPolicy,
    default_image: String,
    /// One lock per image being built: a second build of the same inputs
    /// waits for the first, then finds its image.
    building: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    slots: tokio::sync::Semaphore,
    /// What the contexts being received hold, all together.
    spooled: Arc<std::sync::atomic::AtomicU64>,
}

/// A file removed with this.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A context spooled to disk: removed with this.
pub struct Spooled {
    path: PathBuf,
    bytes: u64,
    /// What every context being received holds now, shared.
    total: Arc<std::sync::atomic::AtomicU64>,
    max_total: u64,
    digest: ring::digest::Context,
    file: tokio::fs::File,
    max: u64,
}

impl Drop for Spooled {
    fn drop(&mut self) {
        self.total
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Spooled {
    /// Adds a piece of the context.
    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        let n = data.len() as u64;
        self.bytes += n;
        let all = self
            .total
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed)
            + n;
        if all > self.max_total {
            return Err(WorkerError::Denied {
                flag: Some("--max-build-context"),
                what: format!(
                    "the contexts being received hold {} bytes, this worker's bound for all at once: try again later",
                    self.max_total
                ),
            });
        }
        if self.bytes > self.max {
            return Err(WorkerError::Denied {
                flag: Some("--max-build-context"),
                what: format!(
                    "the build context is over this worker's bound of {} bytes",
                    self.max
                ),
            });
        }
        self.digest.update(data);
        self.file
            .write_all(data)
            .await
            .map_err(|e| WorkerError::state(&self.path, e))
    }
}

impl Builder {
    pub fn new(
        docker: Docker,
        state_dir: &Path,
        settings: BuildSettings,
        policy: SandboxPolicy,
        default_image: String,
    ) -> Result<Self> {
        let dir = state_dir.join("builds");
        std::fs::create_dir_all(&dir).map_err(|e| WorkerError::state(&dir, e))?;
        // Contexts of builds cut short by a crash.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let slots = tokio::sync::Semaphore::new(settings.concurrent.max(1));
        Ok(Self {
            docker,
            dir,
            settings,
            policy,
            default_image,
            building: Mutex::new(HashMap::new()),
            slots,
            spooled: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        })
    }

    /// A new spool for a context.
    pub async fn spool(&self) -> Result<Spooled> {
        let path = self
            .dir
            .join(format!("{}.tar", uuid::Uuid::new_v4().simple()));
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .await
            .map_err(|e| WorkerError::state(&path, e))?;
        Ok(Spooled {
            path,
            bytes: 0,
            total: self.spooled.clone(),
            // Two contexts of the largest size at once, at most.
            max_total: self.settings.max_context_bytes.saturating_mul(2),
            digest: ring::digest::Context::new(&ring::digest::SHA256),
            file,
            max: self.settings.max_context_bytes,
        })
    }

    /// Builds `spooled` (its context complete), sending the build's output
    /// to `output` as it comes. A closed `output` (the client gone) stops
    /// the build.
    pub async fn build(
        &self,
        request: Request,
        mut spooled: Spooled,
        output: tokio::sync::mpsc::Sender<String>,
    ) -> Result<Outcome> {
        let dockerfile = dockerfile_path(&request.dockerfile)?;
        spooled
            .file
            .flush()
            .await
            .map_err(|e| WorkerError::state(&spooled.path, e))?;
        let mut digest = spooled.digest.clone();
        digest.update(b"\0dockerfile\0");
        digest.update(dockerfile.as_bytes());
        let hex: String = digest
            .finish()
            .as_ref()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        let image = format!("{BUILT_IMAGES}{hex}");
        // Read before anything is built: the bases must be allowed. What
        // the engine gets is a clean copy, with the very text checked.
        let clean = Removed(spooled.path.with_extension("clean.tar"));
        let text = {
            let (src, dst) = (spooled.path.clone(), clean.0.clone());
            let (name, max) = (dockerfile.clone(), self.settings.max_context_bytes);
            tokio::task::spawn_blocking(move || clean_context(&src, &dst, &name, max))
                .await
                .map_err(|e| WorkerError::Config(format!("build: {e}")))??
        };
        let Some(text) = text else {
            return Ok(Outcome::Failed(Failure {
                kind: FailureKind::Invalid,
                step: 0,
                steps: 0,
                instruction: String::new(),
                message: format!("the context has no file {dockerfile}"),
            }));
        };
        for base in images_named(&text)? {
            if base != "scratch"
                && !crate::policy::image_allowed(&self.policy, &base, &self.default_image)
            {
                return Err(WorkerError::Denied {
                    flag: Some("--allow-image"),
                    what: format!(
                        "the Dockerfile takes from the image {base:?}, which is not on this worker's list (its operator allows it with corral-worker --allow-image {base})"
                    ),
                });
            }
        }
        let lock = {
            let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
            building.entry(image.clone()).or_default().clone()
        };
        let held = tokio::select! {
            held = lock.lock() => held,
            () = output.closed() => return Err(gone()),
        };
        let outcome = if self.docker.inspect_image(&image).await.is_ok() {
            Ok(Outcome::Built {
                image: image.clone(),
                cached: true,
            })
        } else {
            let _slot = tokio::select! {
                slot = self.slots.acquire() => slot.map_err(|_| WorkerError::ShuttingDown)?,
                () = output.closed() => return Err(gone()),
            };
            let time = request
                .timeout
                .map_or(self.settings.max_time, |t| t.min(self.settings.max_time));
            self.run(&image, CHECKED_DOCKERFILE, &clean.0, time, &output)
                .await
        };
        drop(held);
        {
            let mut building = self.building.lock().unwrap_or_else(|e| e.into_inner());
            if Arc::strong_count(&lock) <= 2 {
                building.remove(&image);
            }
        }
        outcome
    }

    async fn run(
        &self,
        image: &str,
        dockerfile: &str,
        context: &Path,
        time: Duration,
        output: &tokio::sync::mpsc::Sender<String>,
    ) -> Result<Outcome> {
        let started = Instant::now();
        let file = tokio::fs::File::open(context)
            .await
            .map_err(|e| WorkerError::state(context, e))?;
        let body = tokio_util::io::ReaderStream::with_capacity(file, 256 << 10);
        let memory = i32::try_from(self.settings.memory_bytes).unwrap_or(i32::MAX);
        let options = BuildImageOptions {
            dockerfile: dockerfile.to_string(),
            t: Some(image.to_string()),
            rm: true,
            forcerm: true,
            memory: Some(memory),
            memswap: Some(memory),
            networkmode: Some(self.settings.network.clone()),
            // No labels: the engine would add them as steps the Dockerfile
            // does not have, and its step numbers would no longer be its.
            version: BuilderVersion::BuilderV1,
            ..Default::default()
        };
        let mut stream =
            self.docker
                .build_image(options, None, Some(bollard::body_try_stream(body)));
        let mut steps = Steps::default();
        let deadline = tokio::time::sleep(time);
        tokio::pin!(deadline);
        loop {
            let next = tokio::select! {
                next = stream.next() => next,
                () = &mut deadline => {
                    return Ok(Outcome::Failed(steps.failure(
                        FailureKind::TimedOut,
                        format!("the build took more than {}s and was stopped", time.as_secs()),
                    )));
                }
                () = output.closed() => return Err(gone()),
            };
            match next {
                None => break,
                Some(Ok(info)) => {
                    if let Some(text) = info.stream {
                        steps.saw(&text);
                        for piece in pieces(&text) {
                            // A client that stops reading holds the build
                            // up no longer than its time.
                            tokio::select! {
                                sent = output.send(piece) => {
                                    if sent.is_err() {
                                        return Err(gone());
                                    }
                                }
                                () = &mut deadline => {
                                    return Ok(Outcome::Failed(steps.failure(
                                        FailureKind::TimedOut,
                                        format!("the build took more than {}s and was stopped", time.as_secs()),
                                    )));
                                }
                            }
                        }
                    }
                }
                Some(Err(bollard::errors::Error::DockerStreamError { error })) => {
                    let kind = if steps.step == 0 {
                        FailureKind::Invalid
                    } else {
                        FailureKind::StepFailed
                    };
                    return Ok(Outcome::Failed(steps.failure(kind, error)));
                }
                Some(Err(bollard::errors::Error::DockerResponseServerError {
                    status_code,
                    message,
                })) if status_code < 500 || steps.step == 0 => {
                    // The engine could not read the Dockerfile or its
                    // context (a parse error, a file it lacks).
                    return Ok(Outcome::Failed(
                        steps.failure(FailureKind::Invalid, message),
                    ));
                }
                Some(Err(e)) => return Err(e.into()),
            }
        }
        match self.docker.inspect_image(image).await {
            Ok(_) => {
                tracing::info!(image, elapsed = ?started.elapsed(), "built an image");
                Ok(Outcome::Built {
                    image: image.to_string(),
                    cached: false,
                })
            }
            Err(e) => Ok(Outcome::Failed(steps.failure(
                FailureKind::StepFailed,
                format!("the build ended without its image: {e}"),
            ))),
        }
    }
}

mod context;
#[cfg(test)]
mod tests;

use context::*;
