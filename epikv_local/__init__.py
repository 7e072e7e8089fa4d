"""epikv-local: attention-free (EPIKV) KV-cache eviction for reasoning models on a patched llama.cpp.

Layers (each subpackage's docstring says what it owns and may import):

* :mod:`epikv_local.engine` -- native bindings, model/context handles, capture, selection, budget engine,
  session;
* :mod:`epikv_local.policies` -- scorers only (numpy), one registry;
* :mod:`epikv_local.api` -- front doors: generation loop, sampling, chat templates, default model,
  calibration store, command line;
* :mod:`epikv_local.eval` -- the research harness (traces, fidelity, labels, anatomy, calibration); the
  product never imports it.

Importing this package loads nothing native; :func:`epikv_local.engine.native.load` (called by ``Model``)
does. The main API below is imported lazily on first access.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (module names never equal an export, so an import of the module
# cannot shadow the exported object on this package)
_EXPORTS = {
    "Model": "engine.handles", "Session": "engine.session", "SessionConfig": "engine.session",
    "BudgetConfig": "engine.budget", "ScoringConfig": "policies.scoring", "make_policy": "policies",
    "generate": "api.generation", "stream_generate": "api.generation", "generate_step": "api.generation",
    "SamplingConfig": "engine.sampling", "apply_chat_template": "api.chat", "tokenize_prompt": "api.chat",
    "default_model_path": "api.models", "resolve_policy": "api.calibration",
    "EpikvError": "errors", "ConfigError": "errors", "BudgetError": "errors", "ModelError": "errors",
    "NativeError": "errors", "Llama": "api.llama",
    "token_view": "api.tokenview", "generate_batch": "api.slots", "SequencePool": "engine.pool",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'epikv_local' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
