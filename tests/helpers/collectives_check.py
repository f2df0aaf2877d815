"""Run under torchrun (3 ranks): Kiln's gloo all-gather and reduce-scatter
(parallelisms/cpu_collectives.py) against torch's, on uneven values, sum and average, async, and
apply_fsdp installing them with forward prefetch; reduce_partial_gradients
(parallelisms/partial_gradients.py) against DTensor's own reduction. Rank 0 prints one line per
check, "<name>: ok" or what differs on any rank; exits 1 if anything differs."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

sys.path.insert(0, ".")
from parallelisms.cpu_collectives import AllToAllReduceScatter, BroadcastAllGather  # noqa: E402
from parallelisms.fsdp import apply_fsdp  # noqa: E402
from parallelisms.partial_gradients import reduce_partial_gradients  # noqa: E402


def collectives(rank: int, world: int) -> list[str]:
    """What differs between Kiln's FSDP collectives and torch's."""
    group = dist.group.WORLD
    problems = []
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(37, generator=gen) * (rank + 1)  # odd length, different on every rank

    ours, theirs = torch.empty(37 * world), torch.empty(37 * world)
    BroadcastAllGather()(ours, shard, group)
    dist.all_gather_into_tensor(theirs, shard)
    if not torch.equal(ours, theirs):
        problems.append("all-gather")
    later = torch.empty(37 * world)  # FSDP's prefetch: async, complete only once waited
    work = BroadcastAllGather()(later, shard, group, async_op=True)
    if not isinstance(work, dist.Work):
        problems.append(f"async all-gather returned {type(work).__name__}")
    elif not (work.wait() and torch.equal(later, theirs)):
        problems.append("async all-gather")

    full = torch.randn(37 * world, generator=gen) * 10 ** rank  # magnitudes that round differently
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        mine = torch.empty(37)
        AllToAllReduceScatter()(mine, full, group, op)
        gathered = [torch.empty_like(full) for _ in range(world)]
        dist.all_gather(gathered, full)
        expected = torch.stack(gathered).double().sum(0).view(world, -1)[rank]
        expected = expected / world if op == dist.ReduceOp.AVG else expected
        if not torch.allclose(mine.double(), expected, rtol=1e-6, atol=1e-6):
            problems.append(f"reduce-scatter {op}")
    try:
        AllToAllReduceScatter()(torch.empty(37), full, group, dist.ReduceOp.MAX)
        problems.append("MAX accepted")
    except ValueError:
        pass

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(5, 3), "1": nn.Linear(3, 3)})
    apply_fsdp(model, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
    first, second = (model.layers[i]._get_fsdp_state() for i in ("0", "1"))
    comms = {type(g._all_gather_comm).__name__ + "/" + type(g._reduce_scatter_comm).__name__
             for g in first._fsdp_param_groups}
    if comms != {"BroadcastAllGather/AllToAllReduceScatter"}:
        problems.append(f"apply_fsdp installed {comms}")
    if first._states_to_forward_prefetch != [second] or second._states_to_forward_prefetch:
        problems.append("forward prefetch is not block 0 -> block 1")
    if not all(g.unshard_async_op for g in first._fsdp_param_groups):
        problems.append("unshards are not async")
    return problems


def partial_gradients(rank: int, world: int) -> list[str]:
    """What differs between reduce_partial_gradients and DTensor's own reduction of Partial grads."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(10 + rank)
    params, expected = [], []
    for shape in ((5,), (3, 4)):  # two partial gradients: one group, one all-reduce
        p = nn.Parameter(DTensor.from_local(torch.zeros(shape), mesh, [Replicate()]))
        p.grad = DTensor.from_local(torch.randn(shape, generator=gen), mesh, [Partial()])
        expected.append(p.grad.redistribute(mesh, [Replicate()]).to_local())
        params.append(p)
    sharded = nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)]))
    sharded.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])  # not partial: untouched
    reduced = reduce_partial_gradients([*params, sharded])
    problems = [] if reduced == 2 else [f"reduced {reduced} gradients, not 2"]
    for p, want in zip(params, expected, strict=True):
        # One bucket may be summed in another order than each tensor alone (a ring of 3 ranks).
        if p.grad.placements != (Replicate(),) or not torch.allclose(p.grad.to_local(), want, rtol=1e-6):
            problems.append(f"gradient of shape {tuple(p.shape)}")
    if sharded.grad.placements != (Shard(0),):
        problems.append("a sharded gradient changed")
    return problems


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    for check in (collectives, partial_gradients):
        every_rank: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(every_rank, check(rank, world))
        problems = sorted({p for ps in every_rank for p in ps})
        failed |= bool(problems)
        if rank == 0:
            print(f"{check.__name__}: " + (", ".join(problems) if problems else "ok"), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
