//! Frames between a worker and corral-init (see `corral/v1/init.proto`).

use bytes::Bytes;

use crate::{
    Event, OperationId, OperationResult, OperationSpec, ProtocolError, SandboxId, TerminalSize, pb,
};

/// A frame from the worker to corral-init.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitRequest {
    Attach {
        after_seq: u64,
        window_bytes: u64,
        /// Which attach this is, counted from 1; the Welcome echoes it.
        attach: u64,
    },
    Credit {
        bytes: u64,
    },
    Run {
        operation_id: OperationId,
        spec: OperationSpec,
    },
    Cancel {
        operation_id: OperationId,
    },
    /// A signal (1-31) for the operation's process group.
    Signal {
        operation_id: OperationId,
        signal: i32,
    },
    Input {
        operation_id: OperationId,
        offset: u64,
        data: Bytes,
        eof: bool,
    },
    Resize {
        operation_id: OperationId,
        size: TerminalSize,
    },
    Reset,
    /// A decision on an egress connection, to journal as an event.
    Egress(crate::event::Egress),
    /// What the worker saw of the way in to a port, to journal as an event.
    Port(crate::event::PortEvent),
    /// Serve the egress proxy (as `--egress` does at start); nothing if it
    /// runs already.
    StartRelay,
    /// Start the way in (see `corral_init::ingress`), its relay given
    /// `secret` for its control connection.
    StartIngress {
        secret: Vec<u8>,
    },
}

/// A signal number a client may send: 1-31 (SIGHUP .. SIGSYS).
pub fn valid_signal(signal: i32) -> Result<i32, ProtocolError> {
    if (1..=31).contains(&signal) {
        Ok(signal)
    } else {
        Err(ProtocolError::invalid(
            "signal",
            format!("{signal} is not a signal (1-31)"),
        ))
    }
}

/// An operation as its owner remembers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationRecord {
    pub id: OperationId,
    pub spec: OperationSpec,
    /// `None` while running.
    pub result: Option<OperationResult>,
    /// Seq of the operation's first event (0 until known).
    pub first_seq: u64,
    /// Input bytes init has taken.
    pub input_bytes: u64,
}

impl OperationRecord {
    /// About what remembering it costs (see [`weight`]).
    pub fn weight(&self) -> usize {
        weight(&self.spec, self.result.as_ref())
    }
}

/// About what remembering an operation costs: its command or path, a
/// write's data, the output captured in its result.
pub fn weight(spec: &crate::OperationSpec, result: Option<&crate::OperationResult>) -> usize {
    use crate::OperationSpec;
    let spec = match spec {
        OperationSpec::Shell(s) => s.command.len(),
        OperationSpec::ReadFile(r) => r.path.len(),
        OperationSpec::WriteFile(w) => w.path.len() + w.data.len(),
        OperationSpec::PutArchive(a) | OperationSpec::GetArchive(a) | OperationSpec::ListDir(a) => {
            a.path.len()
        }
    };
    let result = result.map_or(0, |r| {
        r.stdout.head.len()
            + r.stdout.tail.len()
            + r.stderr.head.len()
            + r.stderr.tail.len()
            + r.file_data.len()
    });
    256 + spec + result
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub version: String,
    pub boot_id: String,
    pub last_seq: u64,
    pub operations: Vec<OperationRecord>,
    /// More Welcome frames follow with the rest of the operations.
    pub more: bool,
    /// The attach this answers (0 from a supervisor that does not say).
    pub attach: u64,
    /// This frame's place in the Welcome, from 0.
    pub page: u32,
}

/// Most encoded bytes of operations in one Welcome frame (well under
/// [`crate::limits::MAX_FRAME_BYTES`], and above the largest single
/// operation record).
pub const WELCOME_PAGE_BYTES: usize = 8 << 20;

/// Most encoded bytes of one whole Welcome a worker takes. Init remembers
/// at most 64 MiB of finished operations (`MAX_FINISHED_BYTES` in
/// corral-init), and its running ones are what the worker sent it; a
/// Welcome past this is a broken or hostile supervisor.
pub const MAX_WELCOME_BYTES: usize = 256 << 20;

