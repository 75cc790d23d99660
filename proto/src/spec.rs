//! What a client asks for: sandbox and operation specs, validated.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::limits::*;
use crate::{ProtocolError, pb};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum NetworkMode {
    /// No network interface but loopback (the default).
    #[default]
    None,
    /// Docker's default bridge: outbound access.
    Bridge,
}

/// A sandbox's make-up. `None` fields take the worker's hardened defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct SandboxSpec {
    pub image: Option<String>,
    pub network: NetworkMode,
    pub memory_bytes: Option<u64>,
    pub cpu_millis: Option<u32>,
    pub pids_limit: Option<u32>,
    pub workspace_bytes: Option<u64>,
    pub tmp_bytes: Option<u64>,
    pub run_as_root: bool,
    pub writable_rootfs: bool,
    pub add_capabilities: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// OCI runtime (`runsc` for gVisor); `None`: the worker's default.
    #[cfg_attr(feature = "serde", serde(default))]
    pub runtime: Option<String>,
    /// Removed by the worker after this long with no client (no watcher,
    /// no call naming it); `None`: never.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub idle_timeout_ms: Option<u64>,
    /// Removed by the worker this long after it was made, whatever it
    /// does; `None`: only the worker's own limit applies.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub ttl_ms: Option<u64>,
    /// The memory limit covers the tmpfs files too (see worker.proto).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub memory_includes_files: bool,
    /// The client's own names for it, kept and shown, never given to
    /// commands (see [`crate::limits::MAX_LABELS`]).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "BTreeMap::is_empty")
    )]
    pub labels: BTreeMap<String, String>,
    /// Egress by policy through the worker's proxy (see worker.proto);
    /// empty: no way out (and no proxy, unless `egress_proxy`).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty")
    )]
    pub egress: Vec<crate::egress::Rule>,
    /// The proxy even with no rules, so that a policy can be given later.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub egress_proxy: bool,
    /// A template of the worker's that it is made from (see
    /// [`crate::template`]).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub template: Option<String>,
    /// Volumes mounted into it (see [`crate::volume`]).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty")
    )]
    pub volumes: Vec<crate::volume::VolumeMount>,
}

/// A pseudo-terminal's window size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

#[cfg(feature = "serde")]
fn is_false(b: &bool) -> bool {
    !b
}

/// Runs `command` through `/bin/sh -c` (or bash), non-interactively.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ShellSpec {
    pub command: String,
    pub workdir: Option<String>,
    pub env: BTreeMap<String, String>,
    pub timeout_ms: Option<u64>,
    pub output_limit_bytes: Option<u64>,
    pub use_bash: bool,
    /// Background processes outlive the command (else its process group is
    /// killed when its main process exits).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub keep_background: bool,
    /// Stdin is a pipe fed through the operation's input.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub stdin: bool,
    /// Runs on a pseudo-terminal of this size.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub terminal: Option<TerminalSize>,
}

impl ShellSpec {
    pub fn new(command: impl Into<String>) -> Self {
        Self {
            command: command.into(),
            workdir: None,
            env: BTreeMap::new(),
            timeout_ms: None,
            output_limit_bytes: None,
            use_bash: false,
            keep_background: false,
            stdin: false,
            terminal: None,
        }
    }

