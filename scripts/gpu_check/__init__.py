"""The prepared GPU check: native checks and a speed / memory / context comparison, in one JSON file.

Three uses (``scripts/gpu_check.sh`` picks the interpreter, runs ``python scripts/gpu_check ...`` and keeps a
log; docs/gpu.md says how to run them):

``--prepare`` (here, before a device run)
    Builds the travel bundle ``build/gpu_bundle/`` (ignored by git; the device tool carries it):
    ``llama.cpp.tar.gz`` (the patched llama.cpp tree of ``scripts/prepare_llama_cpp.py``, pruned to what a
    CUDA build of libllama + ggml-base/-cpu/-cuda/-rpc needs), ``vocab-llama-bpe.gguf`` (llama.cpp's
    vocab-only Llama-3 tokenizer: the random models get Llama-3's 128,256-token vocabulary), ``wheels/``
    (cffi and pycparser for CPython 3.12 manylinux x86-64), ``site/`` (the pure-Python packages llama_cpp --
    ctypes bindings only --, gguf and diskcache, copied from this environment) and ``manifest.json``.
    Fails when the bundle exceeds ``--max-bundle-mib`` or bundle + working tree exceed the tool's 64 MiB.

``--mode gpu`` (there, on the machine with the GPU)
    Unpacks the bundle into ``build/gpu_run/`` (kept on a warm machine: a rerun skips what is done),
    installs the wheels, builds the patched library and the capture shim with CUDA (sm_90, ninja, all
    cores, only the needed targets) while a background process writes the 8B-shaped F16 model, then runs
    the checks and measurements below on the GPU. Refuses to run without an NVIDIA GPU: it never produces
    GPU figures from anything else.

``--mode cpu`` (here and in CI)
    The same driver with small shapes on the CPU and the installed package (no rebuild): a 4-layer random
    model, contexts 256/512/1024. Same JSON schema, ``"mode": "cpu"``.

Both modes, on random-weight models made by ``scripts/make_random_model.py``:

* native checks, as pytest tests behind the backend fixture (``backend``: the device and the model): the
  checks of ``checks`` (captured layer outputs of the model with every layer on the GPU vs the same file on
  the CPU, within a stated tolerance; an evicting session holds its budget, engine and llama.cpp's cells
  agree; EPIKV with a budget >= the sequence gives logits bit-identical to no eviction) and
  tests/engine/test_native.py's flash-attention graph test (FLASH_ATTN_EXT nodes, no soft_max);
* per variant -- ``plain`` (no eviction, full cache), ``epikv`` and ``streaming`` (KV budget ``--budget``),
  ``h2o`` (flash attention off, attention read back) -- a growing sequence (random prompt tokens, prefilled
  in ``--batch`` chunks, eviction on) with a greedy decode of ``--decode-tokens`` tokens at each context of
  ``--contexts``: decode tokens/s, eviction rounds and their mean time, live cells, KV bytes, memory in use
  (GPU: ``nvidia-smi`` memory.used; CPU: process RSS). The sequence then keeps growing (checkpoints at
  doubling lengths up to ``--max-context``) until the variant's time cap, its cache (plain) or the run's
  deadline: the longest context each variant reaches, and why it stopped. Plain gets one session per context
  with a cache of exactly that size, then one sized for ``--max-context`` for the search;
* GPU mode, with the time left: the whole of ``tests/engine/test_native.py`` on the same backend (a
  SmolLM2-shaped random model with every layer on the GPU).

Result: ``<out>/gpu_check.json`` (written after every stage, so a run cut short still leaves its results).
Exit status: 0 when every check passed and every stage ran; 1 when a check or a stage failed (the JSON says
which); 2 with one ``gpu_check: error: ...`` line for bad input or a missing prerequisite.

The modules: ``common`` (paths, CheckError, small helpers), ``presets`` (the two modes' shapes and settings),
``bundle`` (--prepare), ``facts`` (GPU, memory, tool versions, ggml's devices), ``build`` (--mode gpu: unpack,
wheels, configure, build), ``models`` (the random models), ``backend`` (the pytest plugin: backend fixture and
per-test report), ``checks`` (the native checks as pytest tests), ``native`` (runs them in a subprocess and
turns the plugin's report into the JSON's entries), ``measure`` (the variants), ``run`` (stages, deadline,
the JSON), ``cli`` (the options); ``__main__`` is the entry point.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# the sibling scripts (benchlib, prepare_llama_cpp, make_random_model) and the package itself, which travels
# as a working tree to the GPU machine (not installed there)
for _p in (str(SCRIPTS), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
