#!/usr/bin/env bash
# The fuzzers' longer mode (the default test command runs them bounded: 200 session-file examples per test, 15
# schemathesis examples per operation and mode, 60 hostile requests):
#   bash scripts/fuzz.sh                 # EPIKV_FUZZ_EXAMPLES=1000
#   EPIKV_FUZZ_EXAMPLES=5000 EPIKV_FUZZ_SECONDS=3600 bash scripts/fuzz.sh
# Session files (tests/engine/test_state_fuzz.py: byte flips, truncations, re-digested edits, crafted headers,
# a planted pickle) and the server (tests/api/test_server_fuzz.py: schemathesis from /openapi.json, hand-written
# hostile generators) on the default model; hypothesis prints each test's case counts.
set -euo pipefail
cd "$(dirname "$0")/.."
export EPIKV_FUZZ_EXAMPLES="${EPIKV_FUZZ_EXAMPLES:-1000}"
exec "${EPIKV_VENV:-.venv}/bin/python" -m pytest -q -s -p no:cacheprovider --hypothesis-show-statistics \
    tests/engine/test_state_fuzz.py tests/api/test_server_fuzz.py "$@"
