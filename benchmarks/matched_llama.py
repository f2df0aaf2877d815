"""Llama 3 debug flavors of 1 to 32 blocks (`layers_N`), registered from outside the framework
(`--job.custom_import benchmarks/matched_llama.py`): the families table of benchmarks/benchmark.py
sets each family's debug model beside the Llama of the nearest parameter count."""

import dataclasses

from models import get_model_spec

_LLAMA = get_model_spec("llama3")
for _n in range(1, 33):
    _LLAMA.flavors[f"layers_{_n}"] = dataclasses.replace(_LLAMA.flavors["debug"], n_layers=_n)
