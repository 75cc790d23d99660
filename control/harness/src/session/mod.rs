//! Durable sessions: the append-only log ([`log`]).

pub mod log;

pub use log::{Clock, LogError, Records, Recovery, SessionLog, Timed, TimedRecords};
