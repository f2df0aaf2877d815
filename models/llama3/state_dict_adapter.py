"""Converts Llama 3 weights and configs between Kiln's names and Hugging Face's LlamaForCausalLM."""

import copy
import re
from collections.abc import Callable
from typing import Any

from torch import Tensor

from components.runtime.errors import KilnError
from models.llama3.model import LlamaArgs

# Kiln name → Hugging Face name, for the parameters outside the blocks and inside block {i}.
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
KILN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")  # a block's parameter: (index, name inside the block)
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Fields of config.json that fix the weights' meaning, compared in this order (HF defaults if absent).
_HF_DEFAULTS: dict[str, Any] = {
    "model_type": "llama", "hidden_size": None, "num_hidden_layers": None,
    "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
    "intermediate_size": None, "vocab_size": None, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}


def interleaved_to_half(w: Tensor, n_heads: int) -> Tensor:
    """q/k rows from Meta's RoPE pairs (2i, 2i+1) to HF's pairs (i, i + head_dim/2), head by head.

    Within a head HF's row order is the even rows of Meta's, then the odd ones.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of interleaved_to_half: HF's rotate-half rows back to Meta's interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_fields(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling or None) from transformers 4's rope_* or 5's rope_parameters."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": kind, **{k: params.get(k) for k in keys}}


class LlamaStateDictAdapter:
    """Renames and re-permutes a Llama state dict for one flavor's shape (its args)."""

    def __init__(self, args: LlamaArgs) -> None:
        self.args = args

    def _expected_kiln_keys(self) -> list[str]:
        blocks = [f"layers.{i}.{name}" for i in range(self.args.n_layers) for name in BLOCK_NAMES]
        return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]

    def _permute(self, name: str, w: Tensor, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
        """Re-orders q/k projection rows with fn; every other tensor passes through."""
        heads = {"attention.wq.weight": self.args.n_heads, "attention.wk.weight": self.args.kv_heads}
        n = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
        if n is None:
            return w
        if w.dim() != 2 or w.shape[0] != n * self.args.head_dim:  # else the reshape fails obscurely
            raise KilnError(f"{name} has shape {list(w.shape)}, not {n} heads of {self.args.head_dim} rows")
        return fn(w, n)

    def to_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """Kiln names and interleaved RoPE rows → HF names and rotate-half rows."""
        out = {}
        for name, w in sd.items():
            if name == "output.weight" and self.args.tie_embeddings:
                continue  # HF ties lm_head to embed_tokens itself and omits it from the file
            m = KILN_BLOCK.fullmatch(name)
            hf = f"model.layers.{m[1]}.{BLOCK_NAMES.get(m[2], '?')}" if m else TOP_NAMES.get(name, "?")
            if hf.endswith("?"):
                raise KilnError(f"parameter {name!r} has no Hugging Face Llama name")
            out[hf] = self._permute(name, w, interleaved_to_half)
        return out

    def from_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF names and rotate-half rows → Kiln names and interleaved rows; every parameter is required."""
        top = {hf: kiln for kiln, hf in TOP_NAMES.items()}
        block = {hf: kiln for kiln, hf in BLOCK_NAMES.items()}
        out = {}
        for hf, w in sd.items():
            if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight" and self.args.tie_embeddings):
                continue  # old exports store the RoPE table; a tied head is the embedding again
            m = HF_BLOCK.fullmatch(hf)
            name = f"layers.{m[1]}.{block.get(m[2], '?')}" if m else top.get(hf, "?")
            if name.endswith("?"):
                raise KilnError(f"Hugging Face tensor {hf!r} has no Kiln Llama name")
            out[name] = self._permute(name, w, half_to_interleaved)
        if self.args.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return self._check_complete(out)

    def _check_complete(self, out: dict[str, Tensor]) -> dict[str, Tensor]:
        """Refuse converted weights that miss or add tensors, naming the first one."""
        expected = self._expected_kiln_keys()
        missing = [k for k in expected if k not in out]
        if missing:
            raise KilnError(f"the Hugging Face weights lack {self._describe(missing[0])} "
                            f"({len(missing)} tensors missing)")
        extra = sorted(set(out) - set(expected))
        if extra:
            raise KilnError(f"the Hugging Face weights hold {self._describe(extra[0])}, "
                            f"which a {self.args.n_layers}-layer model of this flavor lacks")
        return out

    def _describe(self, name: str) -> str:
        """A Kiln parameter as messages name it: by its Hugging Face name."""
        return repr(self.to_hf_name(name))

    def to_hf_name(self, name: str) -> str:
        """The HF name of one Kiln parameter (for messages)."""
        m = KILN_BLOCK.fullmatch(name)
        return f"model.layers.{m[1]}.{BLOCK_NAMES[m[2]]}" if m else TOP_NAMES[name]

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str = "float32") -> dict[str, Any]:
        """A config.json for LlamaForCausalLM, in the rope_theta/rope_scaling form of Meta's releases."""
        a = self.args
        scaling = None
        if a.rope_scaling is not None and a.rope_scaling.scale_factor != 1.0:  # 1.0 = off in rope.py
            s = a.rope_scaling
            scaling = {"rope_type": "llama3", "factor": s.scale_factor, "low_freq_factor": s.low_freq_factor,
                       "high_freq_factor": s.high_freq_factor,
                       "original_max_position_embeddings": s.original_max_seq_len}
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "intermediate_size": a.ffn_dim,
            "vocab_size": a.vocab_size, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "rms_norm_eps": a.norm_eps, "rope_theta": float(a.rope_theta), "rope_scaling": scaling,
            "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos, "eos_token_id": tokenizer_eos, "torch_dtype": dtype,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> LlamaArgs:
        """The flavor's args if the HF config describes the same model; else name the first difference."""
        ours, theirs = _comparable(self.hf_config(0, 0)), _comparable(config)
        for key, want in ours.items():
            if theirs[key] != want:
                raise KilnError(f"the Hugging Face config does not match the Kiln flavor: {key} is "
                                f"{theirs[key]!r} in config.json but {want!r} in the flavor")
        return copy.deepcopy(self.args)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of _HF_DEFAULTS, with HF's defaults filled in and RoPE in one normal form."""
    out = {k: config.get(k, default) for k, default in _HF_DEFAULTS.items()}
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = out["num_key_value_heads"] or heads
    if out["head_dim"] is None and out["hidden_size"] and heads:
        out["head_dim"] = out["hidden_size"] // heads
    out["rope_theta"], out["rope_scaling"] = _rope_fields(config)
    if out["rope_scaling"] is not None and out["rope_scaling"]["original_max_position_embeddings"] is None:
        # transformers falls back to max_position_embeddings when it is absent
        out["rope_scaling"]["original_max_position_embeddings"] = out["max_position_embeddings"]
    return out
