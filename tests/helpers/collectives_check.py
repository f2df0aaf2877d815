"""Run under torchrun (3 ranks): the gloo accelerations (parallelisms/gloo_accelerations.py) against
torch's own collectives, and FSDP's recovery and reduction options with them off and on.

- collectives: the broadcast all-gather (sync, async, a bounded wait) and the all-to-all
  reduce-scatter (sum, average; other ops refused) equal torch's on uneven values;
- installed: apply_gloo_accelerations gives every FSDP module the collectives, a forward prefetch
  chain and async unshards, and does nothing to a model that has no FSDP;
- exception_in_backward: backward fails half-way, reset_iter_state() on the root, and the next
  step's gradients equal a plain all-reduce of whole gradients;
- reductions: set_force_sum_reduction_for_comms, a gradient divide factor with it, and fp16
  reduction give the reference's gradients (1.000 ×, not 2 ×);
- partial_gradients: reduce_partial_gradients against DTensor's own reduction of Partial grads.
Rank 0 prints one line per check, "<name>: ok" or what differs on any rank; exits 1 if anything does.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

sys.path.insert(0, ".")
from components.runtime.distributed import exit_cleanly
from parallelisms.fsdp import apply_fsdp  # noqa: E402
from parallelisms.gloo_accelerations import (  # noqa: E402
    AllToAllReduceScatter,
    BroadcastAllGather,
    apply_gloo_accelerations,
)
from parallelisms.partial_gradients import reduce_partial_gradients  # noqa: E402

WIDTHS = (7, 5, 5, 3)  # 7x5, 5x5 and 5x3 weights: shards of 3 ranks that need padding


def collectives(rank: int, world: int) -> list[str]:
    """What differs between the accelerated collectives and torch's."""
    from datetime import timedelta

    group = dist.group.WORLD
    problems = []
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(37, generator=gen) * (rank + 1)  # odd length, different on every rank
    ours, theirs = torch.empty(37 * world), torch.empty(37 * world)
    BroadcastAllGather()(ours, shard, group)
    dist.all_gather_into_tensor(theirs, shard)
    if not torch.equal(ours, theirs):
        problems.append("all-gather")
    later = torch.empty(37 * world)  # FSDP's async unshard: complete only once waited
    work = BroadcastAllGather()(later, shard, group, async_op=True)
    if not isinstance(work, dist.Work):
        problems.append(f"async all-gather returned {type(work).__name__}")
    elif not (work.wait(timedelta(seconds=30)) and torch.equal(later, theirs)):
        problems.append("async all-gather")

    full = torch.randn(37 * world, generator=gen) * 10 ** rank  # magnitudes that round differently
    gathered = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(gathered, full)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        mine = torch.empty(37)
        AllToAllReduceScatter()(mine, full, group, op)
        expected = torch.stack(gathered).double().sum(0).view(world, -1)[rank]
        expected = expected / world if op == dist.ReduceOp.AVG else expected
        if not torch.allclose(mine.double(), expected, rtol=1e-6, atol=1e-6):
            problems.append(f"reduce-scatter {op}")
    try:
        AllToAllReduceScatter()(torch.empty(37), full, group, dist.ReduceOp.MAX)
        problems.append("MAX accepted")
    except ValueError:
        pass
    return problems


