"""Fully sharded data parallel (16.7): fully_shard splits every parameter over the ranks of a 1-D mesh.

    python scripts/tutorial/fully_shard_demo.py             # 2 processes
    python scripts/tutorial/fully_shard_demo.py --world 4

Each rank keeps only its slice (Shard(dim=0)) of every parameter, gradient and optimizer state. For a
layer's forward the slices are all-gathered into the full weight, which is freed again afterwards
(resharded); backward all-gathers once more and reduce-scatters the gradients, so each rank gets the
averaged gradient of its own slice. The script prints the shards and the memory each rank keeps,
watches a forward from inside the layers, counts the collectives, and checks that one FSDP training
step on a batch split over the ranks gives the same gradients (each rank: its rows) and the same updated
parameters as one process training on the whole batch.
"""

import argparse
import copy
import gc
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_in_rank_order, spawn_world  # noqa: E402

BATCH, D_IN, HIDDEN, D_OUT = 8, 8, 16, 4
LR = 0.1
TOLERANCE = 1e-6
LAYERS = ("fc1", "fc2", "fc3")


class MLP(nn.Module):
    """Three Linear layers: each becomes one FSDP unit, with its own all-gather and reduce-scatter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two ReLU hidden layers, a linear output."""
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def shard_table(model: nn.Module) -> str:
    """Per parameter: global shape, placement and the local shard this rank stores; then the memory."""
    lines, kept, full = [f"rank {dist.get_rank()}:"], 0, 0
    for name, p in model.named_parameters():
        local = p.to_local()
        kept += local.numel() * local.element_size()
        full += p.numel() * p.element_size()
        lines.append(f"  {name:<11} global {str(tuple(p.shape)):<9} {str(p.placements):<16} "
                     f"local {tuple(local.shape)}")
    lines.append(f"  memory: keeps {kept} B of the full model's {full} B ({100 * kept / full:.0f}%)")
    return "\n".join(lines)


def watch_layers(model: MLP, events: list[str]) -> None:
    """Record what each Linear's weight is while its forward runs, and right after.

    FSDP's own pre-forward hook (the all-gather) runs before ours, and its post-forward hook (the reshard)
    before our forward hook, so we see the full weight inside and the shard again once the layer is done.
    """
    def describe(w: torch.Tensor) -> str:
        if isinstance(w, DTensor):
            return f"DTensor {tuple(w.shape)}, local shard {tuple(w.to_local().shape)}"
        return f"plain tensor {tuple(w.shape)}"

    for name in LAYERS:
        def before(mod: nn.Module, args: tuple, name: str = name) -> None:
            events.append(f"  {name} forward starts: weight is {describe(mod.weight)}")

        def after(mod: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
            events.append(f"  {name} forward done:   weight is {describe(mod.weight)}")

        getattr(model, name).register_forward_pre_hook(before)
        getattr(model, name).register_forward_hook(after)


def count(mode: CommDebugMode) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) that the mode saw, whatever the exact c10d op names are."""
    counts = mode.get_comm_counts()
    gathers = sum(n for op, n in counts.items() if "allgather" in str(op) or "all_gather" in str(op))
    scatters = sum(n for op, n in counts.items() if "reduce_scatter" in str(op))
    return gathers, scatters


def shard(model: MLP, world: int, device: torch.device) -> MLP:
    """fully_shard each Linear (one all-gather / reduce-scatter unit each), then the root module."""
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    for name in LAYERS:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: owns what no Linear took (nothing here), drives the step
    if dist.get_rank() == 0:
        print(f"== fully_shard over a 1-D mesh of {world} ranks ({device.type}): {mesh} ==", flush=True)
    return model


def max_diff(sharded: dict[str, torch.Tensor], full: dict[str, torch.Tensor], rows_only: bool) -> dict:
    """Per name, the largest |difference| between an FSDP tensor and the one-process tensor.

    rows_only: compare this rank's local shard with its row block of the full tensor; else all-gather
    the FSDP tensor with full_tensor() and compare everything.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, t in sharded.items():
        mine = t.to_local() if rows_only else t.full_tensor()
        theirs = full[name].chunk(world, dim=0)[rank] if rows_only else full[name]
        out[name] = (mine - theirs).abs().max().item()
    return out


