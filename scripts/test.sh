#!/usr/bin/env bash
# The test command: install (builds what is missing), then run the whole test suite on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${EPIKV_VENV:-.venv}/bin/python" -m pytest -q tests "$@"
