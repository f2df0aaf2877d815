"""Run under torchrun (3 ranks): Kiln's gloo all-gather and reduce-scatter
(parallelisms/cpu_collectives.py) against torch's, on uneven values, sum and average, async, and
apply_fsdp installing them with forward prefetch, reduce-scatters left in flight through backward
(same gradients as a plain all-reduce); TP's sequence-parallel styles on those collectives
(parallelisms/tp_cpu_collectives.py) against torch's own; reduce_partial_gradients
(parallelisms/partial_gradients.py) against DTensor's own reduction. Rank 0 prints one line per
check, "<name>: ok" or what differs on any rank; exits 1 if anything differs."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, ".")
from parallelisms.cpu_collectives import (  # noqa: E402
    AllToAllReduceScatter,
    BroadcastAllGather,
    ReduceScatterOverlap,
)
from parallelisms.fsdp import apply_fsdp  # noqa: E402
from parallelisms.partial_gradients import reduce_partial_gradients  # noqa: E402
from parallelisms.tp_cpu_collectives import SequenceRedistribute, on_gloo_styles, redistribute  # noqa: E402


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


class Chain(nn.Module):
    """Blocks called one after another through the root's forward, as FSDP's lazy init needs."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def overlapped_reduce_scatter(rank: int, world: int) -> list[str]:
    """What differs when FSDP's reduce-scatters stay in flight through backward: the gradients
    against a plain all-reduce of whole ones, over two backwards (the second accumulates, which
    must not defer), and whether anything was deferred at all or left pending."""
    torch.manual_seed(0)
    blocks = [nn.Linear(7, 5), nn.Linear(5, 5), nn.Linear(5, 3)]  # 7x5, 5x5 + 5: uneven shards of 3
    whole = nn.Sequential(*[nn.Linear(b.in_features, b.out_features) for b in blocks])
    whole.load_state_dict(nn.Sequential(*blocks).state_dict())
    model = Chain(blocks)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
    deferred, defer = [], ReduceScatterOverlap.defer
    ReduceScatterOverlap.defer = lambda self, work, finish: (deferred.append(1), defer(self, work, finish))
    try:
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model(x).square().sum().backward()
            whole(x).square().sum().backward()
    finally:
        ReduceScatterOverlap.defer = defer
    problems = [] if len(deferred) == len(blocks) else [f"{len(deferred)} of {len(blocks)} deferred"]
    groups = [g for b in blocks for g in b._get_fsdp_state()._fsdp_param_groups]
    overlaps = {id(g._reduce_scatter_comm.overlap) for g in groups}
    comm = blocks[0]._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
    if len(overlaps) != 1 or comm.overlap.pending or comm.overlap.callback_queued:
        problems.append("overlap not shared, or left pending after backward")
    for (name, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
        dist.all_reduce(q.grad)
        if not torch.allclose(p.grad.full_tensor(), q.grad / world, rtol=1e-5, atol=1e-6):
            problems.append(f"gradient of {name}")
    full, mine = torch.randn(4 * world), torch.empty(4)  # outside backward: finished at once
    comm(mine, full, dist.group.WORLD, dist.ReduceOp.SUM)
    gathered = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(gathered, full)
    if not torch.allclose(mine, torch.stack(gathered).sum(0).view(world, -1)[rank], rtol=1e-6, atol=1e-6):
        problems.append("reduce-scatter outside backward")
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


class Mlp(nn.Module):
    """A sequence-parallel feed-forward: gather the sequence, column- then row-wise linears."""

    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


def _mlp_grads(plan: dict, x: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Output and every gradient (input, weights) of the MLP under `plan`, from the same seed."""
    torch.manual_seed(0)
    model = parallelize_module(Mlp(), init_device_mesh("cpu", (world,)), plan)
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()  # a gradient unlike on every row
    return [out.detach(), x.grad, *(p.grad.full_tensor() for p in model.parameters())]


def sequence_redistribute(rank: int, world: int) -> list[str]:
    """What differs between TP's styles on Kiln's gloo collectives (parallelisms/tp_cpu_collectives.py)
    and torch's own: outputs and gradients of a sequence-parallel MLP on odd shapes, a Replicate
    gradient's backward (a local slice), a sequence that does not divide (torch's path), and
    whether the forward gathers / reduce-scatters and their backwards really ran through Kiln's."""
    plan = {"ff": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ff.0": ColwiseParallel(), "ff.2": RowwiseParallel(output_layouts=Shard(1))}
    calls = []
    forward, backward = SequenceRedistribute.forward, SequenceRedistribute.backward
    SequenceRedistribute.forward = staticmethod(lambda ctx, *a: (calls.append("f"), forward(ctx, *a))[1])
    SequenceRedistribute.backward = staticmethod(lambda ctx, g: (calls.append("b"), backward(ctx, g))[1])
    try:
        x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        theirs, ours = _mlp_grads(plan, x, world), _mlp_grads(on_gloo_styles(plan), x, world)
        problems = [] if sorted(calls) == ["b", "b", "f", "f"] else [f"Kiln's path ran {sorted(calls)}"]
        names = ["output", "input gradient", "w1", "b1", "w2", "b2"]
        problems += [f"MLP {n}" for n, a, b in zip(names, theirs, ours, strict=True)
                     if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
        mesh = init_device_mesh("cpu", (world,))
        calls.clear()
        local = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        grads = []
        for styles in (lambda p: p, on_gloo_styles):
            layer = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)
            module = parallelize_module(nn.Identity(), mesh, styles({"": layer})[""])
            local.grad = None
            module(local).square().sum().backward()  # a Replicate gradient: sliced, no collective
            grads.append(local.grad.clone())
        if not torch.allclose(*grads, rtol=1e-6) or calls != ["f", "b"]:
            problems.append(f"Replicate gradient (Kiln's path ran {calls})")
        calls.clear()
        sizes = [3] + [2] * (world - 1)  # a sequence of 2 · world + 1: uneven, torch's path
        uneven = DTensor.from_local(torch.full((2, sizes[rank]), float(rank)), mesh, [Shard(1)],
                                    shape=torch.Size([2, sum(sizes)]), stride=(sum(sizes), 1))
        if calls or not torch.equal(redistribute(uneven, (Replicate(),)).to_local(), uneven.full_tensor()):
            problems.append(f"uneven sequence (Kiln's path ran {calls})")
    finally:
        SequenceRedistribute.forward, SequenceRedistribute.backward = staticmethod(forward), staticmethod(backward)
    return problems


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    for check in (collectives, overlapped_reduce_scatter, partial_gradients, sequence_redistribute):
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
