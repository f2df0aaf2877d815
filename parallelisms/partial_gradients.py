"""Gradients left as partial sums after backward, reduced in one all-reduce per mesh.

Under sequence parallel a norm's weight is replicated on the TP ranks while each rank saw only its
slice of the sequence, so backward leaves the weight's gradient a Partial DTensor: the sum over
ranks is the gradient. torch reduces such a gradient wherever it is read — once in the grad-norm,
again inside the optimizer's fused kernel, one all-reduce per norm weight each time. Reducing them
all once, flattened into one buffer per mesh, before the clip leaves every later reader a
Replicate gradient and nothing to communicate.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def reduce_partial_gradients(params: list[torch.nn.Parameter]) -> int:
    """Turn every Partial gradient into the reduced (Replicate) one, one all-reduce per mesh dim
    of each (mesh, placements) group; returns how many gradients were reduced."""
    groups: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            groups[(g.device_mesh, tuple(g.placements))].append(p)
    for (mesh, placements), group in groups.items():
        pieces = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in pieces])
        for dim, placement in enumerate(placements):
            if isinstance(placement, Partial):
                dist.all_reduce(flat, op=_REDUCE_OPS[placement.reduce_op], group=mesh.get_group(dim))
        reduced = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
        for p, piece, value in zip(group, pieces, flat.split([t.numel() for t in pieces]), strict=True):
            p.grad = DTensor.from_local(value.view_as(piece), mesh, reduced, run_check=False,
                                        shape=p.grad.shape, stride=p.grad.stride())
    return sum(len(group) for group in groups.values())
