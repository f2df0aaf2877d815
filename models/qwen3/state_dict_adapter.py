"""Converts Qwen3 weights and configs between Kiln's names and Hugging Face's Qwen3ForCausalLM /
Qwen3MoeForCausalLM, and reads a Qwen3 config.json into Qwen3Args (`args_from_hf`).

Names: Llama's (q/k/v/o_proj, gate/up/down_proj, input/post_attention_layernorm) plus
`self_attn.q_norm` / `self_attn.k_norm`; an MoE block's router is `mlp.gate` and its experts are
written one file tensor per expert, `mlp.experts.{j}.gate_proj/up_proj/down_proj`, the layout of the
published checkpoints (transformers 5 fuses them on load into `mlp.experts.gate_up_proj`
[experts, 2·hidden, dim] and `mlp.experts.down_proj`; both layouts are read).

RoPE: Kiln rotates interleaved pairs, Hugging Face rotate-half pairs, so the q/k rows of each head
are re-ordered (as for Llama), and so are the QK-norm weights, which scale those same rows: the
RMS over a head is the same in any order, so norm-then-rotate commutes with the re-ordering.
"""

import copy
import re
from typing import Any

import torch
from torch import Tensor

from components.runtime.errors import KilnError
from models.common.moe import MoEArgs
from models.llama3.state_dict_adapter import half_to_interleaved, interleaved_to_half
from models.qwen3.model import Qwen3Args

TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Kiln name → Hugging Face name inside block {i}.
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_NAMES = {"feed_forward.w1.weight": "mlp.gate_proj.weight",
               "feed_forward.w2.weight": "mlp.down_proj.weight",
               "feed_forward.w3.weight": "mlp.up_proj.weight"}
MOE_NAMES = {"moe.router.gate.weight": "mlp.gate.weight"}
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # Kiln stack → HF per-expert name
KILN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
HF_FUSED = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
MODEL_TYPES = ("qwen3", "qwen3_moe")


def _rows(w: Tensor, n_heads: int, head_dim: int, name: str) -> None:
    if w.dim() != 2 or w.shape[0] != n_heads * head_dim:  # else the reshape fails obscurely
        raise KilnError(f"{name} has shape {list(w.shape)}, not {n_heads} heads of {head_dim} rows")


