"""DDP with a DistributedSampler on MNIST (section 16.4): each rank trains on its own share of every epoch.

    python scripts/tutorial/ddp_mnist.py --data-dir data --download           # fetch MNIST once; 2 ranks
    python scripts/tutorial/ddp_mnist.py --data-dir data --limit 4000 --epochs 3 --world-size 3
    torchrun --standalone --nproc-per-node=2 scripts/tutorial/ddp_mnist.py --data-dir data

--data-dir is a folder in torchvision's layout (<data-dir>/MNIST/raw/*-ubyte); --download fills it.
The model is wrapped in DistributedDataParallel, so gradients are averaged over the ranks in backward, and
the training set is split by a DistributedSampler: every epoch it shuffles the indices with a seed that
set_epoch changes, pads them to a multiple of the world size, and hands rank r every world-size-th one.

Each epoch prints, in rank order, how many samples each rank saw and a checksum of their indices, then the
mean training loss over all ranks and the accuracy on the test split (each rank scores a slice, the counts
are all-reduced). It checks that the ranks' indices cover the epoch and overlap only by the padding, and,
at the end, that every rank holds exactly the same parameters.
"""

import argparse
import json
import os
import sys
import zlib
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import init_from_torchrun, print_in_rank_order, spawn_world
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

TO_TENSOR = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])


def load_mnist(data_dir: str, train: bool, download: bool = False) -> datasets.MNIST:
    """torchvision's MNIST split, fetched only when asked; a clear message when the files are missing."""
    try:
        return datasets.MNIST(data_dir, train=train, download=download, transform=TO_TENSOR)
    except RuntimeError as err:
        sys.exit(f"error: no MNIST in {Path(data_dir) / 'MNIST' / 'raw'} ({err}); pass --download to fetch "
                 f"it, or --data-dir for a folder holding MNIST/raw/*-ubyte")


class WithIndex(Dataset):
    """Yields (image, label, index), so every rank can report exactly which samples it trained on."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image, label = self.dataset[index]
        return image, label, index


def make_model() -> nn.Sequential:
    """A small MLP classifier for 28x28 images; the fixed seed gives every rank the same start."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 10))


def checksum(indices: list[int]) -> str:
    """Order-independent fingerprint of a set of indices: their sum and the CRC32 of them sorted (int64)."""
    crc = zlib.crc32(torch.tensor(sorted(indices), dtype=torch.int64).numpy().tobytes())
    return f"sum={sum(indices)} crc32={crc:08x}"


def check_partition(per_rank: list[list[int]], n: int, padded: int, rank: int) -> None:
    """The ranks' indices cover 0..n-1, total the padded epoch, and repeat only the padding."""
    seen = Counter(i for indices in per_rank for i in indices)
    total = sum(len(indices) for indices in per_rank)
    repeats = total - len(seen)
    ok = set(seen) == set(range(n)) and total == padded and repeats == padded - n
    if not ok:
        raise RuntimeError(f"ranks' indices do not partition the epoch: {len(seen)} distinct of {n}, "
                           f"{total} in all (expected {padded})")
    if rank == 0:
        overlap = "disjoint" if repeats == 0 else f"disjoint apart from {repeats} padding repeat(s)"
        print(f"check: ranks' indices cover all {n} samples ({total} with padding), {overlap}", flush=True)


def all_reduce_sum(*values: float, device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def test_accuracy(model: nn.Module, test_set: Dataset, rank: int, world: int, device: torch.device) -> tuple:
    """Each rank scores every world-th test image; the counts are summed, so each image counts once."""
    model.eval()
    correct = 0
    for images, labels in DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=256):
        correct += (model(images.to(device)).argmax(1) == labels.to(device)).sum().item()
    model.train()
    correct, total = all_reduce_sum(correct, len(range(rank, len(test_set), world)), device=device)
    return int(correct), int(total)


def train(rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
    """Train the MLP with DDP on this rank's share of each epoch; print and check what happened."""
    train_set = load_mnist(args.data_dir, train=True)
    if args.limit:
        train_set = Subset(train_set, range(min(args.limit, len(train_set))))
    test_set = load_mnist(args.data_dir, train=False)
    sampler = DistributedSampler(WithIndex(train_set), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(WithIndex(train_set), batch_size=args.batch_size, sampler=sampler)
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"== {world} ranks on {device} ({dist.get_backend()}): {len(train_set)} training images, "
              f"{len(test_set)} test images, batch {args.batch_size} per rank, {len(sampler)} samples per "
              f"rank per epoch\n", flush=True)
    log = []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)  # without it every epoch would shuffle the same way
        seen: list[int] = []
        loss_sum = 0.0
        for images, labels, indices in loader:
            loss = F.cross_entropy(ddp(images.to(device)), labels.to(device))
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks here
            opt.step()
            seen += indices.tolist()
            loss_sum += loss.item() * len(indices)
        if rank == 0:
            print(f"-- epoch {epoch}", flush=True)
        print_in_rank_order(f"rank {rank}: {len(seen)} samples, indices {checksum(seen)}, "
                            f"first five {seen[:5]}")
        per_rank: list[list[int]] = [[] for _ in range(world)]
        dist.all_gather_object(per_rank, seen)
        check_partition(per_rank, len(train_set), len(sampler) * world, rank)
        loss_total, count = all_reduce_sum(loss_sum, len(seen), device=device)
        correct, total = test_accuracy(model, test_set, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss_total / count:.4f}, "
                  f"test accuracy {100 * correct / total:.2f}% ({correct}/{total})", flush=True)
        log.append(per_rank)
    if rank == 0 and args.dump_indices:
        Path(args.dump_indices).write_text(json.dumps({"world_size": world, "epochs": log}))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if diff.item() != 0:
        raise RuntimeError(f"replicas drifted apart (max abs diff {diff.item():.1e})")
    if rank == 0:
        print(f"check: every rank holds the same parameters as rank 0 (max abs diff {diff.item():.1e})")


def main() -> None:
    """Parse options; run under torchrun if it started us, else spawn our own world."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default="data", help="folder holding MNIST/raw/*-ubyte")
    parser.add_argument("--download", action="store_true", help="fetch MNIST into --data-dir if missing")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N training images")
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (not under torchrun)")
    parser.add_argument("--dump-indices", help="write every epoch's per-rank indices to this JSON file")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        rank, world, device = init_from_torchrun()
        try:
            if rank == 0:
                load_mnist(args.data_dir, train=True, download=args.download)
                load_mnist(args.data_dir, train=False, download=args.download)
            dist.barrier()  # the others read the files only once rank 0 has them
            train(rank, world, device, args)
        finally:
            dist.destroy_process_group()
    else:
        load_mnist(args.data_dir, train=True, download=args.download)  # fetch or fail once, before spawning
        load_mnist(args.data_dir, train=False, download=args.download)
        spawn_world(train, args.world_size, args)


if __name__ == "__main__":
    main()
