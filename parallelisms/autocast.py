"""bf16 compute where FSDP does not cast the parameters: the model's forward under torch.autocast.

FSDP's mixed precision casts the parameters themselves for compute; every other layout (one
process, DDP, TP, PP without FSDP) keeps fp32 parameters and runs the forward under autocast,
which computes matmuls in bf16 and keeps precision-sensitive ops in fp32. Wrapping the model's
own forward reaches every caller alike: the training step, validation and pipeline stages.
"""

import functools

import torch
from torch import nn


def apply_autocast(model: nn.Module, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Run model.forward under torch.autocast(device_type, dtype), in place (names unchanged)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
