#!/usr/bin/env bash
# The test command: install (builds what is missing), then run the whole test suite on the real model, then
# the native code's sanitizer subset (ASan + UBSan build of libllama and the capture shim, scripts/sanitize.sh).
# The HTML token view is checked in a real headless Chromium: where none is installed and this runs as root
# with apt-get (CI, a fresh machine), Debian's chromium is installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "epikv: installing chromium for the token-view test" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium fonts-dejavu-core) >/dev/null
fi
"${EPIKV_VENV:-.venv}/bin/python" -m pytest -q tests "$@"
if [ "${EPIKV_SKIP_SANITIZE:-}" != 1 ]; then
    bash scripts/sanitize.sh
fi
