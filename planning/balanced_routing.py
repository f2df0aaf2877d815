"""Perfectly balanced MoE routing for the fake step.

How many tokens an expert gets depends on the data (`counts.tolist()`), which fake tensors do not
have. The planner assumes every expert of a layer gets the same share — the state the expert bias
steers towards — and runs the real experts and, with expert parallel, the real all-to-alls (so
their bytes are counted) on those splits. A real run's busiest expert carries more than its share
(moe_imbalance in metrics.jsonl says how much).

A plan for CUDA runs the experts as a CUDA run does, where models/common/moe.py takes
torch._grouped_mm (bfloat16): one grouped GEMM per projection, whose fake kernel runs on the CPU's fake
tensors, rather than the loop over experts that real CPU tensors take. One op per projection
instead of three per expert is also most of an MoE plan's time saved.
"""

from collections.abc import Callable

import torch
from torch import nn

from components.optim.expert_balance import moe_layers
from models.common.moe import GroupedExperts
from parallelisms.expert_parallel import ExpertParallelDispatch


def even_split(rows: int, parts: int) -> list[int]:
    """rows split into `parts` sizes that differ by at most one."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_local_experts(x: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """MoE.dispatch without expert parallel: this rank's rows spread evenly over its experts."""
    return experts(x, even_split(x.shape[0], counts.numel()))


class BalancedExpertParallel(ExpertParallelDispatch):
    """Expert parallel whose count exchange (still issued) is replaced by even splits: every rank
    sends each expert the same number of rows and receives as many from every rank."""

    def __init__(self, real: ExpertParallelDispatch) -> None:
        self.group, self.ep = real.group, real.ep
        self.me = torch.distributed.get_rank(self.group)

    def exchange_counts(self, counts: torch.Tensor, rows: int) -> tuple[list[list[int]], list[list[int]]]:
        local = counts.numel() // self.ep
        send = counts.view(self.ep, local)
        torch.distributed.all_to_all_single(torch.empty_like(send), send, group=self.group)
        split = even_split(rows, counts.numel())  # every rank has as many rows as this one
        mine = split[self.me * local:(self.me + 1) * local]
        return [split[r * local:(r + 1) * local] for r in range(self.ep)], [mine] * self.ep


def cuda_experts(experts: GroupedExperts) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """The experts' forward as a CUDA run takes it, on the CPU's fake tensors."""

    def forward(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return experts.grouped_mm(x, counts) if experts.grouped_mm_takes(x) else experts.loop(x, counts)

    return forward


def balance_routing(parts: list[nn.Module], device_type: str = "cpu") -> int:
    """Install balanced routing in every MoE layer of the parts — and, planning for CUDA, CUDA's
    grouped experts; returns how many layers."""
    layers = moe_layers(parts)
    for _, moe in layers:
        if isinstance(moe.dispatch, ExpertParallelDispatch):
            moe.dispatch = BalancedExpertParallel(moe.dispatch)
        else:
            moe.dispatch = balanced_local_experts
        if device_type == "cuda":
            moe.experts.forward = cuda_experts(moe.experts)
    return len(layers)
