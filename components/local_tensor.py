"""local_tensor: the plain tensor behind a DTensor, for code that works on this rank's values."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (all of it when replicated, e.g. the loss under loss
    parallel, or a parameter's shard under TP/EP); a plain tensor is returned as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
