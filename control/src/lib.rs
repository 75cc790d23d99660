//! corral-control: Corral's control plane.
//!
//! This crate owns the `corral` command line ([`cli`], [`run`]), the typed
//! gRPC client for workers ([`client`]), `corral exec` ([`exec`]: live
//! output, resume from a cursor across worker restarts, exit codes), and the
//! embedded worker that `corral` runs when given no `--worker`
//! ([`embedded`]). The agent harness (coordinator, context builder, tools,
//! LLM clients, session log) will live here too.
//!
//! It does not run operations itself: that is the worker's job.

pub mod cli;
pub mod client;
pub mod embedded;
pub mod exec;
pub mod llm;
pub mod run;
