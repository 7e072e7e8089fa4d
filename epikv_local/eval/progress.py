"""Progress bars with an ETA for the long evaluation commands (labels, calibrate, benchmarks).

tqdm on stderr. ``EPIKV_PROGRESS=0`` switches the bars off; when stderr is not a terminal (logs, CI) a bar
is redrawn at most every 30 s so that log files stay readable.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable


def progress_bar(iterable: Iterable | None = None, desc: str = "", total: int | None = None, unit: str = "it"):
    """A tqdm bar (``update(n)``, ``close()``, iterable) on stderr."""
    from tqdm import tqdm

    off = os.environ.get("EPIKV_PROGRESS", "1") == "0"
    tty = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=off,
                mininterval=0.5 if tty else 30.0, dynamic_ncols=tty, leave=tty)
