//! End-to-end tests: one binary, modules under `suite/`.
mod suite;