impl Welcome {
    /// The Welcome for `operations`, in frames of at most `page_bytes` of
    /// operations each (a record larger than that gets a frame of its own).
    /// Every frame but the last says `more`.
    pub fn paged(
        version: &str,
        boot_id: &str,
        last_seq: u64,
        attach: u64,
        operations: Vec<OperationRecord>,
        page_bytes: usize,
    ) -> Vec<Welcome> {
        use prost::Message;
        let page = |operations, page: usize| Welcome {
            version: version.to_string(),
            boot_id: boot_id.to_string(),
            last_seq,
            operations,
            more: true,
            attach,
            page: u32::try_from(page).unwrap_or(u32::MAX),
        };
        let mut pages = Vec::new();
        let mut current = Vec::new();
        let mut bytes = 0usize;
        for op in operations {
            let len = op.to_pb_in(String::new()).encoded_len() + 8;
            if !current.is_empty() && bytes + len > page_bytes {
                pages.push(page(std::mem::take(&mut current), pages.len()));
                bytes = 0;
            }
            bytes += len;
            current.push(op);
        }
        pages.push(page(current, pages.len()));
        if let Some(last) = pages.last_mut() {
            last.more = false;
        }
        pages
    }
}

/// Why corral-init refused a frame (see `RejectKind` in init.proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    /// An init of an older build, which says no kind.
    Unspecified,
    Malformed,
    UnknownOperation,
    TakesNoInput,
    InputGap,
    InputFull,
    IdReused,
}

impl From<RejectKind> for pb::RejectKind {
    fn from(k: RejectKind) -> Self {
        match k {
            RejectKind::Unspecified => pb::RejectKind::Unspecified,
            RejectKind::Malformed => pb::RejectKind::Malformed,
            RejectKind::UnknownOperation => pb::RejectKind::UnknownOperation,
            RejectKind::TakesNoInput => pb::RejectKind::TakesNoInput,
            RejectKind::InputGap => pb::RejectKind::InputGap,
            RejectKind::InputFull => pb::RejectKind::InputFull,
            RejectKind::IdReused => pb::RejectKind::IdReused,
        }
    }
}

impl From<pb::RejectKind> for RejectKind {
    fn from(k: pb::RejectKind) -> Self {
        match k {
            pb::RejectKind::Unspecified => RejectKind::Unspecified,
            pb::RejectKind::Malformed => RejectKind::Malformed,
            pb::RejectKind::UnknownOperation => RejectKind::UnknownOperation,
            pb::RejectKind::TakesNoInput => RejectKind::TakesNoInput,
            pb::RejectKind::InputGap => RejectKind::InputGap,
            pb::RejectKind::InputFull => RejectKind::InputFull,
            pb::RejectKind::IdReused => RejectKind::IdReused,
        }
    }
}

/// A frame from corral-init to the worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitMessage {
    Welcome(Welcome),
    Event(Event),
    Rejected {
        operation_id: Option<OperationId>,
        kind: RejectKind,
        reason: String,
    },
    InputAck {
        operation_id: OperationId,
        received: u64,
        consumed: u64,
        closed: bool,
    },
    ResetDone {
        killed: u32,
    },
}

