"""Gradient-norm clipping over parameters that live on different device meshes.

torch.nn.utils.clip_grad_norm_ stacks every per-parameter norm, which fails when DTensors sit on
different meshes (e.g. FSDP-only embeddings beside FSDP×TP blocks). Here each mesh group gets
its own sum of squares over the ranks that hold its pieces, and the groups are combined by hand.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _group_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements): a group's squares are summed over the same ranks."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    return groups


def _local_square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ x² over these plain tensors, in float32 without copies.

    torch's float32 norm on CPU sums a tensor in a few long serial runs, which on a large
    output-head gradient lands far enough from the float64 value to break grad-norm parity between
    layouts. Summing each row first, then the rows' squares, keeps every run short and the result at
    float32 rounding, without a float64 copy of every gradient (which costs a step real time).
    GPUs reduce in a tree: one fused kernel per group.
    """
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors)).float().square().sum()
    rows = [t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1) for t in tensors]
    row_norms = [torch.linalg.vector_norm(r, 2, dim=-1, dtype=torch.float32) for r in rows]
    return torch.cat(row_norms).square().sum()


def _group_square_sum(group: list[torch.Tensor]) -> torch.Tensor:
    """Σ x² over a group of gradients sharing mesh and placements, summed over the ranks that hold
    different pieces of them (their sharded mesh dims); the same value on every rank."""
    if not isinstance(group[0], DTensor):
        return _local_square_sum(group)
    g = group[0]
    if any(p.is_partial() for p in g.placements):  # not seen from Kiln's layouts: let DTensor reduce it
        return torch.stack([torch.linalg.vector_norm(t, 2).full_tensor() for t in group]).square().sum()
    local = _local_square_sum([t.to_local() for t in group])
    # Each mesh dim either splits the tensor (Shard, or the _StridedShard of FSDP over TP) or copies it.
    placements = [Replicate() if p.is_replicate() else Partial() for p in g.placements]
    return DTensor.from_local(local, g.device_mesh, placements, run_check=False).full_tensor()


@torch.no_grad()
def total_grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients together, the same on every rank (a plain tensor)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    squares = [_group_square_sum(group) for group in _group_by_mesh(grads).values()]
    device = squares[0].device
    return torch.stack([s.to(device, torch.float64) for s in squares]).sum().sqrt().float()


@torch.no_grad()
def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float,
                   pipeline_group: dist.ProcessGroup | None = None,
                   counted_elsewhere: list[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Scale gradients so their total norm is at most max_norm (max_norm <= 0: measure only).

    With pipeline parallel each rank holds other layers: pipeline_group sums their squared norms.
    counted_elsewhere: second copies of a weight (tied across pipeline stages) that are clipped
    but left out of the norm, which counts the weight once.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in counted_elsewhere}
    total = total_grad_norm([p for p in params if id(p) not in skip])
    if pipeline_group is not None:
        square = total.double() ** 2
        dist.all_reduce(square, group=pipeline_group)
        total = square.sqrt().float()
    if max_norm > 0:
        # One mesh group at a time: the fused multiply cannot mix DTensors of different meshes.
        by_grad = {id(p.grad): p for p in params}
        for group in _group_by_mesh([p.grad for p in params]).values():
            torch.nn.utils.clip_grads_with_norm_([by_grad[id(g)] for g in group], max_norm, total)
    return total
