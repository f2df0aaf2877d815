"""Reads a Hugging Face MixtralForCausalLM config.json (a dict) into MoEModelArgs (ModelSpec.args_from_hf).

Mixtral routes as the Mixtral adapter assumes (models/moe/state_dict_adapter.py): softmax over the
experts, the top num_experts_per_tok renormalised to sum 1, no shared experts, no dense layers, no
expert bias (load_balance_coeff None) and the auxiliary loss weighted by router_aux_loss_coef.
"""

from typing import Any

from components.runtime.errors import KilnError
from models.common.moe import MoEArgs
from models.llama3.hf_config import _int, llama_shape, refuse
from models.moe.model import MoEModelArgs


def mixtral_args_from_hf(config: dict[str, Any]) -> MoEModelArgs:
    """MoEModelArgs of a MixtralForCausalLM config.json; what Mixtral's layers do not do is refused."""
    if config.get("model_type", "mixtral") != "mixtral":
        raise KilnError(f"config.json has model_type {config.get('model_type')!r}, not 'mixtral'")
    shape = llama_shape(config, "moe")
    if shape["tie_embeddings"]:
        raise refuse("moe", "tie_word_embeddings", True, "its Mixtral conversion keeps the output head apart")
    if config.get("router_jitter_noise"):
        raise refuse("moe", "router_jitter_noise", config["router_jitter_noise"], "the router adds no noise")
    experts = _int({"num_local_experts": 8, **config}, "num_local_experts", "moe")
    top_k = _int({"num_experts_per_tok": 2, **config}, "num_experts_per_tok", "moe")
    if top_k > experts:
        raise KilnError(f"config.json has num_experts_per_tok = {top_k}, more than num_local_experts = "
                        f"{experts}")
    aux = config.get("router_aux_loss_coef", 0.001)  # transformers' default
    return MoEModelArgs(**shape, moe=MoEArgs(
        num_experts=experts, top_k=top_k, hidden_dim=config["intermediate_size"], num_shared_experts=0,
        score_func="softmax", route_norm=True, route_scale=1.0, load_balance_coeff=None,
        aux_loss_coeff=float(aux)))
