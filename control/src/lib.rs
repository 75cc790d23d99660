//! corral-control: the `corral` command line, over the harness library
//! (`corral-harness`).
//!
//! It owns argument parsing ([`cli`]), running a parsed command and its
//! exit codes ([`run`]), `corral exec` ([`exec`]: live output, input and
//! terminals, resume from a cursor across worker restarts), the local
//! worker that `corral` commands share when given no `--worker`
//! ([`local`]), the terminal ([`terminal`]), and `corral run` /
//! `corral session` ([`agent_run`]).
//!
//! It does not run operations itself: that is the worker's job.

pub mod agent_run;
pub mod cli;
pub mod exec;
pub mod local;
pub mod run;
pub mod terminal;
