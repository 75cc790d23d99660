//! A build's inputs checked before the engine sees them: the Dockerfile's
//! path, the context's names and size (links, devices and escapes
//! refused), every base image against the policy, and the build's output
//! read into named steps.

use super::*;

pub(crate) fn gone() -> WorkerError {
    WorkerError::NotApplicable("the client went away: the build was stopped".into())
}

/// The step the build is at, from its output (`Step 3/5 : RUN make`).
#[derive(Debug, Default)]
pub(crate) struct Steps {
    pub(crate) step: u32,
    steps: u32,
    instruction: String,
}

impl Steps {
    pub(crate) fn saw(&mut self, text: &str) {
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

    pub(crate) fn failure(&self, kind: FailureKind, message: String) -> Failure {
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
pub(crate) fn pieces(text: &str) -> Vec<String> {
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
pub(crate) fn dockerfile_path(given: &str) -> Result<String> {
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
pub(crate) const CHECKED_DOCKERFILE: &str = ".corral-dockerfile";

/// An entry's name as the engine would resolve it (`a/../b` is `b`), or
/// `None` for one outside the context or not UTF-8.
pub(crate) fn clean_name(raw: &[u8]) -> Option<String> {
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
pub(crate) fn clean_context(
    src: &Path,
    dst: &Path,
    name: &str,
    max_bytes: u64,
) -> Result<Option<String>> {
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

pub(crate) fn refused(what: String) -> WorkerError {
    WorkerError::Denied { flag: None, what }
}

pub(crate) fn unreadable(why: String) -> WorkerError {
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
pub(crate) fn images_named(text: &str) -> Result<Vec<String>> {
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
pub(crate) fn instruction(
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
