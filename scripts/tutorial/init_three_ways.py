"""Three ways to start a process group: an explicit TCPStore, the env:// default, and torchrun.

    python scripts/tutorial/init_three_ways.py --method store --world-size 4
    python scripts/tutorial/init_three_ways.py --method env --world-size 4
    torchrun --standalone --nproc-per-node=4 scripts/tutorial/init_three_ways.py --method torchrun

Every distributed program first starts its processes and lets them find each other (the rendezvous).
- store:    mp.spawn starts the processes; rank 0 opens a TCPStore (a small key-value server) on a free
            port and every other rank connects to it; the store is handed to init_process_group.
- env:      mp.spawn again, but init_process_group builds that store itself from MASTER_ADDR/MASTER_PORT.
- torchrun: torchrun starts the processes and fills RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT;
            the script only reads them.
Every rank then reports who it is, in rank order, and an all_reduce of ones proves the group talks:
the sum on every rank must be the world size.
"""

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import backend_and_device, free_port, print_in_rank_order

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)
HOW = {
    "store": "rank 0 hosted a TCPStore, the others connected, init_process_group got the store",
    "env": "init_process_group built the store from MASTER_ADDR/MASTER_PORT (env://)",
    "torchrun": "torchrun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; the script read them",
}


def claim_device(local_rank: int, local_world_size: int) -> str:
    """Pick backend and device (nccl on this rank's GPU, else gloo on CPU) before the group exists."""
    backend, device = backend_and_device(local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend


def init_with_store(rank: int, world_size: int, port: int) -> None:
    """Rank 0 hosts the TCPStore, the others connect; the group is built on that store."""
    store = dist.TCPStore(HOST, port, world_size, is_master=(rank == 0), timeout=TIMEOUT)
    # The store is a plain key-value server: what one rank sets, every rank can get (get waits for it).
    store.set(f"hello/{rank}", f"rank {rank} was here")
    seen = [store.get(f"hello/{r}").decode() for r in range(world_size)]
    if seen != [f"rank {r} was here" for r in range(world_size)]:
        raise RuntimeError(f"rank {rank} read {seen} from the store")
    if rank == 0:
        print(f"store: rank 0 read the hello/<rank> key of all {world_size} ranks back from the TCPStore",
              flush=True)
    backend = claim_device(rank, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)


def init_with_env(rank: int, world_size: int, port: int) -> None:
    """Point MASTER_ADDR/MASTER_PORT at rank 0 and let init_process_group build the store (env://)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = HOST, str(port)
    dist.init_process_group(claim_device(rank, world_size), rank=rank, world_size=world_size, timeout=TIMEOUT)


def init_from_env_vars() -> tuple[int, int, int]:
    """Read what torchrun put in the environment and join its world; return rank, world size, local rank."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group(claim_device(local_rank, local_world_size), rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    return rank, world_size, local_rank


def report(method: str, local_rank: int) -> None:
    """Each rank says who it is, then an all_reduce of ones checks that every rank took part."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if rank == 0:
        print(f"== method {method}: {world_size} processes joined one group ({HOW[method]})", flush=True)
    who = f"rank {rank} of {world_size}: local rank {local_rank}"
    print_in_rank_order(f"{who}, backend {dist.get_backend()}, device {device}")
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones, op=dist.ReduceOp.SUM)
    total = ones.item()
    if total != world_size:  # checked before this rank's turn to print, so rank 0's "ok" means all passed
        raise RuntimeError(f"rank {rank}: all_reduce of ones gave {total}, expected {world_size}")
    print_in_rank_order(f"rank {rank}: all_reduce(ones) = {total:g}")
    if rank == 0:
        print(f"check: all_reduce of ones equals the world size {world_size} on every rank", flush=True)


def spawned(rank: int, world_size: int, method: str, port: int) -> None:
    """What every mp.spawn child runs: join the group the chosen way, report, leave."""
    (init_with_store if method == "store" else init_with_env)(rank, world_size, port)
    try:
        report(method, local_rank=rank)  # one machine: local rank and global rank coincide
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Start the world the way --method asks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["store", "env", "torchrun"], default="store")
    parser.add_argument("--world-size", type=int, default=4, help="processes to spawn (store and env only)")
    args = parser.parse_args()
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    if args.method == "torchrun":
        if not under_torchrun:
            sys.exit("--method torchrun: launch with torchrun --standalone --nproc-per-node=4 "
                     "scripts/tutorial/init_three_ways.py --method torchrun")
        _, _, local_rank = init_from_env_vars()
        try:
            report("torchrun", local_rank)
        finally:
            dist.destroy_process_group()
        return
    if under_torchrun:
        sys.exit(f"--method {args.method} spawns its own processes: run it with python, not torchrun")
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    # mp.spawn children do not agree on a port by themselves: pick a free one here and pass it down.
    port = free_port()
    print(f"spawning {args.world_size} processes, rendezvous at {HOST}:{port}", flush=True)
    mp.spawn(spawned, args=(args.world_size, args.method, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
