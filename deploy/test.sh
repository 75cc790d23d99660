#!/usr/bin/env bash
# Runs Corral's whole test suite against the local Docker engine: builds the
# static corral-init and the sandbox images first (the tests run real
# sandboxes), builds Corral's own images and validates the deployment files,
# then runs every test of the workspace with cargo-nextest, and the Python
# SDK's.
set -euo pipefail
cd "$(dirname "$0")/.."

RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --target x86_64-unknown-linux-gnu -p corral-init
deploy/images/build.sh
deploy/images/build-debian.sh
# Corral's own images (static binaries, FROM scratch), and the Kubernetes
# manifests and Compose file checked against their schemas.
deploy/images/runtime.sh
deploy/validate.sh
cargo build --locked --workspace --bins
# The harness without the worker library (a caller that reaches workers
# over gRPC only) builds too.
cargo check --locked -p corral-harness --no-default-features
# The tests against a real llama.cpp server need its build (about 10
# minutes the first time): deploy/test-llama.sh runs them.
# Each session the suite runs through `corral run` leaves its trajectory in
# target/debug/atif (the SDK's tests validate them): this run's only.
rm -rf target/debug/atif
cargo nextest run --locked --workspace -E 'not test(real_llama)' "$@"
# The Python SDK (sdk/python): ruff, mypy --strict and pytest against real
# workers, in a venv of its own.
sdk/python/test.sh
