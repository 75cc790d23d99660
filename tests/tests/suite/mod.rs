mod bad_input;
mod cli;
mod hardening;
mod limits;
mod ordering;
mod restart;
mod roundtrip;
mod service;
