"""What the engine needs of a llama.cpp context, as an explicit ``Protocol``.

:class:`~epikv_local.engine.handles.Context` implements it over the patched llama.cpp; tests (and a future
backend) can stand in with any object that has these members. Shapes: T tokens of one decode, C KV cells,
V vocabulary entries; positions are int token indices of one sequence (holes allowed after evictions).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class KVContext(Protocol):
    #: KV cells allocated (llama.cpp may round the requested size up)
    n_ctx: int
    #: the most tokens one ``decode`` call takes
    n_batch: int

    def decode(self, tokens: list[int], positions, logits_last: bool = True, logits_all: bool = False,
               seq_id: int = 0) -> None:
        """Decode T tokens at the given positions; KVFullError when no KV slot is found."""

    def logits(self, i: int = -1) -> np.ndarray:
        """(V,) float32 logits of output row i of the last decode."""

    def seq_rm_positions(self, positions: np.ndarray, seq_id: int = 0) -> int:
        """Remove the listed positions in one pass; returns the number of cells removed."""

    def seq_rm_range(self, p0: int, p1: int, seq_id: int = 0) -> None:
        """Remove positions [p0, p1) (p1 < 0: to the end)."""

    def cell_positions(self, seq_id: int = 0) -> np.ndarray:
        """(C,) int32 position held by each cell (-1: none)."""

    def layer_out(self, il: int, n_tokens: int) -> np.ndarray | None:
        """(T, n_embd) float32 output hidden states of layer il for the last decode (None: not captured)."""

    def layer_keys(self, il: int, n_tokens: int) -> np.ndarray | None:
        """(T, d_k) float32 keys after RoPE of layer il for the last decode (None: not captured)."""

    def set_layer_capture(self, il: int, enable: bool = True, kind: int = 0) -> None:
        """Capture layer il's output (kind 0), keys (kind 1) or queries (kind 2) from the next decode on."""

    def layer_capture(self, il: int, n_tokens: int, kind: int = 0) -> np.ndarray | None:
        """(T, row) float32 captured rows of layer il of ``kind`` for the last decode (None: not captured)."""

    def set_kv_full_callback(self, fn) -> None:
        """Install fn(n_tokens) -> bool, called by llama_decode when a ubatch does not fit."""

    def clear(self) -> None:
        """Empty the cache."""

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for the KV cache."""
