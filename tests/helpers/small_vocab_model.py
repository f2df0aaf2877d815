"""A model registered from outside models/ (via --job.custom_import): Llama with a 1000-token vocab."""

import dataclasses

from models import ModelSpec, get_model_spec, register_model_spec

_llama = get_model_spec("llama3")
register_model_spec(ModelSpec(
    name="small_vocab",
    flavors={"tiny": dataclasses.replace(_llama.flavors["tiny"], vocab_size=1000)},
    model_cls=_llama.model_cls,
    parallelize_fn=_llama.parallelize_fn,
    flops_per_token_fn=_llama.flops_per_token_fn,
))
