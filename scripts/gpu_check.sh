#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md). One entry point, three uses:
#
#   bash scripts/gpu_check.sh --prepare            # here: build the travel bundle build/gpu_bundle (prints its size)
#   bash scripts/gpu_check.sh --mode gpu           # on the GPU machine (device tool, carry build/gpu_bundle)
#   bash scripts/gpu_check.sh --mode cpu [--out D] # here / CI: the same driver with small shapes on the CPU
#
# Other options go to the driver, the folder scripts/gpu_check/ run as `python scripts/gpu_check` (--help lists
# them). The run writes ONE result file, gpu_check.json, into --out (gpu mode: $OUT of the device tool when set),
# and this script keeps the console output beside it in gpu_check.log. Interpreter: $PYTHON, else
# .venv/bin/python (prepare, cpu), python3 on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s)}
export PYTHONUNBUFFERED=1

mode=""
out=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --prepare) mode=prepare ;;
        --mode) mode=${args[$((i + 1))]:-} ;;
        --mode=*) mode=${args[$i]#--mode=} ;;
        --out) out=${args[$((i + 1))]:-} ;;
        --out=*) out=${args[$i]#--out=} ;;
        -h|--help) mode=help ;;
    esac
done

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ "$mode" != gpu ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi

case "$mode" in
    prepare|help)
        exec "$PY" scripts/gpu_check "$@"
        ;;
    gpu|cpu)
        if [ "$mode" = gpu ]; then
            # the CUDA build's libraries (libggml-cuda) need the toolkit's runtime (cudart, cublas) at load time,
            # and the loader reads LD_LIBRARY_PATH only when a process starts: set it here
            nvcc_bin=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -n 1 || true)
            nvcc_root=${nvcc_bin:+$(dirname "$(readlink -f "$nvcc_bin")")/..}
            for d in ${nvcc_root:+"$nvcc_root/lib64" "$nvcc_root/lib" "$nvcc_root/targets/x86_64-linux/lib"} \
                     /usr/local/cuda/lib64 /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
                if [ -d "$d" ]; then
                    d=$(cd "$d" && pwd -P)
                    case ":${LD_LIBRARY_PATH:-}:" in
                        *":$d:"*) ;;
                        *) LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" ;;
                    esac
                fi
            done
            export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
        fi
        if [ -z "$out" ]; then
            out=${OUT:-build/gpu_check_out}
            set -- "$@" --out "$out"
        fi
        mkdir -p "$out"
        echo "gpu_check: mode $mode, python $("$PY" -c 'import sys; print(sys.version.split()[0])'), out $out" >&2
        set -o pipefail
        "$PY" scripts/gpu_check "$@" 2>&1 | tee "$out/gpu_check.log"
        ;;
    *)
        echo "usage: bash scripts/gpu_check.sh --prepare | --mode gpu | --mode cpu [--out DIR] [options]" >&2
        exit 2
        ;;
esac
