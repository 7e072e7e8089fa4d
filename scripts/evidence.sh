#!/usr/bin/env bash
# Evidence for "Make EPIKV win on the models users run" (SmolLM2-135M, the default model).
#
#   (0) counterfactual labels + layer anatomy on the dev traces (results/anatomy_smollm2.json, the figure)
#   (a) calibration on the dev traces only (writes ~/.cache/epikv-local/calibration/<sha256>.json)
#   (b) held-out fidelity on r1_traces_test.jsonl: EPIKV default, EPIKV calibrated and every baseline at
#       budgets 128, 256, 512, 1024 (nothing is chosen on these numbers)
#
# Full size: N_TRACES=8 MAX_TOKENS=1536 (hours on 2 cores: every baseline incl. the flash-off attention
# policies). Reduced: e.g. N_TRACES=3 MAX_TOKENS=1152 BUDGETS=128,256,512,1024 bash scripts/evidence.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${EPIKV_VENV:-.venv}/bin/python"
THREADS="${THREADS:-2}"
N_TRACES="${N_TRACES:-8}"
MAX_TOKENS="${MAX_TOKENS:-1536}"
BUDGETS="${BUDGETS:-128,256,512,1024}"
DEV=../shared/data/r1_traces_dev.jsonl
TEST=../shared/data/r1_traces_test.jsonl
LABELS=results/labels_smollm2_r1_traces_dev.jsonl
mkdir -p results

# (0) labels (resumable) and anatomy: 3 dev traces x 768 tokens, horizon 32, stride 16
"$PY" -m epikv_local.cli labels --traces "$DEV" --n-traces 3 --max-tokens 768 --horizon 32 --stride 16 \
    --out "$LABELS" --threads "$THREADS"
"$PY" scripts/anatomy.py --labels "$LABELS" --threads "$THREADS"

# (a) calibration (dev only); reuses the labels above for the layer ranking
"$PY" -m epikv_local.cli calibrate --traces "$DEV" --labels "$LABELS" --threads "$THREADS"

# (b) held-out test: every registered policy (epikv = default settings) + epikv_calibrated
"$PY" scripts/bench_fidelity.py --traces "$TEST" --n-traces "$N_TRACES" --max-tokens "$MAX_TOKENS" \
    --budgets "$BUDGETS" --calibration auto --name "test_evidence" --threads "$THREADS"
