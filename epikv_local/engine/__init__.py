"""Engine: everything that touches llama.cpp, and the budget.

Owns the native bindings (:mod:`.native`: cffi declarations mirroring the patched ``llama.h`` and
``native/epikv_capture.h``, C return codes turned into exceptions), the model and context handles
(:mod:`.handles`), the capture plan that turns a policy's declared signals into native capture
(:mod:`.capture`), the one selection step (:mod:`.selection`), the budget engine (:mod:`.budget`), the
llama.cpp sampler chain (:mod:`.sampling`), the session that ties them together (:mod:`.session`), saving and
restoring a session's sequence (:mod:`.state`) and the ``KVContext`` protocol the engine expects of a context
(:mod:`.protocol`).

May import: numpy, cffi, llama_cpp (ctypes bindings only, loaded by :func:`.native.load`),
:mod:`epikv_local.policies` (the scorer contract and scoring math) and :mod:`epikv_local.errors`.
Never the front doors (:mod:`epikv_local.api`) or the evaluation code (:mod:`epikv_local.eval`).
Importing it loads nothing native.
"""
