//! corral-init: the supervisor that runs as PID 1 inside every sandbox.
//!
//! The worker puts this binary (built static, so it runs in any image, even a
//! `FROM scratch` one) into each container as its entrypoint, and talks to it
//! over the container's attached stdin/stdout with length-delimited frames
//! (`corral_proto::frame`, messages in `corral/v1/init.proto`). No network.
//!
//! This crate owns:
//! - [`supervisor`]: the single-threaded poll loop that runs operations, each
//!   shell command in its own process group, enforces timeouts and cancels,
//!   reaps zombies, reads output under flow-control credit, and answers
//!   re-attaching workers from its journal;
//! - [`keeper`]: one per running command, the subreaper of all it starts,
//!   so that nothing escapes its operation by leaving its session;
//! - [`journal`]: the bounded, sequence-numbered event log (shared with the
//!   worker, which keeps one per sandbox for its watchers);
//! - [`capture`]: head/tail capture of an output stream with its full size;
//! - [`fileops`]: read/write of files confined to the sandbox's roots;
//! - [`archive`]: trees in and out as tar streams (`corral cp`), each in a
//!   process of its own run as the sandbox's user;
//! - [`listing`]: a directory's entries, listed in a process of its own
//!   that the sandbox's commands cannot trace (`files.list`);
//! - [`users`]: the sandbox user's `passwd` and `group` entries, for the
//!   uid the worker chose;
//! - [`ingress`]: the way in, connections the worker asks for to ports of
//!   the sandbox's loopback, dialled from inside and handed over or carried
//!   (a process of its own, started on the worker's first ask);
//! - [`relay`]: the egress proxy address on the sandbox's loopback, each
//!   connection carried to the worker's socket for this sandbox (a process
//!   of its own, started and restarted by the supervisor);
//! - [`treecopy`]: a fork's copy of one sandbox's writable trees into
//!   another, run by the worker on the host as a process of its own;
//! - [`syscalls`]: the seccomp filters it applies to itself and all it
//!   starts (io_uring, AF_VSOCK), on top of the engine's profile.
//!
//! It must stay small and static: no async runtime, no threads, nothing that
//! needs a shared library.

// The supervisor has no tracing subscriber: its stderr is its log, which the
// worker reads from the attach stream and logs with the sandbox's id.
#![allow(clippy::print_stderr)]

pub mod archive;
pub mod capture;
pub mod fileops;
pub mod ingress;
pub mod journal;
pub mod keeper;
pub mod listing;
pub mod procs;
pub mod relay;
pub mod supervisor;
pub mod syscalls;
pub mod treecopy;
pub mod users;

/// Version reported in the init's Welcome frame.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
