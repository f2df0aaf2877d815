"""Check that every rank sees the same folder: DCP checkpoints need storage all nodes share."""

import os
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from components.errors import KilnError


def unseen_by(folder: Path, wait_seconds: float) -> list[tuple[int, str]]:
    """(rank, host) of every rank that cannot see a file rank 0 writes into `folder`.

    Collective: every rank calls it. Rank 0 writes a probe file with a fresh name; the others
    list the folder until it shows up (a network file system may take a moment) or wait_seconds
    pass. Listing the folder, rather than stat-ing the name, revalidates NFS's directory cache.
    """
    name = [f".kiln-shared-probe-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    probe = folder / name[0]
    if dist.get_rank() == 0:
        probe.touch()
    dist.barrier()
    deadline = time.monotonic() + wait_seconds
    seen = False
    while True:
        try:
            seen = name[0] in os.listdir(folder)
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    answers: list = [None] * dist.get_world_size()
    dist.all_gather_object(answers, (seen, socket.gethostname()))
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    return [(rank, host) for rank, (ok, host) in enumerate(answers) if not ok]


def require_shared(folder: Path, what: str, wait_seconds: float) -> None:
    """Raise on every rank when some rank does not share `folder` with rank 0 (seen within wait_seconds)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    missing = unseen_by(folder, wait_seconds)
    if missing:
        ranks = ", ".join(str(r) for r, _ in missing)
        hosts = ", ".join(sorted({h for _, h in missing}))
        raise KilnError(
            f"{what} {folder} is not shared: rank(s) {ranks} (host {hosts}) cannot see the files rank 0 "
            f"writes there. Every rank writes its own shards of a checkpoint and reads others' when "
            f"resuming in another layout, so the folder must be on storage all nodes mount at the same "
            f"path (NFS, Lustre, a cluster file system), or run with --checkpoint.enable false")
