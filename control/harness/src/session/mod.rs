//! Durable sessions: the append-only log ([`log`]).

pub mod log;

pub use log::{LogError, Records, Recovery, SessionLog};
