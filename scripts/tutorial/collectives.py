"""The collectives distributed training is built from, each on tiny tensors you can check by eye.

    python scripts/tutorial/collectives.py                  # 4 ranks (gloo on CPU, nccl on GPUs)
    python scripts/tutorial/collectives.py --world-size 3

A collective is a call every rank of the group makes together; data moves between the ranks inside it.
Shown here: broadcast, all_reduce (SUM and MAX), all_gather, reduce_scatter and all_to_all. Every rank
prints its tensor before and after, in rank order. Most inputs are 10 * rank + position, so the tens
digit of a number tells which rank it started on (for small worlds); all_reduce uses random digits
from a generator seeded with SEED + rank, so runs are reproducible. Each rank recomputes what it must
hold from the inputs of all ranks (it can rebuild them locally: they depend only on the rank) and
stops with an error if the collective gave anything else.
"""

import argparse

import torch
import torch.distributed as dist
from common import print_in_rank_order, spawn_world

SEED = 1234
# Renamed in torch 2.14 (reduce_scatter_tensor still works there, with a deprecation warning).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def labelled(rank: int, n: int) -> torch.Tensor:
    """Rank r's n values 10*r + 0, 10*r + 1, ...: readable, and any rank can rebuild any other's."""
    return 10.0 * rank + torch.arange(n, dtype=torch.float32)


def random_digits(rank: int, n: int) -> torch.Tensor:
    """n random digits 0-9 drawn from a generator seeded by the rank: reproducible, rebuildable anywhere."""
    gen = torch.Generator().manual_seed(SEED + rank)
    return torch.randint(0, 10, (n,), generator=gen).to(torch.float32)


def show(t: torch.Tensor) -> str:
    """A tensor as a nested list of plain numbers, e.g. [[0, 1], [10, 11]]."""
    if t.dim() == 0:
        return f"{t.item():g}"
    return "[" + ", ".join(show(row) for row in t.cpu()) + "]"


def say(rank: int, text: str) -> None:
    """Rank 0 prints a line for the reader (headers, explanations, check results)."""
    if rank == 0:
        print(text, flush=True)


def before(name: str, explain: str, rank: int, tensor: torch.Tensor) -> None:
    """Rank 0 names the collective and says what it does; then every rank shows its input, in order."""
    say(rank, f"\n== {name}: {explain}")
    print_in_rank_order(f"rank {rank} before: {show(tensor)}")


def after(name: str, rank: int, tensor: torch.Tensor, expected: torch.Tensor) -> None:
    """Check this rank's result, then every rank shows it, in order; rank 0 reports that all matched."""
    if not torch.equal(tensor.cpu(), expected):  # checked before this rank prints: "ok" means all passed
        raise RuntimeError(f"{name} on rank {rank}: got {show(tensor)}, expected {show(expected)}")
    print_in_rank_order(f"rank {rank} after:  {show(tensor)}")
    say(rank, f"check: {name} ok")


def collectives(rank: int, world_size: int, device: torch.device) -> None:
    """Run each collective once on this rank's inputs and check it against the locally computed answer."""
    w = world_size
    say(rank, f"{w} ranks, device {device}, backend {dist.get_backend()}")

    source = 0
    x = labelled(rank, 3).to(device)
    before("broadcast", f"rank {source}'s tensor is copied over every other rank's tensor "
           "(how all replicas start from the same weights)", rank, x)
    dist.broadcast(x, src=source)
    after("broadcast", rank, x, expected=labelled(source, 3))

    digits = [random_digits(r, 4) for r in range(w)]  # every rank's input, rebuilt on this rank
    # clone: on the CPU .to(device) returns the same tensor, and all_reduce would overwrite digits[rank]
    x = digits[rank].clone().to(device)
    before("all_reduce(sum)", "the ranks' tensors are added element by element and every rank gets the "
           "total (how data parallel combines gradients)", rank, x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    after("all_reduce(sum)", rank, x, expected=torch.stack(digits).sum(dim=0))

    x = digits[rank].clone().to(device)
    before("all_reduce(max)", "the same, but each element becomes the largest value any rank held there",
           rank, x)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    after("all_reduce(max)", rank, x, expected=torch.stack(digits).amax(dim=0))

    piece = labelled(rank, 2).to(device)
    pieces = [torch.empty_like(piece) for _ in range(w)]
    before("all_gather", "every rank contributes a piece and every rank ends with all pieces, in rank "
           "order (how FSDP rebuilds full weights from shards)", rank, piece)
    dist.all_gather(pieces, piece)
    after("all_gather", rank, torch.stack(pieces), expected=torch.stack([labelled(r, 2) for r in range(w)]))

    full = labelled(rank, 2 * w).to(device)
    chunk = torch.empty(2, device=device)
    before("reduce_scatter", "the ranks' tensors are added, the total is cut into one chunk per rank and "
           "rank r keeps chunk r (how FSDP sums gradients, leaving each rank its shard)", rank, full)
    reduce_scatter_single(chunk, full, op=dist.ReduceOp.SUM)
    total = torch.stack([labelled(r, 2 * w) for r in range(w)]).sum(dim=0)
    after("reduce_scatter", rank, chunk, expected=total[2 * rank:2 * rank + 2])

    outbox = labelled(rank, w).to(device)  # element j is what this rank sends to rank j
    inbox = torch.empty_like(outbox)
    before("all_to_all", "element j of rank i goes to rank j, into slot i: a transpose across ranks "
           "(how expert parallel sends tokens to the rank holding their expert)", rank, outbox)
    dist.all_to_all_single(inbox, outbox)
    after("all_to_all", rank, inbox, expected=torch.stack([labelled(r, w)[rank] for r in range(w)]))


def main() -> None:
    """Spawn the world and run the collectives in it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (collectives need someone to talk to)")
    spawn_world(collectives, args.world_size)


if __name__ == "__main__":
    main()
