"""Pipeline parallel (16.5.1): GPipe written by hand with send/recv, then the same with torch's pipelining.

    python scripts/tutorial/pipeline_parallel.py                           # 2 stages, 4 microbatches
    python scripts/tutorial/pipeline_parallel.py --nproc 4 --microbatches 8

The model is an MLP of 4 equal blocks (Linear + Tanh), cut into --nproc stages of equal size, one per
rank. The batch is cut into M microbatches so that stage 1 can work on microbatch 0 while stage 0 already
works on microbatch 1. GPipe runs every microbatch's forward first, then every backward in reverse order,
letting the gradients add up; each microbatch's loss is scaled by 1/M so that the sum is the full-batch
mean loss and the summed gradients are the full-batch gradients.

(a) by hand: activations go forward with isend/recv, gradients of the stage inputs go back the same way;
    each stage records the order of its work, and rank 0 draws the timeline and measures the bubble.
(b) torch.distributed.pipelining: pipeline() traces the model and cuts it at the split points,
    build_stage() keeps this rank's piece, ScheduleGPipe runs the same schedule.
Both are checked against the whole model run on one process: the full-batch loss and every gradient.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_in_rank_order, spawn_world  # noqa: E402

SEED = 0
N_BLOCKS = 4
# float32 rounding: M microbatch gradients summed one after another differ from the one-batch gradient
# by ~1e-7 of its largest entry (3e-7 at M=16); a real mistake (a missing 1/M, a lost microbatch) is ~1/M.
GRAD_TOLERANCE = 1e-5  # relative to the largest entry of each reference gradient
LOSS_TOLERANCE = 1e-6  # relative to the reference loss


class BlockMLP(nn.Module):
    """N_BLOCKS equal blocks, each Linear(h, h) followed by Tanh: easy to cut anywhere."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the blocks one after another."""
        for block in self.blocks:
            x = block(x)
        return x


def build_model(hidden: int) -> BlockMLP:
    """The whole model from one seed, so every rank (and the one-process reference) has the same weights."""
    torch.manual_seed(SEED)
    return BlockMLP(hidden)


