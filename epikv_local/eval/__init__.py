"""Evaluation: the research harness. Traces (:mod:`.traces`), statistics (:mod:`.stats`), teacher-forced
fidelity (:mod:`.fidelity`) with its long-range metrics (:mod:`.longrange`), free-generation collapse
(:mod:`.collapse`), counterfactual labels (:mod:`.labels`), layer anatomy (:mod:`.anatomy`), the calibration
procedure that writes a model's settings (:mod:`.calibrate`, step 3: :mod:`.signals`) and its command-line
subcommands (:mod:`.commands`). For the benchmark scripts: the policies they run (:mod:`.specs`), their result
documents' provenance and merging (:mod:`.provenance`), reading inputs and writing results (:mod:`.io`),
progress bars (:mod:`.progress`) and figures (:mod:`.plots`).

May import everything of the product (:mod:`epikv_local.engine`, :mod:`epikv_local.policies`,
:mod:`epikv_local.api`); nothing of the product imports it. Plotting (matplotlib) is imported lazily and only
by the functions that draw.
"""