def demo(rank: int, world: int, device: torch.device) -> None:
    """Shard the MLP, look at its shards, train one step and compare with one process on the whole batch."""
    # Same seed on every rank, full weights built BEFORE sharding: fully_shard then slices these tensors.
    # (Initialising after sharding would need DTensor's sharded RNG, which on a CPU mesh may fill every
    # shard with the same numbers.)
    torch.manual_seed(0)
    model = MLP().to(device)
    reference = copy.deepcopy(model)  # the one-process model, trained on the whole batch below
    shard(model, world, device)
    print_in_rank_order(shard_table(model))
    full_init = {n: p.detach() for n, p in reference.named_parameters()}
    if max(max_diff(dict(model.named_parameters()), full_init, rows_only=True).values()) != 0:
        raise RuntimeError(f"rank {rank}: a shard is not this rank's row block of the full tensor")

    torch.manual_seed(1)
    x, y = torch.randn(BATCH, D_IN, device=device), torch.randn(BATCH, D_OUT, device=device)

    # One process, whole batch: mean squared error over all BATCH samples, one SGD step.
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    torch.optim.SGD(reference.parameters(), lr=LR).step()

    # FSDP: the same step, each rank on its own slice of the batch (data parallel).
    x_mine, y_mine = x.chunk(world)[rank], y.chunk(world)[rank]
    events: list[str] = []
    watch_layers(model, events)
    with CommDebugMode() as forward_comms, warnings.catch_warnings():
        # Under CommDebugMode (a dispatch mode) the root's output is a view, which FSDP warns about; harmless
        # here: nothing modifies the output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        loss = F.mse_loss(model(x_mine), y_mine)
    with CommDebugMode() as backward_comms:
        loss.backward()  # reduce-scatter: each rank ends with the batch-averaged gradient of its rows
    grad_diffs = max_diff({n: p.grad for n, p in model.named_parameters()}, ref_grads, rows_only=True)
    grad_shapes = ", ".join(f"{n} {tuple(p.grad.to_local().shape)}" for n, p in model.named_parameters())
    torch.optim.SGD(model.parameters(), lr=LR).step()  # each rank updates its own rows only

    (fwd_gathers, fwd_scatters), (bwd_gathers, bwd_scatters) = count(forward_comms), count(backward_comms)
    if rank == 0:
        print(f"\n== one training step, {BATCH // world} of the {BATCH} samples per rank "
              "(rank 0's view of the forward) ==")
        print("\n".join(events))
        print(f"collectives: forward {fwd_gathers} all-gathers, {fwd_scatters} reduce-scatters; "
              f"backward {bwd_gathers} all-gathers, {bwd_scatters} reduce-scatters")
        print(f"gradient shards kept on rank 0: {grad_shapes}", flush=True)
    if (fwd_gathers, fwd_scatters, bwd_scatters) != (len(LAYERS), 0, len(LAYERS)):
        raise RuntimeError(f"unexpected collectives: forward {forward_comms.get_comm_counts()}, "
                           f"backward {backward_comms.get_comm_counts()}")

    whole_loss = loss.detach().clone()
    dist.all_reduce(whole_loss, op=dist.ReduceOp.SUM)  # equal slices: the mean of the ranks' means
    whole_loss /= world
    full_after = {n: p.detach() for n, p in reference.named_parameters()}
    param_diffs = max_diff(dict(model.named_parameters()), full_after, rows_only=False)
    grad_diff = torch.tensor(max(grad_diffs.values()), device=device)
    dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)  # the worst rank's gradient shard
    grad_diff, param_diff = grad_diff.item(), max(param_diffs.values())
    if rank == 0:
        print(f"\n== compare with one process training on the whole batch (SGD lr {LR}) ==")
        print(f"loss: FSDP (mean over ranks) {whole_loss.item():.6f}, one process {ref_loss.item():.6f}")
        for name, d in param_diffs.items():
            print(f"  {name:<11} max abs diff {d:.1e}")
    worst = max(grad_diff, param_diff, abs(whole_loss.item() - ref_loss.item()))
    if worst > TOLERANCE:
        raise RuntimeError(f"rank {rank}: FSDP step differs from one process (max abs diff {worst:.2e})")
    if rank == 0:
        print(f"check: gradient shards equal the row blocks of the whole-batch gradient "
              f"(max abs diff {grad_diff:.1e} over all ranks)")
        print(f"check: parameters after one FSDP step (full_tensor) equal one process trained on the whole "
              f"batch (max abs diff {param_diff:.1e})", flush=True)


def run(rank: int, world: int, device: torch.device) -> None:
    """The demo, then a garbage collection while the process group still works.

    FSDP's hooks tie modules and their state in reference cycles, which otherwise live until the
    interpreter shuts down; freeing their tensors that late can race with gloo's worker threads and abort
    the process ("terminate called without an active exception").
    """
    demo(rank, world, device)
    gc.collect()


def main() -> None:
    """Parse --world and spawn that many processes."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, choices=(2, 4), help="ranks in the mesh (default 2)")
    args = parser.parse_args()
    spawn_world(run, args.world)


if __name__ == "__main__":
    main()
