//! Operations as the agent harness sees them, and the managers that run
//! them on a worker.
//!
//! - [`operation`]: the operation value, its status machine and its bounded
//!   output-so-far;
//! - [`backend`]: the few worker calls a manager needs, in-process
//!   ([`backend::LocalBackend`], the worker library) or over gRPC
//!   ([`backend::RemoteBackend`], reconnecting);
//! - [`manager`]: one actor per sandbox that adds (at most once per id),
//!   cancels (idempotently) and turns the sandbox's event stream into full
//!   operation snapshots. The same code serves both backends, so
//!   `LocalManager` and `RemoteManager` behave alike by construction, and
//!   one conformance suite checks each.

pub mod backend;
pub mod manager;
pub mod operation;

pub use backend::{Backend, BackendError, LocalBackend, RemoteBackend};
pub use manager::{LocalManager, Manager, ManagerError, OperationManager, RemoteManager};
pub use operation::{OpStatus, Operation, Progress};