class Qwen3StateDictAdapter:
    """Renames, splits/stacks experts and re-orders RoPE rows for one Qwen3 flavor (its args)."""

    def __init__(self, args: Qwen3Args) -> None:
        self.args = args
        m = args.moe
        if m is not None:
            why = [reason for bad, reason in (
                (m.score_func != "softmax", "sigmoid routing"),
                (m.num_shared_experts > 0, "shared experts"),
                (m.route_scale != 1.0, "a route scale"),
            ) if bad]
            if why:
                raise KilnError(f"this Qwen3 flavor has {why[0]}, which Qwen3MoeForCausalLM cannot express")

    # --- RoPE row order -------------------------------------------------------------------------

    def _permute(self, name: str, w: Tensor, to_hf: bool) -> Tensor:
        """Re-orders q/k projection rows and the QK-norm weights; every other tensor passes through."""
        fn = interleaved_to_half if to_hf else half_to_interleaved
        a = self.args
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            _rows(w.unsqueeze(1), 1, a.head_dim, name)
            return fn(w.unsqueeze(1), 1).squeeze(1)
        heads = {"attention.wq.weight": a.n_heads, "attention.wk.weight": a.kv_heads}
        n = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
        if n is None:
            return w
        _rows(w, n, a.head_dim, name)
        return fn(w, n)

    # --- Kiln → Hugging Face --------------------------------------------------------------------

    def to_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """Kiln names and interleaved RoPE rows → HF names (one tensor per expert), rotate-half rows."""
        block_names = {**ATTENTION_NAMES, **(MOE_NAMES if self.args.moe else DENSE_NAMES)}
        out = {}
        for name, w in sd.items():
            if name == "output.weight" and self.args.tie_embeddings:
                continue  # HF ties lm_head to embed_tokens itself and omits it from the file
            m = KILN_BLOCK.fullmatch(name)
            if m is None:
                if name not in TOP_NAMES:
                    raise KilnError(f"parameter {name!r} has no Hugging Face Qwen3 name")
                out[TOP_NAMES[name]] = w
                continue
            prefix, rest = f"model.layers.{m[1]}.", m[2]
            if rest == "moe.expert_bias":
                if torch.count_nonzero(w):
                    raise KilnError(f"{name} is not zero: Qwen3-MoE chooses experts without a bias, so this "
                                    "model would route differently there")
            elif rest.startswith("moe.experts.") and rest[-2:] in EXPERT_PROJ:
                for j, piece in enumerate(w.unbind(0)):
                    out[prefix + f"mlp.experts.{j}.{EXPERT_PROJ[rest[-2:]]}.weight"] = piece.contiguous()
            elif rest in block_names:
                out[prefix + block_names[rest]] = self._permute(name, w, to_hf=True)
            else:
                raise KilnError(f"parameter {name!r} has no Hugging Face Qwen3 name")
        return out

    # --- Hugging Face → Kiln --------------------------------------------------------------------

    def from_hf(self, sd: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF names (per-expert or fused experts) → Kiln names; every parameter is required."""
        a = self.args
        top = {hf: kiln for kiln, hf in TOP_NAMES.items()}
        names = {**ATTENTION_NAMES, **(MOE_NAMES if a.moe else DENSE_NAMES)}
        block = {hf: kiln for kiln, hf in names.items()}
        proj_of = {hf: kiln for kiln, hf in EXPERT_PROJ.items()}
        out: dict[str, Tensor] = {}
        experts: dict[tuple[str, str], dict[int, Tensor]] = {}
        for hf, w in sd.items():
            if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight" and a.tie_embeddings):
                continue  # old exports store the RoPE table; a tied head is the embedding again
            m = HF_BLOCK.fullmatch(hf)
            e = HF_EXPERT.fullmatch(m[2]) if m and a.moe else None
            if e:
                experts.setdefault((m[1], proj_of[e[2]]), {})[int(e[1])] = w
            elif m and a.moe and m[2] == "mlp.experts.gate_up_proj":  # transformers 5's fused layout
                gate, up = w.chunk(2, dim=1)
                out[f"layers.{m[1]}.moe.experts.w1"], out[f"layers.{m[1]}.moe.experts.w3"] = gate, up
            elif m and a.moe and m[2] == "mlp.experts.down_proj":
                out[f"layers.{m[1]}.moe.experts.w2"] = w
            elif m and m[2] in block:
                name = f"layers.{m[1]}.{block[m[2]]}"
                out[name] = self._permute(name, w, to_hf=False)
            elif not m and hf in top:
                out[top[hf]] = w
            else:
                dense = " (a dense flavor cannot hold MoE weights)" if m and "experts" in m[2] else ""
                raise KilnError(f"Hugging Face tensor {hf!r} has no Kiln Qwen3 name{dense}")
        if a.moe is not None:
            n = a.moe.num_experts
            for (layer, proj), pieces in experts.items():
                if sorted(pieces) != list(range(n)):
                    raise KilnError(f"layer {layer} {EXPERT_PROJ[proj]}: the Hugging Face weights hold "
                                    f"experts {sorted(pieces)}, the flavor has {n}")
                out[f"layers.{layer}.moe.experts.{proj}"] = torch.stack([pieces[j] for j in range(n)])
            for i in range(a.n_layers):  # Qwen3-MoE has no expert bias: it starts at zero
                out[f"layers.{i}.moe.expert_bias"] = torch.zeros(n)
        if a.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return self._check_complete(out)

    def _expected_kiln_keys(self) -> list[str]:
        per_block = [*ATTENTION_NAMES]
        if self.args.moe is None:
            per_block += DENSE_NAMES
        else:
            per_block += [*MOE_NAMES, "moe.experts.w1", "moe.experts.w2", "moe.experts.w3", "moe.expert_bias"]
        blocks = [f"layers.{i}.{name}" for i in range(self.args.n_layers) for name in per_block]
        return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]

    def _check_complete(self, out: dict[str, Tensor]) -> dict[str, Tensor]:
        """Refuse converted weights that miss or add tensors, naming the first one."""
        expected = self._expected_kiln_keys()
        missing = [k for k in expected if k not in out]
        if missing:
            raise KilnError(f"the Hugging Face weights lack the tensors of Kiln's {missing[0]!r} "
                            f"({len(missing)} tensors missing)")
        extra = sorted(set(out) - set(expected))
        if extra:
            raise KilnError(f"the Hugging Face weights hold the tensors of Kiln's {extra[0]!r}, which a "
                            f"{self.args.n_layers}-layer model of this flavor lacks")
        return out

    # --- config.json ----------------------------------------------------------------------------

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str = "float32") -> dict[str, Any]:
        """A config.json for Qwen3ForCausalLM (dense) or Qwen3MoeForCausalLM, in the published form."""
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if a.moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if a.moe else "qwen3",
            "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "intermediate_size": a.hidden_dim,
            "vocab_size": a.vocab_size, "hidden_act": "silu", "attention_bias": False,
            "rms_norm_eps": a.norm_eps, "rope_theta": float(a.rope_theta), "rope_scaling": None,
            "max_position_embeddings": a.max_seq_len,
            "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos, "eos_token_id": tokenizer_eos, "torch_dtype": dtype,
        }
        if a.moe is not None:
            m = a.moe
            config |= {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                       "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.route_norm,
                       "router_aux_loss_coef": m.aux_loss_coeff, "decoder_sparse_step": 1,
                       "mlp_only_layers": []}
        return config

    def args_from_hf_config(self, config: dict[str, Any]) -> Qwen3Args:
        """The flavor's args if the HF config describes the same model; else name the first difference."""
        theirs, ours = _shape(args_from_hf(config)), _shape(self.args)
        for key, want in ours.items():
            if theirs.get(key) != want:
                raise KilnError(f"the Hugging Face config does not match the Kiln flavor: {key} is "
                                f"{theirs.get(key)!r} in config.json but {want!r} in the flavor")
        return copy.deepcopy(self.args)


def _shape(args: Qwen3Args) -> dict[str, Any]:
    """What fixes the weights' meaning (not max_seq_len, init or the training-only balancing)."""
    out = {"model_type": "qwen3_moe" if args.moe else "qwen3", "hidden_size": args.dim,
           "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
           "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
           "rms_norm_eps": args.norm_eps, "rope_theta": float(args.rope_theta),
           "tie_word_embeddings": args.tie_embeddings}
    if args.moe is None:
        return out | {"intermediate_size": args.hidden_dim}
    m = args.moe
    return out | {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                  "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.route_norm}


def _rope(config: dict[str, Any]) -> tuple[float, str]:
    """(rope_theta, rope type) from transformers 4's rope_theta/rope_scaling or 5's rope_parameters."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta), params.get("rope_type", params.get("type", "default"))


def args_from_hf(config: dict[str, Any]) -> Qwen3Args:
    """Qwen3Args from a Qwen3 or Qwen3-MoE config.json (a dict), with transformers' defaults for
    absent fields; every field Kiln does not implement is refused, all in one KilnError."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise KilnError(f"config.json has model_type {kind!r}; the qwen3 family reads "
                        f"{' or '.join(MODEL_TYPES)}")
    moe = kind == "qwen3_moe"
    theta, rope_type = _rope(config)
    problems = []
    if config.get("attention_bias", False):
        problems.append("attention_bias is true (Kiln's Qwen3 attention has no biases)")
    if config.get("use_sliding_window", False):
        problems.append("use_sliding_window is true (Kiln's attention is full causal attention)")
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        problems.append("layer_types holds layers other than full_attention (sliding-window attention)")
    if rope_type != "default":
        problems.append(f"RoPE scaling of type {rope_type!r} (Kiln's Qwen3 uses plain RoPE)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config['hidden_act']!r} (Kiln's feed-forward is SwiGLU)")
    if moe and config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers is {config['mlp_only_layers']} (Kiln's Qwen3-MoE has MoE in "
                        "every block)")
    if moe and config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step is {config['decoder_sparse_step']} (Kiln's Qwen3-MoE has "
                        "MoE in every block)")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in config]
    if missing:
        problems.append(f"it lacks {', '.join(missing)}")
    if problems:
        raise KilnError(f"cannot import this {kind} config.json: {'; '.join(problems)}")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    moe_args = None
    if moe:
        moe_args = MoEArgs(num_experts=config.get("num_experts", config.get("num_local_experts", 128)),
                           top_k=config.get("num_experts_per_tok", 8),
                           hidden_dim=config.get("moe_intermediate_size", 768), score_func="softmax",
                           route_norm=bool(config.get("norm_topk_prob", False)), load_balance_coeff=None,
                           aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)))
    return Qwen3Args(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or (128 if not moe else dim // heads),
        hidden_dim=config.get("intermediate_size", 6144 if moe else 22016), vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), moe=moe_args)
