"""Weight initialisers that need little memory beyond the weight itself.

torch's nn.init.trunc_normal_ samples the whole tensor by rejection, with temporaries a few times
its size (see docs/compatibility.md): a large output head would need several times its own size
while it initialises, on a rank meant to hold its shards plus one parameter. Sampling it a block of
rows at a time keeps torch's sampler and bounds that extra memory by the block.
"""

import torch
from torch import nn

BLOCKS = 16  # row blocks per weight: the sampler's temporaries are about a sixteenth of it


def trunc_normal_(weight: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0) -> torch.Tensor:
    """nn.init.trunc_normal_ over BLOCKS row blocks of weight in turn (same distribution; the
    values depend on the block split, which is fixed, so they are the same in every layout)."""
    if weight.is_meta:  # nothing to sample, and no random numbers drawn, as torch's own
        return weight
    rows = -(-weight.shape[0] // BLOCKS) if weight.dim() else 1
    for block in weight.split(rows) if weight.dim() else [weight]:
        nn.init.trunc_normal_(block, mean=mean, std=std, a=a, b=b)
    return weight
