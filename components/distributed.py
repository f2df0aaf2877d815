"""Process-group setup and teardown, device choice and seeding: the parts of a run every rank shares."""

import gc
import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """Where this process stands: global rank, local rank, world size and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Global rank 0 writes the console, metrics.jsonl and the saved config."""
        return self.rank == 0


def pick_device(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when GPUs are present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_seconds: int) -> DistInfo:
    """Join the process group torchrun set up (nccl on GPU, gloo on CPU); one process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # An explicit timeout: gloo's default of 30 minutes turns a mismatched collective into a hang.
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_seconds),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, local_rank, world_size, device)


def set_seed(seed: int, deterministic: bool) -> None:
    """Seed every RNG the same on every rank (data order and init depend on the seed, not the rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def exit_cleanly(code: int, release_meshes=None) -> None:
    """Leave without the SIGABRT that a live DeviceMesh can cause at exit (TORCH_ON_CPU.md).

    Order that measured zero failures: drop mesh references, collect garbage, destroy the group,
    flush, then os._exit so no late destructor runs.
    """
    if release_meshes is not None:
        release_meshes()
    gc.collect()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
