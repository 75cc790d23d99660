//! What a host's errors are on the wire: a status whose code and
//! machine-readable reason (and, for a limit, the flag that sets it) a
//! client decides on, and whose text is bounded.

use corral_proto::Reason;
use tonic::{Code, Status};

use super::HostError;
use crate::session::LogError;
use crate::sessions::SessionError;

/// The status code a worker's reason is passed on with.
fn code_of(reason: Reason) -> Code {
    use Reason as R;
    match reason {
        R::InvalidArgument | R::TooLarge => Code::InvalidArgument,
        R::Unauthenticated => Code::Unauthenticated,
        R::PolicyDenied | R::PermissionDenied => Code::PermissionDenied,
        R::SandboxNotFound | R::SandboxRemoved | R::OperationNotFound => Code::NotFound,
        R::Conflict => Code::AlreadyExists,
        R::AtCapacity | R::TooManyWatchers | R::NoFreeUid | R::QuotaExceeded => {
            Code::ResourceExhausted
        }
        R::Draining
        | R::ShuttingDown
        | R::DockerUnavailable
        | R::SupervisorDetached
        | R::SandboxBusy
        | R::SupervisorUnresponsive
        | R::NoWorker => Code::Unavailable,
        R::Internal => Code::Internal,
        _ => Code::FailedPrecondition,
    }
}

/// A status with `reason`, its text bounded.
pub fn status(code: Code, reason: Reason, message: String) -> Status {
    corral_proto::reason::status(code, reason, None, bounded(message))
}

/// A status's text as sent: at most 512 characters (an id of a megabyte
/// echoed whole would not fit in the response's headers).
pub fn bounded(text: String) -> String {
    match text.char_indices().nth(512) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

impl From<HostError> for Status {
    fn from(e: HostError) -> Self {
        let text = bounded(crate::client::source_chain(&e));
        match &e {
            HostError::Invalid(_) => status(Code::InvalidArgument, Reason::InvalidArgument, text),
            HostError::NotFound(_) => status(Code::NotFound, Reason::SessionNotFound, text),
            HostError::Running(_) => status(Code::FailedPrecondition, Reason::SessionRunning, text),
            HostError::NotRunning(_) => {
                status(Code::FailedPrecondition, Reason::SessionNotRunning, text)
            }
            HostError::Full { .. } => corral_proto::reason::status(
                Code::ResourceExhausted,
                Reason::AtCapacity,
                Some("--max-sessions"),
                text,
            ),
            HostError::ShuttingDown => status(Code::Unavailable, Reason::ShuttingDown, text),
            HostError::EndpointDenied(_) => corral_proto::reason::status(
                Code::PermissionDenied,
                Reason::PolicyDenied,
                Some("--allow-base-url"),
                text,
            ),
            HostError::Io { .. } => status(Code::Internal, Reason::Internal, text),
            HostError::Session(s) => session_status(s, text),
        }
    }
}

fn session_status(e: &SessionError, text: String) -> Status {
    use SessionError as S;
    match e {
        S::Invalid(_) | S::NoSuchTurn { .. } | S::Model(_) | S::Upload { .. } => {
            status(Code::InvalidArgument, Reason::InvalidArgument, text)
        }
        S::Log(log) => match log {
            LogError::BadId(_) | LogError::BadForkPoint { .. } => {
                status(Code::InvalidArgument, Reason::InvalidArgument, text)
            }
            LogError::NotFound(_) => status(Code::NotFound, Reason::SessionNotFound, text),
            LogError::AlreadyExists(_) => status(Code::AlreadyExists, Reason::Conflict, text),
            // Another process holds its log (a `corral run` of its own).
            LogError::Locked(_) => status(Code::FailedPrecondition, Reason::SessionRunning, text),
            _ => status(Code::Internal, Reason::Internal, text),
        },
        S::Gone(_) => status(Code::FailedPrecondition, Reason::SessionNotRunning, text),
        // The key is the service's, never a client's.
        S::NoApiKey { base_url } => status(
            Code::FailedPrecondition,
            Reason::InvalidArgument,
            format!(
                "this service has no API key for {base_url}: its operator starts `corral serve` with OPENAI_API_KEY or --api-key-file (a client sends none), or the session names another --base-url the service allows"
            ),
        ),
        // The workers' own refusal, passed on with its reason.
        S::Fleet(f) => match f {
            crate::fleet::FleetError::Client(c) => {
                let reason = c.reason().unwrap_or(Reason::Internal);
                let code = match c {
                    crate::client::ClientError::Status(s) => s.code(),
                    _ => Code::Unavailable,
                };
                corral_proto::reason::status(code, reason, c.flag().as_deref(), text)
            }
            crate::fleet::FleetError::Usage(_) | crate::fleet::FleetError::Invalid(_) => {
                status(Code::InvalidArgument, Reason::InvalidArgument, text)
            }
            crate::fleet::FleetError::NoWorker(_) | crate::fleet::FleetError::Discovery(_) => {
                status(Code::Unavailable, Reason::NoWorker, text)
            }
            crate::fleet::FleetError::NoLocal | crate::fleet::FleetError::Setup(_) => {
                status(Code::Internal, Reason::Internal, text)
            }
        },
        // The worker's own reason, as it gave it (never read off its text).
        S::Refused { why, .. } => {
            corral_proto::reason::status(Code::Unavailable, why.reason, why.flag.as_deref(), text)
        }
        S::Sandbox { why: Some(why), .. } => {
            corral_proto::reason::status(code_of(why.reason), why.reason, why.flag.as_deref(), text)
        }
        S::Sandbox { why: None, .. } | S::Core(_) | S::Task(_) => {
            status(Code::Internal, Reason::Internal, text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_key_is_the_services_to_give_not_a_clients() {
        let e = SessionError::NoApiKey {
            base_url: "https://api.openai.com/v1".into(),
        };
        let s = Status::from(HostError::Session(e));
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("this service has no API key"), "{s:?}");
        assert!(s.message().contains("corral serve"), "{s:?}");
        assert!(!s.message().starts_with("no API key"), "{s:?}");
    }
}
