"""What every walkthrough shares: backend and device, starting a world, printing in rank order."""

import gc
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def backend_and_device(local_rank: int, local_world_size: int = 1) -> tuple[str, torch.device]:
    """nccl on cuda:local_rank when this machine has a GPU per process, else gloo on the CPU.

    NCCL refuses two ranks on one GPU, so a world larger than the GPU count runs on the CPU.
    """
    if torch.cuda.is_available() and local_world_size <= torch.cuda.device_count():
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def free_port() -> int:
    """A TCP port nobody listens on right now (for the rendezvous of an mp.spawn world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_and_run(rank: int, world_size: int, fn: Callable, args: tuple) -> None:
    backend, device = backend_and_device(rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    fn(rank, world_size, device, *args)
    leave_cleanly()


def leave_cleanly() -> None:
    """End a rank without the SIGABRT that gloo can raise at interpreter exit.

    Module hooks (DDP, FSDP) keep tensors in reference cycles; if they are freed while Python shuts
    down, gloo's worker thread may touch them and the process aborts ("terminate called without an
    active exception"). Collect them while the group still works, then leave with os._exit so no
    late destructor runs — the order Kiln's trainer uses (components/runtime/distributed.py).
    """
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_world(fn: Callable, world_size: int, *args) -> None:
    """Run fn(rank, world_size, device, *args) in world_size processes joined in one process group.

    The processes find each other through MASTER_ADDR / MASTER_PORT (the default env:// store).
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(_init_and_run, args=(world_size, fn, args), nprocs=world_size, join=True)


def init_from_torchrun() -> tuple[int, int, torch.device]:
    """Join the world torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the env)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, device = backend_and_device(int(os.environ.get("LOCAL_RANK", "0")),
                                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return rank, world_size, device


def print_in_rank_order(text: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank prints its text, rank 0 first: a barrier between turns keeps the lines in order."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for turn in range(world):
        if turn == rank:
            print(text, flush=True)
        dist.barrier(group)
