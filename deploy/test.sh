#!/usr/bin/env bash
# Runs Corral's whole test suite against the local Docker engine: builds the
# static corral-init and the sandbox image first (the tests run real
# sandboxes), then every test of the workspace with cargo-nextest.
set -euo pipefail
cd "$(dirname "$0")/.."

RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --target x86_64-unknown-linux-gnu -p corral-init
deploy/images/build.sh
deploy/images/build-debian.sh
cargo build --locked --workspace --bins
# The tests against a real llama.cpp server need its build (about 10
# minutes the first time): deploy/test-llama.sh runs them.
cargo nextest run --locked --workspace -E 'not test(real_llama)' "$@"
