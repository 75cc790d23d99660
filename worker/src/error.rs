//! The worker's typed errors and their one mapping to gRPC status codes.

use corral_proto::{ProtocolError, Reason, reason};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Invalid(#[from] ProtocolError),
    #[error("unknown sandbox {0}")]
    UnknownSandbox(String),
    /// Removed by this worker lately, for this reason.
    #[error("sandbox {id} was removed: {reason}")]
    Removed { id: String, reason: &'static str },
    #[error("unknown operation {0}")]
    UnknownOperation(String),
    #[error("{what} {id} already exists with a different spec")]
    Conflict { what: &'static str, id: String },
    #[error("this worker is at its capacity of {0} sandboxes")]
    AtCapacity(u32),
    /// Every uid tried was another container's (a range too small for the
    /// engine's sandboxes).
    #[error("no free uid in --sandbox-uids {range} after {tries} tries")]
    NoFreeUid { range: String, tries: u32 },
    #[error("sandbox {id} is lost: {reason}")]
    SandboxLost { id: String, reason: String },
    #[error(
        "sandbox {0} is checkpointed (its processes and memory are saved; nothing runs): restore it first"
    )]
    Checkpointed(String),
    #[error(
        "image {0:?} is not present on the Docker engine (build it with deploy/images/build.sh, or build-debian.sh for corral-debian, or pull it)"
    )]
    NoSuchImage(String),
    #[error("no template {0:?} on this worker (build one with `corral template build`)")]
    NoSuchTemplate(String),
    #[error(transparent)]
    Volume(#[from] crate::volumes::VolumeError),
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    #[error(
        "template {template:?} is in use: {why} (corral template rm --force forgets it anyway; they go on)"
    )]
    TemplateInUse { template: String, why: String },
    #[error("the sandbox of template {template:?} was not ready: {why}; it was removed")]
    TemplateNotReady { template: String, why: String },
    #[error(
        "runtime {runtime:?} is not registered with the Docker engine ({message}); its operator registers it in the engine's daemon.json (runsc: see docs/security.md#gvisor)"
    )]
    NoSuchRuntime { runtime: String, message: String },
    #[error("Docker engine: {0}")]
    Docker(#[from] bollard::errors::Error),
    #[error("the supervisor of sandbox {id} did not answer: {reason}")]
    InitUnresponsive { id: String, reason: String },
    #[error("configuration: {0}")]
    Config(String),
    #[error("corral-init binary: {0}")]
    InitBinary(String),
    #[error("state directory {path}: {source}")]
    State {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    StateLocked(String),
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// Draining: no new sandboxes here (ask another worker).
    #[error(
        "this worker is draining: it takes no new sandboxes (ask another worker; its operator ends the drain with `corral worker undrain`)"
    )]
    Draining,
    /// A limit on watchers was reached.
    #[error("too many watchers: {0}")]
    TooManyWatchers(String),
    /// The worker's policy refuses what was asked; `flag` is the worker
    /// flag that would allow it (none for what is never granted).
    #[error("refused: {what}")]
    Denied {
        flag: Option<&'static str>,
        what: String,
    },
    /// What was asked does not fit the operation (input to one that takes
    /// none, a resize of one without a terminal).
    #[error("{0}")]
    NotApplicable(String),
    /// Input past the end of what the operation has taken.
    #[error("{0}")]
    InputGap(String),
    /// A fork's copy failed (the children it made are removed).
    #[error("fork: {0}")]
    Fork(String),
    /// The link to the sandbox's supervisor is down for now: ask again.
    #[error("sandbox {0}: its supervisor is not reachable right now; try again")]
    Detached(String),
    /// A change of the sandbox (being made, restored, removed) did not end
    /// within the time a call waits for it.
    #[error("sandbox {id} is {change}, which did not end in time: try again")]
    Busy { id: String, change: &'static str },
}

pub type Result<T, E = WorkerError> = std::result::Result<T, E>;

impl WorkerError {
    pub fn state(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::State {
            path: path.display().to_string(),
            source,
        }
    }
}

