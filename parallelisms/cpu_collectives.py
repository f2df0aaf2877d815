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
rank order, the same on every rank. With forward prefetch (parallelisms/fsdp.py) the all-gathers
run as async work, and on a 1-D mesh each reduce-scatter stays in flight while backward computes
the next group's gradients (ReduceScatterOverlap). GPUs (NCCL) keep FSDP's own collectives.
"""

import ctypes
import functools
from collections.abc import Callable

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
        slices = unowned(output_tensor).view(group.size(), -1)
        mine = slices[group.rank()]
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP's copy-in usually put it there already
            mine.copy_(input_tensor.view(-1))
        works = [dist.broadcast(slices[i], src=dist.get_global_rank(group, i), group=group, async_op=async_op)
                 for i in range(group.size())]
        return AllWork(works) if async_op else None


class ReduceScatterOverlap:
    """Lets backward go on while a reduce-scatter's bytes move, shared by a model's FSDP modules.

    CPU has no streams: FSDP's reduce-scatter blocks until the slower rank catches up. Here each
    one is issued as async gloo work and finished (wait, then sum) when the next one starts — at
    most one in flight, so at most one extra gradient buffer lives — and at the latest by an
    autograd callback at the end of the backward pass, before anything reads a gradient.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, Callable[[], None]]] = []
        self.callback_queued = False

    def can_defer(self) -> bool:
        """Whether a reduce-scatter may finish later: only inside a backward pass, whose end runs
        finish_all (FSDP's final callback calling post_backward counts; callbacks it queues run too)."""
        if not self.callback_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_all)
            except RuntimeError:  # not inside a backward pass (e.g. a pipeline schedule's last reduce)
                return False
            self.callback_queued = True
        return True

    def defer(self, work: dist.Work, finish: Callable[[], None]) -> None:
        """Finish the one in flight, then leave this one in flight."""
        self.finish_pending()
        self.pending.append((work, finish))

    def finish_pending(self) -> None:
        for work, finish in self.pending:
            work.wait()
            finish()
        self.pending.clear()

    def finish_all(self) -> None:
        """The end-of-backward callback."""
        self.finish_pending()
        self.callback_queued = False


class AllToAllReduceScatter(DefaultAllocMixin, ReduceScatter):
    """Reduce-scatter as one all-to-all (rank i receives every rank's i-th chunk) and a sum; left in
    flight through `overlap` when FSDP will only view the output as this group's new gradients."""

    def __init__(self, overlap: ReduceScatterOverlap | None = None,
                 group_params: list[torch.nn.Parameter] | None = None) -> None:
        self.overlap = overlap
        self.group_params = group_params or []

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"reduce-scatter through all-to-all sums or averages, not {op}")
        received = torch.empty_like(input_tensor)
        # input_tensor rides along so that it lives until the bytes have left.
        finish = functools.partial(_sum_chunks, received, output_tensor, group.size(),
                                   op == dist.ReduceOp.AVG, input_tensor)
        overlap = self.overlap
        out, into = unowned(received), unowned(input_tensor)
        if overlap is not None and self.output_only_viewed(input_tensor.dtype) and overlap.can_defer():
            overlap.defer(dist.all_to_all_single(out, into, group=group, async_op=True), finish)
        else:
            dist.all_to_all_single(out, into, group=group)
            finish()
        return None

    def output_only_viewed(self, reduce_dtype: torch.dtype) -> bool:
        """Whether FSDP's foreach_reduce (torch 2.13/2.14) will only take views of the output as
        fresh gradients: none to accumulate into, no cast to the parameter dtype, no
        post-accumulate hooks. (HSDP's all-reduce reads it too: apply_fsdp gives no overlap there.)"""
        return all(p.grad is None and p.dtype == reduce_dtype
                   and not getattr(p, "_post_accumulate_grad_hooks", None) for p in self.group_params)


def _sum_chunks(received: torch.Tensor, output: torch.Tensor, world: int, average: bool,
                sent: torch.Tensor) -> None:
    """The reduce-scatter's sum, in rank order (the same on every rank)."""
    torch.sum(received.view(world, -1), dim=0, out=output.view(-1))
    if average:
        output.div_(world)


def unowned(t: torch.Tensor) -> torch.Tensor:
    """The same memory as contiguous t, in a tensor that does not keep t's storage alive.

    Kiln's collectives hand gloo these aliases. gloo's worker thread drops its reference to a
    finished work a moment after the waiter wakes; holding the last reference to a buffer, it would
    free the memory there, where a profiler of the training thread (components/memory_report.py)
    never sees the free. With aliases the buffer's owners (FSDP, autograd, Kiln) free it, on the
    training thread; each keeps its buffer alive until the work is waited.
    """
    if t.numel() == 0:
        return t
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)


def on_gloo(mesh: DeviceMesh) -> bool:
    """Whether every dimension of the mesh talks through gloo (not NCCL, nor the planner's fake
    process group, which counts FSDP's own collectives)."""
    return all(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim))


def use_cpu_collectives(model: torch.nn.Module, overlap_reduce_scatter: bool = False) -> None:
    """Give every FSDP module of the model the CPU collectives above; overlap_reduce_scatter lets
    their reduce-scatters run on while backward computes (1-D FSDP meshes)."""
    overlap = ReduceScatterOverlap() if overlap_reduce_scatter else None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # torch's, underscored in 2.13 and 2.14
            params = [fsdp_param.sharded_param for fsdp_param in group.fsdp_params] if group else []
            module.set_custom_all_gather(BroadcastAllGather())
            module.set_custom_reduce_scatter(AllToAllReduceScatter(overlap, params))
