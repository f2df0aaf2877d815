"""Converts MoE weights between Kiln's names and Hugging Face's MixtralForCausalLM (per-expert files).

The files use the layout of Mistral's Mixtral releases — `block_sparse_moe.gate` and one
`experts.{j}.w1/w2/w3` per expert — which transformers 4 reads as is and transformers 5 converts
to its fused expert tensors on load. Only flavors that Mixtral can express convert: softmax
routing with the top-k weights renormalised, no shared experts, no dense layers, no route scale,
and an expert bias that is still zero (Mixtral chooses by the raw scores).
"""

import copy
import re
from typing import Any

import torch
from torch import Tensor

from components.runtime.errors import KilnError
from models.llama3.state_dict_adapter import (
    BLOCK_NAMES,
    HF_BLOCK,
    KILN_BLOCK,
    TOP_NAMES,
    LlamaStateDictAdapter,
    half_to_interleaved,
    interleaved_to_half,
)
from models.moe.model import MoEModelArgs

_ATTENTION = {k: v for k, v in BLOCK_NAMES.items() if not k.startswith("feed_forward")}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


class MixtralStateDictAdapter(LlamaStateDictAdapter):
    """Renames, splits/stacks experts and re-permutes RoPE rows for one MoE flavor (its args)."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__(args)
        m = args.moe
        why = [reason for bad, reason in (
            (m.score_func != "softmax" or not m.route_norm, "routing other than renormalised softmax top-k"),
            (m.num_shared_experts > 0, "shared experts"),
            (args.n_dense_layers > 0, "dense layers"),
            (m.route_scale != 1.0, "a route scale"),
            (args.tie_embeddings, "tied embeddings"),
        ) if bad]
        if why:
            raise KilnError(f"this MoE flavor has {why[0]}, which MixtralForCausalLM cannot express")

    def to_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for name, w in sd.items():
            m = KILN_BLOCK.fullmatch(name)
            if m is None:
                out[_top_name(name)] = w
                continue
            layer, rest = m[1], m[2]
            prefix = f"model.layers.{layer}."
            if rest == "moe.expert_bias":
                if torch.count_nonzero(w):
                    raise KilnError(f"{name} is not zero: Mixtral chooses experts without a bias, so this "
                                    f"model would route differently there")
            elif rest == "moe.router.gate.weight":
                out[prefix + "block_sparse_moe.gate.weight"] = w
            elif rest.startswith("moe.experts.w"):
                for j, piece in enumerate(w.unbind(0)):
                    out[prefix + f"block_sparse_moe.experts.{j}.{rest[-2:]}.weight"] = piece.contiguous()
            elif rest in _ATTENTION:
                out[prefix + _ATTENTION[rest]] = self._permute(name, w, interleaved_to_half)
            else:
                raise KilnError(f"parameter {name!r} has no Hugging Face Mixtral name")
        return out

    def from_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        top = {hf: kiln for kiln, hf in TOP_NAMES.items()}
        attention = {hf: kiln for kiln, hf in _ATTENTION.items()}
        out: dict[str, Tensor] = {}
        experts: dict[tuple[str, str], dict[int, Tensor]] = {}
        for hf, w in sd.items():
            if hf.endswith("rotary_emb.inv_freq"):
                continue
            e = _EXPERT.fullmatch(hf)
            if e:
                experts.setdefault((e[1], e[3]), {})[int(e[2])] = w
                continue
            m = HF_BLOCK.fullmatch(hf)
            if m and m[2] == "block_sparse_moe.gate.weight":
                out[f"layers.{m[1]}.moe.router.gate.weight"] = w
            elif m and m[2] in attention:
                name = f"layers.{m[1]}.{attention[m[2]]}"
                out[name] = self._permute(name, w, half_to_interleaved)
            elif not m and hf in top:
                out[top[hf]] = w
            else:
                raise KilnError(f"Hugging Face tensor {hf!r} has no Kiln MoE name")
        n = self.args.moe.num_experts
        for (layer, proj), pieces in experts.items():
            if sorted(pieces) != list(range(n)):
                raise KilnError(f"layer {layer} {proj}: the Hugging Face weights hold experts "
                                f"{sorted(pieces)}, the flavor has {n}")
            out[f"layers.{layer}.moe.experts.{proj}"] = torch.stack([pieces[j] for j in range(n)])
        for i in range(self.args.n_layers):  # Mixtral has no expert bias: it starts at zero
            out[f"layers.{i}.moe.expert_bias"] = torch.zeros(n)
        return self._check_complete(out)

    def _expected_kiln_keys(self) -> list[str]:
        per_block = [*_ATTENTION, "moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2",
                     "moe.experts.w3", "moe.expert_bias"]
        blocks = [f"layers.{i}.{name}" for i in range(self.args.n_layers) for name in per_block]
        return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]

    def _describe(self, name: str) -> str:
        return f"the tensors of Kiln's {name!r}"  # an expert stack has no single Hugging Face name

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str = "float32") -> dict[str, Any]:
        a, m = self.args, self.args.moe
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "intermediate_size": m.hidden_dim,
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coeff, "vocab_size": a.vocab_size, "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps, "rope_theta": float(a.rope_theta), "sliding_window": None,
            "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": False,
            "bos_token_id": tokenizer_bos, "eos_token_id": tokenizer_eos, "torch_dtype": dtype,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> MoEModelArgs:
        ours = self.hf_config(0, 0)
        for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                    "vocab_size"):
            if config.get(key) != ours[key]:
                raise KilnError(f"the Hugging Face config does not match the Kiln flavor: {key} is "
                                f"{config.get(key)!r} in config.json but {ours[key]!r} in the flavor")
        return copy.deepcopy(self.args)


def _top_name(name: str) -> str:
    if name not in TOP_NAMES:
        raise KilnError(f"parameter {name!r} has no Hugging Face Mixtral name")
    return TOP_NAMES[name]
