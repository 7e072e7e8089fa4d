#!/usr/bin/env bash
# Accuracy evidence (issue 21) on a model that answers (default: Qwen2.5-Coder-0.5B-Instruct Q4_K_M from
# ../shared/models/fetch.sh), in parts. Every outcome is one JSONL line as it comes, so a part can be stopped
# and re-run (it resumes) or split over machines (concatenate the records, then PARTS=merge).
# PARTS picks the parts and their order (default: all of them, in this order):
#
#   budgets    GSM8K dev (the first DEV_PROBLEMS): full cache + StreamingLLM at CANDIDATES cells, prompt counted
#              and protected; the merge chooses three budgets per prompt mode, where StreamingLLM loses nearest
#              75 %, 50 % and 25 % of the full cache's right answers ($OUT/accuracy_gsm8k_dev_$TAG.json)
#   calibrate  `epikv-local calibrate` of the model on the dev traces ($OUT/calibration_$TAG.json; its
#              cost_seconds is the calibration time)
#   gsm8k      GSM8K test, the first TEST_PROBLEMS ($OUT/accuracy_gsm8k_$TAG.jsonl): full cache + POLICIES
#              (+ the calibration's two policies once the calibrate part has run) at the budgets chosen on
#              dev, prompt counted and protected
#   math       MATH-500 levels 1-3 (all of them, or the first MATH_PROBLEMS) at the same budgets (MATH has
#              no dev split: GSM8K dev chose them)
#   passkey    recall (a): a code at depths 0.1-0.9 of CONTEXT tokens of dev trace text, RECALL_BUDGET cells,
#              the prompt counted
#   multiturn  recall (b): facts in turns 2-4, asked in turn 8, RECALL_BUDGET cells
#   merge      the summaries of every records file present and not empty
#
# BUDGETS_COUNTED / BUDGETS_PROTECTED (comma-separated) override the dev choice. The full size is hours on 2
# cores (about 10 s per answer); docs/benchmarks.md gives the parts' costs and results.
#   PARTS=budgets bash scripts/accuracy_evidence.sh
#   PARTS="gsm8k merge" TEST_PROBLEMS=100 bash scripts/accuracy_evidence.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${EPIKV_VENV:-.venv}/bin/python"
fail() { echo "accuracy_evidence: $*" >&2; exit 2; }

PARTS="${PARTS:-budgets calibrate gsm8k math passkey multiturn merge}"
MODEL="${MODEL:-}"
if [ -z "$MODEL" ]; then
    MODEL=$(../shared/models/fetch.sh qwen2.5-coder-0.5b) || fail "no MODEL given and ../shared/models/fetch.sh failed"
fi
[ -f "$MODEL" ] || fail "model not found: $MODEL"
TAG="${TAG:-qwen05b}"
OUT="${OUT:-results}"
DATA="${DATA:-../shared/data}"
THREADS="${THREADS:-2}"
MAX_TOKENS="${MAX_TOKENS:-448}"
DEV_PROBLEMS="${DEV_PROBLEMS:-30}"
CANDIDATES="${CANDIDATES:-128,160,192,256,320}"
TEST_PROBLEMS="${TEST_PROBLEMS:-300}"
MATH_PROBLEMS="${MATH_PROBLEMS:-}"
POLICIES="${POLICIES:-streaming,random,epikv,said_epikv,keydiff,triattention,rkv,lagkv,h2o,snapkv}"
RECALL_POLICIES="${RECALL_POLICIES:-streaming,epikv,said_epikv,keydiff,triattention,lagkv}"
RECALL_BUDGET="${RECALL_BUDGET:-256}"
CONTEXT="${CONTEXT:-1024}"
SEEDS="${SEEDS:-6}"
mkdir -p "$OUT"
DEV_RECORDS="$OUT/accuracy_gsm8k_dev_$TAG.jsonl"
DEV_SUMMARY="$OUT/accuracy_gsm8k_dev_$TAG.json"
CAL="$OUT/calibration_$TAG.json"
common=(-m "$MODEL" --data "$DATA" --threads "$THREADS")

