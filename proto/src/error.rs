//! Validation errors for everything that crosses a process boundary.

/// A message that is malformed or breaks a limit. The text names the field
/// and says what is wrong, so it can go back to the caller as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("missing field `{0}`")]
    Missing(&'static str),
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("undecodable message: {0}")]
    Decode(String),
}

impl ProtocolError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl From<prost::DecodeError> for ProtocolError {
    fn from(e: prost::DecodeError) -> Self {
        Self::Decode(e.to_string())
    }
}

#[cfg(feature = "grpc")]
impl From<ProtocolError> for tonic::Status {
    fn from(e: ProtocolError) -> Self {
        crate::reason::status(
            tonic::Code::InvalidArgument,
            crate::Reason::InvalidArgument,
            None,
            e.to_string(),
        )
    }
}
