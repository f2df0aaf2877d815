"""Process-group setup and teardown, device choice and seeding: the parts of a run every rank shares."""

import gc
import os
import random
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from components.runtime.errors import KilnError

T = TypeVar("T")


@dataclass
class DistInfo:
    """Where this process stands: global rank, local rank, world size and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    nodes: int = 1  # torchrun agents (machines) in the job: GROUP_WORLD_SIZE
    store: dist.Store | None = field(default=None, repr=False)  # the job's key-value store

    @property
    def is_main(self) -> bool:
        """Global rank 0 writes the console, metrics.jsonl and the saved config."""
        return self.rank == 0


def pick_device(local_rank: int, local_world_size: int = 1) -> torch.device:
    """cuda:LOCAL_RANK when GPUs are present, else the CPU. More processes on a node than visible
    GPUs is an error on every rank, since two ranks on one GPU would share its memory (NCCL refuses)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    processes = max(local_rank + 1, local_world_size)
    if processes > gpus:
        visible = "cuda:0" if gpus == 1 else f"cuda:0..{gpus - 1}"
        raise KilnError(f"{processes} processes on this node but it has {gpus} visible GPU(s) ({visible}): "
                        f"launch at most {gpus} per node (torchrun --nproc-per-node={gpus})")
    return torch.device("cuda", local_rank)


def init_distributed(timeout_seconds: int) -> DistInfo:
    """Join the process group torchrun set up (nccl on GPU, gloo on CPU); one process needs none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK")):
        raise KilnError("WORLD_SIZE > 1 but MASTER_ADDR, MASTER_PORT or RANK is not set: launch with "
                        "torchrun (or set all of them as torchrun would)")
    rank = int(os.environ.get("RANK", "0"))
    share_tokenizer_threads()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        # An explicit timeout: gloo's default of 30 minutes turns a mismatched collective into a hang.
        store = _attempt_store(rank, world_size, timeout)
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank,
                                world_size=world_size, device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, local_rank, world_size, device, int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                    store)


def share_tokenizer_threads() -> None:
    """Give each process of a node an equal share of its cores for the tokenizer's threads (the Rust
    tokenizer sizes its pool from RAYON_NUM_THREADS when it first encodes, one thread per core by
    default): ranks that tokenize a corpus together then split the cores instead of fighting."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local > 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local)))


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, under a prefix per restart attempt.

    After an elastic restart the workers reuse torchrun's store, where the killed attempt's
    process-group keys (peer addresses) are still present: without a fresh prefix a new worker
    can read a dead peer's address and fail with "Connection refused".
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return dist.PrefixStore(f"kiln/attempt_{attempt}", store)


# How a collective reports that a peer is gone: gloo's closed or reset sockets and timeouts, NCCL's
# aborted communicators and watchdog timeouts, and the store's lost connections.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
              "timed out", "Timeout", "NCCL communicator was aborted", "ECONNRESET", "Connection refused")


def lost_peer_message(exc: BaseException, timeout_seconds: int) -> str | None:
    """One line for a collective that failed because another rank died or went silent; else None."""
    text = str(exc).strip()
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and
                                                any(m in text for m in _PEER_LOST))):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    first = first.split(" This is typically caused")[0]  # gloo's advice, said better below
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", first)  # the C++ source location
    where = f"rank {os.environ.get('RANK', '0')} on {socket.gethostname()}"
    return (f"{where} lost contact with the other ranks: another process or node crashed, was "
            f"killed, or did not answer within comm.timeout_seconds = {timeout_seconds} s; the first "
            f"failure is in the other node's log ({type(exc).__name__}: {first[:300]})")


def local_rank_zero_first(local_rank: int, work: Callable[[], T]) -> T:
    """work() on local rank 0 of each node first, then on the others, which find its results
    (files it wrote, a cache it filled) and reuse them."""
    if local_rank == 0:
        result = work()
    if dist.is_initialized():
        dist.barrier()
    if local_rank != 0:
        result = work()
    return result


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
    """Leave without the SIGABRT that a live DeviceMesh can cause at exit.

    With a mesh still alive, a process can die with SIGABRT ("terminate called without an active
    exception") after destroy_process_group(), and torchrun then reports a failure. So: drop mesh
    references, collect garbage, destroy the group, flush, then os._exit so no late destructor runs
    (the order found to end cleanly: benchmarks/notes.md).
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
