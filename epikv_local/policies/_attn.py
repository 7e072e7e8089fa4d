"""Helpers shared by the attention-based policies (h2o, tova, snapkv)."""

from __future__ import annotations

import numpy as np


def per_position(obs, which: str, who: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of the cells holding a position (cell_pos >= 0) for obs.<which>."""
    vals = getattr(obs, which)
    if obs.cell_pos is None or vals is None:
        raise RuntimeError(f"{who}.observe without attention: the session must run with flash attention off "
                           "and needs_attention")
    cell_pos = np.asarray(obs.cell_pos)
    vals = np.asarray(vals, dtype=np.float64)
    n = min(len(cell_pos), len(vals))
    cell_pos, vals = cell_pos[:n], vals[:n]
    ok = cell_pos >= 0
    return cell_pos[ok].astype(np.int64), vals[ok]
