"""Entry point: ``python scripts/gpu_check [options]`` (what scripts/gpu_check.sh runs), or
``python -m gpu_check`` with ``scripts/`` on the path; the options are ``cli``'s."""

import sys
from pathlib import Path

if __package__ in (None, ""):
    # run as a folder: Python put the folder itself first on sys.path, where its modules (build, run, ...) would
    # shadow top-level modules of those names; put scripts/ there instead and import the package
    HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    sys.path.insert(0, str(HERE.parent))

from gpu_check.cli import main  # noqa: E402  (after the path fix above)
from epikv_local.errors import run_main  # noqa: E402  (gpu_check put the repository on the path)

if __name__ == "__main__":
    sys.exit(run_main("gpu_check", main))
