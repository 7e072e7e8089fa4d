"""In-memory states of ``epikv_local.Llama`` (``save_state`` / ``load_state``, and the entries of a
llama-cpp-python cache set with ``set_cache``).

A state is shaped like ``llama_cpp.llama.LlamaState`` (the attributes llama-cpp-python's caches and callers
read), but its ``llama_state`` bytes are a whole session file (``Session.save_state``): the KV cells with the
holes that evictions left, the eviction engine's bookkeeping, the tokens, and the policy's running state. A
bare llama.cpp context state would lose everything but the cells, and the next eviction would then score the
cache without the policy's history. The bytes are opaque here: they go through a temporary file to and from
the session's own format, which checks them in full when they are loaded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from ..engine.session import Session
from ..errors import ConfigError

#: what ``LlamaState.format`` says for a state of this package (a llama-cpp-python state has no such field)
FORMAT = "epikv-session"


class LlamaState:
    """A saved sequence (picklable, so that ``LlamaDiskCache`` can store it).

    input_ids: (n_tokens,) intc, the token at each position 0..n_tokens-1, evicted ones included
        (llama-cpp-python's is its whole (n_ctx,) buffer; only the first n_tokens mean anything there either).
    scores: (1, n_vocab) float32, the logits of the last decoded token, or (0, n_vocab) when there were none
        (llama-cpp-python's holds a row per token, all zeros unless ``logits_all=True``).
    n_tokens: positions decoded (live cells are at most kv_budget of them).
    llama_state / llama_state_size: the session file's bytes and their count (what the caches' capacity counts).
    seed: the Llama's sampling seed.
    kv_budget, policy, n_live, n_evicted: what the state holds, for inspection (not read back).
    format: :data:`FORMAT`, which ``load_state`` checks.
    """

    def __init__(self, input_ids: np.ndarray, scores: np.ndarray, n_tokens: int, llama_state: bytes,
                 llama_state_size: int, seed: int, kv_budget: int = 0, policy: str = "", n_live: int = 0,
                 n_evicted: int = 0, format: str = FORMAT):
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed
        self.kv_budget = kv_budget
        self.policy = policy
        self.n_live = n_live
        self.n_evicted = n_evicted
        self.format = format

    def __repr__(self) -> str:
        return (f"LlamaState(n_tokens={self.n_tokens}, n_live={self.n_live}, n_evicted={self.n_evicted}, "
                f"policy={self.policy!r}, kv_budget={self.kv_budget}, {self.llama_state_size} bytes)")


def capture(session: Session, seed: int, scores: np.ndarray) -> LlamaState:
    """The session's sequence as a :class:`LlamaState` (``Session.save_state`` through a temporary file)."""
    with tempfile.TemporaryDirectory(prefix="epikv-state-") as d:
        path = Path(d) / "state.epikv"
        session.save_state(path)
        data = path.read_bytes()
    st = session.stats()
    return LlamaState(input_ids=np.asarray(session.tokens, dtype=np.intc), scores=scores, n_tokens=session.n_past,
                      llama_state=data, llama_state_size=len(data), seed=seed, kv_budget=st.kv_budget,
                      policy=st.policy, n_live=st.n_live, n_evicted=st.n_evicted)


def check(state) -> LlamaState:
    """``state`` if it is a state of this package, else ConfigError saying why not."""
    if getattr(state, "format", None) != FORMAT or not isinstance(getattr(state, "llama_state", None), bytes):
        raise ConfigError(
            f"load_state takes a state from epikv_local.Llama.save_state, got {type(state).__name__}: a "
            "llama_cpp LlamaState holds a llama.cpp context state, without the evicted cache's bookkeeping and "
            "the policy's state, so it cannot continue a budgeted session")
    return state


def restore(session: Session, state: LlamaState) -> None:
    """Replace the session's sequence with ``state``'s (``Session.load_state``: DataError when the bytes are
    not a valid session file for this model and cache types; the session is then left as it was)."""
    data = check(state).llama_state
    with tempfile.TemporaryDirectory(prefix="epikv-state-") as d:
        path = Path(d) / "state.epikv"
        path.write_bytes(data)
        session.load_state(path)
