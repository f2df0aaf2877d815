"""What the planner reads of a model's shape from meta models (no memory, milliseconds): what a
block adds, and the MoE layers' FLOPs, which each TP rank runs whole under EP."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from models.common.moe import GroupedExperts, MoE
from parallelisms.tensor_parallel import model_blocks


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (models/common/moe.py): under EP, sharded over other ranks."""
    return [p for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def in_blocks(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of a model's (or stage's) blocks and multi-token prediction modules: those FSDP
    gathers again for the backward after resharding them (parallelisms/fsdp.py)."""
    owners = [getattr(module, name, None) or {} for name in ("layers", "mtp")]
    return [p for owner in owners for block in owner.values() for p in block.parameters()]


class TensorParallelRows(NamedTuple):
    """What a model or stage under TP gathers and reduces at least per token of a microbatch, in rows
    of the hidden size (forward and backward), and how often the tokens pass its head."""

    gathers: float = 0.0
    reductions: float = 0.0
    heads: int = 0
    joins: int = 0  # MTP modules, whose joining projection's output DTensor gathers whole (a row each way)


def tensor_parallel_rows(module: nn.Module, expert_parallel: bool) -> TensorParallelRows:
    """TP's floor of a model or stage as Kiln's plans split it (planning/comm_floor.py): each block's
    attention and feed-forward gather their input sequence and reduce-scatter their output, and
    their backward the reverse: 4 rows gathered, 4 reduced. An MoE layer under EP runs whole on
    every TP rank: its output is cut, not reduced, and its gradient gathered back (2 reduced).
    MLA's plan (models/deepseek_v3/parallelize.py) runs its low-rank down projections whole, so its
    input's gradient is complete on every rank and what it reduces is the latents' gradients, all-
    reduced at their widths. An MTP module's joining projection gathers its two inputs (2 rows
    each way). Each pass of the tokens through the embedding (its output reduce-scattered) or the
    loss-parallel head (its input gathered) adds a row each way: the first stage embeds the tokens
    and the MTP modules' ids, a later stage holding the embedding (the tied copy) their ids alone;
    the head runs on the main model's rows and each depth's (models/llama3/model.py)."""
    per_block = [block_rows(block, expert_parallel) for block in model_blocks(module)] if hasattr(
        module, "layers") else []
    gathers, reductions = (sum(rows) for rows in zip((0.0, 0.0), *per_block, strict=True))
    depth = len(getattr(module, "mtp", None) or {})
    first = "0" in (getattr(module, "layers", None) or {})
    embeds = (first + depth) if getattr(module, "tok_embeddings", None) is not None else 0
    heads = (1 + depth) if getattr(module, "output", None) is not None else 0
    ends = 2 * depth + embeds + heads
    return TensorParallelRows(gathers + ends, reductions + ends, heads, depth)


def block_rows(block: nn.Module, expert_parallel: bool) -> tuple[float, float]:
    """(gathered, reduced) rows per token of one block under TP: tensor_parallel_rows's."""
    attention = block.attention
    latents = getattr(attention, "wq_a", None), getattr(attention, "wkv_a", None)
    narrow = (sum(m.out_features for m in latents) / latents[0].in_features
              if all(isinstance(m, nn.Linear) for m in latents) else None)
    routed_whole = expert_parallel and getattr(block, "moe_enabled", False)
    return 4.0, (2 if narrow is None else 1 + narrow) + (0 if routed_whole else 2)


def block_tensor_parallel_rows(spec: Any, args: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """What one block (an MoE block where the model has them, as the search's cut models are) gathers
    and reduces per token under TP (block_rows): without EP, and with it."""
    cut = {"n_dense_layers": 0} if hasattr(args, "n_dense_layers") else {}
    with torch.device("meta"):
        block = model_blocks(spec.model_cls(dataclasses.replace(args, n_layers=1, **cut)))[0]
    return block_rows(block, False), block_rows(block, True)


def block_parameters(spec: Any, args: Any) -> tuple[int, int]:
    """The parameters one block adds to the model, and of them its routed experts' (an MoE block
    where the model has them, as the search's cut models are)."""
    cut = {"n_dense_layers": 0} if hasattr(args, "n_dense_layers") else {}
    counts = []
    for n in (1, 2):
        with torch.device("meta"):
            model = spec.model_cls(dataclasses.replace(args, n_layers=n, **cut))
        experts = expert_parameters(model)
        counts.append((sum(p.numel() for p in model.parameters()), sum(p.numel() for p in experts)))
    (every_one, experts_one), (every_two, experts_two) = counts
    return every_two - every_one, experts_two - experts_one


def moe_flops_per_token(spec: Any, args: Any) -> float:
    """Training FLOPs per token of the model's MoE layers, counted as the families count theirs (6
    per active parameter): each layer's router, shared experts and the top-k of its routed experts.
    With TP and EP both, every TP rank runs these layers whole (models/moe/parallelize.py)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    active = 0.0
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        experts = sum(p.numel() for p in layer.experts.parameters())
        every = sum(p.numel() for p in layer.parameters())
        active += every - experts + experts * layer.args.top_k / layer.args.num_experts
    return 6 * active
