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
}

/// A context spooled to disk: removed with this.
pub struct Spooled {
    path: PathBuf,
    bytes: u64,
    digest: ring::digest::Context,
    file: tokio::fs::File,
    max: u64,
}

impl Drop for Spooled {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Spooled {
    /// Adds a piece of the context.
    pub async fn write(&mut self, data: &[u8]) -> Result<()> {
        self.bytes += data.len() as u64;
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

    pub fn len(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
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
        // Read before anything is built: the bases must be allowed.
        let text = {
            let path = spooled.path.clone();
            let name = dockerfile.clone();
            tokio::task::spawn_blocking(move || read_entry(&path, &name))
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
        for base in base_images(&text)? {
            if base != "scratch"
                && !crate::policy::image_allowed(&self.policy, &base, &self.default_image)
            {
                return Err(WorkerError::Denied {
                    flag: Some("--allow-image"),
                    what: format!(
                        "the Dockerfile's base image {base:?} is not on this worker's list (its operator allows it with corral-worker --allow-image {base})"
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
            self.run(&image, &dockerfile, &spooled.path, time, &output)
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
                            if output.send(piece).await.is_err() {
                                return Err(gone());
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

fn gone() -> WorkerError {
    WorkerError::NotApplicable("the client went away: the build was stopped".into())
}

/// The step the build is at, from its output (`Step 3/5 : RUN make`).
#[derive(Debug, Default)]
struct Steps {
    step: u32,
    steps: u32,
    instruction: String,
}

impl Steps {
    fn saw(&mut self, text: &str) {
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("Step ") else {
                continue;
            };
            let Some((count, instruction)) = rest.split_once(" : ") else {
                continue;
            };
            let Some((n, of)) = count.split_once('/') else {
                continue;
            };
            if let (Ok(n), Ok(of)) = (n.trim().parse(), of.trim().parse()) {
                self.step = n;
                self.steps = of;
                self.instruction = instruction.trim().chars().take(4096).collect();
            }
        }
    }

    fn failure(&self, kind: FailureKind, message: String) -> Failure {
        Failure {
            kind,
            step: self.step,
            steps: self.steps,
            instruction: self.instruction.clone(),
            message: message.trim().chars().take(16 << 10).collect(),
        }
    }
}

/// Output split into pieces of at most [`MAX_OUTPUT_PIECE`] bytes, each
/// valid UTF-8.
fn pieces(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > MAX_OUTPUT_PIECE {
        let mut cut = MAX_OUTPUT_PIECE;
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        out.push(rest[..cut].to_string());
        rest = &rest[cut..];
    }
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// The Dockerfile's path in the context: relative, within it, plain.
fn dockerfile_path(given: &str) -> Result<String> {
    let given = if given.is_empty() {
        "Dockerfile"
    } else {
        given
    };
    let invalid = |why: &str| {
        WorkerError::Invalid(corral_proto::ProtocolError::invalid(
            "dockerfile",
            format!("{given:?}: {why}"),
        ))
    };
    if given.len() > 4096 || given.contains('\0') {
        return Err(invalid("not a path"));
    }
    let mut parts = Vec::new();
    for part in given.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(invalid("a path within the context, without ..")),
            p => parts.push(p),
        }
    }
    if given.starts_with('/') || parts.is_empty() {
        return Err(invalid("a path within the context"));
    }
    Ok(parts.join("/"))
}

/// The text of the entry `name` of the tar file at `path`, if it has one
/// (a regular file, at most [`MAX_DOCKERFILE_BYTES`]).
fn read_entry(path: &Path, name: &str) -> Result<Option<String>> {
    let invalid =
        |why: String| WorkerError::Invalid(corral_proto::ProtocolError::invalid("context", why));
    let file = std::fs::File::open(path).map_err(|e| WorkerError::state(path, e))?;
    let mut archive = tar::Archive::new(file);
    let entries = archive
        .entries()
        .map_err(|e| invalid(format!("not a tar stream: {e}")))?;
    let mut found = None;
    for entry in entries {
        let mut entry = entry.map_err(|e| invalid(format!("not a tar stream: {e}")))?;
        let entry_path = entry
            .path()
            .map_err(|e| invalid(format!("an entry's name: {e}")))?
            .into_owned();
        let normalized: Vec<String> = entry_path
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(p) => Some(p.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect();
        if normalized.join("/") != name {
            continue;
        }
        if !entry.header().entry_type().is_file() {
            return Err(invalid(format!("{name} is not a regular file")));
        }
        if entry.size() > MAX_DOCKERFILE_BYTES {
            return Err(invalid(format!(
                "{name} is over {MAX_DOCKERFILE_BYTES} bytes"
            )));
        }
        let mut text = String::new();
        entry
            .by_ref()
            .take(MAX_DOCKERFILE_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        // The last entry of a name is the one unpacked.
        found = Some(text);
    }
    Ok(found)
}

/// The images a Dockerfile builds on (its `FROM`s that name no earlier
/// stage). A base that a build argument chooses cannot be checked before
/// the build: refused.
fn base_images(text: &str) -> Result<Vec<String>> {
    let mut stages: Vec<String> = Vec::new();
    let mut bases = Vec::new();
    let mut line = String::new();
    for raw in text.lines() {
        let trimmed = raw.trim();
        if line.is_empty() && (trimmed.starts_with('#') || trimmed.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            line.push_str(head);
            line.push(' ');
            continue;
        }
        line.push_str(trimmed);
        let words: Vec<&str> = line.split_whitespace().collect();
        if words
            .first()
            .is_some_and(|w| w.eq_ignore_ascii_case("FROM"))
        {
            let mut rest = words[1..].iter().skip_while(|w| w.starts_with("--"));
            let Some(image) = rest.next() else {
                return Err(WorkerError::Invalid(corral_proto::ProtocolError::invalid(
                    "dockerfile",
                    format!("{line:?}: FROM names no image"),
                )));
            };
            if image.contains('$') {
                return Err(WorkerError::Denied {
                    flag: None,
                    what: format!(
                        "FROM {image}: a base image chosen by a build argument cannot be checked against this worker's images; name it"
                    ),
                });
            }
            if !stages.iter().any(|s| s.eq_ignore_ascii_case(image)) {
                bases.push((*image).to_string());
            }
            if let (Some(as_), Some(name)) = (rest.next(), rest.next())
                && as_.eq_ignore_ascii_case("AS")
            {
                stages.push((*name).to_string());
            }
        }
        line.clear();
    }
    Ok(bases)
}

/// A piece of a spooled context, for tests.
#[cfg(test)]
fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_images_skip_stages_flags_and_comments() {
        let text = "# syntax=docker/dockerfile:1\nFROM --platform=linux/amd64 corral-debian AS build\nRUN make \\\n  all\nfrom build AS test\nFROM python:3.12\nCOPY --from=build /a /a\n";
        assert_eq!(
            base_images(text).unwrap(),
            vec!["corral-debian".to_string(), "python:3.12".to_string()]
        );
    }

    #[test]
    fn a_base_chosen_by_an_argument_is_refused() {
        let e = base_images("ARG BASE=corral-debian\nFROM $BASE\n").unwrap_err();
        assert!(matches!(e, WorkerError::Denied { .. }), "{e}");
        let e = base_images("FROM\n").unwrap_err();
        assert!(matches!(e, WorkerError::Invalid(_)), "{e}");
    }

    #[test]
    fn the_dockerfile_path_stays_in_the_context() {
        assert_eq!(dockerfile_path("").unwrap(), "Dockerfile");
        assert_eq!(
            dockerfile_path("./env/Dockerfile").unwrap(),
            "env/Dockerfile"
        );
        for bad in ["/etc/passwd", "../Dockerfile", "a/../../b", ".", "a\0b"] {
            assert!(dockerfile_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn steps_are_read_from_the_output() {
        let mut s = Steps::default();
        s.saw("Step 1/3 : FROM corral-debian\n ---> abc\n");
        s.saw("Step 2/3 : RUN false\n");
        let f = s.failure(FailureKind::StepFailed, " boom \n".into());
        assert_eq!((f.step, f.steps), (2, 3));
        assert_eq!(f.instruction, "RUN false");
        assert_eq!(f.message, "boom");
    }

    #[test]
    fn output_pieces_are_bounded_and_whole_characters() {
        let text = "é".repeat(MAX_OUTPUT_PIECE);
        let p = pieces(&text);
        assert!(p.iter().all(|x| x.len() <= MAX_OUTPUT_PIECE));
        assert_eq!(p.concat(), text);
    }

    #[test]
    fn the_dockerfile_is_found_by_its_normalized_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.tar");
        std::fs::write(
            &path,
            tar_of(&[("./env/Dockerfile", b"FROM corral-debian\n"), ("x", b"y")]),
        )
        .unwrap();
        assert_eq!(
            read_entry(&path, "env/Dockerfile").unwrap().as_deref(),
            Some("FROM corral-debian\n")
        );
        assert_eq!(read_entry(&path, "Dockerfile").unwrap(), None);
        std::fs::write(&path, b"not a tar").unwrap();
        assert!(!matches!(read_entry(&path, "Dockerfile"), Ok(Some(_))));
    }
}