    /// Whether the operation takes input (WriteInput).
    pub fn takes_input(&self) -> bool {
        self.stdin || self.terminal.is_some()
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS))
    }

    pub fn output_limit(&self) -> u64 {
        self.output_limit_bytes
            .unwrap_or(DEFAULT_OUTPUT_LIMIT_BYTES)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReadFileSpec {
    pub path: String,
    pub offset: u64,
    /// Most bytes read; with `stream`, 0 means to the end.
    pub limit: u64,
    /// The bytes come as stdout output events, chunked under flow control,
    /// not in the result.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub stream: bool,
}

impl ReadFileSpec {
    /// Reads the whole file (up to [`MAX_FILE_BYTES`]) into the result.
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            offset: 0,
            limit: MAX_FILE_BYTES,
            stream: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WriteFileSpec {
    pub path: String,
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_bytes_b64"))]
    pub data: Bytes,
    pub mode: u32,
    /// Adds to the end of the file instead of replacing it.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub append: bool,
    /// More bytes follow as the operation's input, until its end.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub stream: bool,
}

impl WriteFileSpec {
    /// Replaces `path` with `data` (mode 0644).
    pub fn new(path: impl Into<String>, data: impl Into<Bytes>) -> Self {
        Self {
            path: path.into(),
            data: data.into(),
            mode: 0o644,
            append: false,
            stream: false,
        }
    }
}

/// A tree moved as a tar stream (see `ArchiveSpec` in worker.proto).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ArchiveSpec {
    pub path: String,
    /// Get only: the directory's contents (entries named `./...`), not the
    /// directory under its own name.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_false"))]
    pub contents: bool,
}

impl ArchiveSpec {
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            contents: false,
        }
    }

    /// The contents of the directory `path`.
    pub fn contents_of(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            contents: true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "kind", rename_all = "snake_case"))]
pub enum OperationSpec {
    Shell(ShellSpec),
    ReadFile(ReadFileSpec),
    WriteFile(WriteFileSpec),
    /// A tar stream, fed as input, unpacked in the sandbox.
    PutArchive(ArchiveSpec),
    /// A tree of the sandbox packed as a tar stream of stdout output.
    GetArchive(ArchiveSpec),
    /// A directory's entries as stdout output (see `list_dir` in
    /// worker.proto), listed by a helper the sandbox cannot trace.
    ListDir(ArchiveSpec),
}

impl OperationSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Shell(_) => "shell",
            Self::ReadFile(_) => "read_file",
            Self::WriteFile(_) => "write_file",
            Self::PutArchive(_) => "put_archive",
            Self::GetArchive(_) => "get_archive",
            Self::ListDir(_) => "list_dir",
        }
    }

    /// Whether the operation takes input through WriteInput.
    pub fn takes_input(&self) -> bool {
        match self {
            Self::Shell(s) => s.takes_input(),
            Self::WriteFile(w) => w.stream,
            Self::PutArchive(_) => true,
            Self::ReadFile(_) | Self::GetArchive(_) | Self::ListDir(_) => false,
        }
    }

    /// The spec as replies show it: a write's bytes are not echoed back
    /// (only their count, in `bytes_written` of the result).
    pub fn without_data(&self) -> Self {
        match self {
            Self::WriteFile(w) if !w.data.is_empty() => Self::WriteFile(WriteFileSpec {
                data: Bytes::new(),
                ..w.clone()
            }),
            other => other.clone(),
        }
    }
}

fn no_nul(field: &'static str, s: &str) -> Result<(), ProtocolError> {
    match s.find('\0') {
        Some(i) => Err(ProtocolError::invalid(
            field,
            format!("contains a NUL byte at offset {i}"),
        )),
        None => Ok(()),
    }
}

fn validate_env(field: &'static str, env: &BTreeMap<String, String>) -> Result<(), ProtocolError> {
    if env.len() > MAX_ENV_ENTRIES {
        return Err(ProtocolError::invalid(
            field,
            format!("more than {MAX_ENV_ENTRIES} entries"),
        ));
    }
    for (k, v) in env {
        if k.is_empty() {
            return Err(ProtocolError::invalid(field, "empty variable name"));
        }
        if k.contains('=') {
            return Err(ProtocolError::invalid(
                field,
                format!("variable name {k:?} contains '='"),
            ));
        }
        no_nul(field, k)?;
        no_nul(field, v)?;
        let entry = k.len() + 1 + v.len();
        if entry > MAX_ENV_ENTRY_BYTES {
            return Err(ProtocolError::invalid(
                field,
                format!(
                    "{k} is {entry} bytes with its name; a program cannot be started with a variable over {MAX_ENV_ENTRY_BYTES}"
                ),
            ));
        }
    }
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > MAX_ENV_BYTES {
        return Err(ProtocolError::invalid(
            field,
            format!("{total} bytes in all is over the limit of {MAX_ENV_BYTES}"),
        ));
    }
    Ok(())
}

