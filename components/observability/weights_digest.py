"""A digest of a replica's weights and optimizer state: equal digests mean bitwise equal replicas.

Replicas of one model (fault-tolerant replica groups, which must stay identical; DiLoCo groups
after an outer step) log it so a person or a test can see that they agree, as Megatron-LM's
weight-hash check across data-parallel replicas does.
"""

import hashlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local_bytes(tensor: torch.Tensor) -> bytes:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def local_digest(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None) -> bytes:
    """sha256 of this rank's shards of every buffer and parameter (optimizers None) or of every
    optimizer state tensor, in parameter order."""
    digest = hashlib.sha256()
    if optimizers is None:  # buffers that training moves too (an MoE layer's expert bias)
        for part in parts:
            for name, buffer in part.named_buffers():
                digest.update(name.encode())
                digest.update(_local_bytes(buffer))
    for i, part in enumerate(parts):
        for name, param in part.named_parameters():
            digest.update(name.encode())
            if optimizers is None:
                digest.update(_local_bytes(param))
                continue
            for key, value in sorted(optimizers[i].state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    digest.update(key.encode())
                    digest.update(_local_bytes(value))
    return digest.digest()


def weights_digest(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None = None) -> str:
    """The digest of the whole replica's weights (or, given its optimizers, of their states): every
    rank's shards, gathered over the default process group; 16 hex digits. Every rank must call it."""
    mine = torch.tensor(np.frombuffer(local_digest(parts, optimizers)[:8], dtype=np.int64).copy())
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        gathered = [torch.zeros_like(mine, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine.to(device))
        mine = torch.cat([g.cpu() for g in gathered])
    return hashlib.sha256(mine.numpy().tobytes()).hexdigest()[:16]
