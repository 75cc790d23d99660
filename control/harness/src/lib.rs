//! corral-harness: Corral's agent harness, as a library.
//!
//! It owns everything a session is made of, and one front door to it
//! ([`sessions`]: start, resume, fork, remove, list; [`runner`]: a
//! session's run on a [`fleet`] of workers, across its sandboxes, to its
//! end); the `corral` binary is a thin command line over it. Its parts:
//!
//! - [`agent`]: the coordinator (an event loop per session) around an
//!   I/O-free core whose records are the only way a session changes;
//! - [`context`]: the pure context builder (what the model is sent);
//! - [`tools`]: translators from tool calls to operations and back;
//! - [`llm`]: model clients (OpenAI Responses and Chat Completions, SSE);
//! - [`session`]: the durable, append-only session log;
//! - [`ops`]: operation managers (one actor per sandbox);
//! - [`worker_api`]: the worker's calls as one trait, implemented by the
//!   worker library in this process (`local_api`, feature `local`, on by
//!   default: without it the harness links no worker) and by [`client`],
//!   the typed gRPC client;
//! - [`follow`]: the one way to wait for operations (events followed from
//!   a cursor across reconnects); [`listeners`]: who owns a socket on this
//!   machine that a token would go to;
//! - [`transfer`]: trees in and out of a sandbox as tar streams;
//! - [`placement`]: workers found by list or DNS, and where a new sandbox
//!   goes among them; [`fleet`]: a caller's workers, the one place that
//!   answers which worker (place, find a sandbox's, find a session's again
//!   by its id); [`metrics`]: the control plane's metrics;
//! - [`atif`]: a session as a trajectory in Harbor's ATIF; [`timeline`]:
//!   a session on a time axis (data, terminal view, HTML page);
//!   [`telemetry`]: a run's traces (OpenTelemetry, OTLP);
//! - [`host`]: the sessions a service (`corral serve`) hosts, each one's
//!   run, journal of events, inputs and stops, and the marks that resume
//!   them after a restart; [`control`]: the client of such a service;
//!   [`audit`]: the
//!   hash-chained log of the calls a service answers; [`tenants`]: the
//!   tenants and keys a service checks its callers against.
//!
//! It runs no operation itself: workers do.

pub mod agent;
pub mod atif;
pub mod audit;
pub mod client;
pub mod context;
pub mod control;
pub mod fleet;
pub mod follow;
pub mod host;
pub mod listeners;
pub mod llm;
#[cfg(feature = "local")]
pub mod local_api;
pub mod metrics;
pub mod ops;
pub mod placement;
pub mod runner;
pub mod session;
pub mod sessions;
pub mod telemetry;
pub mod tenants;
pub mod timeline;
pub mod tools;
pub mod transfer;
pub mod worker_api;
