#!/usr/bin/env bash
# Builds everything Corral runs: the `corral` and `corral-worker` binaries,
# the static `corral-init` supervisor the worker puts into every sandbox, and
# the default sandbox image. Usage: deploy/build.sh [--debug]
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
[ "${1:-}" = "--debug" ] && profile=dev

cargo build --locked --profile "$profile" --bins
# corral-init must run in images with no C library: link it statically. With
# an explicit --target, RUSTFLAGS reach the target artifacts only, never the
# build scripts and proc-macros (which cannot be static).
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --target x86_64-unknown-linux-gnu -p corral-init
deploy/images/build.sh
# What `corral run` uses by default (about a minute the first time).
deploy/images/build-debian.sh
