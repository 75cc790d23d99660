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

/// Where the engine is told its Dockerfile is: the text the worker
/// checked, added last to the context it sends (so no other entry of the
/// context can stand in for it).
const CHECKED_DOCKERFILE: &str = ".corral-dockerfile";

/// An entry's name as the engine would resolve it (`a/../b` is `b`), or
/// `None` for one outside the context or not UTF-8.
fn clean_name(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    if s.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = Vec::new();
    for p in s.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

/// Copies the context at `src` to `dst` entry by entry, refusing what the
/// engine could take otherwise than the worker reads it (a name outside
/// the context, a sparse file that unpacks to more than it holds, a device)
/// and what is over `max_bytes` in all; then adds the Dockerfile `name` as
/// [`CHECKED_DOCKERFILE`]. Its text, if the context has it.
fn clean_context(src: &Path, dst: &Path, name: &str, max_bytes: u64) -> Result<Option<String>> {
    let invalid =
        |why: String| WorkerError::Invalid(corral_proto::ProtocolError::invalid("context", why));
    let state = |e: std::io::Error| WorkerError::state(dst, e);
    let file = std::fs::File::open(src).map_err(|e| WorkerError::state(src, e))?;
    let mut archive = tar::Archive::new(file);
    let out = std::fs::File::create(dst).map_err(state)?;
    let mut builder = tar::Builder::new(std::io::BufWriter::new(out));
    let entries = archive
        .entries()
        .map_err(|e| invalid(format!("not a tar stream: {e}")))?;
    let mut found = None;
    let mut total = 0u64;
    for entry in entries {
        let mut entry = entry.map_err(|e| invalid(format!("not a tar stream: {e}")))?;
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let Some(clean) = clean_name(&raw) else {
            return Err(invalid(format!(
                "{shown:?}: a name outside the context (or not UTF-8)"
            )));
        };
        let kind = entry.header().entry_type();
        let sparse = kind.is_gnu_sparse()
            || entry.pax_extensions().ok().flatten().is_some_and(|mut x| {
                x.any(|e| e.is_ok_and(|e| e.key_bytes().starts_with(b"GNU.sparse")))
            });
        if sparse {
            return Err(invalid(format!(
                "{shown:?}: a sparse file (it would unpack to more than it holds)"
            )));
        }
        total = total.saturating_add(entry.size());
        if total > max_bytes {
            return Err(WorkerError::Denied {
                flag: Some("--max-build-context"),
                what: format!(
                    "the build context unpacks to over this worker's bound of {max_bytes} bytes"
                ),
            });
        }
        if clean.is_empty() {
            // The context's root itself.
            continue;
        }
        let mut header = entry.header().clone();
        if kind.is_file() {
            if clean == name {
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
                builder
                    .append_data(&mut header, &clean, text.as_bytes())
                    .map_err(state)?;
                // The last entry of a name is the one the engine takes.
                found = Some(text);
            } else {
                builder
                    .append_data(&mut header, &clean, &mut entry)
                    .map_err(state)?;
            }
        } else if kind.is_dir() {
            builder
                .append_data(&mut header, &clean, std::io::empty())
                .map_err(state)?;
        } else if kind.is_symlink() || kind.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .map(|t| t.into_owned())
                .unwrap_or_default();
            if kind.is_hard_link() {
                let Some(target) = clean_name(&target).filter(|t| !t.is_empty()) else {
                    return Err(invalid(format!(
                        "{shown:?}: a hard link outside the context"
                    )));
                };
                builder
                    .append_link(&mut header, &clean, &target)
                    .map_err(state)?;
            } else {
                let target = String::from_utf8(target)
                    .map_err(|_| invalid(format!("{shown:?}: a link target not UTF-8")))?;
                builder
                    .append_link(&mut header, &clean, &target)
                    .map_err(state)?;
            }
            if clean == name {
                return Err(invalid(format!("{name} is not a regular file")));
            }
        } else {
            return Err(invalid(format!(
                "{shown:?}: not a file, directory or link (a context holds no devices or FIFOs)"
            )));
        }
    }
    if let Some(text) = &found {
        let mut header = tar::Header::new_gnu();
        header.set_size(text.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, CHECKED_DOCKERFILE, text.as_bytes())
            .map_err(state)?;
    }
    builder
        .into_inner()
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .map_err(state)?;
    Ok(found)
}

fn refused(what: String) -> WorkerError {
    WorkerError::Denied { flag: None, what }
}

fn unreadable(why: String) -> WorkerError {
    WorkerError::Invalid(corral_proto::ProtocolError::invalid("dockerfile", why))
}