def make_data(batch: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets of the full batch (same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def my_blocks(rank: int, world: int) -> range:
    """Which blocks stage `rank` holds: N_BLOCKS / world consecutive ones."""
    per = N_BLOCKS // world
    return range(rank * per, (rank + 1) * per)


def reference(hidden: int, batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Full-batch mean loss and every gradient of the whole model on one process."""
    model = build_model(hidden)
    x, y = make_data(batch, hidden)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def compare_grads(named_params, ref: dict[str, torch.Tensor]) -> tuple[float, float, int]:
    """Max abs and max relative (to the largest reference entry) gradient differences, and how many."""
    worst_abs = worst_rel = 0.0
    count = 0
    for name, p in named_params:
        diff = (p.grad.detach().cpu() - ref[name]).abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / ref[name].abs().max().item())
        count += 1
    return worst_abs, worst_rel, count


def gpipe_by_hand(rank: int, world: int, device: torch.device, stage: nn.Module, x: torch.Tensor,
                  y: torch.Tensor, n_mb: int) -> tuple[list[tuple[str, int]], float | None]:
    """All forwards, then all backwards in reverse; returns this stage's order of work and the loss."""
    first, last = rank == 0, rank == world - 1
    x_mbs, y_mbs = x.chunk(n_mb), y.chunk(n_mb)
    mb_shape = x_mbs[0].shape  # every microbatch and every activation has this shape: no header needed
    # GPipe keeps every microbatch's activations until its backward: that memory is its price
    # (the 1F1B schedule starts backwards earlier to free them sooner).
    inputs, outputs, losses, sends, order = [], [], [], [], []

    for m in range(n_mb):  # forward phase: one microbatch after another
        if first:
            inp = x_mbs[m].to(device)
        else:
            inp = torch.empty(mb_shape, device=device)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_()  # a leaf, so that inp.grad can go back to the previous stage
        out = stage(inp)
        inputs.append(inp)
        outputs.append(out)
        order.append(("F", m))
        if last:
            losses.append(F.mse_loss(out, y_mbs[m].to(device)) / n_mb)  # the 1/M makes the sum the mean
        else:
            sends.append(dist.isend(out.detach(), dst=rank + 1))  # don't wait: start the next microbatch
    for work in sends:
        work.wait()
    sends.clear()

    for m in reversed(range(n_mb)):  # backward phase: newest microbatch first, gradients accumulate
        if last:
            losses[m].backward()
        else:
            grad_out = torch.empty(mb_shape, device=device)
            dist.recv(grad_out, src=rank + 1)
            outputs[m].backward(grad_out)
        order.append(("B", m))
        if not first:
            sends.append(dist.isend(inputs[m].grad, dst=rank - 1))
    for work in sends:
        work.wait()
    return order, (sum(loss.item() for loss in losses) if last else None)


def timeline(orders: list[list[tuple[str, int]]]) -> list[list[str]]:
    """Place each stage's recorded work on time slots (one unit of work per slot, as early as possible).

    F(s, m) needs F(s-1, m) done; B(s, m) needs B(s+1, m) done; each stage works in its recorded order.
    """
    world = len(orders)
    slot: dict[tuple[int, str, int], int] = {}
    pos = [0] * world
    while any(pos[s] < len(orders[s]) for s in range(world)):
        progressed = False
        for s in range(world):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                dep = (s - 1, "F", m) if kind == "F" else (s + 1, "B", m)
                if not 0 <= dep[0] < world:
                    dep = None
                if dep is not None and dep not in slot:
                    break
                earliest = slot[(s, *orders[s][pos[s] - 1])] + 1 if pos[s] else 0
                slot[(s, kind, m)] = max(earliest, slot[dep] + 1 if dep else 0)
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded orders deadlock: some stage waits for work never done")
    width = max(slot.values()) + 1
    grid = [["."] * width for _ in range(world)]
    for (s, kind, m), t in slot.items():
        grid[s][t] = f"{kind}{m}"
    return grid


def part_a(rank: int, world: int, device: torch.device, hidden: int, batch: int, n_mb: int,
           ref_loss: float, ref_grads: dict[str, torch.Tensor]) -> None:
    """GPipe by hand, its timeline and bubble, checked against one process."""
    blocks = my_blocks(rank, world)
    full = build_model(hidden)
    stage = nn.Sequential(*(full.blocks[i] for i in blocks)).to(device)
    x, y = make_data(batch, hidden)
    if rank == 0:
        print(f"== (a) GPipe by hand: {world} stages, batch {batch} cut into {n_mb} microbatches "
              f"of {batch // n_mb}\n")
    order, loss = gpipe_by_hand(rank, world, device, stage, x, y, n_mb)
    held = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
    print_in_rank_order(f"stage {rank} ({held}) order: "
                        + " ".join(f"{k}{m}" for k, m in order))

    orders = [None] * world
    dist.all_gather_object(orders, order)
    if rank == 0:
        grid = timeline(orders)
        print("\ntimeline (one unit of work per slot; '.' = idle, the bubble):")
        print("          " + " ".join(f"{t:>3}" for t in range(len(grid[0]))))
        for s, row in enumerate(grid):
            print(f"stage {s:<3} " + " ".join(f"{cell:>3}" for cell in row))
        idle = sum(row.count(".") for row in grid) / (len(grid) * len(grid[0]))
        formula = (world - 1) / (n_mb + world - 1)
        print(f"bubble fraction: measured {idle:.4f}, (N-1)/(M+N-1) = ({world}-1)/({n_mb}+{world}-1) = "
              f"{formula:.4f}; without microbatches (M=1) it would be {(world - 1) / world:.4f}")
        if abs(idle - formula) > 1e-9:
            raise RuntimeError("the measured bubble is not the GPipe bubble")

    # Check: the loss on the last stage, every stage's gradients against the same blocks on one process.
    names_grads = [(f"blocks.{i}.{n}", p) for i in blocks for n, p in full.blocks[i].named_parameters()]
    d_abs, d_rel, count = compare_grads(names_grads, ref_grads)
    if d_rel > GRAD_TOLERANCE:
        raise RuntimeError(f"(a) stage {rank} gradients differ from one process (relative {d_rel:.3g})")
    print_in_rank_order(f"check: (a) stage {rank} gradients ({count} tensors) match one process "
                        f"(max abs diff {d_abs:.3g}, max relative diff {d_rel:.3g})")
    if rank == world - 1:
        report_loss("(a)", loss, ref_loss, f"sum of the {n_mb} microbatch losses, each scaled by 1/{n_mb}")


def report_loss(part: str, loss: float, ref_loss: float, how: str) -> None:
    """Print the loss check line and raise if it is off."""
    diff = abs(loss - ref_loss)
    if diff > LOSS_TOLERANCE * abs(ref_loss):
        raise RuntimeError(f"{part} loss {loss} differs from one process {ref_loss}")
    print(f"check: {part} loss {loss:.8f} ({how}) matches one process {ref_loss:.8f} "
          f"(max abs diff {diff:.3g})", flush=True)


def part_b(rank: int, world: int, device: torch.device, hidden: int, batch: int, n_mb: int,
           ref_loss: float, ref_grads: dict[str, torch.Tensor]) -> None:
    """The same model and schedule through torch.distributed.pipelining, checked the same way."""
    model = build_model(hidden)
    x, y = make_data(batch, hidden)
    # Cut before the first block of every stage but the first.
    split_spec = {f"blocks.{my_blocks(s, world).start}": SplitPoint.BEGINNING for s in range(1, world)}
    pipe = pipeline(model, mb_args=(x.chunk(n_mb)[0],), split_spec=split_spec)  # traced with one microbatch
    stage = pipe.build_stage(rank, device)
    # loss_fn gives each microbatch's mean loss; the schedule divides the gradients by M (scale_grads=True).
    schedule = ScheduleGPipe(stage, n_microbatches=n_mb, loss_fn=F.mse_loss)
    if rank == 0:
        cuts = ", ".join(f"{name!r}: SplitPoint.{point.name}" for name, point in split_spec.items())
        print(f"\n== (b) torch.distributed.pipelining: split_spec {{{cuts}}}, ScheduleGPipe, "
              f"{n_mb} microbatches\n")
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x.to(device))  # the first stage feeds the whole batch; the schedule chunks it
    elif rank == world - 1:
        schedule.step(target=y.to(device), losses=losses)  # the last stage gets the targets, returns losses
    else:
        schedule.step()  # middle stages only receive, compute and send
    names = [name for name, _ in stage.submod.named_parameters()]
    print_in_rank_order(f"stage {rank} holds {names}")

    d_abs, d_rel, count = compare_grads(stage.submod.named_parameters(), ref_grads)
    if d_rel > GRAD_TOLERANCE:
        raise RuntimeError(f"(b) stage {rank} gradients differ from one process (relative {d_rel:.3g})")
    print_in_rank_order(f"check: (b) stage {rank} gradients ({count} tensors) match one process "
                        f"(max abs diff {d_abs:.3g}, max relative diff {d_rel:.3g})")
    if rank == world - 1:
        loss = sum(loss.item() for loss in losses) / n_mb
        report_loss("(b)", loss, ref_loss, f"mean of the {len(losses)} microbatch losses")


def worker(rank: int, world: int, device: torch.device, hidden: int, batch: int, n_mb: int) -> None:
    """Run the hand-made GPipe and torch's, both checked against the one-process reference."""
    ref_loss, ref_grads = reference(hidden, batch)
    part_a(rank, world, device, hidden, batch, n_mb, ref_loss, ref_grads)
    dist.barrier()
    part_b(rank, world, device, hidden, batch, n_mb, ref_loss, ref_grads)


def main() -> None:
    """Parse the sizes, then spawn one process per stage."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help=f"stages (ranks); must divide {N_BLOCKS}")
    parser.add_argument("--microbatches", type=int, default=4, help="M, microbatches per batch")
    parser.add_argument("--batch", type=int, default=8, help="rows in the batch; M must divide it")
    parser.add_argument("--hidden", type=int, default=8, help="width of every block")
    args = parser.parse_args()
    if args.nproc < 2 or N_BLOCKS % args.nproc:
        parser.error(f"--nproc must be 2 or more and divide {N_BLOCKS}")
    if args.batch % args.microbatches:
        parser.error("--microbatches must divide --batch")
    spawn_world(worker, args.nproc, args.hidden, args.batch, args.microbatches)


if __name__ == "__main__":
    main()
