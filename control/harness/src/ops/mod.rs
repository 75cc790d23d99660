//! Operations as the agent harness sees them, and the managers that run
//! them on a worker.
//!
//! - [`operation`]: the operation value, its status machine and its bounded
//!   output-so-far;
//! - [`manager`]: one actor per sandbox that adds (at most once per id),
//!   cancels (idempotently) and turns the sandbox's events (followed with
//!   [`crate::follow`]) into full operation snapshots. It is written once
//!   against [`crate::worker_api::WorkerApi`], so `LocalManager` (the
//!   worker library in this process) and `RemoteManager` (gRPC) behave
//!   alike by construction, and one conformance suite checks each.

pub mod manager;
pub mod operation;

#[cfg(feature = "local")]
pub use manager::LocalManager;
pub use manager::{Manager, ManagerError, OperationManager, RemoteManager};
pub use operation::{OpStatus, OpView, Operation, Progress};
