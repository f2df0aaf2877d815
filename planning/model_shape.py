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


def cut_to(args: Any, n_layers: int) -> Any:
    """The model's arguments cut to `n_layers` blocks of one kind: MoE blocks where the model has
    them (no dense first blocks), as the search's and depth scaling's plans are."""
    dense = {"n_dense_layers": 0} if hasattr(args, "n_dense_layers") else {}
    return dataclasses.replace(args, n_layers=n_layers, **dense)


class TensorParallelRows(NamedTuple):
    """What a model or stage under TP gathers and reduces at least per token of a microbatch, in rows
    of the hidden size (forward and backward), and how often the tokens pass its head."""

    gathers: float = 0.0
    reductions: float = 0.0
    heads: int = 0
    # MTP modules: DTensor moves each joining projection's output from column to sequence shards by an
    # all-to-all on GPUs and, on the planner's CPU meshes (gloo has none), an all-gather
    joins: int = 0


def tensor_parallel_rows(module: nn.Module, expert_parallel: bool) -> TensorParallelRows | None:
    """TP's floor of a model or stage as Kiln's plans split it (planning/comm_floor.py): each block's
    attention and feed-forward gather their input sequence and reduce-scatter their output, and
    their backward the reverse: 4 rows gathered, 4 reduced (block_rows says where less). An MTP
    module's joining projection gathers its two inputs (2 rows each way). Each pass of the tokens
    through the embedding (its output reduce-scattered) or the loss-parallel head (its input
    gathered) adds a row each way: the first stage embeds the tokens and the MTP modules' ids, a
    later stage holding the embedding (the tied copy) their ids alone; the head runs on the main
    model's rows and each depth's (models/llama3/model.py). None where a block is not of Kiln's
    kind (block_rows)."""
    per_block = [block_rows(block, expert_parallel) for block in model_blocks(module)]
    if None in per_block:
        return None
    gathers, reductions = (sum(rows) for rows in zip((0.0, 0.0), *per_block, strict=True))
    depth = len(getattr(module, "mtp", None) or {})
    first = "0" in module.layers
    embeds = (first + depth) if getattr(module, "tok_embeddings", None) is not None else 0
    heads = (1 + depth) if getattr(module, "output", None) is not None else 0
    ends = 2 * depth + embeds + heads
    return TensorParallelRows(gathers + ends, reductions + ends, heads, depth)


def block_rows(block: nn.Module, expert_parallel: bool) -> tuple[float, float] | None:
    """(gathered, reduced) rows per token of one block under TP: 4 and 4, but an MoE layer under EP
    runs whole on every TP rank (its output cut, not reduced: 2 reduced), and MLA's plan
    (models/deepseek_v3/parallelize.py) runs its down projections whole and all-reduces their
    latents' gradients at their widths, reduce-scattering its input's gradient only where its queries
    come from the input directly (wq, no q_lora_rank). None for a block without Kiln's `attention` and
    `feed_forward` or `moe` (models/common/block.py): its own TP plan, whose floor is not known."""
    attention = getattr(block, "attention", None)
    if attention is None or all(getattr(block, name, None) is None for name in ("feed_forward", "moe")):
        return None
    downs = [m for m in (getattr(attention, "wq_a", None), getattr(attention, "wkv_a", None))
             if isinstance(m, nn.Linear)]
    attention_rows = 2.0
    if downs:
        queries_whole = 0 if isinstance(getattr(attention, "wq_a", None), nn.Linear) else 1
        attention_rows = 1 + queries_whole + sum(m.out_features for m in downs) / downs[0].in_features
    routed_whole = expert_parallel and getattr(block, "moe_enabled", False)
    return 4.0, attention_rows + (0 if routed_whole else 2)


def block_tensor_parallel_rows(spec: Any, args: Any
                               ) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """What one block (an MoE block where the model has them, as the search's cut models are) gathers
    and reduces per token under TP (block_rows): without EP, and with it; None where not known."""
    with torch.device("meta"):
        block = model_blocks(spec.model_cls(cut_to(args, 1)))[0]
    plain, routed = block_rows(block, False), block_rows(block, True)
    return None if plain is None or routed is None else (plain, routed)


def block_parameters(spec: Any, args: Any) -> tuple[int, int]:
    """The parameters one block adds to the model, and of them its routed experts' (an MoE block
    where the model has them, as the search's cut models are)."""
    counts = []
    for n in (1, 2):
        with torch.device("meta"):
            model = spec.model_cls(cut_to(args, n))
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
