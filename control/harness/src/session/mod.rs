//! Durable sessions: the append-only log ([`log`]).

pub mod log;

pub use log::{Clock, LogError, Mark, Records, Recovery, SessionLog, Timed, TimedRecords};
