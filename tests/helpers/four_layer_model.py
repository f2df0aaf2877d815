"""Registers "llama3_4l" (via --job.custom_import): the tiny Llama with 4 layers, for pipeline tests."""

import dataclasses

from models import ModelSpec, get_model_spec, register_model_spec

_llama = get_model_spec("llama3")
register_model_spec(ModelSpec(
    name="llama3_4l",
    flavors={"tiny": dataclasses.replace(_llama.flavors["tiny"], n_layers=4)},
    model_cls=_llama.model_cls,
    parallelize_fn=_llama.parallelize_fn,
    flops_per_token_fn=_llama.flops_per_token_fn,
    pipeline_fn=_llama.pipeline_fn,
    state_dict_adapter=_llama.state_dict_adapter,
))
