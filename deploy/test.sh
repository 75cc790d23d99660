#!/usr/bin/env bash
# Runs Corral's whole test suite against the local Docker engine: builds the
# static corral-init and the sandbox images first (the tests run real
# sandboxes), builds Corral's own images and validates the deployment files,
# then runs every test of the workspace with cargo-nextest, the Python
# SDK's and the TypeScript SDK's.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the suite needs of this machine, said before anything is built (a
# first build takes 15-20 minutes on 2 cores): `.ci/run` installs and sets
# up all of it on Debian.
missing=()
need() { "$@" >/dev/null 2>&1 || missing+=("$WHAT"); }
WHAT="cargo-nextest (cargo install --locked cargo-nextest)" need cargo nextest --version
WHAT="a Docker engine that answers (docker info)" need docker info
WHAT="busybox-static and bash-static (apt-get install busybox-static bash-static)" \
    need test -x /bin/busybox -a -x /bin/bash-static
WHAT="python3 with venv (apt-get install python3-venv)" need python3 -m venv --help
WHAT="chromium (apt-get install chromium)" need sh -c 'command -v chromium || command -v chromium-browser'
WHAT="openssl (apt-get install openssl)" need command -v openssl
WHAT="curl and jq (apt-get install curl jq)" need sh -c 'command -v curl && command -v jq'
WHAT="Node 20 and TypeScript (apt-get install nodejs node-typescript)" need sh -c 'command -v node && command -v tsc'
WHAT="ip and iptables (apt-get install iproute2 iptables)" need sh -c 'command -v ip && command -v iptables'
if docker info >/dev/null 2>&1; then
    runtimes=$(docker info --format '{{json .Runtimes}}' 2>/dev/null || true)
    case "$runtimes" in
        *'"runsc"'*host-uds=open*) ;;
        *) missing+=("gVisor registered with the engine as runtime runsc, with --network=none and --host-uds=open (apt-get install runsc; see .ci/run for /etc/docker/daemon.json)") ;;
    esac
    [ "$(docker info --format '{{.ExperimentalBuild}}' 2>/dev/null)" = "true" ] ||
        missing+=("the engine's experimental features (\"experimental\": true in /etc/docker/daemon.json, then restart dockerd)")
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "deploy/test.sh: this machine lacks what the suite needs:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    echo "(.ci/run installs and sets up all of it on Debian)" >&2
    exit 2
fi

RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --target x86_64-unknown-linux-gnu -p corral-init
deploy/images/build.sh
deploy/images/build-debian.sh
# A real Jupyter server for the way-in tests (wheels from PyPI, built
# offline FROM corral-debian; cached).
tests/jupyter/build-image.sh
# Corral's own images (static binaries, FROM scratch), and the Kubernetes
# manifests and Compose file checked against their schemas.
deploy/images/runtime.sh
deploy/validate.sh
# No import cycles among the project's own files, Rust or Python.
python3 tests/imports.py
cargo build --locked --workspace --bins
# The harness without the worker library (a caller that reaches workers
# over gRPC only) builds too.
cargo check --locked -p corral-harness --no-default-features
# The tests against a real llama.cpp server need its build (about 10
# minutes the first time): deploy/test-llama.sh runs them.
# Each session the suite runs through `corral run` leaves its trajectory in
# target/debug/atif (the SDK's tests validate them): this run's only.
rm -rf target/debug/atif
# Both suites run whatever the first says; the script fails if either did.
rust=0
cargo nextest run --locked --workspace -E 'not test(real_llama)' "$@" || rust=$?
# The Python SDK (sdk/python): ruff, mypy --strict and pytest against real
# workers, in a venv of its own.
sdk=0
sdk/python/test.sh || sdk=$?
# The TypeScript SDK (sdk/typescript): tsc, then node --test against a
# real worker.
ts=0
sdk/typescript/test.sh || ts=$?
if [ "$rust" != 0 ] || [ "$sdk" != 0 ] || [ "$ts" != 0 ]; then
    echo "deploy/test.sh: failed: the Rust suite exited $rust, the Python SDK's $sdk, the TypeScript SDK's $ts" >&2
    exit 1
fi
