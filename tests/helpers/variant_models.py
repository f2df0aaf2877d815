"""Llama variants registered from outside models/ (via --job.custom_import), as a user's model would.

- "llama3_tied": the tiny Llama with tied input/output embeddings (Llama 3.2 1B/3B style).
- "small_vocab": the tiny Llama with a 1000-token vocabulary (smaller than the tokenizer's).
- "llama3_4l": the tiny Llama with 4 layers, so pipeline tests have a layer for every stage.
"""

import dataclasses

from models import get_model_spec, register_model_spec

_llama = get_model_spec("llama3")


def _register(name: str, **changes) -> None:
    register_model_spec(dataclasses.replace(
        _llama, name=name, flavors={"tiny": dataclasses.replace(_llama.flavors["tiny"], **changes)}))


_register("llama3_tied", tie_embeddings=True)
_register("small_vocab", vocab_size=1000)
_register("llama3_4l", n_layers=4)
