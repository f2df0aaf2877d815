"""Converts DeepSeek-V2/V3 weights and configs between Kiln's names and Hugging Face's
DeepseekV3ForCausalLM.

Written in the layout of DeepSeek's releases — one `mlp.experts.{j}.gate_proj/up_proj/down_proj`
per expert, `mlp.gate.weight` and `mlp.gate.e_score_correction_bias` (Kiln's expert bias) — which
transformers 4 reads as is and transformers 5 fuses on load; read from that layout or from
transformers 5's fused `mlp.experts.gate_up_proj` [E, 2·I, dim] / `mlp.experts.down_proj`. RoPE rows
need no permutation: DeepSeek's checkpoints keep the rotary pairs interleaved, as Kiln does
(transformers' rope_interleave). A release's multi-token-prediction modules are the blocks past
num_hidden_layers (num_nextn_predict_layers of them; transformers runs none): block j holds an MTP
block's weights under the usual names plus enorm, hnorm, eh_proj and shared_head.norm, and copies of
the embedding and the head (embed_tokens, shared_head.head) that Kiln shares with the main model —
read past on import, written on export as the releases have them. A flavor without MTP (mtp_depth
0, and every import without --config) reads past a release's MTP blocks altogether.
"""

import copy
import dataclasses
import re
from typing import Any

import torch
from torch import Tensor

from components.runtime.errors import KilnError
from models.common.moe import MoEArgs
from models.common.rope import YarnScaling
from models.deepseek_v3.model import DeepSeekV3Args

TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_NAMES = {  # Kiln name inside block {i} → Hugging Face name inside model.layers.{i}
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
MTP_NAMES = {  # Kiln name inside mtp.{j} → Hugging Face name inside model.layers.{j} (j ≥ n_layers)
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
KILN_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
KILN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class DeepSeekV3StateDictAdapter:
    """Renames and splits/stacks the experts of one flavor's state dict (its args)."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        self.args = args

    def to_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """Kiln names → DeepSeek's release names, one tensor per expert and projection."""
        out = {}
        for name, w in sd.items():
            if name == "output.weight" and self.args.tie_embeddings:
                continue  # transformers ties lm_head to embed_tokens itself
            mtp = KILN_MTP.fullmatch(name)
            if mtp and mtp[2] in MTP_NAMES:
                out[f"model.layers.{mtp[1]}.{MTP_NAMES[mtp[2]]}"] = w
                continue
            if mtp and mtp[2].startswith("block."):  # an MTP block: named as a block of its index
                name = f"layers.{mtp[1]}.{mtp[2].removeprefix('block.')}"
            m = KILN_BLOCK.fullmatch(name)
            if m and m[2].startswith("moe.experts.w"):
                proj = EXPERT_PROJ[m[2][-2:]]
                for j, piece in enumerate(w.unbind(0)):
                    out[f"model.layers.{m[1]}.mlp.experts.{j}.{proj}.weight"] = piece.contiguous()
                continue
            hf = f"model.layers.{m[1]}.{BLOCK_NAMES.get(m[2], '?')}" if m else TOP_NAMES.get(name, "?")
            if hf.endswith("?"):
                raise KilnError(f"parameter {name!r} has no Hugging Face DeepSeek-V3 name")
            out[hf] = w
        for j in self._mtp_layers():
            for hf, kiln in MTP_SHARED.items():
                if kiln in sd:
                    out[f"model.layers.{j}.{hf}"] = sd[kiln]
        return out

    def _mtp_layers(self) -> range:
        """The block indices a release gives the MTP modules: right after the main model's."""
        return range(self.args.n_layers, self.args.n_layers + self.args.mtp_depth)

    def from_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """DeepSeek's (or transformers 5's fused) names → Kiln names; every parameter is required."""
        top = {hf: kiln for kiln, hf in TOP_NAMES.items()}
        block = {hf: kiln for kiln, hf in BLOCK_NAMES.items()}
        mtp_names = {hf: kiln for kiln, hf in MTP_NAMES.items()}
        out: dict[str, Tensor] = {}
        experts: dict[tuple[str, str], dict[int, Tensor]] = {}
        n = self.args.moe.num_experts
        for hf, w in sd.items():
            if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight" and self.args.tie_embeddings):
                continue
            m = HF_BLOCK.fullmatch(hf)
            if m and int(m[1]) >= self.args.n_layers:
                if int(m[1]) not in self._mtp_layers() or m[2] in MTP_SHARED:
                    continue  # MTP modules the flavor leaves out, or copies of shared weights
                if m[2] in mtp_names:
                    out[f"mtp.{m[1]}.{mtp_names[m[2]]}"] = w
                    continue
            e = HF_EXPERT.fullmatch(m[2]) if m else None
            if e:
                experts.setdefault((m[1], e[2]), {})[int(e[1])] = w
            elif m and m[2] == "mlp.experts.gate_up_proj":  # transformers 5: [E, 2·I, dim], gate first
                gate, up = w.chunk(2, dim=1)
                out[f"layers.{m[1]}.moe.experts.w1"] = gate.contiguous()
                out[f"layers.{m[1]}.moe.experts.w3"] = up.contiguous()
            elif m and m[2] == "mlp.experts.down_proj":
                out[f"layers.{m[1]}.moe.experts.w2"] = w
            elif m and m[2] in block:
                out[f"layers.{m[1]}.{block[m[2]]}"] = w
            elif not m and hf in top:
                out[top[hf]] = w
            else:
                raise KilnError(f"Hugging Face tensor {hf!r} has no Kiln DeepSeek-V3 name")
        kiln_proj = {hf: kiln for kiln, hf in EXPERT_PROJ.items()}
        for (layer, proj), pieces in experts.items():
            if sorted(pieces) != list(range(n)):
                raise KilnError(f"layer {layer} {proj}: the Hugging Face weights hold experts "
                                f"{_ranges(sorted(pieces))}, the flavor has {n}")
            out[f"layers.{layer}.moe.experts.{kiln_proj[proj]}"] = torch.stack([pieces[j] for j in range(n)])
        if self.args.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        for j in self._mtp_layers():  # an MTP block's weights were read as block j's
            for name in [k for k in out if k.startswith(f"layers.{j}.")]:
                out[f"mtp.{j}.block.{name.removeprefix(f'layers.{j}.')}"] = out.pop(name)
        return self._check_complete(out)

    def _expected_kiln_keys(self) -> list[str]:
        a = self.args
        attention = ([] if a.q_lora_rank else ["attention.wq.weight"]) + (
            ["attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight"] if a.q_lora_rank
            else []) + ["attention.wkv_a.weight", "attention.kv_norm.weight", "attention.wkv_b.weight",
                        "attention.wo.weight", "attention_norm.weight", "ffn_norm.weight"]
        dense = ["feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]
        moe = ["moe.router.gate.weight", "moe.expert_bias", "moe.experts.w1", "moe.experts.w2",
               "moe.experts.w3"]
        if a.moe.num_shared_experts:
            moe += [f"moe.shared_experts.w{i}.weight" for i in (1, 2, 3)]
        blocks = [f"layers.{i}.{name}" for i in range(a.n_layers)
                  for name in attention + (dense if i < a.n_dense_layers else moe)]
        mtp_block = [f"block.{n}" for n in attention + moe]  # MTP blocks come after the dense ones
        mtp = [f"mtp.{j}.{name}" for j in self._mtp_layers() for name in [*MTP_NAMES, *mtp_block]]
        return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight", *mtp]

    def _check_complete(self, out: dict[str, Tensor]) -> dict[str, Tensor]:
        """Refuse converted weights that miss or add tensors, naming the first one."""
        expected = self._expected_kiln_keys()
        missing = [k for k in expected if k not in out]
        if missing:
            mtp = (f"; num_nextn_predict_layers = {self.args.mtp_depth} asks for multi-token prediction "
                   "modules the folder does not hold" if missing[0].startswith("mtp.") else "")
            raise KilnError(f"the Hugging Face weights lack the tensor(s) of Kiln's {missing[0]!r} "
                            f"({len(missing)} missing){mtp}")
        extra = sorted(set(out) - set(expected))
        if extra:
            raise KilnError(f"the Hugging Face weights hold the tensor(s) of Kiln's {extra[0]!r}, which a "
                            f"{self.args.n_layers}-layer model of this flavor lacks")
        return out

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str = "float32") -> dict[str, Any]:
        """A config.json for DeepseekV3ForCausalLM (transformers 4's rope_theta/rope_scaling form)."""
        a, m = self.args, self.args.moe
        if m.score_func != "sigmoid":
            raise KilnError(f"this flavor scores experts by {m.score_func}; DeepseekV3ForCausalLM scores "
                            "by sigmoid only")
        scaling = None
        if a.rope_scaling is not None and a.rope_scaling.factor != 1.0:
            s = a.rope_scaling
            scaling = {"type": "yarn", "rope_type": "yarn", "factor": s.factor,
                       "original_max_position_embeddings": s.original_max_seq_len, "beta_fast": s.beta_fast,
                       "beta_slow": s.beta_slow, "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim,
                       "truncate": s.truncate}
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads, "vocab_size": a.vocab_size, "intermediate_size": a.inter_dim,
            "moe_intermediate_size": m.hidden_dim, "n_routed_experts": m.num_experts,
            "n_shared_experts": m.num_shared_experts, "num_experts_per_tok": m.top_k,
            "n_group": m.num_groups, "topk_group": m.top_k_groups, "routed_scaling_factor": m.route_scale,
            "norm_topk_prob": m.route_norm, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "first_k_dense_replace": a.n_dense_layers, "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "hidden_act": "silu",
            "attention_bias": False, "rms_norm_eps": a.norm_eps, "rope_theta": float(a.rope_theta),
            "rope_scaling": scaling, "rope_interleave": True, "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_embeddings, "num_nextn_predict_layers": a.mtp_depth,
            "bos_token_id": tokenizer_bos, "eos_token_id": tokenizer_eos, "torch_dtype": dtype,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> DeepSeekV3Args:
        """The flavor's args if the HF config describes the same model; else name the first difference."""
        theirs = args_from_hf(config)
        ours = self.args
        for f in dataclasses.fields(ours):
            if f.name in ("moe", "depth_init", "mtp_depth"):  # mtp_depth: a training choice (args_from_hf)
                continue
            if getattr(theirs, f.name) != getattr(ours, f.name):
                raise KilnError(f"the Hugging Face config does not match the Kiln flavor: {f.name} is "
                                f"{getattr(theirs, f.name)!r} in config.json but {getattr(ours, f.name)!r} "
                                "in the flavor")
        for f in ("num_experts", "top_k", "hidden_dim", "num_shared_experts", "score_func", "route_norm",
                  "route_scale", "num_groups", "top_k_groups"):
            if getattr(theirs.moe, f) != getattr(ours.moe, f):
                raise KilnError(f"the Hugging Face config does not match the Kiln flavor: moe.{f} is "
                                f"{getattr(theirs.moe, f)!r} in config.json but {getattr(ours.moe, f)!r} "
                                "in the flavor")
        return copy.deepcopy(ours)


# config.json fields transformers' DeepseekV3ForCausalLM reads whose other values Kiln does not run.
_ONLY = {"hidden_act": "silu", "attention_bias": False, "rope_interleave": True, "scoring_func": "sigmoid",
         "topk_method": "noaux_tc", "attention_dropout": 0.0}


def args_from_hf(config: dict[str, Any]) -> DeepSeekV3Args:
    """A Hugging Face DeepSeek-V3 config.json (a dict) → args; every field Kiln does not implement is
    named in one KilnError. num_nextn_predict_layers is not read: transformers writes 1 into every
    DeepSeek-V3 config.json it saves, with no MTP weights; multi-token prediction is a training
    choice (model.mtp_depth), and a flavor with it reads a release's MTP modules (from-hf --config)."""
    c = config
    problems = []
    if c.get("model_type", "deepseek_v3") != "deepseek_v3":
        problems.append(f"model_type is {c.get('model_type')!r}, not 'deepseek_v3'")
    for key, value in _ONLY.items():
        if key in c and c[key] is not None and c[key] != value:
            problems.append(f"{key} is {c[key]!r} (Kiln implements {value!r})")
    heads = c.get("num_attention_heads", 128)
    if c.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads is {c['num_key_value_heads']} (MLA in Kiln expands one key "
                        f"and value per head: {heads})")
    if c.get("quantization_config"):
        problems.append("the weights are quantized (quantization_config): convert them to bf16/fp32 first")
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    max_pos = c.get("max_position_embeddings", 4096)
    scaling = None
    if kind == "yarn":
        original = params.get("original_max_position_embeddings") or max_pos
        if params.get("attention_factor") is not None:
            problems.append("rope attention_factor is set (Kiln derives it from mscale and mscale_all_dim)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            problems.append(f"partial_rotary_factor is {params['partial_rotary_factor']}")
        scaling = YarnScaling(
            factor=float(params.get("factor") or max_pos / original), original_max_seq_len=int(original),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            truncate=bool(params.get("truncate", True)))
    elif kind != "default":
        problems.append(f"rope type {kind!r} (Kiln implements default and yarn)")
    n_experts = c.get("n_routed_experts", c.get("num_local_experts", 256))
    groups, top_groups = c.get("n_group") or 1, c.get("topk_group") or 1
    top_k = c.get("num_experts_per_tok", 8)
    if n_experts % groups:
        problems.append(f"n_group {groups} does not divide n_routed_experts {n_experts}")
    elif top_k > top_groups * (n_experts // groups):
        problems.append(f"num_experts_per_tok {top_k} exceeds the experts of topk_group {top_groups} groups")
    if problems:
        raise KilnError("this DeepSeek-V3 config.json has what Kiln does not implement: "
                        + "; ".join(problems))
    return DeepSeekV3Args(
        dim=c.get("hidden_size", 7168), n_layers=c.get("num_hidden_layers", 61), n_heads=heads,
        vocab_size=c.get("vocab_size", 129280), max_seq_len=max_pos, norm_eps=c.get("rms_norm_eps", 1e-6),
        q_lora_rank=c.get("q_lora_rank", 1536) or None, kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
        v_head_dim=c.get("v_head_dim", 128), inter_dim=c.get("intermediate_size", 18432),
        n_dense_layers=c.get("first_k_dense_replace", 3), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        moe=MoEArgs(num_experts=n_experts, top_k=top_k, hidden_dim=c.get("moe_intermediate_size", 2048),
                    num_shared_experts=c.get("n_shared_experts", 1), score_func="sigmoid",
                    route_norm=bool(c.get("norm_topk_prob", True)),
                    route_scale=float(c.get("routed_scaling_factor", 2.5)), num_groups=groups,
                    top_k_groups=top_groups),
    )


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]} ({len(ids)})" if ids else "none"
