"""Model parallel by hand (16.5): one small network cut into stages, one stage per rank, with send/recv.

    python scripts/tutorial/model_parallel.py                      # 3 ranks: Linear 4->16, 16->8, 8->3
    python scripts/tutorial/model_parallel.py --widths 4,16,3      # 2 ranks
    python scripts/tutorial/model_parallel.py --batch-sizes 5,2,7  # three batches of different sizes

Each rank holds one Linear layer (ReLU after it, except on the last rank, which also computes the loss).
The activations change shape from stage to stage, and the batch size changes from batch to batch, so a
receiving rank cannot know how big a buffer to post. The sender therefore sends a small header first:
the number of dimensions, then the shape (int64 tensors), and only then the data. Backward runs the
chain the other way: each rank sends the gradient of its input to the previous rank, which continues
with activation.backward(received_grad). The logits, the loss and every stage's parameter gradients are
checked against the same model (same seed, same weights) run on one process.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_in_rank_order, spawn_world  # noqa: E402

SEED = 0
TOLERANCE = 1e-6


def build_model(widths: list[int]) -> nn.Sequential:
    """The whole network, from one seed: stage i is Linear(widths[i], widths[i+1]) (+ ReLU if not last)."""
    torch.manual_seed(SEED)
    stages = []
    for i in range(len(widths) - 1):
        linear = nn.Linear(widths[i], widths[i + 1])
        stages.append(linear if i == len(widths) - 2 else nn.Sequential(linear, nn.ReLU()))
    return nn.Sequential(*stages)


def make_batch(batch_size: int, widths: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class labels for one batch; every rank can rebuild it (only rank 0 / the last use it)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size, widths[0], generator=g)
    return x, torch.randint(widths[-1], (batch_size,), generator=g)


def send_with_shape(t: torch.Tensor, dst: int) -> None:
    """Send a tensor whose shape the receiver does not know: ndim, then the shape, then the data."""
    dist.send(torch.tensor([t.dim()], dtype=torch.int64, device=t.device), dst=dst)
    dist.send(torch.tensor(t.shape, dtype=torch.int64, device=t.device), dst=dst)
    dist.send(t.detach().contiguous(), dst=dst)


def recv_with_shape(src: int, device: torch.device) -> torch.Tensor:
    """The matching receive: learn ndim, then the shape, allocate exactly that, then receive the data."""
    ndim = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(ndim, src=src)
    shape = torch.empty(int(ndim.item()), dtype=torch.int64, device=device)
    dist.recv(shape, src=src)
    data = torch.empty(*shape.tolist(), device=device)
    dist.recv(data, src=src)
    return data


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference, as a Python float."""
    return (a.detach().cpu() - b.detach().cpu()).abs().max().item()


def run_batch(rank: int, world: int, device: torch.device, stage: nn.Module, widths: list[int],
              batch_size: int, step: int, events: list) -> dict:
    """One forward and backward through the chain of ranks; returns what this rank computed."""
    first, last = rank == 0, rank == world - 1
    x, labels = make_batch(batch_size, widths, step)

    # Forward: receive the activation (shape unknown in advance), run my stage, pass it on.
    if first:
        stage_input = x.to(device)
    else:
        stage_input = recv_with_shape(rank - 1, device).requires_grad_()  # a leaf: its .grad goes back
    start = time.perf_counter()
    out = stage(stage_input)
    loss = F.cross_entropy(out, labels.to(device)) if last else None
    events.append(("forward", start, time.perf_counter()))
    if not last:
        send_with_shape(out, rank + 1)
    sent = f"sent {tuple(out.shape)} to rank {rank + 1}" if not last else f"loss {loss.item():.6f}"
    received = (f"input {tuple(x.shape)}" if first else f"header from rank {rank - 1}: "
                f"ndim {stage_input.dim()}, shape {list(stage_input.shape)}, then the data")

    # Backward: the gradient of my output arrives from the next rank (same shape as the activation I
    # sent, so no header is needed); the gradient of my input goes back to the previous rank.
    if last:
        start = time.perf_counter()
        loss.backward()
    else:
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=rank + 1)
        start = time.perf_counter()
        out.backward(grad_out)
    events.append(("backward", start, time.perf_counter()))
    if not first:
        dist.send(stage_input.grad, dst=rank - 1)
    return {"received": received, "sent": sent, "out": out, "loss": loss}


