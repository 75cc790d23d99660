//! The operation value: what a tool asked for, where it stands, and how it
//! ended. Immutable snapshots of it travel from a manager to its consumer.

use bytes::Bytes;
use corral_proto::{OperationId, OperationResult, OperationSpec, Outcome};
use serde::{Deserialize, Serialize};

/// Version of the operation value (and of its persisted form).
pub const OPERATION_VERSION: u32 = 1;
/// Output-so-far kept per stream while an operation runs.
pub const PROGRESS_TAIL_BYTES: usize = 4096;

/// ```text
/// ready ──▶ awaiting ──▶ completed | failed | canceled   (terminal: never change)
///    └──────────┴──▶ canceling ──▶ canceled | failed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpStatus {
    Ready,
    Awaiting,
    Canceling,
    /// Ran to an end the tool can report (any exit code, a timeout, a
    /// file error...): see the result's outcome.
    Completed,
    /// Could not run or lost its sandbox: see `failure`.
    Failed,
    Canceled,
}

impl OpStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Canceled)
    }
}

/// The tail of what a running operation printed so far, and how much.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    pub stdout_tail: Bytes,
    pub stderr_tail: Bytes,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

impl Progress {
    pub fn push(&mut self, stream: corral_proto::OutputStream, data: &[u8]) {
        let (tail, total) = match stream {
            corral_proto::OutputStream::Stdout => (&mut self.stdout_tail, &mut self.stdout_bytes),
            corral_proto::OutputStream::Stderr => (&mut self.stderr_tail, &mut self.stderr_bytes),
        };
        *total += data.len() as u64;
        let mut joined = Vec::with_capacity((tail.len() + data.len()).min(PROGRESS_TAIL_BYTES));
        let keep_old = PROGRESS_TAIL_BYTES
            .saturating_sub(data.len())
            .min(tail.len());
        joined.extend_from_slice(&tail[tail.len() - keep_old..]);
        let start = data.len().saturating_sub(PROGRESS_TAIL_BYTES);
        joined.extend_from_slice(&data[start..]);
        *tail = Bytes::from(joined);
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub id: OperationId,
    pub version: u32,
    pub spec: OperationSpec,
    pub status: OpStatus,
    pub progress: Progress,
    /// Set once completed (and when canceled or failed after running).
    pub result: Option<OperationResult>,
    /// Why it failed, when it did.
    pub failure: Option<String>,
    /// It failed because its sandbox was lost (or its worker stayed out of
    /// reach past the deadline): it may or may not have run to its end.
    pub lost: bool,
}

/// One operation of a tool call as its result is rendered from (see
/// `crate::tools::Translator::render`): borrowed from what the session
/// recorded, or from an [`Operation`] ([`Operation::view`]), never rebuilt.
#[derive(Debug, Clone, Copy)]
pub struct OpView<'a> {
    pub spec: &'a OperationSpec,
    pub status: OpStatus,
    pub result: Option<&'a OperationResult>,
    pub failure: Option<&'a str>,
    /// It failed because its sandbox was lost.
    pub lost: bool,
}

impl Operation {
    /// This operation as a result is rendered from.
    pub fn view(&self) -> OpView<'_> {
        OpView {
            spec: &self.spec,
            status: self.status,
            result: self.result.as_ref(),
            failure: self.failure.as_deref(),
            lost: self.lost,
        }
    }

    pub fn new(id: OperationId, spec: OperationSpec) -> Self {
        Self {
            id,
            version: OPERATION_VERSION,
            spec,
            status: OpStatus::Ready,
            progress: Progress::default(),
            result: None,
            failure: None,
            lost: false,
        }
    }

    /// Applies a result: the status follows from how the operation ended.
    pub fn finish(&mut self, result: OperationResult) {
        if self.status.is_terminal() {
            return;
        }
        self.status = match &result.outcome {
            Outcome::Canceled => OpStatus::Canceled,
            Outcome::SandboxLost { .. } | Outcome::SpawnFailed { .. } => {
                self.failure = Some(result.outcome.to_string());
                self.lost = matches!(result.outcome, Outcome::SandboxLost { .. });
                OpStatus::Failed
            }
            Outcome::Exited { .. }
            | Outcome::Signaled { .. }
            | Outcome::TimedOut
            | Outcome::OutOfMemory
            | Outcome::FileError { .. } => OpStatus::Completed,
        };
        self.result = Some(result);
    }

    pub fn fail(&mut self, reason: impl Into<String>) {
        if !self.status.is_terminal() {
            self.status = OpStatus::Failed;
            self.failure = Some(reason.into());
        }
    }

    /// [`Self::fail`], because its sandbox was lost.
    pub fn fail_lost(&mut self, reason: impl Into<String>) {
        if !self.status.is_terminal() {
            self.fail(reason);
            self.lost = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_proto::OutputStream;

    #[test]
    fn progress_keeps_a_bounded_tail_and_counts_everything() {
        let mut p = Progress::default();
        for _ in 0..10 {
            p.push(OutputStream::Stdout, &[b'a'; 1000]);
        }
        p.push(OutputStream::Stdout, b"end");
        assert_eq!(p.stdout_bytes, 10_003);
        assert_eq!(p.stdout_tail.len(), PROGRESS_TAIL_BYTES);
        assert!(p.stdout_tail.ends_with(b"aaaend"));
        p.push(OutputStream::Stderr, &vec![b'x'; 10_000]);
        assert_eq!(p.stderr_tail.len(), PROGRESS_TAIL_BYTES);
    }

    #[test]
    fn terminal_states_never_change() {
        let spec = OperationSpec::Shell(corral_proto::ShellSpec::new("true"));
        let mut op = Operation::new(OperationId::random(), spec);
        op.finish(OperationResult::with_outcome(Outcome::Exited { code: 3 }));
        assert_eq!(op.status, OpStatus::Completed);
        op.finish(OperationResult::with_outcome(Outcome::Canceled));
        op.fail("late");
        assert_eq!(op.status, OpStatus::Completed);
        assert_eq!(
            op.result.map(|r| r.outcome),
            Some(Outcome::Exited { code: 3 })
        );
    }
}
