//! Corral's wire contract.
//!
//! This crate owns:
//! - the `corral.v1` protobuf definitions (`proto/corral/v1/*.proto`), compiled
//!   at build time with protox, so no system `protoc` is needed; the generated
//!   prost messages and (feature `grpc`) tonic stubs live in [`pb`];
//! - the validated domain types every other crate works with ([`ids`],
//!   [`spec`], [`result`], [`event`], [`sandbox`], [`init`]), and the conversions between
//!   them and [`pb`]: generated `Option`s and `i32` enums stop here;
//! - the length-delimited [`frame`] codec spoken between a worker and the
//!   in-sandbox supervisor `corral-init`;
//! - the hard limits every part enforces ([`limits`]);
//! - the machine-readable [`reason`] every error status carries;
//! - [`egress`] rules: what a sandbox's connections may reach, parsed and
//!   matched, and how a worker's bound covers them;
//! - [`text`]: outside words made safe for a terminal or a log line;
//! - [`units`]: sizes and CPUs as people write them.
//!
//! It owns no behaviour beyond validation: no I/O, no async.

pub mod egress;
pub mod error;
pub mod event;
pub mod frame;
#[cfg(feature = "http")]
pub mod gateway;
pub mod ids;
pub mod init;
pub mod limits;
pub mod reason;
pub mod result;
pub mod sandbox;
#[cfg(feature = "serde")]
mod serde_bytes_b64;
pub mod spec;
pub mod template;
pub mod text;
pub mod units;
pub mod volume;

pub use error::ProtocolError;
pub use event::{Event, EventKind, OutputStream};
pub use ids::{OperationId, SandboxId};
pub use reason::Reason;
pub use result::{Captured, FileErrorKind, OperationResult, Outcome};
pub use sandbox::{
    Ceilings, Limits, PoolInfo, SandboxInfo, SandboxPolicy, SandboxState, SandboxStats, WorkerInfo,
};
pub use spec::{
    ArchiveSpec, NetworkMode, OperationSpec, ReadFileSpec, SandboxSpec, ShellSpec, TerminalSize,
    WriteFileSpec,
};

/// Generated protobuf messages and gRPC stubs. Use them only at the edges
/// (gRPC handlers, the frame codec); convert to the domain types right away.
#[allow(clippy::all, missing_docs, unused_qualifications)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/corral.v1.rs"));

    /// The encoded file descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/corral_descriptor.bin"));
}
