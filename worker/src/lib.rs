//! corral-worker: runs operations in hardened Docker sandboxes and serves
//! them over gRPC.
//!
//! This crate owns:
//! - [`worker`]: the set of sandboxes, one slot each in one table (being
//!   made, running, checkpointed, being restored, being removed: a sandbox
//!   in transition is never unknown), their lifecycle along its files and
//!   recovery on start (re-adopt what still runs, remove what has no
//!   record);
//! - [`sandbox`]: one actor per sandbox, the only writer of its journal and
//!   operation table, linked to the sandbox's `corral-init` over attached
//!   stdio, with flow control towards its watchers;
//! - [`runtime`]: the seam between the lifecycle and what runs sandboxes
//!   (a fake one under the lifecycle's tests); [`docker`]: the runtime the
//!   worker runs on, everything said to the Docker engine (bollard),
//!   including the hardened container configuration;
//! - [`uids`]: the uid each sandbox's commands run as, one no host account
//!   and no other sandbox holds;
//! - [`policy`]: what a sandbox may be, as the operator allows it (clients
//!   ask, the worker decides);
//! - [`pool`]: warm pools, sandboxes of a template made ahead of time and
//!   each handed to one matching create;
//! - [`build`]: images built on the engine from a client's Dockerfile
//!   (`--allow-build`), named by their inputs, their bases checked first;
//! - [`fork`]: live forks, children given a copy of a frozen parent's
//!   writable trees;
//! - [`egress`]: reading what a sandbox's outbound connection asks for (a
//!   proxy request's head, a TLS server name) and deciding on it by policy,
//!   with [`dns`], its stub resolver, [`proxy`], each sandbox's socket,
//!   its accept loop and bounds, and [`rate`], the byte rate its
//!   connections share; [`reports`]: what egress and the way in tell a
//!   sandbox to journal as its events, never waiting on a data path;
//! - [`admission`]: which connections reach the server (limits, handshake
//!   timeout); [`budget`]: what their requests may hold while they are read;
//! - [`metrics`]: Prometheus metrics and the endpoint that serves them;
//!   [`telemetry`]: operations' spans (OpenTelemetry, OTLP), under the
//!   trace context their submit carried; [`stall`]: a warning when the
//!   process's runtime falls behind (also used by `corral serve`);
//! - [`state`]: the worker's durable records (sandboxes, id, drain); [`initbin`]: the supervisor
//!   binary; [`service`] and [`server`]: the gRPC edge (auth, health,
//!   reflection), the only place generated types are touched; [`cli`]:
//!   the worker's flags; [`process`]: what a Corral process needs as it
//!   starts (logs, arguments, tokens, certificates), shared with `corral`.
//!
//! It does not own the supervisor (crate `corral-init`) or the wire types
//! (crate `corral-proto`).

pub mod admission;
pub mod budget;
pub mod build;
pub mod cli;
pub mod dns;
pub mod docker;
pub mod durable;
pub mod egress;
pub mod error;
pub mod fork;
pub mod initbin;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod rate;
pub mod registry;
pub mod reports;
pub mod runtime;
pub mod sandbox;
pub mod server;
pub mod service;
pub mod stall;
pub mod state;
pub mod telemetry;
pub mod templates;
pub mod uids;
pub mod volumes;
pub mod worker;

pub use error::WorkerError;
pub use worker::{Worker, WorkerConfig};
