"""Run under torchrun: Kiln's gloo all-gather and reduce-scatter (parallelisms/cpu_collectives.py)
against torch's, on uneven values, sum and average; and apply_fsdp installing them. Prints what
differs and exits 1, or prints "ok"."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, ".")
from parallelisms.cpu_collectives import AllToAllReduceScatter, BroadcastAllGather  # noqa: E402
from parallelisms.fsdp import apply_fsdp  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    problems = []
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(37, generator=gen) * (rank + 1)  # odd length, different on every rank

    ours, theirs = torch.empty(37 * world), torch.empty(37 * world)
    BroadcastAllGather()(ours, shard, group)
    dist.all_gather_into_tensor(theirs, shard)
    if not torch.equal(ours, theirs):
        problems.append("all-gather")

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
        # The sum runs in rank order: every rank's copy of a chunk would agree bit for bit.
    try:
        AllToAllReduceScatter()(torch.empty(37), full, group, dist.ReduceOp.MAX)
        problems.append("MAX accepted")
    except ValueError:
        pass

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(5, 3)})
    apply_fsdp(model, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
    state = model.layers["0"]._get_fsdp_state()
    comms = {type(g._all_gather_comm).__name__ + "/" + type(g._reduce_scatter_comm).__name__
             for g in state._fsdp_param_groups}
    if comms != {"BroadcastAllGather/AllToAllReduceScatter"}:
        problems.append(f"apply_fsdp installed {comms}")

    print("problems: " + ", ".join(problems) if problems else "ok", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
