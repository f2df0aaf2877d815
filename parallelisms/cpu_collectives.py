"""FSDP's all-gather and reduce-scatter on CPU (gloo) as broadcasts and one all-to-all.

gloo has no reduce-scatter of its own: torch runs one as an all-reduce of the whole input plus a
copy, and its all-gather into one tensor is slower than an all-reduce of the same output. The
same bytes move faster as other collectives gloo does have. Measured on a 2-core machine,
float32, ms per call (`python scripts/benchmark.py --tables collectives`):

    shard per rank   all-gather  as broadcasts   reduce-scatter  as all-to-all + sum
    2 processes
      256 KiB           0.74         0.33             1.41              0.36
      1 MiB             2.41         1.42             3.43              1.61
      4 MiB             5.76         3.47             9.92              5.04
    4 processes
      256 KiB           3.44         3.58             5.64              2.04
      1 MiB             7.50         6.01            11.92              5.03
      4 MiB            23.50        19.63            38.87             19.60

FSDP2 takes custom collectives through set_custom_all_gather / set_custom_reduce_scatter; torch
has no faster CPU path, so these are Kiln's own. The all-gather writes in place (no extra memory);
the reduce-scatter's receive buffer is the size of its input, like gloo's own copy. Sums run in
rank order, the same on every rank. GPUs (NCCL) keep FSDP's own collectives.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin


class AllWork(dist.Work):
    """Several collectives' works waited as one (FSDP waits on one Work per async all-gather)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: object = None) -> bool:
        for work in self.works:
            work.wait()
        return True


class BroadcastAllGather(DefaultAllocMixin, AllGather):
    """All-gather as one broadcast per rank into the output's slices; async (gloo's worker threads
    move the bytes while the caller computes) when FSDP prefetches (parallelisms/fsdp.py)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        slices = output_tensor.view(group.size(), -1)
        mine = slices[group.rank()]
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP's copy-in usually put it there already
            mine.copy_(input_tensor.view(-1))
        works = [dist.broadcast(slices[i], src=dist.get_global_rank(group, i), group=group, async_op=async_op)
                 for i in range(group.size())]
        return AllWork(works) if async_op else None


class AllToAllReduceScatter(DefaultAllocMixin, ReduceScatter):
    """Reduce-scatter as one all-to-all (rank i receives every rank's i-th chunk) and a sum."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"reduce-scatter through all-to-all sums or averages, not {op}")
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(group.size(), -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        return None


def on_gloo(mesh: DeviceMesh) -> bool:
    """Whether every dimension of the mesh talks through gloo (not NCCL, nor the planner's fake
    process group, which counts FSDP's own collectives)."""
    return all(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim))


def use_cpu_collectives(model: torch.nn.Module) -> None:
    """Give every FSDP module of the model the CPU collectives above."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(BroadcastAllGather())
            module.set_custom_reduce_scatter(AllToAllReduceScatter())
