#!/usr/bin/env bash
# Held-out evidence (issue 12) on the default model (SmolLM2-135M), one command:
#
#   (0) counterfactual labels + layer anatomy on the dev traces (results/anatomy_smollm2.json, the figure)
#   (a) calibration on the dev traces only: EPIKV's settings, TriAttention's query statistics and the policy
#       selected among the signals, overall and per budget (written to results/calibration_smollm2.json; with
#       CALIB_TO_PACKAGE=1 to the package's shipped calibration instead, epikv_local/calibrations/<sha256>.json)
#   (b) held-out fidelity on r1_traces_test.jsonl: every registered policy at its defaults, epikv_calibrated and
#       calibrated, budgets 128, 256, 512, 1024, all-token + key-token + answer-span metrics, paired with
#       StreamingLLM (nothing is chosen on these numbers)
#   (b') free-generation collapse on held-out MATH-500 prompts, every policy + the calibration's
#   (c) the tables and the figure (scripts/report.py -> docs/benchmarks.md, docs/figures/)
#
# Full size (the committed results): N_TRACES=8 MAX_TOKENS=1536, about 3 h on 2 cores (calibration ~28 min,
# held-out fidelity ~2 h, collapse ~20 min; measured in parts, docs/benchmarks.md).
# Reduced: e.g. N_TRACES=2 MAX_TOKENS=1152 bash scripts/evidence.sh
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
    --batch 8 --out "$LABELS" --threads "$THREADS"
"$PY" scripts/anatomy.py --labels "$LABELS" --threads "$THREADS"

# (a) calibration (dev only); reuses the labels above for the layer ranking
if [ "${CALIB_TO_PACKAGE:-0}" = 1 ]; then
    SHA=$("$PY" -c 'from epikv_local.api.calibration import model_sha256; from epikv_local.api.models import default_model_path; print(model_sha256(default_model_path()))')
    CAL="epikv_local/calibrations/$SHA.json"
else
    CAL=results/calibration_smollm2.json
fi
"$PY" -m epikv_local.cli calibrate --traces "$DEV" --labels "$LABELS" --threads "$THREADS" --out "$CAL"

# (b) held-out test: every registered policy + epikv_calibrated + calibrated (this calibration's choices)
"$PY" scripts/bench_fidelity.py --traces "$TEST" --n-traces "$N_TRACES" --max-tokens "$MAX_TOKENS" \
    --budgets "$BUDGETS" --calibration "$CAL" --name "test_evidence" --threads "$THREADS"

# (b') free-generation collapse on MATH-500 prompts not used on dev (the dev run took the first 6): every
#      registered policy + this calibration's, budgets 64 and 128, 8 prompts x 256 tokens
"$PY" scripts/bench_collapse.py --skip-prompts 6 --n-prompts 8 --max-tokens 256 --budgets 64,128 \
    --policies all --calibration "$CAL" --name heldout --threads "$THREADS"

# (c) tables and figure
"$PY" scripts/report.py