impl WorkerError {
    /// The status code and machine-readable reason this error is sent with.
    pub fn code_and_reason(&self) -> (tonic::Code, Reason) {
        use tonic::Code;
        match self {
            WorkerError::Invalid(_) => (Code::InvalidArgument, Reason::InvalidArgument),
            WorkerError::UnknownSandbox(_) => (Code::NotFound, Reason::SandboxNotFound),
            WorkerError::Removed { .. } => (Code::NotFound, Reason::SandboxRemoved),
            WorkerError::UnknownOperation(_) => (Code::NotFound, Reason::OperationNotFound),
            WorkerError::Conflict { .. } => (Code::AlreadyExists, Reason::Conflict),
            WorkerError::Denied { .. } => (Code::PermissionDenied, Reason::PolicyDenied),
            WorkerError::AtCapacity(_) => (Code::ResourceExhausted, Reason::AtCapacity),
            WorkerError::TooManyWatchers(_) => (Code::ResourceExhausted, Reason::TooManyWatchers),
            WorkerError::NoFreeUid { .. } => (Code::ResourceExhausted, Reason::NoFreeUid),
            WorkerError::SandboxLost { .. } => (Code::FailedPrecondition, Reason::SandboxLost),
            WorkerError::Checkpointed(_) => (Code::FailedPrecondition, Reason::SandboxCheckpointed),
            WorkerError::NoSuchImage(_) => (Code::FailedPrecondition, Reason::NoSuchImage),
            WorkerError::NoSuchTemplate(_) => (Code::FailedPrecondition, Reason::NoSuchTemplate),
            WorkerError::TemplateInUse { .. } => (Code::FailedPrecondition, Reason::TemplateInUse),
            WorkerError::TemplateNotReady { .. } => {
                (Code::FailedPrecondition, Reason::TemplateNotReady)
            }
            WorkerError::NoSuchRuntime { .. } => (Code::FailedPrecondition, Reason::NoSuchRuntime),
            // The engine could not reach the registry, or it failed.
            WorkerError::Registry(_) => (Code::Unavailable, Reason::DockerUnavailable),
            WorkerError::Volume(e) => {
                use crate::volumes::VolumeError as V;
                match e {
                    V::NoSuchVolume(_) => (Code::FailedPrecondition, Reason::NoSuchVolume),
                    V::InUse { .. } => (Code::FailedPrecondition, Reason::VolumeInUse),
                    V::OtherSize { .. } => (Code::AlreadyExists, Reason::Conflict),
                    V::Refused(_) => (Code::InvalidArgument, Reason::InvalidArgument),
                    V::Unavailable(_) => (Code::FailedPrecondition, Reason::NotApplicable),
                    V::Io { .. } => (Code::Internal, Reason::Internal),
                }
            }
            WorkerError::NotApplicable(_) => (Code::FailedPrecondition, Reason::NotApplicable),
            WorkerError::InputGap(_) => (Code::OutOfRange, Reason::InputGap),
            WorkerError::Fork(_) => (Code::FailedPrecondition, Reason::ForkFailed),
            // The engine refused what was asked: asking again cannot help.
            WorkerError::Docker(bollard::errors::Error::DockerResponseServerError {
                status_code,
                ..
            }) if (400..500).contains(status_code) => match status_code {
                400 => (Code::InvalidArgument, Reason::DockerRefused),
                _ => (Code::FailedPrecondition, Reason::DockerRefused),
            },
            WorkerError::Docker(_) => (Code::Unavailable, Reason::DockerUnavailable),
            WorkerError::InitUnresponsive { .. } => {
                (Code::Unavailable, Reason::SupervisorUnresponsive)
            }
            WorkerError::Detached(_) => (Code::Unavailable, Reason::SupervisorDetached),
            WorkerError::Busy { .. } => (Code::Unavailable, Reason::SandboxBusy),
            WorkerError::Draining => (Code::Unavailable, Reason::Draining),
            WorkerError::ShuttingDown => (Code::Unavailable, Reason::ShuttingDown),
            WorkerError::InitBinary(_)
            | WorkerError::Config(_)
            | WorkerError::State { .. }
            | WorkerError::StateLocked(_) => (Code::Internal, Reason::Internal),
        }
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        let (code, reason) = e.code_and_reason();
        let flag = match &e {
            WorkerError::Denied { flag, .. } => *flag,
            _ => None,
        };
        reason::status(code, reason, flag, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docker(status_code: u16) -> tonic::Code {
        tonic::Status::from(WorkerError::Docker(
            bollard::errors::Error::DockerResponseServerError {
                status_code,
                message: "m".into(),
            },
        ))
        .code()
    }

    #[test]
    fn the_engines_refusals_are_not_retryable_and_its_outages_are() {
        assert_eq!(docker(400), tonic::Code::InvalidArgument);
        assert_eq!(docker(409), tonic::Code::FailedPrecondition);
        assert_eq!(docker(404), tonic::Code::FailedPrecondition);
        assert_eq!(docker(500), tonic::Code::Unavailable);
        assert_eq!(docker(503), tonic::Code::Unavailable);
    }

    #[test]
    fn a_refusal_by_policy_names_its_flag_in_metadata() {
        let s = tonic::Status::from(WorkerError::Denied {
            flag: Some("--allow-root"),
            what: "no root".into(),
        });
        assert_eq!(s.code(), tonic::Code::PermissionDenied);
        assert_eq!(reason::of(&s), Some(Reason::PolicyDenied));
        assert_eq!(reason::flag_of(&s).as_deref(), Some("--allow-root"));
        let s = tonic::Status::from(WorkerError::AtCapacity(3));
        assert_eq!(reason::of(&s), Some(Reason::AtCapacity));
        assert_eq!(reason::flag_of(&s), None);
    }
}