chosen() {  # chosen <counted|protected>: the override, else the dev choice of that prompt mode
    local override
    if [ "$1" = counted ]; then override="${BUDGETS_COUNTED:-}"; else override="${BUDGETS_PROTECTED:-}"; fi
    if [ -n "$override" ]; then echo "$override"; return; fi
    [ -f "$DEV_SUMMARY" ] || fail "no budgets for the $1 prompt: run PARTS=budgets first or give BUDGETS_${1^^}"
    "$PY" - "$DEV_SUMMARY" "$1" <<'EOF' || exit 2
import json, sys
c = json.load(open(sys.argv[1])).get("budget_choice", {}).get(sys.argv[2])
if not c or not c["chosen"]:
    sys.exit(f"accuracy_evidence: no budgets chosen on dev for the {sys.argv[2]} prompt "
             f"({c['why'] if c else 'not run'}): run more CANDIDATES or DEV_PROBLEMS, or give the budgets")
print(",".join(map(str, c["chosen"])))
EOF
}

answers() {  # answers <task> <records> [bench_accuracy arguments]: both prompt modes at their chosen budgets
    local task=$1 records=$2; shift 2
    local cal=()
    [ -f "$CAL" ] && cal=(--calibration "$CAL")
    for prompt in counted protected; do
        local budgets
        budgets=$(chosen "$prompt")
        # the full cache evicts nothing, so one run serves both prompt modes
        "$PY" scripts/bench_accuracy.py "${common[@]}" --task "$task" "$@" --policies "$POLICIES" "${cal[@]}" \
            --budgets "$budgets" --prompt "$prompt" --max-tokens "$MAX_TOKENS" --records "$records" \
            $([ "$prompt" = protected ] && echo --no-full)
    done
}

for part in $PARTS; do
    case "$part" in
    budgets)
        for prompt in counted protected; do
            "$PY" scripts/bench_accuracy.py "${common[@]}" --task gsm8k --split dev --limit "$DEV_PROBLEMS" \
                --policies streaming --budgets "$CANDIDATES" --prompt "$prompt" --max-tokens "$MAX_TOKENS" \
                --records "$DEV_RECORDS" $([ "$prompt" = protected ] && echo --no-full)
        done
        "$PY" scripts/bench_accuracy.py --merge --records "$DEV_RECORDS" --out "$DEV_SUMMARY" ;;
    calibrate)
        "$PY" -m epikv_local.cli calibrate -m "$MODEL" --traces "$DATA/r1_traces_dev.jsonl" -t "$THREADS" \
            --out "$CAL" ;;
    gsm8k)
        answers gsm8k "$OUT/accuracy_gsm8k_$TAG.jsonl" --split test --limit "$TEST_PROBLEMS" ;;
    math)
        answers math "$OUT/accuracy_math_l123_$TAG.jsonl" --split test --levels 1,2,3 \
            ${MATH_PROBLEMS:+--limit "$MATH_PROBLEMS"} ;;
    passkey)
        "$PY" scripts/bench_recall.py "${common[@]}" --task passkey --context "$CONTEXT" --seeds "$SEEDS" \
            --first-seed 1000 --budgets "$RECALL_BUDGET" --policies "$RECALL_POLICIES" \
            --records "$OUT/recall_passkey_$TAG.jsonl" ;;
    multiturn)
        "$PY" scripts/bench_recall.py "${common[@]}" --task multiturn --seeds "$((SEEDS * 2))" --first-seed 1000 \
            --budgets "$RECALL_BUDGET" --policies "$RECALL_POLICIES" --records "$OUT/recall_multiturn_$TAG.jsonl" ;;
    merge)
        for f in "$OUT/accuracy_gsm8k_dev_$TAG" "$OUT/accuracy_gsm8k_$TAG" "$OUT/accuracy_math_l123_$TAG"; do
            if [ -s "$f.jsonl" ]; then  # a run stopped before its first answer leaves an empty file
                "$PY" scripts/bench_accuracy.py --merge --records "$f.jsonl" --out "$f.json"
            fi
        done
        for f in "$OUT/recall_passkey_$TAG" "$OUT/recall_multiturn_$TAG"; do
            if [ -s "$f.jsonl" ]; then  # a run stopped before its first answer leaves an empty file
                "$PY" scripts/bench_recall.py --merge --records "$f.jsonl" --out "$f.json"
            fi
        done ;;
    *) fail "unknown part '$part' (budgets calibrate gsm8k math passkey multiturn merge)" ;;
    esac
done
