//! The worker's side of egress by policy: reading what a sandbox's
//! connection asks for (an HTTP proxy request's head, a TLS ClientHello's
//! server name) and deciding on it. Every byte here comes from a sandbox
//! and is hostile: parsers are bounded, total, and never allocate more than
//! their limits.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use corral_proto::egress::{Cidr, Rule, internal_range, normalize_name};

pub mod http;

mod admit;
mod gate;
mod head;
mod hello;
mod relay;
#[cfg(test)]
mod tests;

pub use admit::*;
pub use gate::*;
pub use head::*;
pub use hello::*;
pub use relay::*;