/// The images a Dockerfile takes anything from: its `FROM`s and
/// `COPY --from`s that name no stage of its own. Read as the engine's
/// classic builder reads it, and refused where the two could read it
/// differently (a byte-order mark, an `escape` directive, whitespace or
/// control characters other than space and tab) or where what it takes
/// cannot be checked before the build: a base a build argument chooses, an
/// `ADD` from a URL (the engine would fetch it itself, outside any
/// sandbox's network).
fn images_named(text: &str) -> Result<Vec<String>> {
    if text.starts_with('\u{feff}') {
        return Err(unreadable("it starts with a byte-order mark".into()));
    }
    if let Some(c) = text.chars().find(|c| {
        (c.is_control() && !matches!(c, '\n' | '\t' | '\r')) || (c.is_whitespace() && !c.is_ascii())
    }) {
        return Err(unreadable(format!(
            "it holds the character {c:?}, which the engine may read otherwise"
        )));
    }
    let mut stages: Vec<String> = Vec::new();
    let mut images = Vec::new();
    let mut line = String::new();
    let mut at_top = true;
    for raw in text.split('\n') {
        let trimmed = raw.trim_matches(|c| c == ' ' || c == '\t' || c == '\r');
        if at_top && trimmed.starts_with('#') {
            let directive = trimmed[1..].trim_matches(|c| c == ' ' || c == '\t');
            if directive.split('=').next().is_some_and(|k| {
                k.trim_matches(|c| c == ' ' || c == '\t')
                    .eq_ignore_ascii_case("escape")
            }) {
                return Err(unreadable("an escape directive is not taken".into()));
            }
            continue;
        }
        at_top = false;
        if line.is_empty() && (trimmed.starts_with('#') || trimmed.is_empty()) {
            continue;
        }
        // A comment line inside a continued one is dropped, as the engine
        // drops it.
        if !line.is_empty() && trimmed.starts_with('#') {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            line.push_str(head);
            line.push(' ');
            continue;
        }
        line.push_str(trimmed);
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        instruction(&words, &line, &mut stages, &mut images)?;
        line.clear();
    }
    if !line.trim().is_empty() {
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        instruction(&words, &line, &mut stages, &mut images)?;
    }
    Ok(images)
}

/// One instruction's part in [`images_named`].
fn instruction(
    words: &[&str],
    line: &str,
    stages: &mut Vec<String>,
    images: &mut Vec<String>,
) -> Result<()> {
    let Some(keyword) = words.first() else {
        return Ok(());
    };
    let args = &words[1..];
    if keyword.eq_ignore_ascii_case("ONBUILD") {
        // Its instruction runs in a build FROM this image: checked now.
        return instruction(args, line, stages, images);
    }
    if keyword.eq_ignore_ascii_case("FROM") {
        let mut rest = args.iter().skip_while(|w| w.starts_with("--"));
        let Some(image) = rest.next() else {
            return Err(unreadable(format!("{line:?}: FROM names no image")));
        };
        if image.contains('$') {
            return Err(refused(format!(
                "FROM {image}: a base image chosen by a build argument cannot be checked against this worker's images; name it"
            )));
        }
        if !stages.iter().any(|s| s.eq_ignore_ascii_case(image)) {
            images.push((*image).to_string());
        }
        if let (Some(as_), Some(name)) = (rest.next(), rest.next())
            && as_.eq_ignore_ascii_case("AS")
        {
            stages.push((*name).to_string());
        }
    } else if keyword.eq_ignore_ascii_case("COPY") || keyword.eq_ignore_ascii_case("ADD") {
        for flag in args.iter().take_while(|w| w.starts_with("--")) {
            let Some(from) = flag
                .get(..7)
                .filter(|f| f.eq_ignore_ascii_case("--from="))
                .map(|_| &flag[7..])
            else {
                continue;
            };
            if from.contains('$') {
                return Err(refused(format!(
                    "{keyword} {flag}: an image chosen by a build argument cannot be checked; name it"
                )));
            }
            let stage = stages.iter().any(|s| s.eq_ignore_ascii_case(from))
                || from.parse::<usize>().is_ok();
            if !stage {
                images.push(from.to_string());
            }
        }
        if keyword.eq_ignore_ascii_case("ADD")
            && args
                .iter()
                .any(|w| w.contains("://") || w.starts_with("git@"))
        {
            return Err(refused(format!(
                "{line:?}: ADD from a URL is fetched by the engine itself, outside any sandbox's network policy; download it in a RUN step (under --build-network) or put it in the context"
            )));
        }
    }
    Ok(())
}

