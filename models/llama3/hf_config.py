"""Reads a Hugging Face LlamaForCausalLM config.json (a dict) into LlamaArgs (ModelSpec.args_from_hf).

Every field that changes what the weights compute is either carried over exactly or refused in one
KilnError that names it: an import never approximates. The fields shared with Llama-shaped families
(attention, norm, RoPE, embeddings) are read by `llama_shape`, which models/moe reuses.
"""

import json
from typing import Any

from components.runtime.errors import KilnError
from models.common.rope import RopeScaling
from models.llama3.model import LlamaArgs
from models.llama3.state_dict_adapter import _HF_DEFAULTS, _rope_fields

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def refuse(family: str, key: str, value: Any, why: str) -> KilnError:
    """The one error of a config field Kiln does not implement."""
    return KilnError(f"config.json sets {key} = {json.dumps(value)}, which Kiln's {family} does not "
                     f"implement ({why})")


def _int(config: dict[str, Any], key: str, family: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KilnError(f"config.json has {key} = {json.dumps(value)}; {family} needs a positive integer")
    return value


def _rope(config: dict[str, Any], family: str) -> tuple[float, RopeScaling | None]:
    """rope_theta, and Llama 3.1 scaling as Kiln's RopeScaling; any other scaling is refused."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    theta, scaling = _rope_fields(config)
    if scaling is None:
        return theta, None
    if scaling["rope_type"] != "llama3":
        raise refuse(family, f"{key}.rope_type", scaling["rope_type"], "its RoPE scaling is Llama 3.1's "
                     "'llama3' type or none")
    if scaling["original_max_position_embeddings"] is None:  # transformers' fallback when it is absent
        scaling["original_max_position_embeddings"] = config.get("max_position_embeddings", 2048)
    params = config[key]
    for k in ("factor", "low_freq_factor", "high_freq_factor"):
        if not isinstance(scaling[k], (int, float)) or isinstance(scaling[k], bool):
            raise KilnError(f"config.json has {key}.{k} = {json.dumps(params.get(k))}; llama3 RoPE "
                            f"scaling needs a number")
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                                  "high_freq_factor", "original_max_position_embeddings"})
    if extra:
        raise refuse(family, f"{key}.{extra[0]}", params[extra[0]], "llama3 RoPE scaling has factor, "
                     "low_freq_factor, high_freq_factor and original_max_position_embeddings only")
    return theta, RopeScaling(scale_factor=float(scaling["factor"]),
                              low_freq_factor=float(scaling["low_freq_factor"]),
                              high_freq_factor=float(scaling["high_freq_factor"]),
                              original_max_seq_len=int(scaling["original_max_position_embeddings"]))


def llama_shape(config: dict[str, Any], family: str) -> dict[str, Any]:
    """LlamaArgs keywords of the attention, norm, RoPE and embeddings of a Llama-shaped config, after
    refusing what Kiln's Llama blocks do not compute: biases, sliding windows, another activation, a
    head_dim other than hidden_size / num_attention_heads, other RoPE scalings, quantized weights."""
    for key in _REQUIRED:
        _int(config, key, family)
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or heads % kv:
        raise KilnError(f"config.json has num_key_value_heads = {json.dumps(kv)}, which does not divide "
                        f"num_attention_heads = {heads}")
    if dim % heads:
        raise refuse(family, "num_attention_heads", heads, f"its head_dim is hidden_size / "
                     f"num_attention_heads, and {heads} does not divide hidden_size {dim}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        raise refuse(family, "head_dim", head_dim, f"its head_dim is hidden_size / num_attention_heads "
                     f"= {dim // heads}")
    for key, why in (("attention_bias", "no biases in the attention projections"),
                     ("mlp_bias", "no biases in the feed-forward"),
                     ("qkv_bias", "no biases in the attention projections")):
        if config.get(key):
            raise refuse(family, key, config[key], why)
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise refuse(family, "sliding_window", config["sliding_window"], "attention sees every earlier token")
    if config.get("quantization_config") is not None:
        raise refuse(family, "quantization_config", config["quantization_config"].get("quant_method", "?")
                     if isinstance(config["quantization_config"], dict) else config["quantization_config"],
                     "weights are read as plain floating-point tensors")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(family, "hidden_act", act, "the feed-forward is SwiGLU (silu)")
    if config.get("attention_dropout"):
        raise refuse(family, "attention_dropout", config["attention_dropout"], "no dropout")
    if config.get("pretraining_tp", 1) != 1:
        raise refuse(family, "pretraining_tp", config["pretraining_tp"], "projections are not split")
    theta, scaling = _rope(config, family)
    eps = config.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])
    tie = config.get("tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"])
    return dict(dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
                n_kv_heads=None if kv == heads else kv, vocab_size=config["vocab_size"],
                norm_eps=float(eps), rope_theta=theta, rope_scaling=scaling,
                max_seq_len=_int({**_HF_DEFAULTS, **config}, "max_position_embeddings", family),
                tie_embeddings=bool(tie))


def llama_args_from_hf(config: dict[str, Any]) -> LlamaArgs:
    """LlamaArgs of a LlamaForCausalLM config.json: the feed-forward keeps intermediate_size exactly
    (ffn_hidden_dim)."""
    if config.get("model_type", "llama") != "llama":
        raise KilnError(f"config.json has model_type {config.get('model_type')!r}, not 'llama'")
    shape = llama_shape(config, "llama3")
    return LlamaArgs(**shape, ffn_hidden_dim=config["intermediate_size"])
