"""Front doors: what users call. The generation loop (``generate_step -> stream_generate -> generate``),
sampling, chat templates, the default model, the calibration store read at run time, and the command line.

May import: :mod:`epikv_local.engine`, :mod:`epikv_local.policies`, :mod:`epikv_local.errors`. Never the
evaluation code (:mod:`epikv_local.eval`): the research harness builds on the product, not the reverse.
"""