impl From<InitRequest> for pb::InitRequest {
    fn from(r: InitRequest) -> Self {
        use pb::init_request::{self as p, Kind};
        let kind = match r {
            InitRequest::Attach {
                after_seq,
                window_bytes,
                attach,
            } => Kind::Attach(p::Attach {
                after_seq,
                window_bytes,
                attach,
            }),
            InitRequest::Credit { bytes } => Kind::Credit(p::Credit { bytes }),
            InitRequest::Run { operation_id, spec } => Kind::Run(p::Run {
                operation_id: operation_id.into(),
                spec: Some(spec.into()),
            }),
            InitRequest::Cancel { operation_id } => Kind::Cancel(p::Cancel {
                operation_id: operation_id.into(),
            }),
            InitRequest::Signal {
                operation_id,
                signal,
            } => Kind::Signal(p::Signal {
                operation_id: operation_id.into(),
                signal,
            }),
            InitRequest::Input {
                operation_id,
                offset,
                data,
                eof,
            } => Kind::Input(p::Input {
                operation_id: operation_id.into(),
                offset,
                data,
                eof,
            }),
            InitRequest::Resize { operation_id, size } => Kind::Resize(p::Resize {
                operation_id: operation_id.into(),
                size: Some(size.into()),
            }),
            InitRequest::Reset => Kind::Reset(p::Reset {}),
            InitRequest::Egress(e) => Kind::Egress(p::Egress {
                egress: Some(e.into()),
            }),
            InitRequest::Port(e) => Kind::Port(p::Port {
                port: Some(e.into()),
            }),
            InitRequest::StartRelay => Kind::StartRelay(p::StartRelay {}),
            InitRequest::StartIngress { secret } => Kind::StartIngress(p::StartIngress {
                secret: secret.into(),
            }),
        };
        Self { kind: Some(kind) }
    }
}

impl TryFrom<pb::InitRequest> for InitRequest {
    type Error = ProtocolError;
    fn try_from(r: pb::InitRequest) -> Result<Self, ProtocolError> {
        use pb::init_request::Kind;
        Ok(match r.kind.ok_or(ProtocolError::Missing("kind"))? {
            Kind::Attach(a) => Self::Attach {
                after_seq: a.after_seq,
                window_bytes: a.window_bytes,
                attach: a.attach,
            },
            Kind::Credit(c) => Self::Credit { bytes: c.bytes },
            Kind::Run(run) => Self::Run {
                operation_id: OperationId::new(run.operation_id)?,
                spec: run.spec.ok_or(ProtocolError::Missing("spec"))?.try_into()?,
            },
            Kind::Cancel(c) => Self::Cancel {
                operation_id: OperationId::new(c.operation_id)?,
            },
            Kind::Signal(s) => Self::Signal {
                operation_id: OperationId::new(s.operation_id)?,
                signal: valid_signal(s.signal)?,
            },
            Kind::Input(i) => Self::Input {
                operation_id: OperationId::new(i.operation_id)?,
                offset: i.offset,
                data: i.data,
                eof: i.eof,
            },
            Kind::Resize(r) => Self::Resize {
                operation_id: OperationId::new(r.operation_id)?,
                size: r.size.ok_or(ProtocolError::Missing("size"))?.try_into()?,
            },
            Kind::Reset(_) => Self::Reset,
            Kind::Egress(e) => Self::Egress(
                e.egress
                    .ok_or(ProtocolError::Missing("egress"))?
                    .try_into()?,
            ),
            Kind::Port(e) => Self::Port(e.port.ok_or(ProtocolError::Missing("port"))?.try_into()?),
            Kind::StartRelay(_) => Self::StartRelay,
            Kind::StartIngress(s) => Self::StartIngress {
                secret: s.secret.to_vec(),
            },
        })
    }
}

impl OperationRecord {
    /// The wire form, as the worker service returns it.
    pub fn to_pb(&self, sandbox_id: &SandboxId) -> pb::Operation {
        self.to_pb_in(sandbox_id.to_string())
    }

    /// The wire form with `sandbox_id` as given (empty inside a sandbox,
    /// where the supervisor does not know its sandbox's id).
    fn to_pb_in(&self, sandbox_id: String) -> pb::Operation {
        pb::Operation {
            sandbox_id,
            operation_id: self.id.to_string(),
            spec: Some(self.spec.without_data().into()),
            status: if self.result.is_some() {
                pb::OperationStatus::Finished
            } else {
                pb::OperationStatus::Running
            } as i32,
            result: self.result.clone().map(Into::into),
            first_seq: self.first_seq,
            input_bytes: self.input_bytes,
        }
    }
}

