"""Gradient-norm clipping over parameters that live on different device meshes.

torch.nn.utils.clip_grad_norm_ stacks every per-parameter norm, which fails when DTensors sit on
different meshes (e.g. FSDP-only embeddings beside FSDP×TP blocks). Here each mesh group gets
its own norm, made whole with full_tensor(), and the groups are combined by hand.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements): within a group per-tensor norms stack cleanly."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    return groups


@torch.no_grad()
def total_grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients together, the same on every rank (a plain tensor)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # torch's float32 norm on CPU sums serially: on a 1M-element output-head gradient it was
    # 3e-4 off the float64 value, enough to break grad-norm parity between layouts. GPUs
    # reduce in a tree and stay in float32.
    acc = torch.float64 if grads[0].device.type == "cpu" else torch.float32
    group_norms = []
    for group in _group_by_mesh(grads).values():
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2, dtype=acc) for g in group]), 2
        )
        group_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = group_norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in group_norms]), 2)
    return total.float()


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
