"""Llama variants registered from outside models/ (via --job.custom_import), as a user's model would.

- "llama3_tied": the tiny Llama with tied input/output embeddings (Llama 3.2 1B/3B style).
- "small_vocab": the tiny Llama with a 1000-token vocabulary (smaller than the tokenizer's).
- "llama3_4l": the tiny Llama with 4 layers, so pipeline tests have a layer for every stage.
- "llama3_tied_4l": the same, tied, for pipeline stages that share the embedding.
- "llama3_odd": dim 96, 3 heads, 5 layers, a 4098-token vocabulary (seq 60 in tests): uneven FSDP
  shards that need padding (a 256-row feed-forward over 3 ranks), uneven pipeline stages.
- "llama3_odd_tp": the same with a 264-unit feed-forward, which TP 3 can split (256 it refuses).
- "llama3_5l": the tiny flavor with five blocks (the layout search's test model).
- "llama3_10l": the same with ten, a block for every stage of a pipeline deeper than four.
- "moe_variant", "moe_2experts": see below.
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
_register("llama3_tied_4l", tie_embeddings=True, n_layers=4)
_register("llama3_odd", dim=96, n_heads=3, n_kv_heads=3, n_layers=5, vocab_size=4098)
_register("llama3_odd_tp", dim=96, n_heads=3, n_kv_heads=3, n_layers=5, vocab_size=4098, multiple_of=24)
_register("llama3_5l", n_layers=5)  # the tiny shape, five blocks: uneven stages, a depth to scale to
_register("llama3_10l", n_layers=10)

# "moe_variant": the tiny MoE with a dense first block, sigmoid scores renormalised and scaled,
# and the auxiliary load-balancing loss on (besides the expert bias).
_moe = get_model_spec("moe")
_tiny_moe = _moe.flavors["tiny"]
for _name, _aux in (("moe_variant", 0.01), ("moe_variant_noaux", 0.0)):
    register_model_spec(dataclasses.replace(_moe, name=_name, flavors={"tiny": dataclasses.replace(
        _tiny_moe, n_layers=3, n_dense_layers=1,
        moe=dataclasses.replace(_tiny_moe.moe, score_func="sigmoid", route_norm=True, route_scale=2.0,
                                aux_loss_coeff=_aux))}))

# "moe_2experts": the tiny MoE with 2 experts, top 1: EP 2 over 4 ranks leaves one local expert for
# two FSDP ranks, so expert weights are sharded along their rows (models/moe/parallelize.py).
register_model_spec(dataclasses.replace(_moe, name="moe_2experts", flavors={"tiny": dataclasses.replace(
    _tiny_moe, moe=dataclasses.replace(_tiny_moe.moe, num_experts=2, top_k=1))}))

# "moe_top9": the tiny MoE choosing 9 of its 8 experts (a bad flavor).
register_model_spec(dataclasses.replace(_moe, name="moe_top9", flavors={"tiny": dataclasses.replace(
    _tiny_moe, moe=dataclasses.replace(_tiny_moe.moe, top_k=9))}))

# "moe_nobias": the debug MoE without the expert-bias update (to measure what the bias does).
_debug_moe = _moe.flavors["debug"]
register_model_spec(dataclasses.replace(_moe, name="moe_nobias", flavors={"debug": dataclasses.replace(
    _debug_moe, moe=dataclasses.replace(_debug_moe.moe, load_balance_coeff=None))}))
