"""Two helpers that model and parallel code share: the plain tensor behind a DTensor, and running a
function eagerly, outside torch.compile's graphs."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (all of it when replicated, e.g. the loss under loss
    parallel, or a parameter's shard under TP/EP); a plain tensor is returned as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


# A decorator (a graph break at the call). torch._disable_dynamo is torch's lazy form of
# torch.compiler.disable (private): it imports the compiler at the first call, not at import, so
# importing Kiln does not pay for the compiler.
outside_compile = torch._disable_dynamo
