"""Opt-in speed-ups for gloo (CPU) process groups: `--comm.gloo_accelerations`.

Off by default. Kiln's users train on GPUs with NCCL, so torch's own collectives are the path every
layout runs and the parity tests hold to the single process; these change only how bytes move on
gloo, where torch's collectives are slow (gloo has no reduce-scatter: torch runs one as an
all-reduce of the whole input). `apply_gloo_accelerations` runs after a model is parallelized and
acts only where every process group involved is gloo; on NCCL, or the planner's fake groups, it
changes nothing. With it on:

- FSDP's all-gather is one broadcast per rank into the output's slices and its reduce-scatter one
  all-to-all plus a sum in rank order, through FSDP2's custom-collective hooks. Both are finished
  when the call returns, so FSDP's divide factors, casts and all-reduce hook run as usual.
- Each FSDP module starts the next one's all-gather before it computes (forward prefetch), and
  unshards run as async work that FSDP itself waits for (CPU has no streams to overlap with).
- Context parallel's K/V all-gather runs as broadcasts while the rank attends its own chunks, and
  in backward the other ranks' K/V gradients go home by one all-to-all while its own pairs'
  backward runs; the work is waited before the function returns, an exception included.

Tensor parallel keeps torch's styles: they have no public hook for their collectives. Every buffer
handed to gloo is an owning tensor, which gloo's work keeps alive until the bytes have moved.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's comm interface
from torch.distributed.tensor import DTensor

from parallelisms.blockwise_attention import Merged, backward_pairs, forward_pairs


class AllWork(dist.Work):
    """Several collectives' works waited as one (FSDP waits on one Work per async all-gather)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for every work; a non-zero timeout bounds the whole wait, as for one work."""
        deadline = time.monotonic() + timeout.total_seconds() if timeout else None
        for work in self.works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        return True


class BroadcastAllGather(AllGather):
    """All-gather as one broadcast per rank into the output's slices; async when FSDP asks."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        slices = output_tensor.view(group.size(), -1)
        mine = slices[group.rank()]
        if mine.data_ptr() != input_tensor.data_ptr():  # FSDP's copy-in usually put it there already
            mine.copy_(input_tensor.view(-1))
        works = [dist.broadcast(slices[i], src=dist.get_global_rank(group, i), group=group, async_op=async_op)
                 for i in range(group.size())]
        return AllWork(works) if async_op else None


class AllToAllReduceScatter(ReduceScatter):
    """Reduce-scatter as one all-to-all (rank i receives every rank's i-th chunk) and a sum in rank
    order, finished before it returns."""

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"the gloo reduce-scatter sums or averages, not {op} (FSDP asks for a "
                             "pre-multiplied sum when given a gradient divide factor, which gloo lacks too; "
                             "set_force_sum_reduction_for_comms(True) makes FSDP divide after a plain sum)")
        world = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def _on_gloo(meshes: set[DeviceMesh]) -> bool:
    """Whether every dimension of every mesh talks through gloo."""
    return bool(meshes) and all(dist.get_backend(mesh.get_group(i)) == "gloo"
                                for mesh in meshes for i in range(mesh.ndim))


def _forward_order(model: nn.Module) -> list[FSDPModule]:
    """The FSDP modules of a model that follows the model contract (models/protocol.py), in the
    order forward runs them: embedding, blocks, then the group of the final norm and head (a tied
    embedding lives in that group and is left out)."""
    embed, norm, output = (getattr(model, name, None) for name in ("tok_embeddings", "norm", "output"))
    tied = embed is not None and output is not None and bool(
        {id(p) for p in embed.parameters()} & {id(p) for p in output.parameters()})
    tail = next((m for m in (norm, output) if m is not None), None)
    order = [None if tied else embed, *model.layers.values(), tail]
    return [m for m in order if isinstance(m, FSDPModule)]


def accelerate_fsdp(model: nn.Module) -> bool:
    """Broadcast all-gathers, all-to-all reduce-scatters, forward prefetch and async unshards for the
    model's FSDP modules, when all of the model's meshes are gloo; returns whether it did."""
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not fsdp or not _on_gloo(meshes):
        return False
    for module in fsdp:
        module.set_custom_all_gather(BroadcastAllGather())
        module.set_custom_reduce_scatter(AllToAllReduceScatter())
    order = _forward_order(model)
    for module, following in zip(order, order[1:], strict=False):
        module.set_modules_to_forward_prefetch([following])
    for module in fsdp:  # torch's only switch for async unshards is private (docs/compatibility.md)
        module._set_unshard_async_op(True)
    return True


def accelerate_context_parallel(model: nn.Module) -> bool:
    """Switch the model's all-gather context-parallel attention to the overlapped gloo gather;
    returns whether it did."""
    cores = {id(m.core_attention): m.core_attention for m in model.modules()
             if getattr(getattr(m, "core_attention", None), "method", None) == "allgather"}
    done = False
    for core in cores.values():
        if dist.get_backend(core.group) == "gloo":
            core.attend = overlapped_gather_attention
            done = True
    return done


def apply_gloo_accelerations(model: nn.Module) -> list[str]:
    """Apply what fits this parallelized model; returns the names of what changed."""
    changed = []
    if accelerate_fsdp(model):
        changed.append("FSDP broadcast all-gather + prefetch, all-to-all reduce-scatter")
    if accelerate_context_parallel(model):
        changed.append("CP overlapped K/V gather")
    return changed


def overlapped_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over every cp rank's k/v [b, kv_heads, s, d], gathered
    by gloo broadcasts that move while this rank's own chunk pairs compute."""
    return _OverlappedGatherAttention.apply(q, k, v, group)


class _OverlappedGatherAttention(torch.autograd.Function):
    """Forward: every rank's K/V broadcast asynchronously while the queries attend this rank's own
    chunks, then the other ranks' chunks. Backward: the other ranks' pairs first, their K/V
    gradients sent home by one async all-to-all while the own pairs' backward runs."""

    @staticmethod
    def forward(ctx, q, k, v, group):  # noqa: ANN001, ANN205 (autograd.Function signature)
        cp, r = group.size(), group.rank()
        kv = torch.stack([k, v])
        gathered = kv.new_empty((cp, *kv.shape))  # [cp, 2, b, kv_heads, s, d], rank order
        work = BroadcastAllGather()(gathered, kv, group, async_op=True)
        merged = Merged()
        try:
            kernel = forward_pairs(merged, q, k, v, r, r, cp)
        finally:  # the broadcasts write into `gathered`: never leave them behind
            work.wait()
        for j in range(cp):
            if j != r:
                forward_pairs(merged, q, gathered[j, 0], gathered[j, 1], r, j, cp)
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.group, ctx.kernel = group, kernel
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, gathered, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        cp, r = group.size(), group.rank()
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
        for j in range(cp):
            if j != r:
                backward_pairs(dq, dkv[j, 0], dkv[j, 1], dout, q, gathered[j, 0], gathered[j, 1], out, lse,
                               r, j, cp, kernel)
        send = dkv.to(gathered.dtype)  # slot r stays zero: the own gradient is added below
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group, async_op=True)
        own = torch.zeros(gathered.shape[1:], dtype=torch.float32, device=q.device)
        try:
            backward_pairs(dq, own[0], own[1], dout, q, gathered[r, 0], gathered[r, 1], out, lse, r, r, cp,
                           kernel)
        finally:
            work.wait()
        dk, dv = (own + received.float().sum(0)).to(gathered.dtype)
        return dq.to(q.dtype), dk, dv, None
