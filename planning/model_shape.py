"""What the planner reads of a model's shape from meta models (no memory, milliseconds): what a
block adds, and the MoE layers' FLOPs, which each TP rank runs whole under EP."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from models.common.moe import GroupedExperts, MoE


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (models/common/moe.py): under EP, sharded over other ranks."""
    return [p for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def in_blocks(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of a model's (or stage's) blocks and multi-token prediction modules: those FSDP
    gathers again for the backward after resharding them (parallelisms/fsdp.py)."""
    owners = [getattr(module, name, None) or {} for name in ("layers", "mtp")]
    return [p for owner in owners for block in owner.values() for p in block.parameters()]


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