def reference(widths: list[int], batch_size: int, step: int, rank: int) -> dict:
    """The same model and batch on this one process: logits, loss and stage `rank`'s gradients."""
    model = build_model(widths)
    x, labels = make_batch(batch_size, widths, step)
    logits = model(x)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return {"logits": logits, "loss": loss, "grads": [p.grad for p in model[rank].parameters()]}


def worker(rank: int, world: int, device: torch.device, widths: list[int], batch_sizes: list[int]) -> None:
    """Keep only my stage of the seeded model, run every batch through the chain, check it."""
    if len(widths) - 1 != world:
        raise ValueError(f"{len(widths) - 1} stages need {len(widths) - 1} ranks, not {world}")
    stage = build_model(widths)[rank].to(device)  # same seed on every rank -> same weights as one process
    if rank == 0:
        print(f"== model parallel over {world} ranks: widths {widths}, one Linear per rank\n")
    print_in_rank_order(f"rank {rank} holds stage {rank}: {stage}")

    events: list = []
    for step, batch_size in enumerate(batch_sizes):
        if rank == 0:
            print(f"\n-- batch {step}: {batch_size} rows")
        stage.zero_grad()
        got = run_batch(rank, world, device, stage, widths, batch_size, step, events)
        print_in_rank_order(f"rank {rank}: {got['received']}, {got['sent']}")

        ref = reference(widths, batch_size, step, rank)
        worst = max(max_diff(p.grad, r) for p, r in zip(stage.parameters(), ref["grads"], strict=True))
        if worst > TOLERANCE:
            raise RuntimeError(f"rank {rank}: stage {rank} gradients differ from one process by {worst:.3g}")
        print_in_rank_order(f"check: batch {step} stage {rank} gradients match one process "
                            f"(max abs diff {worst:.3g})")
        if rank == world - 1:
            d_logits, d_loss = max_diff(got["out"], ref["logits"]), max_diff(got["loss"], ref["loss"])
            if max(d_logits, d_loss) > TOLERANCE:
                raise RuntimeError(f"logits/loss differ from one process by {d_logits:.3g}/{d_loss:.3g}")
            print(f"logits (last rank):\n{got['out'].detach()}")
            print(f"check: batch {step} logits match one process (max abs diff {d_logits:.3g})")
            print(f"check: batch {step} loss {got['loss'].item():.6f} matches one process "
                  f"{ref['loss'].item():.6f} (max abs diff {d_loss:.3g})", flush=True)
        dist.barrier()

    # Who computed when: gather every rank's compute intervals and sort them by start time.
    everyone = [None] * world
    dist.all_gather_object(everyone, events)
    if rank == 0:
        order = sorted((start, end, r, kind) for r, evs in enumerate(everyone) for kind, start, end in evs)
        overlaps = sum(order[i + 1][0] < order[i][1] for i in range(len(order) - 1))
        print("\n-- who computed, in time order (first batch):")
        for _, _, r, kind in order[:2 * world]:
            print(f"   rank {r} {kind}")
        print(f"timeline: {' '.join(f'{kind[0].upper()}{r}' for _, _, r, kind in order)}")
        print(f"overlapping compute intervals: {overlaps}")
        print(f"only one rank computes at a time: each waits for its neighbour, so every rank is idle\n"
              f"{2 * (world - 1)} of the {2 * world} turns of a batch. Pipeline parallelism\n"
              "(pipeline_parallel.py) removes much of this by cutting the batch into microbatches.")
        print("\nwhy the header: a recv needs a buffer of the right size before the data arrives.\n"
              "Without the shape message the receiver must guess it; here the width changes from stage\n"
              "to stage and the rows from batch to batch, so any fixed guess is wrong. On gloo a too-small\n"
              "buffer aborts the receiving process, a too-large one is silently part-filled (stale values,\n"
              "wrong shape); other backends may hang or corrupt memory. The gradient going back needs no\n"
              "header: it has the shape of the activation the receiver itself sent.")


def main() -> None:
    """Parse the stage widths and batch sizes, then spawn one process per stage."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="4,16,8,3", help="layer widths; one rank per Linear layer")
    parser.add_argument("--batch-sizes", default="5,3", help="rows of each batch (they may differ)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if len(widths) < 3:
        parser.error("--widths needs at least 3 numbers (2 stages)")
    spawn_world(worker, len(widths) - 1, widths, batch_sizes)


if __name__ == "__main__":
    main()