fn validate_path(field: &'static str, p: &str) -> Result<(), ProtocolError> {
    if p.is_empty() {
        return Err(ProtocolError::Missing(field));
    }
    if p.len() > MAX_PATH_BYTES {
        return Err(ProtocolError::invalid(
            field,
            format!("longer than {MAX_PATH_BYTES} bytes"),
        ));
    }
    no_nul(field, p)
}

impl SandboxSpec {
    /// Whether the sandbox has an egress proxy: rules, or asked for one.
    pub fn has_egress_proxy(&self) -> bool {
        self.egress_proxy || !self.egress.is_empty()
    }

    pub fn validate(&self) -> Result<(), ProtocolError> {
        if let Some(t) = &self.template {
            crate::template::check_name(t)?;
        }
        crate::volume::check_mounts(&self.volumes)?;
        if let Some(r) = &self.runtime
            && (r.is_empty()
                || r.len() > 64
                || !r
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
        {
            return Err(ProtocolError::invalid(
                "runtime",
                format!("{r:?} is not a runtime name like runsc"),
            ));
        }
        if let Some(image) = &self.image {
            if image.is_empty() || image.len() > 512 {
                return Err(ProtocolError::invalid("image", "must be 1-512 bytes"));
            }
            no_nul("image", image)?;
        }
        if self.memory_bytes.is_some_and(|m| m < 16 << 20) {
            return Err(ProtocolError::invalid("memory_bytes", "below 16 MiB"));
        }
        if self.pids_limit.is_some_and(|p| p < 8) {
            return Err(ProtocolError::invalid("pids_limit", "below 8"));
        }
        for cap in &self.add_capabilities {
            let ok = cap.len() <= 64
                && cap.starts_with("CAP_")
                && cap[4..].chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && cap.len() > 4;
            if !ok {
                return Err(ProtocolError::invalid(
                    "add_capabilities",
                    format!("{cap:?} is not a capability name like CAP_CHOWN"),
                ));
            }
        }
        validate_env("env", &self.env)?;
        if self.has_egress_proxy() {
            if self.network != NetworkMode::None {
                return Err(ProtocolError::invalid(
                    "egress",
                    "egress by policy is for a sandbox with network none (the bridge reaches everything already)",
                ));
            }
            if self.egress.len() > crate::egress::MAX_RULES {
                return Err(ProtocolError::invalid(
                    "egress",
                    format!("more than {} rules", crate::egress::MAX_RULES),
                ));
            }
            if self
                .egress
                .iter()
                .any(|r| r.dest == crate::egress::Dest::Any)
            {
                return Err(ProtocolError::invalid(
                    "egress",
                    "`*` is a worker's bound, not a sandbox's rule: name the hosts",
                ));
            }
        }
        validate_labels(&self.labels)
    }
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), ProtocolError> {
    use crate::limits::{MAX_LABEL_KEY_BYTES, MAX_LABEL_VALUE_BYTES, MAX_LABELS};
    if labels.len() > MAX_LABELS {
        return Err(ProtocolError::invalid(
            "labels",
            format!("more than {MAX_LABELS} labels"),
        ));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= MAX_LABEL_KEY_BYTES
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-/".contains(&b));
        if !key_ok {
            return Err(ProtocolError::invalid(
                "labels",
                format!("key {k:?}: 1-{MAX_LABEL_KEY_BYTES} characters of [A-Za-z0-9_.-/]"),
            ));
        }
        if v.len() > MAX_LABEL_VALUE_BYTES || v.chars().any(char::is_control) {
            return Err(ProtocolError::invalid(
                "labels",
                format!(
                    "the value of {k}: at most {MAX_LABEL_VALUE_BYTES} bytes, no control characters"
                ),
            ));
        }
    }
    Ok(())
}

impl OperationSpec {
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match self {
            Self::Shell(s) => {
                if s.command.trim().is_empty() {
                    return Err(ProtocolError::invalid("command", "empty command"));
                }
                if s.command.len() > MAX_COMMAND_BYTES {
                    return Err(ProtocolError::invalid(
                        "command",
                        format!("longer than {MAX_COMMAND_BYTES} bytes"),
                    ));
                }
                no_nul("command", &s.command)?;
                if let Some(w) = &s.workdir {
                    validate_path("workdir", w)?;
                }
                validate_env("env", &s.env)?;
                if s.timeout_ms.is_some_and(|t| t > MAX_TIMEOUT_MS) {
                    return Err(ProtocolError::invalid(
                        "timeout_ms",
                        format!("longer than {MAX_TIMEOUT_MS} ms"),
                    ));
                }
                if s.output_limit_bytes
                    .is_some_and(|l| l > MAX_OUTPUT_LIMIT_BYTES)
                {
                    return Err(ProtocolError::invalid(
                        "output_limit_bytes",
                        format!("above {MAX_OUTPUT_LIMIT_BYTES}"),
                    ));
                }
                if let Some(t) = s.terminal
                    && (t.rows == 0 || t.cols == 0)
                {
                    return Err(ProtocolError::invalid(
                        "terminal",
                        "rows and cols must be above 0",
                    ));
                }
                Ok(())
            }
            Self::ReadFile(r) => {
                validate_path("path", &r.path)?;
                if !r.stream && r.limit > MAX_FILE_BYTES {
                    return Err(ProtocolError::invalid(
                        "limit",
                        format!("above {MAX_FILE_BYTES} bytes"),
                    ));
                }
                Ok(())
            }
            Self::WriteFile(w) => {
                validate_path("path", &w.path)?;
                if w.data.len() as u64 > MAX_FILE_BYTES {
                    return Err(ProtocolError::invalid(
                        "data",
                        format!("above {MAX_FILE_BYTES} bytes"),
                    ));
                }
                if w.mode > 0o7777 {
                    return Err(ProtocolError::invalid("mode", "not a permission mode"));
                }
                Ok(())
            }
            Self::PutArchive(a) | Self::GetArchive(a) | Self::ListDir(a) => {
                validate_path("path", &a.path)
            }
        }
    }
}

