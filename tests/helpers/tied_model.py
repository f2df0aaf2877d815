"""Registers "llama3_tied" (via --job.custom_import): the tiny Llama with tied input/output embeddings."""

import dataclasses

from models import ModelSpec, get_model_spec, register_model_spec

_llama = get_model_spec("llama3")
register_model_spec(ModelSpec(
    name="llama3_tied",
    flavors={"tiny": dataclasses.replace(_llama.flavors["tiny"], tie_embeddings=True)},
    model_cls=_llama.model_cls,
    parallelize_fn=_llama.parallelize_fn,
    flops_per_token_fn=_llama.flops_per_token_fn,
))
