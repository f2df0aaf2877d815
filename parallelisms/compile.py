"""torch.compile per transformer block, in place, so parameter names and checkpoints do not change."""

import torch
import torch._functorch.config  # holds the AOTAutograd cache switch; nothing before compile loads it
from torch import nn
from torch.torch_version import TorchVersion

# The torch releases with the tensor-parallel compile bugs apply_compile works around, [from, to).
# A release outside it gets torch's defaults: check the bugs there before widening pyproject.toml's
# torch range.
TP_COMPILE_BUGS = ((2, 13), (2, 15))


def tp_compile_bugs(version: str) -> bool:
    """Whether this torch version has the tensor-parallel compile bugs (see apply_compile)."""
    low, high = TP_COMPILE_BUGS
    return low <= TorchVersion(version) < high


def apply_compile(model: nn.Module, tensor_parallel: bool = False) -> None:
    """Compile each block of model.layers (blocks share one graph, so compile time stays small).

    `Module.compile()` compiles in place, unlike `torch.compile(module)`, which wraps the module
    and adds `_orig_mod.` to every parameter name.

    Under tensor parallel, torch 2.13 and 2.14 mishandle the tensors that torch's TP styles return
    from their asynchronous redistributes when those enter a compiled graph (AOTAutograd, so on
    every device):
    - a whole compiled block whose sequence-parallel RMSNorms work on DTensors fails in backward
      ("'Tensor' object has no attribute '_local_tensor'" in Redistribute.backward), so only
      attention and feed-forward (or MoE) are compiled, the norms and residual adds stay eager;
    - graphs loaded from the AOTAutograd cache (a second run on the same machine) give the
      sequence-parallel norms wrong gradients while a fresh compile matches eager, so that cache
      is turned off for the process (inductor's FX graph cache stays on).
    """
    per_part = tensor_parallel and tp_compile_bugs(torch.__version__)
    if per_part:
        torch._functorch.config.enable_autograd_cache = False
    for block in model.layers.values():
        if per_part:
            for name in ("attention", "feed_forward", "moe"):  # an MoE block has `moe` instead
                if getattr(block, name, None) is not None:
                    getattr(block, name).compile()
        else:
            block.compile()
