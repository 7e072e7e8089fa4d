"""How the token view shows values: the colour scale, score percentiles and the short texts of scores, sizes
and tokens. Pure functions of plain values (no records, no HTML)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

#: diverging scale, low score (evicted first) -> high score (kept): (fraction in [0, 1], (r, g, b) 0..255)
SCALE = ((0.0, (69, 117, 180)), (0.25, (145, 191, 219)), (0.5, (247, 247, 247)), (0.75, (253, 174, 97)),
         (1.0, (215, 48, 39)))


def _mix(q: float) -> tuple[int, int, int]:
    """The scale's (r, g, b) at fraction q, linearly between its stops (q clamped to [0, 1])."""
    q = min(1.0, max(0.0, q))
    for (f0, c0), (f1, c1) in zip(SCALE, SCALE[1:]):
        if q <= f1:
            t = (q - f0) / (f1 - f0) if f1 > f0 else 0.0
            return tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))
    return SCALE[-1][1]


def colour(q: float | None, light: float = 0.35) -> str:
    """Background colour ("#rrggbb") of a percentile q in [0, 1] (None: unscored), lightened towards white by
    ``light`` (a share in [0, 1]) so that black text stays readable on it."""
    if q is None:
        return "#e6e6e6"
    r, g, b = (round(c + (255 - c) * light) for c in _mix(q))
    return f"#{r:02x}{g:02x}{b:02x}"


def percentiles(scores: Sequence[float | None]) -> list[float | None]:
    """Each score's mid-rank percentile in [0, 1] among the run's scores (ties share one; inf sorts at the ends;
    None stays None). All equal: 0.5."""
    vals = np.array([s for s in scores if s is not None], dtype=np.float64)
    if len(vals) == 0:
        return [None] * len(scores)
    srt = np.sort(vals)
    n = len(srt)
    out: list[float | None] = []
    for s in scores:
        if s is None:
            out.append(None)
            continue
        lo = int(np.searchsorted(srt, s, "left"))
        hi = int(np.searchsorted(srt, s, "right"))
        out.append(0.5 if n == 1 or (lo == 0 and hi == n) else ((lo + hi - 1) / 2) / (n - 1))
    return out


def fmt_score(s: float | None) -> str:
    """A score as shown: integers without a decimal point, others to 3 significant digits, "+inf"/"-inf",
    "unscored" for None or NaN."""
    if s is None or math.isnan(s):
        return "unscored"
    if math.isinf(s):
        return "+inf" if s > 0 else "-inf"
    if s == int(s) and abs(s) < 1e9:
        return str(int(s))
    return f"{s:.3g}"


def fmt_bytes(n: int) -> str:
    """A size in bytes as B, KiB, MiB or GiB (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def display_text(text: str) -> str:
    """What a token's span shows (before escaping): a run of line breaks gets one visible mark (so that a
    newline token has something to colour) and keeps its breaks; everything else is shown as is."""
    return re.sub(r"(\r\n|\r|\n)+", lambda m: "\u21b5" + "\n" * m.group(0).replace("\r\n", "\n").count("\n")
                  if "\n" in m.group(0) else "\u21b5", text)