class Chain(nn.Module):
    """Linear blocks called one after another through the root, with the model contract's names."""

    def __init__(self) -> None:
        super().__init__()
        pairs = zip(WIDTHS, WIDTHS[1:], strict=False)
        self.layers = nn.ModuleDict({str(i): nn.Linear(a, b) for i, (a, b) in enumerate(pairs)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = torch.tanh(block(x))
        return x


def _models(world: int, accelerate: bool, policy: MixedPrecisionPolicy | None = None) -> tuple[Chain, Chain]:
    """(FSDP model, plain twin with the same weights)."""
    torch.manual_seed(0)
    plain = Chain()
    model = Chain()
    model.load_state_dict(plain.state_dict())
    apply_fsdp(model, init_device_mesh("cpu", (world,)), policy or MixedPrecisionPolicy())
    if accelerate:
        apply_gloo_accelerations(model)
    return model, plain


def _gradients_differ(model: Chain, plain: Chain, x: torch.Tensor, world: int,
                      rtol: float = 1e-5) -> list[str]:
    """One more forward/backward of both; the FSDP gradients against the plain all-reduced mean."""
    for module in (model, plain):
        for p in module.parameters():
            p.grad = None
        module(x).square().sum().backward()
    problems = []
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        dist.all_reduce(q.grad)
        got, want = p.grad.full_tensor(), q.grad / world
        if (got - want).norm() > rtol * want.norm():
            problems.append(f"gradient of {name} is {(got.norm() / want.norm()).item():.4f} x")
    return problems


def installed(rank: int, world: int) -> list[str]:
    """What apply_gloo_accelerations failed to install on a gloo FSDP model."""
    model, _ = _models(world, accelerate=True)
    blocks = [model.layers[str(i)] for i in range(len(WIDTHS) - 1)]
    problems = []
    for module in [model, *blocks]:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            comms = (type(group._all_gather_comm).__name__, type(group._reduce_scatter_comm).__name__)
            if comms != ("BroadcastAllGather", "AllToAllReduceScatter") or not group.unshard_async_op:
                problems.append(f"{comms}, async {group.unshard_async_op}")
    states = [b._get_fsdp_state() for b in blocks]
    if [s._states_to_forward_prefetch for s in states] != [[states[1]], [states[2]], []]:
        problems.append("forward prefetch is not block 0 -> 1 -> 2")
    if apply_gloo_accelerations(Chain()):
        problems.append("changed a model without FSDP")
    return problems


def exception_in_backward(rank: int, world: int) -> list[str]:
    """Backward raises half-way (after the last block's reduce-scatter has run), FSDP is reset as
    torch documents, and the next step must give the reference's gradients."""
    problems = []
    for accelerate in (False, True):
        model, plain = _models(world, accelerate)
        x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(rank))

        def fail(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("injected")

        handle = model.layers["1"].register_full_backward_pre_hook(lambda m, g: fail(g[0]))
        try:
            model(x).square().sum().backward()
            problems.append("the injected exception did not happen")
        except RuntimeError as e:
            if "injected" not in str(e):
                raise
        handle.remove()
        model.reset_iter_state()
        problems += [f"accelerations {'on' if accelerate else 'off'}: {p}"
                     for p in _gradients_differ(model, plain, x, world)]
    return problems


def reductions(rank: int, world: int) -> list[str]:
    """Forced sum reduction, a divide factor (with it: gloo has no pre-multiplied sum) and fp16
    reduction, each off and on: FSDP's pre/post divides must apply exactly once."""
    problems = []
    x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    cases = {"force sum": (None, None), "divide factor": (None, float(world)),
             "fp16 reduce": (MixedPrecisionPolicy(reduce_dtype=torch.float16), None)}
    for name, (policy, factor) in cases.items():
        for accelerate in (False, True):
            model, plain = _models(world, accelerate, policy)
            for module in model.modules():
                if isinstance(module, FSDPModule) and policy is None:
                    module.set_force_sum_reduction_for_comms(True)
                    if factor is not None:
                        module.set_gradient_divide_factor(factor)
            rtol = 1e-3 if policy is not None else 1e-5  # fp16 keeps 11 significant bits
            problems += [f"{name}, accelerations {'on' if accelerate else 'off'}: {p}"
                         for p in _gradients_differ(model, plain, x, world, rtol)]
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


CHECKS = (collectives, installed, exception_in_backward, reductions, partial_gradients)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    for check in CHECKS:
        every_rank: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(every_rank, check(rank, world))
        problems = sorted({p for ps in every_rank for p in ps})
        failed |= bool(problems)
        if rank == 0:
            print(f"{check.__name__}: " + (", ".join(problems) if problems else "ok"), flush=True)
    exit_cleanly(1 if failed else 0)


if __name__ == "__main__":
    main()