impl TryFrom<pb::Operation> for OperationRecord {
    type Error = ProtocolError;
    fn try_from(o: pb::Operation) -> Result<Self, ProtocolError> {
        Ok(Self {
            id: OperationId::new(o.operation_id)?,
            spec: o.spec.ok_or(ProtocolError::Missing("spec"))?.try_into()?,
            result: o.result.map(TryInto::try_into).transpose()?,
            first_seq: o.first_seq,
            input_bytes: o.input_bytes,
        })
    }
}

impl From<InitMessage> for pb::InitMessage {
    fn from(m: InitMessage) -> Self {
        use pb::init_message::{self as p, Kind};
        let kind = match m {
            InitMessage::Welcome(w) => Kind::Welcome(p::Welcome {
                version: w.version,
                boot_id: w.boot_id,
                last_seq: w.last_seq,
                operations: w
                    .operations
                    .iter()
                    .map(|o| o.to_pb_in(String::new()))
                    .collect(),
                more: w.more,
                attach: w.attach,
                page: w.page,
            }),
            InitMessage::Event(e) => Kind::Event(e.into()),
            InitMessage::Rejected {
                operation_id,
                kind,
                reason,
            } => Kind::Rejected(p::Rejected {
                operation_id: operation_id.map(String::from).unwrap_or_default(),
                reason,
                kind: pb::RejectKind::from(kind).into(),
            }),
            InitMessage::InputAck {
                operation_id,
                received,
                consumed,
                closed,
            } => Kind::InputAck(p::InputAck {
                operation_id: operation_id.into(),
                received,
                consumed,
                closed,
            }),
            InitMessage::ResetDone { killed } => Kind::ResetDone(p::ResetDone { killed }),
        };
        Self { kind: Some(kind) }
    }
}

impl TryFrom<pb::InitMessage> for InitMessage {
    type Error = ProtocolError;
    fn try_from(m: pb::InitMessage) -> Result<Self, ProtocolError> {
        use pb::init_message::Kind;
        Ok(match m.kind.ok_or(ProtocolError::Missing("kind"))? {
            Kind::Welcome(w) => Self::Welcome(Welcome {
                version: w.version,
                boot_id: w.boot_id,
                last_seq: w.last_seq,
                operations: w
                    .operations
                    .into_iter()
                    .map(TryInto::try_into)
                    .collect::<Result<_, _>>()?,
                more: w.more,
                attach: w.attach,
                page: w.page,
            }),
            Kind::Event(e) => Self::Event(e.try_into()?),
            Kind::Rejected(r) => Self::Rejected {
                operation_id: OperationId::new(r.operation_id).ok(),
                // A kind of a newer build's: as an older one's.
                kind: pb::RejectKind::try_from(r.kind)
                    .map_or(RejectKind::Unspecified, RejectKind::from),
                reason: r.reason,
            },
            Kind::InputAck(a) => Self::InputAck {
                operation_id: OperationId::new(a.operation_id)?,
                received: a.received,
                consumed: a.consumed,
                closed: a.closed,
            },
            Kind::ResetDone(d) => Self::ResetDone { killed: d.killed },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejection_says_its_kind_and_an_unknown_kind_reads_as_none_said() {
        let sent = InitMessage::Rejected {
            operation_id: Some(OperationId::new("op-1").unwrap()),
            kind: RejectKind::UnknownOperation,
            reason: "input for an unknown operation".into(),
        };
        let wire = pb::InitMessage::from(sent.clone());
        assert_eq!(InitMessage::try_from(wire.clone()).unwrap(), sent);
        // An older init says no kind; a newer one may say one this build
        // does not know: both read as unspecified, never as another.
        for kind in [0, 99] {
            let mut w = wire.clone();
            if let Some(pb::init_message::Kind::Rejected(r)) = &mut w.kind {
                r.kind = kind;
            }
            let InitMessage::Rejected { kind, .. } = InitMessage::try_from(w).unwrap() else {
                panic!("not a rejection");
            };
            assert_eq!(kind, RejectKind::Unspecified);
        }
    }
}
