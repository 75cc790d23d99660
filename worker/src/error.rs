//! The worker's typed errors and their one mapping to gRPC status codes.

use corral_proto::ProtocolError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Invalid(#[from] ProtocolError),
    #[error("unknown sandbox {0}")]
    UnknownSandbox(String),
    #[error("unknown operation {0}")]
    UnknownOperation(String),
    #[error("{what} {id} already exists with a different spec")]
    Conflict { what: &'static str, id: String },
    #[error("this worker is at its capacity of {0} sandboxes")]
    AtCapacity(u32),
    #[error("sandbox {id} is lost: {reason}")]
    SandboxLost { id: String, reason: String },
    #[error(
        "image {0:?} is not present on the Docker engine (build it with deploy/images/build.sh, or pull it)"
    )]
    NoSuchImage(String),
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
    /// The worker's policy refuses what was asked.
    #[error("refused: {0}")]
    Denied(String),
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

impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        use tonic::Code;
        let code = match &e {
            WorkerError::Invalid(_) => Code::InvalidArgument,
            WorkerError::UnknownSandbox(_) | WorkerError::UnknownOperation(_) => Code::NotFound,
            WorkerError::Conflict { .. } => Code::AlreadyExists,
            WorkerError::Denied(_) => Code::PermissionDenied,
            WorkerError::AtCapacity(_) => Code::ResourceExhausted,
            WorkerError::SandboxLost { .. } | WorkerError::NoSuchImage(_) => {
                Code::FailedPrecondition
            }
            WorkerError::Docker(_)
            | WorkerError::InitUnresponsive { .. }
            | WorkerError::ShuttingDown => Code::Unavailable,
            WorkerError::InitBinary(_)
            | WorkerError::Config(_)
            | WorkerError::State { .. }
            | WorkerError::StateLocked(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
