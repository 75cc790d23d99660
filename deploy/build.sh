#!/usr/bin/env bash
# Builds everything Corral runs: the `corral` and `corral-worker` binaries,
# the static `corral-init` supervisor the worker puts into every sandbox, and
# the default sandbox image. Usage: deploy/build.sh [--debug]
set -euo pipefail
cd "$(dirname "$0")/.."

triple=x86_64-unknown-linux-gnu
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
# corral-init must run in images with no C library: link it statically. With
# an explicit --target, RUSTFLAGS reach the target artifacts only, never the
# build scripts and proc-macros (which cannot be static). The release
# binaries are built the same way, once: Corral's own images
# (deploy/images/runtime.sh, which deploy/test.sh runs) take these very ones.
if [ "${1:-}" = "--debug" ]; then
    cargo build --locked --bins
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --locked --release --target "$triple" -p corral-init
else
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --locked --release --target "$triple" \
        -p corral-worker -p corral-init -p corral-control
    mkdir -p "$target_dir/release"
    for bin in corral corral-worker; do
        cp -f "$target_dir/$triple/release/$bin" "$target_dir/release/$bin"
    done
fi
deploy/images/build.sh
# What `corral run` uses by default (about a minute the first time).
deploy/images/build-debian.sh
