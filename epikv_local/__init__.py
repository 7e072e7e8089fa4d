"""epikv-local: attention-free (EPIKV) KV-cache eviction for reasoning models on a patched llama.cpp.

Importing this package loads nothing native; :func:`epikv_local.native.load` (called by ``Model``) does.
Main API (lazily imported): ``Model``, ``Session``, ``SessionConfig``, ``BudgetConfig``, ``ScoringConfig``,
``make_policy``, ``generate``, ``stream_generate``, ``SamplingConfig``, ``default_model_path``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Model": "model", "Session": "session", "SessionConfig": "session", "BudgetConfig": "eviction",
    "ScoringConfig": "scoring", "make_policy": "policies", "generate": "generate",
    "stream_generate": "generate", "SamplingConfig": "generate", "apply_chat_template": "generate",
    "tokenize_prompt": "generate", "default_model_path": "default_model",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'epikv_local' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
