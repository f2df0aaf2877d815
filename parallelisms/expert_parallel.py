"""Expert parallel: an MoE layer's experts split over ep ranks, tokens sent to their experts' rank.

Each rank routes its own tokens, sorts them by expert (so they are grouped by destination rank),
exchanges the per-expert counts with one all-to-all and the tokens with a second (autograd
through both directions), runs its local experts, and sends the outputs back with the reverse
all-to-all. EP ranks are borrowed from dp_shard × cp (TorchTitan's layout), so expert weights
are sharded over `ep` along the expert dimension and FSDP-sharded over what is left.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import Shard, distribute_tensor

from components.runtime.tensor_utils import outside_compile


class ExpertParallelDispatch:
    """dispatch → local experts → combine, installed as MoE.dispatch."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    @outside_compile  # data-dependent all-to-alls stay outside compiled graphs
    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """x [n, dim]: this rank's (token, choice) rows sorted by global expert; counts [E] per expert."""
        group = self.group
        send, recv = self.exchange_counts(counts, x.shape[0])
        in_splits, out_splits = [sum(row) for row in send], [sum(row) for row in recv]
        received = all_to_all_single(x.new_empty(sum(out_splits), x.shape[1]), x, out_splits, in_splits,
                                     group=group)
        # Received rows are ordered (source rank, expert); the experts want (expert, source rank).
        by_expert = _source_major_to_expert_major(recv).to(x.device)
        # An expert's weight gradient sums the tokens of all ep ranks, each rank's loss already
        # scaled for the mean over dp × cp, while FSDP averages it over only (dp × cp) / ep ranks:
        # 1/ep on the gradient into the experts (and ep back on the one leaving them) evens that.
        # (FSDP's own gradient divide factor needs PREMUL_SUM, which gloo lacks.)
        inputs = _ScaleGrad.apply(received[by_expert], float(self.ep))
        per_expert = [sum(column) for column in zip(*recv, strict=True)]
        out = _ScaleGrad.apply(experts(inputs, per_expert), 1.0 / self.ep)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return all_to_all_single(x.new_empty(x.shape[0], out.shape[1]), out[back], in_splits, out_splits,
                                 group=group)

    def exchange_counts(self, counts: torch.Tensor, rows: int) -> tuple[list[list[int]], list[list[int]]]:
        """(send, recv): send[r][e] rows of mine for rank r's expert e, recv[s][e] rows rank s sends
        for my expert e, learnt with one all-to-all of the counts. (`rows`, this rank's row count,
        is what the planner's balanced routing splits instead: planning/balanced_routing.py.)"""
        send = counts.view(self.ep, counts.numel() // self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return send.tolist(), recv.tolist()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, x, factor):  # noqa: ANN001, ANN205
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * ctx.factor, None


def _source_major_to_expert_major(counts: list[list[int]]) -> torch.Tensor:
    """Row permutation from (source, expert) order to (expert, source) order for counts [S][E]: each
    (expert, source) block's rows, shifted from where the block starts among the received rows to
    where it starts among the experts' — a dozen ops whatever S × E (one arange per block was
    S × E tiny ops per MoE layer, hundreds at EP 64, each paid again by the planner's fake tensors)."""
    sizes = torch.tensor(counts)
    received = sizes.flatten()
    block_starts = (received.cumsum(0) - received).view_as(sizes).t().flatten()
    lengths = sizes.t().flatten()
    shifts = block_starts - (lengths.cumsum(0) - lengths)
    total = sum(map(sum, counts))
    return torch.repeat_interleave(shifts, lengths, output_size=total) + torch.arange(total)


def apply_ep(moe_layers: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's stacked expert weights over ep_mesh (dim 0) and route tokens over it
    (the layout checks make sure ep divides the number of experts)."""
    dispatch = ExpertParallelDispatch(ep_mesh)
    for moe in moe_layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatch = dispatch