fn nonzero<T: Default + PartialEq>(v: T) -> Option<T> {
    if v == T::default() { None } else { Some(v) }
}

fn nonempty(s: String) -> Option<String> {
    if s.is_empty() { None } else { Some(s) }
}

impl TryFrom<pb::SandboxSpec> for SandboxSpec {
    type Error = ProtocolError;
    fn try_from(p: pb::SandboxSpec) -> Result<Self, ProtocolError> {
        let network = match pb::NetworkMode::try_from(p.network) {
            Ok(pb::NetworkMode::Unspecified | pb::NetworkMode::None) => NetworkMode::None,
            Ok(pb::NetworkMode::Bridge) => NetworkMode::Bridge,
            Err(_) => {
                return Err(ProtocolError::invalid(
                    "network",
                    format!("unknown mode {}", p.network),
                ));
            }
        };
        let spec = Self {
            image: nonempty(p.image),
            network,
            memory_bytes: nonzero(p.memory_bytes),
            cpu_millis: nonzero(p.cpu_millis),
            pids_limit: nonzero(p.pids_limit),
            workspace_bytes: nonzero(p.workspace_bytes),
            tmp_bytes: nonzero(p.tmp_bytes),
            run_as_root: p.run_as_root,
            writable_rootfs: p.writable_rootfs,
            add_capabilities: p.add_capabilities,
            env: p.env.into_iter().collect(),
            runtime: nonempty(p.runtime),
            idle_timeout_ms: nonzero(p.idle_timeout_ms),
            ttl_ms: nonzero(p.ttl_ms),
            memory_includes_files: p.memory_includes_files,
            labels: p.labels.into_iter().collect(),
            egress: crate::egress::parse_rules(&p.egress, false)?,
            egress_proxy: p.egress_proxy,
            template: nonempty(p.template),
            volumes: p.volumes.into_iter().map(Into::into).collect(),
        };
        spec.validate()?;
        Ok(spec)
    }
}

