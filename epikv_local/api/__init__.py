"""Front doors: what users call. The generation loop (``generate_step -> stream_generate -> generate``, each
item carrying its statistics), the ``Llama``-shaped API (:mod:`.llama`), the one assembly of a session from
user settings (:mod:`.session_spec`), chat templates, the default model, the calibration store read at run
time, the OpenAI-compatible server (:mod:`.server`), the terminal chat (:mod:`.terminal`), the token view
(:mod:`.tokenview`) and the command line (:mod:`.cli`, :mod:`.options`).

May import: :mod:`epikv_local.engine`, :mod:`epikv_local.policies`, :mod:`epikv_local.errors`. Never the
evaluation code (:mod:`epikv_local.eval`): the research harness builds on the product, not the reverse.
"""
