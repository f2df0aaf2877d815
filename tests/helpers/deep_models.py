"""A deeper Llama for memory tests (via --job.custom_import tests.helpers.deep_models):

- "llama3_deep": the debug flavor with 24 blocks instead of 6, the same largest parameter (the
  4096 × 256 embedding and head), so the whole model is 3.3× the debug model's bytes.
"""

import dataclasses

from models import get_model_spec, register_model_spec

_llama = get_model_spec("llama3")
register_model_spec(dataclasses.replace(_llama, name="llama3_deep", flavors={
    "debug": dataclasses.replace(_llama.flavors["debug"], n_layers=24)}))