/// A context as a tar stream, for tests: names written as given (`..`
/// and all, as a hostile client would).
#[cfg(test)]
fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_named_skip_stages_flags_and_comments() {
        let text = "# syntax=docker/dockerfile:1\nFROM --platform=linux/amd64 corral-debian AS build\nRUN make \\\n# a comment inside\n  all\nfrom build AS test\nFROM python:3.12\nCOPY --from=build /a /a\nCOPY --from=0 /a /b\nCOPY --from=alpine:3 /etc/x /x\nONBUILD COPY --from=busybox /bin/sh /sh\n";
        assert_eq!(
            images_named(text).unwrap(),
            vec!["corral-debian", "python:3.12", "alpine:3", "busybox"]
        );
    }

    #[test]
    fn what_the_engine_could_read_otherwise_or_fetch_itself_is_refused() {
        let denied = |t: &str| matches!(images_named(t), Err(WorkerError::Denied { .. }));
        let invalid = |t: &str| matches!(images_named(t), Err(WorkerError::Invalid(_)));
        assert!(denied("ARG BASE=corral-debian\nFROM $BASE\n"));
        assert!(invalid("FROM\n"));
        assert!(invalid("\u{feff}FROM alpine:3\n"));
        assert!(invalid(
            "# escape=`\nFROM corral-debian\nRUN echo `\nFROM alpine:3\n"
        ));
        assert!(invalid("# Escape = `\nFROM corral-debian\n"));
        assert!(invalid(
            "FROM corral-debian\nRUN echo \\\u{a0}\nFROM alpine:3\n"
        ));
        assert!(invalid(
            "FROM corral-debian\nRUN echo \\\u{b}\nFROM alpine:3\n"
        ));
        assert!(denied(
            "FROM corral-debian\nADD http://127.0.0.1:8080/x /x\n"
        ));
        assert!(denied(
            "FROM corral-debian\nADD [\"https://example.com/x\", \"/x\"]\n"
        ));
        assert!(denied(
            "FROM corral-debian\nONBUILD ADD http://169.254.169.254/ /x\n"
        ));
        assert!(denied("FROM corral-debian\nCOPY --from=$IMG /a /a\n"));
        // A continuation ends at space and tab only, as the engine's does.
        assert_eq!(
            images_named("FROM corral-debian\nRUN echo \\ \t\nFROM python:3.12\n").unwrap(),
            vec!["corral-debian"]
        );
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
    fn the_engine_gets_the_dockerfile_the_worker_read_and_nothing_it_would_read_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("c.tar"), dir.path().join("d.tar"));
        // `a/../Dockerfile` is the engine's Dockerfile, after the other.
        std::fs::write(
            &src,
            tar_of(&[
                ("Dockerfile", b"FROM corral-debian\n"),
                ("./a/../Dockerfile", b"FROM alpine:3\n"),
                ("x", b"y"),
            ]),
        )
        .unwrap();
        let text = clean_context(&src, &dst, "Dockerfile", 1 << 20).unwrap();
        assert_eq!(text.as_deref(), Some("FROM alpine:3\n"));
        let mut names = Vec::new();
        let mut checked = String::new();
        let mut a = tar::Archive::new(std::fs::File::open(&dst).unwrap());
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let n = String::from_utf8(e.path_bytes().into_owned()).unwrap();
            if n == CHECKED_DOCKERFILE {
                e.read_to_string(&mut checked).unwrap();
            }
            names.push(n);
        }
        assert_eq!(names, ["Dockerfile", "Dockerfile", "x", CHECKED_DOCKERFILE]);
        assert_eq!(checked, "FROM alpine:3\n");
        assert_eq!(clean_context(&src, &dst, "missing", 1 << 20).unwrap(), None);
        for bad in ["../x", "/etc/x", "a/../../x"] {
            std::fs::write(&src, tar_of(&[(bad, b"y")])).unwrap();
            assert!(
                clean_context(&src, &dst, "Dockerfile", 1 << 20).is_err(),
                "{bad}"
            );
        }
        std::fs::write(&src, tar_of(&[("big", &[0u8; 4096])])).unwrap();
        assert!(matches!(
            clean_context(&src, &dst, "Dockerfile", 1000),
            Err(WorkerError::Denied { .. })
        ));
        std::fs::write(&src, b"not a tar").unwrap();
        assert!(!matches!(
            clean_context(&src, &dst, "Dockerfile", 1 << 20),
            Ok(Some(_))
        ));
    }
}