impl From<SandboxSpec> for pb::SandboxSpec {
    fn from(s: SandboxSpec) -> Self {
        Self {
            image: s.image.unwrap_or_default(),
            network: match s.network {
                NetworkMode::None => pb::NetworkMode::None,
                NetworkMode::Bridge => pb::NetworkMode::Bridge,
            } as i32,
            memory_bytes: s.memory_bytes.unwrap_or_default(),
            cpu_millis: s.cpu_millis.unwrap_or_default(),
            pids_limit: s.pids_limit.unwrap_or_default(),
            workspace_bytes: s.workspace_bytes.unwrap_or_default(),
            tmp_bytes: s.tmp_bytes.unwrap_or_default(),
            run_as_root: s.run_as_root,
            writable_rootfs: s.writable_rootfs,
            add_capabilities: s.add_capabilities,
            env: s.env.into_iter().collect(),
            runtime: s.runtime.unwrap_or_default(),
            idle_timeout_ms: s.idle_timeout_ms.unwrap_or_default(),
            ttl_ms: s.ttl_ms.unwrap_or_default(),
            memory_includes_files: s.memory_includes_files,
            labels: s.labels.into_iter().collect(),
            egress: s.egress.iter().map(ToString::to_string).collect(),
            egress_proxy: s.egress_proxy,
            template: s.template.unwrap_or_default(),
            volumes: s.volumes.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::OperationSpec> for OperationSpec {
    type Error = ProtocolError;
    fn try_from(p: pb::OperationSpec) -> Result<Self, ProtocolError> {
        use pb::operation_spec::Kind;
        let spec = match p.kind.ok_or(ProtocolError::Missing("spec.kind"))? {
            Kind::Shell(s) => Self::Shell(ShellSpec {
                command: s.command,
                workdir: nonempty(s.workdir),
                env: s.env.into_iter().collect(),
                timeout_ms: nonzero(s.timeout_ms),
                output_limit_bytes: nonzero(s.output_limit_bytes),
                use_bash: s.use_bash,
                keep_background: s.keep_background,
                stdin: s.stdin,
                terminal: s.terminal.map(TerminalSize::try_from).transpose()?,
            }),
            Kind::ReadFile(r) => Self::ReadFile(ReadFileSpec {
                path: r.path,
                offset: r.offset,
                limit: if r.limit == 0 && !r.stream {
                    MAX_FILE_BYTES
                } else {
                    r.limit
                },
                stream: r.stream,
            }),
            Kind::WriteFile(w) => Self::WriteFile(WriteFileSpec {
                path: w.path,
                data: w.data,
                mode: if w.mode == 0 { 0o644 } else { w.mode },
                append: w.append,
                stream: w.stream,
            }),
            Kind::PutArchive(a) => Self::PutArchive(ArchiveSpec {
                path: a.path,
                contents: a.contents,
            }),
            Kind::GetArchive(a) => Self::GetArchive(ArchiveSpec {
                path: a.path,
                contents: a.contents,
            }),
            Kind::ListDir(a) => Self::ListDir(ArchiveSpec {
                path: a.path,
                contents: false,
            }),
        };
        spec.validate()?;
        Ok(spec)
    }
}

impl TryFrom<pb::TerminalSize> for TerminalSize {
    type Error = ProtocolError;
    fn try_from(p: pb::TerminalSize) -> Result<Self, ProtocolError> {
        let dim = |v: u32| {
            u16::try_from(v)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| ProtocolError::invalid("terminal", "rows and cols must be 1-65535"))
        };
        Ok(Self {
            rows: dim(p.rows)?,
            cols: dim(p.cols)?,
        })
    }
}

impl From<TerminalSize> for pb::TerminalSize {
    fn from(t: TerminalSize) -> Self {
        Self {
            rows: t.rows.into(),
            cols: t.cols.into(),
        }
    }
}

impl From<OperationSpec> for pb::OperationSpec {
    fn from(s: OperationSpec) -> Self {
        use pb::operation_spec::Kind;
        let kind = match s {
            OperationSpec::Shell(s) => Kind::Shell(pb::ShellSpec {
                command: s.command,
                workdir: s.workdir.unwrap_or_default(),
                env: s.env.into_iter().collect(),
                timeout_ms: s.timeout_ms.unwrap_or_default(),
                output_limit_bytes: s.output_limit_bytes.unwrap_or_default(),
                use_bash: s.use_bash,
                keep_background: s.keep_background,
                stdin: s.stdin,
                terminal: s.terminal.map(Into::into),
            }),
            OperationSpec::ReadFile(r) => Kind::ReadFile(pb::ReadFileSpec {
                path: r.path,
                offset: r.offset,
                limit: r.limit,
                stream: r.stream,
            }),
            OperationSpec::WriteFile(w) => Kind::WriteFile(pb::WriteFileSpec {
                path: w.path,
                data: w.data,
                mode: w.mode,
                append: w.append,
                stream: w.stream,
            }),
            OperationSpec::PutArchive(a) => Kind::PutArchive(pb::ArchiveSpec {
                path: a.path,
                contents: a.contents,
            }),
            OperationSpec::GetArchive(a) => Kind::GetArchive(pb::ArchiveSpec {
                path: a.path,
                contents: a.contents,
            }),
            OperationSpec::ListDir(a) => Kind::ListDir(pb::ArchiveSpec {
                path: a.path,
                contents: false,
            }),
        };
        Self { kind: Some(kind) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(cmd: &str) -> pb::OperationSpec {
        OperationSpec::Shell(ShellSpec::new(cmd)).into()
    }

    #[test]
    fn shell_round_trips_through_the_wire_type() {
        let mut s = ShellSpec::new("echo hi");
        s.env.insert("A".into(), "1".into());
        s.timeout_ms = Some(5000);
        let spec = OperationSpec::Shell(s);
        let back = OperationSpec::try_from(pb::OperationSpec::from(spec.clone())).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn rejects_nul_and_empty_commands() {
        let e = OperationSpec::try_from(shell("echo a\0b")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid `command`: contains a NUL byte at offset 6"
        );
        let e = OperationSpec::try_from(shell("  ")).unwrap_err();
        assert_eq!(e.to_string(), "invalid `command`: empty command");
        let e = OperationSpec::try_from(pb::OperationSpec { kind: None }).unwrap_err();
        assert_eq!(e, ProtocolError::Missing("spec.kind"));
    }

    #[test]
    fn rejects_bad_env_and_capabilities() {
        let mut s = ShellSpec::new("true");
        s.env.insert("A=B".into(), "1".into());
        assert!(OperationSpec::Shell(s).validate().is_err());
        let spec = SandboxSpec {
            add_capabilities: vec!["chown".into()],
            ..Default::default()
        };
        assert!(spec.validate().is_err());
    }
}

#[cfg(all(test, feature = "serde"))]
mod serde_tests {
    use super::*;
    use crate::{Captured, FileErrorKind, OperationResult, Outcome};

    #[test]
    fn specs_and_results_round_trip_through_json() {
        let spec = OperationSpec::WriteFile(WriteFileSpec {
            mode: 0o600,
            ..WriteFileSpec::new("a", Bytes::from_static(b"\x00\xffhi"))
        });
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(
            json,
            r#"{"kind":"write_file","path":"a","data":"AP9oaQ==","mode":384}"#
        );
        assert_eq!(serde_json::from_str::<OperationSpec>(&json).unwrap(), spec);
        let result = OperationResult {
            stdout: Captured {
                head: Bytes::from_static(b"out"),
                tail: Bytes::new(),
                total_bytes: 3,
                truncated: false,
            },
            ..OperationResult::with_outcome(Outcome::FileError {
                kind: FileErrorKind::NotFound,
                message: "x".into(),
            })
        };
        let json = serde_json::to_string(&result).unwrap();
        assert_eq!(
            serde_json::from_str::<OperationResult>(&json).unwrap(),
            result
        );
        assert!(serde_json::from_str::<crate::OperationId>("\"a/b\"").is_err());
    }
}
