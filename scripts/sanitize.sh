#!/usr/bin/env bash
# The native code under AddressSanitizer + UndefinedBehaviorSanitizer: builds the patched libllama and the
# capture shim with -fsanitize=address,undefined (ggml's kernels, unpatched, keep their normal flags) into
# build/sanitize/ (reused when nothing changed), then
# runs native tests against those libraries (EPIKV_LIB_DIR) inside the normal Python, with the sanitizer
# runtimes preloaded. Any sanitizer report fails the run (halt_on_error, UBSan errors are fatal).
#
#   bash scripts/sanitize.sh            # CI-sized subset: native, property, state, lifetime and boundary tests
#   bash scripts/sanitize.sh --full     # also generation, policies, state (longer)
#
# Leak checking is off: CPython itself is not built with ASan and keeps memory until exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${EPIKV_VENV:-.venv}/bin/python
BUILD=build/sanitize
LIB=$BUILD/lib
START=$(date +%s)

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    # EPIKV_SANITIZE instruments libllama (the patched source) and the capture shim (CMakeLists.txt)
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY" -DEPIKV_SANITIZE=ON \
        -DGGML_OPENMP=OFF -DGGML_RPC=OFF >/dev/null
fi
cmake --build "$BUILD" --target llama ggml ggml-base ggml-cpu epikv_capture -j "$(nproc)" >/dev/null
mkdir -p "$LIB"
find "$BUILD" -name '*.so*' \( -name 'libllama*' -o -name 'libggml*' -o -name 'libepikv_capture*' \) \
    -not -path "$LIB/*" -exec cp -P {} "$LIB/" \;
BUILT=$(date +%s)
echo "sanitize: built in $((BUILT - START)) s" >&2

ASAN_RT=$(gcc -print-file-name=libasan.so)
UBSAN_RT=$(gcc -print-file-name=libubsan.so)
export EPIKV_LIB_DIR="$PWD/$LIB" LLAMA_CPP_LIB_PATH="$PWD/$LIB"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
tests=(tests/engine/test_native.py "tests/engine/test_properties.py::test_bookkeeping_against_the_real_llama_cpp"
       tests/engine/test_state.py tests/api/test_lifetime.py tests/engine/test_boundary.py)
if [ "${1:-}" = "--full" ]; then
    tests+=(tests/api/test_generation.py tests/policies/test_policies.py tests/api/test_hardening.py)
fi
LD_PRELOAD="$ASAN_RT:$UBSAN_RT" "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "sanitize: tests ran in $(( $(date +%s) - BUILT )) s" >&2
