//! corral-control: Corral's control plane.
//!
//! This crate owns the `corral` command line ([`cli`], [`run`]), the typed
//! gRPC client for workers ([`client`]), `corral exec` ([`exec`]: live
//! output, input and terminals, resume from a cursor across worker
//! restarts, exit codes), the local worker that `corral` commands share
//! when given no `--worker` ([`local`]), and the agent harness: the coordinator ([`agent`]) and
//! `corral run` / `corral session` ([`agent_run`]), with their parts —
//! model clients ([`llm`]), the durable session log ([`session`]), the
//! context builder ([`context`]), tool translators ([`tools`]) and the
//! operation managers ([`ops`]).
//!
//! It does not run operations itself: that is the worker's job.

pub mod agent;
pub mod agent_run;
pub mod cli;
pub mod client;
pub mod context;
pub mod exec;
pub mod llm;
pub mod local;
pub mod ops;
pub mod run;
pub mod session;
pub mod terminal;
pub mod tools;
