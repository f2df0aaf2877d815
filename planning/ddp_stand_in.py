"""DDP for the fake step: torch's DistributedDataParallel runs a C++ reducer that reads tensor data
(it verifies parameter shapes across ranks and copies into buckets), which fake tensors do not
have. The planner swaps Kiln's apply_ddp for this stand-in, which does what DDP does to memory and
traffic: gradient buckets of `bucket_cap_mb` (DDP's copy of the gradients, kept for the whole run),
each all-reduced once the last of its gradients is ready, skipped while gradient sync is off.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import parallelisms.compose

BUCKET_CAP_MB = 100  # as parallelisms.fsdp.apply_ddp asks of torch


class DDPStandIn:
    """Buckets of gradients in reverse parameter order (the order backward produces them)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.model = model
        self.sync = True
        self.buckets: list[torch.Tensor] = []
        self.pending: list[int] = []
        model.set_requires_gradient_sync = self.set_requires_gradient_sync
        self._hook = model.register_forward_pre_hook(self._lazy_init)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.sync = sync

    def _lazy_init(self, *_: object) -> None:
        """At the first forward, as DDP does: allocate the buckets, hook every gradient."""
        self._hook.remove()
        params = [p for p in self.model.parameters() if p.requires_grad][::-1]
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if groups[-1] and size + p.numel() * p.element_size() > BUCKET_CAP_MB * 2**20:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        for index, group in enumerate(groups):
            self.buckets.append(torch.empty(sum(p.numel() for p in group), dtype=group[0].dtype,
                                            device=group[0].device))
            self.pending.append(len(group))
            for p in group:
                p.register_post_accumulate_grad_hook(functools.partial(self._ready, index, len(group)))

    def _ready(self, index: int, size: int, _param: object = None) -> None:
        self.pending[index] -= 1
        if self.pending[index] == 0:
            self.pending[index] = size
            if self.sync:
                dist.all_reduce(self.buckets[index], group=self.group)


def planned_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    DDPStandIn(model, mesh)
    return model


@contextlib.contextmanager
def ddp_stand_in() -> Iterator[None]:
    """Kiln's parallelize functions apply the stand-in instead of DDP inside the block."""
    real = parallelisms.compose.apply_ddp
    parallelisms.compose.apply_ddp = planned_ddp
    try:
        yield
    finally:
        parallelisms.compose.apply_ddp = real
