//! The per-sandbox event stream.

use bytes::Bytes;

use crate::{OperationId, OperationResult, ProtocolError, pb};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Started {
        pid: u32,
    },
    Output {
        stream: OutputStream,
        data: Bytes,
    },
    Finished(Box<OperationResult>),
    /// Events `from..=to` were evicted from a capped journal.
    Gap {
        from: u64,
        to: u64,
    },
    SandboxLost {
        reason: String,
    },
    /// A connection of the sandbox's egress proxy, as its worker decided.
    Egress(Egress),
    /// The way in to one of its ports, as its worker saw it.
    Port(PortEvent),
}

/// A decision on one egress connection (see worker.proto's `Egress`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Egress {
    pub host: String,
    pub port: u16,
    pub decision: EgressDecision,
    /// Why, unless allowed (`not_allowed`, `internal_address`, ...).
    pub reason: String,
    /// Decisions made before this one that no event told.
    pub unreported: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum EgressDecision {
    Allowed,
    Blocked,
    /// Allowed, then cut: the policy changed.
    Closed,
}

impl std::fmt::Display for EgressDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EgressDecision {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Blocked => "blocked",
            Self::Closed => "closed",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ProtocolError> {
        match s {
            "allowed" => Ok(Self::Allowed),
            "blocked" => Ok(Self::Blocked),
            "closed" => Ok(Self::Closed),
            other => Err(ProtocolError::invalid(
                "egress.decision",
                format!("unknown decision {other:?}"),
            )),
        }
    }
}

impl From<Egress> for pb::sandbox_event::Egress {
    fn from(e: Egress) -> Self {
        Self {
            host: e.host,
            port: u32::from(e.port),
            decision: e.decision.as_str().into(),
            reason: e.reason,
            unreported: e.unreported,
        }
    }
}

impl TryFrom<pb::sandbox_event::Egress> for Egress {
    type Error = ProtocolError;
    fn try_from(e: pb::sandbox_event::Egress) -> Result<Self, ProtocolError> {
        if e.host.len() > 255 || e.reason.len() > 64 {
            return Err(ProtocolError::invalid("egress", "host or reason too long"));
        }
        Ok(Self {
            host: e.host,
            port: u16::try_from(e.port)
                .map_err(|_| ProtocolError::invalid("egress.port", "not a port"))?,
            decision: EgressDecision::parse(&e.decision)?,
            reason: e.reason,
            unreported: e.unreported,
        })
    }
}

/// What the worker saw of the way in to one port of a sandbox (see
/// worker.proto's `SandboxEvent.Port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortEvent {
    pub port: u16,
    pub what: PortWhat,
    /// An exposure's access, a caller's access, why a connection closed,
    /// or why a request was refused (a reason of the listener's).
    pub detail: String,
    /// A closed connection's bytes: to the sandbox, and from it.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Events before this one that no event told.
    pub unreported: u32,
}

impl PortEvent {
    pub fn new(port: u16, what: PortWhat, detail: impl Into<String>) -> Self {
        Self {
            port,
            what,
            detail: detail.into(),
            bytes_in: 0,
            bytes_out: 0,
            unreported: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum PortWhat {
    Exposed,
    Revoked,
    Expired,
    Opened,
    Closed,
    Refused,
}

impl PortWhat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exposed => "exposed",
            Self::Revoked => "revoked",
            Self::Expired => "expired",
            Self::Opened => "opened",
            Self::Closed => "closed",
            Self::Refused => "refused",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ProtocolError> {
        Ok(match s {
            "exposed" => Self::Exposed,
            "revoked" => Self::Revoked,
            "expired" => Self::Expired,
            "opened" => Self::Opened,
            "closed" => Self::Closed,
            "refused" => Self::Refused,
            other => {
                return Err(ProtocolError::invalid(
                    "port.what",
                    format!("unknown event {other:?}"),
                ));
            }
        })
    }
}

impl std::fmt::Display for PortWhat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<PortEvent> for pb::sandbox_event::Port {
    fn from(e: PortEvent) -> Self {
        Self {
            port: u32::from(e.port),
            what: e.what.as_str().into(),
            detail: e.detail,
            bytes_in: e.bytes_in,
            bytes_out: e.bytes_out,
            unreported: e.unreported,
        }
    }
}

impl TryFrom<pb::sandbox_event::Port> for PortEvent {
    type Error = ProtocolError;
    fn try_from(e: pb::sandbox_event::Port) -> Result<Self, ProtocolError> {
        if e.detail.len() > 64 {
            return Err(ProtocolError::invalid("port.detail", "too long"));
        }
        Ok(Self {
            port: u16::try_from(e.port)
                .map_err(|_| ProtocolError::invalid("port.port", "not a port"))?,
            what: PortWhat::parse(&e.what)?,
            detail: e.detail,
            bytes_in: e.bytes_in,
            bytes_out: e.bytes_out,
            unreported: e.unreported,
        })
    }
}

/// One event of a sandbox. `seq` strictly increases per sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub operation_id: Option<OperationId>,
    pub kind: EventKind,
}

impl Event {
    /// Output bytes this event carries (what flow control counts).
    pub fn output_len(&self) -> usize {
        match &self.kind {
            EventKind::Output { data, .. } => data.len(),
            _ => 0,
        }
    }

