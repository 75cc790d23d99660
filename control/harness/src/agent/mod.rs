//! The agent harness's heart: one coordinator per session.
//!
//! - [`record`]: the session's records, the only way its state changes;
//! - [`state`]: the state, and the one function that applies a record;
//! - [`core`]: the decisions (when to send a turn, what to give the model,
//!   when the run is over) as a step machine with no I/O;
//! - [`coordinator`]: the event loop that feeds the core and carries out
//!   its effects (model requests, operations, timers);
//! - [`events`]: what a run reports to its watcher (`corral run --json`).
//!
//! Every record is fsynced to the session log before it takes effect
//! outside the process, so a run killed at any point resumes: operations
//! are re-attached (never re-run), unanswered inputs are answered.

pub mod coordinator;
pub mod core;
pub mod events;
pub mod record;
pub mod state;

pub use self::core::{Core, CoreError, Effect, replay};
pub use coordinator::{Coordinator, Inbox, Settings, Summary};
pub use events::{CallEnd, Event, RunResult};
pub use record::{Ending, OnSandboxLost, Record, SessionConfig, StopCause, StopMode};
pub use state::{Brief, State};
