//! How operations end.

use bytes::Bytes;

use crate::{ProtocolError, pb};

/// Exactly how an operation ended: never a bare "failed".
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "outcome", rename_all = "snake_case"))]
pub enum Outcome {
    Exited {
        code: i32,
    },
    Signaled {
        signal: i32,
    },
    TimedOut,
    OutOfMemory,
    Canceled,
    SandboxLost {
        reason: String,
    },
    SpawnFailed {
        reason: String,
    },
    FileError {
        kind: FileErrorKind,
        message: String,
    },
}

impl Outcome {
    /// The exit status a shell would report: the code, 128+N for signal N,
    /// 124 for a timeout (as `timeout(1)` does), 137 for OOM, 130 for a
    /// cancel, 125 when the command never ran or its sandbox vanished.
    pub fn exit_status(&self) -> i32 {
        match self {
            Self::Exited { code } => *code,
            Self::Signaled { signal } => 128 + signal,
            Self::TimedOut => 124,
            Self::OutOfMemory => 137,
            Self::Canceled => 130,
            Self::SandboxLost { .. } | Self::SpawnFailed { .. } => 125,
            Self::FileError { .. } => 1,
        }
    }

    pub fn is_success(&self) -> bool {
        matches!(self, Self::Exited { code: 0 })
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited { code } => write!(f, "exited with code {code}"),
            Self::Signaled { signal } => write!(f, "killed by signal {signal}"),
            Self::TimedOut => f.write_str("timed out"),
            Self::OutOfMemory => f.write_str("killed: out of memory"),
            Self::Canceled => f.write_str("canceled"),
            Self::SandboxLost { reason } => write!(f, "sandbox lost: {reason}"),
            Self::SpawnFailed { reason } => write!(f, "could not start: {reason}"),
            Self::FileError { kind, message } => write!(f, "{kind:?}: {message}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum FileErrorKind {
    NotFound,
    PermissionDenied,
    IsDirectory,
    OutsideSandboxRoots,
    TooLarge,
    Other,
    /// A FIFO, device or socket: refused without being opened for I/O.
    NotRegular,
}

/// The kept part of one output stream: its head and tail up to the
/// operation's limit, and the size of the whole stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Captured {
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_bytes_b64"))]
    pub head: Bytes,
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_bytes_b64"))]
    pub tail: Bytes,
    pub total_bytes: u64,
    pub truncated: bool,
}

impl Captured {
    /// Head and tail joined, with a marker where bytes were left out.
    pub fn to_lossy_string(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        if self.truncated {
            let omitted = self.total_bytes - (self.head.len() + self.tail.len()) as u64;
            s.push_str(&format!("\n[... {omitted} bytes omitted ...]\n"));
        }
        s.push_str(&String::from_utf8_lossy(&self.tail));
        s
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct OperationResult {
    pub outcome: Outcome,
    pub stdout: Captured,
    pub stderr: Captured,
    pub duration_ms: u64,
    #[cfg_attr(feature = "serde", serde(with = "crate::serde_bytes_b64"))]
    pub file_data: Bytes,
    pub file_size: u64,
    pub bytes_written: u64,
}

impl OperationResult {
    pub fn with_outcome(outcome: Outcome) -> Self {
        Self {
            outcome,
            stdout: Captured::default(),
            stderr: Captured::default(),
            duration_ms: 0,
            file_data: Bytes::new(),
            file_size: 0,
            bytes_written: 0,
        }
    }
}

impl From<Captured> for pb::CapturedOutput {
    fn from(c: Captured) -> Self {
        Self {
            head: c.head,
            tail: c.tail,
            total_bytes: c.total_bytes,
            truncated: c.truncated,
        }
    }
}

impl From<pb::CapturedOutput> for Captured {
    fn from(c: pb::CapturedOutput) -> Self {
        Self {
            head: c.head,
            tail: c.tail,
            total_bytes: c.total_bytes,
            truncated: c.truncated,
        }
    }
}

impl From<FileErrorKind> for pb::FileErrorKind {
    fn from(k: FileErrorKind) -> Self {
        match k {
            FileErrorKind::NotFound => Self::NotFound,
            FileErrorKind::PermissionDenied => Self::PermissionDenied,
            FileErrorKind::IsDirectory => Self::IsDirectory,
            FileErrorKind::OutsideSandboxRoots => Self::OutsideSandboxRoots,
            FileErrorKind::TooLarge => Self::TooLarge,
            FileErrorKind::Other => Self::Other,
            FileErrorKind::NotRegular => Self::NotRegular,
        }
    }
}

impl From<pb::FileErrorKind> for FileErrorKind {
    fn from(k: pb::FileErrorKind) -> Self {
        match k {
            pb::FileErrorKind::NotFound => Self::NotFound,
            pb::FileErrorKind::PermissionDenied => Self::PermissionDenied,
            pb::FileErrorKind::IsDirectory => Self::IsDirectory,
            pb::FileErrorKind::OutsideSandboxRoots => Self::OutsideSandboxRoots,
            pb::FileErrorKind::TooLarge => Self::TooLarge,
            pb::FileErrorKind::NotRegular => Self::NotRegular,
            pb::FileErrorKind::Other | pb::FileErrorKind::Unspecified => Self::Other,
        }
    }
}

impl From<Outcome> for pb::Outcome {
    fn from(o: Outcome) -> Self {
        use pb::outcome::{self as po, Kind};
        let kind = match o {
            Outcome::Exited { code } => Kind::Exited(po::Exited { code }),
            Outcome::Signaled { signal } => Kind::Signaled(po::Signaled { signal }),
            Outcome::TimedOut => Kind::TimedOut(po::TimedOut {}),
            Outcome::OutOfMemory => Kind::OutOfMemory(po::OutOfMemory {}),
            Outcome::Canceled => Kind::Canceled(po::Canceled {}),
            Outcome::SandboxLost { reason } => Kind::SandboxLost(po::SandboxLost { reason }),
            Outcome::SpawnFailed { reason } => Kind::SpawnFailed(po::SpawnFailed { reason }),
            Outcome::FileError { kind, message } => Kind::FileError(po::FileError {
                kind: pb::FileErrorKind::from(kind) as i32,
                message,
            }),
        };
        Self { kind: Some(kind) }
    }
}

impl TryFrom<pb::Outcome> for Outcome {
    type Error = ProtocolError;
    fn try_from(o: pb::Outcome) -> Result<Self, ProtocolError> {
        use pb::outcome::Kind;
        Ok(
            match o.kind.ok_or(ProtocolError::Missing("outcome.kind"))? {
                Kind::Exited(e) => Self::Exited { code: e.code },
                Kind::Signaled(s) => Self::Signaled { signal: s.signal },
                Kind::TimedOut(_) => Self::TimedOut,
                Kind::OutOfMemory(_) => Self::OutOfMemory,
                Kind::Canceled(_) => Self::Canceled,
                Kind::SandboxLost(l) => Self::SandboxLost { reason: l.reason },
                Kind::SpawnFailed(s) => Self::SpawnFailed { reason: s.reason },
                Kind::FileError(f) => Self::FileError {
                    kind: pb::FileErrorKind::try_from(f.kind)
                        .unwrap_or(pb::FileErrorKind::Other)
                        .into(),
                    message: f.message,
                },
            },
        )
    }
}

impl From<OperationResult> for pb::OperationResult {
    fn from(r: OperationResult) -> Self {
        Self {
            outcome: Some(r.outcome.into()),
            stdout: Some(r.stdout.into()),
            stderr: Some(r.stderr.into()),
            duration_ms: r.duration_ms,
            file_data: r.file_data,
            file_size: r.file_size,
            bytes_written: r.bytes_written,
        }
    }
}

impl TryFrom<pb::OperationResult> for OperationResult {
    type Error = ProtocolError;
    fn try_from(r: pb::OperationResult) -> Result<Self, ProtocolError> {
        Ok(Self {
            outcome: r
                .outcome
                .ok_or(ProtocolError::Missing("result.outcome"))?
                .try_into()?,
            stdout: r.stdout.map(Into::into).unwrap_or_default(),
            stderr: r.stderr.map(Into::into).unwrap_or_default(),
            duration_ms: r.duration_ms,
            file_data: r.file_data,
            file_size: r.file_size,
            bytes_written: r.bytes_written,
        })
    }
}