    /// About what the event takes in memory, for journal budgets: the
    /// event as stored, its operation id's and its result's allocations
    /// (each counted with an allocator's overhead) and what it carries. An
    /// event with nothing to carry still counts what it takes, so a
    /// journal of many small events stays within its budget too.
    pub fn weight(&self) -> usize {
        /// What an allocator adds to each allocation, about.
        const ALLOC: usize = 16;
        let id = self
            .operation_id
            .as_ref()
            .map_or(0, |id| id.as_str().len() + ALLOC);
        std::mem::size_of::<Self>()
            + id
            + match &self.kind {
                EventKind::Output { data, .. } => data.len(),
                EventKind::Finished(r) => {
                    std::mem::size_of::<OperationResult>()
                        + ALLOC
                        + r.stdout.head.len()
                        + r.stdout.tail.len()
                        + r.stderr.head.len()
                        + r.stderr.tail.len()
                        + r.file_data.len()
                }
                EventKind::SandboxLost { reason } => reason.len(),
                EventKind::Egress(e) => e.host.len() + e.reason.len(),
                EventKind::Port(e) => e.detail.len(),
                EventKind::Started { .. } | EventKind::Gap { .. } => 0,
            }
    }
}

impl From<Event> for pb::SandboxEvent {
    fn from(e: Event) -> Self {
        use pb::sandbox_event::{self as ps, Kind};
        let kind = match e.kind {
            EventKind::Started { pid } => Kind::Started(ps::Started { pid }),
            EventKind::Output { stream, data } => Kind::Output(ps::Output {
                stream: match stream {
                    OutputStream::Stdout => pb::OutputStream::Stdout,
                    OutputStream::Stderr => pb::OutputStream::Stderr,
                } as i32,
                data,
            }),
            EventKind::Finished(r) => Kind::Finished(ps::Finished {
                result: Some((*r).into()),
            }),
            EventKind::Gap { from, to } => Kind::Gap(ps::Gap {
                from_seq: from,
                to_seq: to,
            }),
            EventKind::SandboxLost { reason } => Kind::SandboxLost(ps::SandboxLost { reason }),
            EventKind::Egress(e) => Kind::Egress(e.into()),
            EventKind::Port(e) => Kind::Port(e.into()),
        };
        Self {
            seq: e.seq,
            operation_id: e.operation_id.map(String::from).unwrap_or_default(),
            kind: Some(kind),
        }
    }
}

impl TryFrom<pb::SandboxEvent> for Event {
    type Error = ProtocolError;
    fn try_from(e: pb::SandboxEvent) -> Result<Self, ProtocolError> {
        use pb::sandbox_event::Kind;
        let kind = match e.kind.ok_or(ProtocolError::Missing("event.kind"))? {
            Kind::Started(s) => EventKind::Started { pid: s.pid },
            Kind::Output(o) => EventKind::Output {
                stream: match pb::OutputStream::try_from(o.stream) {
                    Ok(pb::OutputStream::Stdout) => OutputStream::Stdout,
                    Ok(pb::OutputStream::Stderr) => OutputStream::Stderr,
                    _ => return Err(ProtocolError::invalid("output.stream", "unknown stream")),
                },
                data: o.data,
            },
            Kind::Finished(f) => EventKind::Finished(Box::new(
                f.result
                    .ok_or(ProtocolError::Missing("finished.result"))?
                    .try_into()?,
            )),
            Kind::Gap(g) => EventKind::Gap {
                from: g.from_seq,
                to: g.to_seq,
            },
            Kind::SandboxLost(l) => EventKind::SandboxLost { reason: l.reason },
            Kind::Egress(e) => EventKind::Egress(e.try_into()?),
            Kind::Port(e) => EventKind::Port(e.try_into()?),
        };
        let operation_id = if e.operation_id.is_empty() {
            None
        } else {
            Some(OperationId::new(e.operation_id)?)
        };
        Ok(Self {
            seq: e.seq,
            operation_id,
            kind,
        })
    }
}
