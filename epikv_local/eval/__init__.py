"""Evaluation: the research harness. Traces (:mod:`.traces`), statistics (:mod:`.stats`), teacher-forced
fidelity (:mod:`.fidelity`), counterfactual labels (:mod:`.labels`), layer anatomy (:mod:`.anatomy`), the
calibration procedure that writes a model's settings (:mod:`.calibrate`) and its command-line subcommands
(:mod:`.commands`).

May import everything of the product (:mod:`epikv_local.engine`, :mod:`epikv_local.policies`,
:mod:`epikv_local.api`); nothing of the product imports it. Plotting (matplotlib) is imported lazily and only
by the functions that draw.
"""
