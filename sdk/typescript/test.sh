#!/usr/bin/env bash
# The TypeScript SDK's checks and tests, as deploy/test.sh runs them: built
# by Debian's TypeScript compiler (tsc, strict), then its tests with Node's
# own runner against a real worker (the debug binaries of `cargo build
# --workspace --bins` and the static corral-init of deploy/test.sh). No
# npm packages: the SDK has no dependencies. Run twice: against the worker,
# then through a front door.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf dist
tsc -p .
node --test test/*.test.mjs
# The same tests as a tenant of a front door (a key, not the worker's token).
CORRAL_TS_THROUGH=front-door node --test test/*.test.mjs
