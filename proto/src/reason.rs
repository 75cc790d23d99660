//! Why a call failed, in words a program can match on.
//!
//! A worker sends every error status with a `corral-reason` entry in its
//! metadata (one of [`Reason`]'s names), and a refusal by its policy with a
//! `corral-flag` entry too: the worker flag that would allow what was asked.
//! Clients (the harness, the CLI, the Python SDK) decide on these, never on
//! a status's message, which is for people and may change.

/// The metadata key of a status's reason.
pub const REASON_KEY: &str = "corral-reason";
/// The metadata key of the flag a policy refusal names.
pub const FLAG_KEY: &str = "corral-flag";
/// The metadata keys of a quota refusal: the quota's name (`sandboxes`,
/// `creates_per_minute`), its limit and the tenant's use when refused.
pub const QUOTA_KEY: &str = "corral-quota";
pub const QUOTA_LIMIT_KEY: &str = "corral-quota-limit";
pub const QUOTA_USED_KEY: &str = "corral-quota-used";

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// A machine-readable reason for an error status.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
        }

        impl Reason {
            /// Every reason, in the order they are declared.
            pub const ALL: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The name sent on the wire.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $name,)*
                }
            }

            /// The reason of a name sent on the wire; `None` for a name
            /// this build does not know (a newer peer's).
            pub fn parse(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(Reason::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

reasons! {
    /// The request is malformed or out of bounds.
    InvalidArgument = "invalid_argument",
    /// No credentials, or the wrong ones.
    Unauthenticated = "unauthenticated",
    /// The worker's policy refuses what was asked (see [`FLAG_KEY`]).
    PolicyDenied = "policy_denied",
    /// The caller's key does not allow what was asked (its scopes: `read`,
    /// `run`, `admin`).
    PermissionDenied = "permission_denied",
    /// The caller's tenant is at a quota (see [`QUOTA_KEY`]).
    QuotaExceeded = "quota_exceeded",
    /// No sandbox of that id on this worker.
    SandboxNotFound = "sandbox_not_found",
    /// The sandbox was removed by this worker lately (TTL, idle, a client).
    SandboxRemoved = "sandbox_removed",
    /// No operation of that id in the sandbox.
    OperationNotFound = "operation_not_found",
    /// A sandbox or operation of that id exists with a different spec.
    Conflict = "conflict",
    /// The worker holds as many sandboxes as it may.
    AtCapacity = "at_capacity",
    /// A limit on concurrent watchers was reached.
    TooManyWatchers = "too_many_watchers",
    /// Every sandbox uid of the worker's range is taken.
    NoFreeUid = "no_free_uid",
    /// A message over the call's size limit.
    TooLarge = "too_large",
    /// The sandbox's container is gone or broken: its work cannot go on.
    SandboxLost = "sandbox_lost",
    /// The sandbox is checkpointed (its processes and memory saved, nothing
    /// running): restore it first.
    SandboxCheckpointed = "sandbox_checkpointed",
    /// A change of the sandbox (its making, restore or removal) is under
    /// way and did not end within the time a call waits: try again.
    SandboxBusy = "sandbox_busy",
    /// The image is not on the worker's Docker engine.
    NoSuchImage = "no_such_image",
    /// The OCI runtime asked for is not registered with the worker's
    /// Docker engine.
    NoSuchRuntime = "no_such_runtime",
    /// No template of that name on the worker (for the caller's tenant).
    NoSuchTemplate = "no_such_template",
    /// A sandbox made from a template did not become ready in time (its
    /// start command ended, or its readiness probe never held); it is gone.
    TemplateNotReady = "template_not_ready",
    /// The template is in use (sandboxes of it run, or a pool keeps
    /// members of it): its removal is refused unless forced.
    TemplateInUse = "template_in_use",
    /// No volume of that name on the worker (for the caller's tenant).
    NoSuchVolume = "no_such_volume",
    /// The volume is mounted by a sandbox in a way that excludes what was
    /// asked (a second writer, a writer beside readers, a removal).
    VolumeInUse = "volume_in_use",
    /// The request does not fit the operation (input to one that takes
    /// none, a resize without a terminal).
    NotApplicable = "not_applicable",
    /// Input past the end of what the operation has taken.
    InputGap = "input_gap",
    /// A fork's copy of its parent failed; the children it made are gone.
    ForkFailed = "fork_failed",
    /// The Docker engine refused the request (a 4xx): asking again will not help.
    DockerRefused = "docker_refused",
    /// The Docker engine did not answer, or failed: try again later.
    DockerUnavailable = "docker_unavailable",
    /// The sandbox's supervisor did not answer in time.
    SupervisorUnresponsive = "supervisor_unresponsive",
    /// The link to the sandbox's supervisor is down for now: try again.
    SupervisorDetached = "supervisor_detached",
    /// The worker takes no new sandboxes (ask another worker).
    Draining = "draining",
    /// The worker is shutting down.
    ShuttingDown = "shutting_down",
    /// A stream ended before all it carries was sent (an upload without its
    /// end, a download cut short, a watch the worker had to drop).
    Incomplete = "incomplete",
    /// The worker itself failed (its state directory, its configuration).
    Internal = "internal",
    /// The control plane knows no session of that id.
    SessionNotFound = "session_not_found",
    /// The session's run is hosted now: what was asked needs it stopped
    /// (or, for an input, running).
    SessionRunning = "session_running",
    /// The session is not running: it takes no input or stop.
    SessionNotRunning = "session_not_running",
    /// No worker could take it: each refused or did not answer in time
    /// (try again later, or add workers).
    NoWorker = "no_worker",
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether statuses carry a fixed text instead of their own (see
/// [`withhold_text`]).
static WITHHELD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The text every status of this process carries once [`withhold_text`]
/// is on.
pub const WITHHELD_TEXT: &str = "(the text of this error is withheld)";

/// From now on, every status this process makes carries
/// [`WITHHELD_TEXT`] instead of its own text: its reason and flag alone say
/// what happened. For tests that show a client decides by reason, never by
/// text (`corral-worker --withhold-error-text`).
pub fn withhold_text() {
    WITHHELD.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// A status of `code` carrying `reason` (and the flag of a policy refusal).
#[cfg(feature = "grpc")]
pub fn status(
    code: tonic::Code,
    reason: Reason,
    flag: Option<&str>,
    message: impl Into<String>,
) -> tonic::Status {
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(
        REASON_KEY,
        tonic::metadata::MetadataValue::from_static(reason.as_str()),
    );
    if let Some(flag) = flag
        && let Ok(v) = flag.parse()
    {
        md.insert(FLAG_KEY, v);
    }
    if WITHHELD.load(std::sync::atomic::Ordering::Relaxed) {
        return tonic::Status::with_metadata(code, WITHHELD_TEXT, md);
    }
    tonic::Status::with_metadata(code, message, md)
}

/// A refusal at tenant's quota: `RESOURCE_EXHAUSTED`, reason
/// `quota_exceeded`, with the quota's name, limit and use in metadata.
#[cfg(feature = "grpc")]
pub fn quota_status(
    quota: &str,
    limit: u64,
    used: u64,
    message: impl Into<String>,
) -> tonic::Status {
    let s = status(
        tonic::Code::ResourceExhausted,
        Reason::QuotaExceeded,
        None,
        message,
    );
    let mut md = s.metadata().clone();
    for (k, v) in [
        (QUOTA_KEY, quota.to_string()),
        (QUOTA_LIMIT_KEY, limit.to_string()),
        (QUOTA_USED_KEY, used.to_string()),
    ] {
        if let Ok(v) = v.parse() {
            md.insert(k, v);
        }
    }
    tonic::Status::with_metadata(s.code(), s.message().to_string(), md)
}

/// The quota a refusal names, with its limit and the use when refused.
#[cfg(feature = "grpc")]
pub fn quota_of(status: &tonic::Status) -> Option<(String, u64, u64)> {
    let md = status.metadata();
    let text = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    Some((
        text(QUOTA_KEY)?,
        text(QUOTA_LIMIT_KEY)?.parse().ok()?,
        text(QUOTA_USED_KEY)?.parse().ok()?,
    ))
}

/// The reason a status carries, if it carries one this build knows.
#[cfg(feature = "grpc")]
pub fn of(status: &tonic::Status) -> Option<Reason> {
    status
        .metadata()
        .get(REASON_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(Reason::parse)
}

/// The worker flag a policy refusal names.
#[cfg(feature = "grpc")]
pub fn flag_of(status: &tonic::Status) -> Option<String> {
    status
        .metadata()
        .get(FLAG_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_goes_through_its_name() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            assert!(seen.insert(r.as_str()), "{r} twice");
            assert_eq!(Reason::parse(r.as_str()), Some(*r));
            assert!(
                r.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
            );
        }
        assert_eq!(Reason::parse("no_such_reason"), None);
    }

    #[cfg(feature = "grpc")]
    #[test]
    fn a_status_carries_its_reason_and_flag_in_metadata() {
        let s = status(
            tonic::Code::PermissionDenied,
            Reason::PolicyDenied,
            Some("--allow-root"),
            "no root here",
        );
        assert_eq!(of(&s), Some(Reason::PolicyDenied));
        assert_eq!(flag_of(&s).as_deref(), Some("--allow-root"));
        assert_eq!(s.message(), "no root here");
        let plain = tonic::Status::unavailable("draining, as text");
        assert_eq!(of(&plain), None);
    }
}
