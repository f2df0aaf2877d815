"""torch.compile per transformer block, in place, so parameter names and checkpoints do not change."""

import torch
from torch import nn


def apply_compile(model: nn.Module, tensor_parallel: bool = False) -> None:
    """Compile each block of model.layers (blocks share one graph, so compile time stays small).

    `Module.compile()` compiles in place, unlike `torch.compile(module)`, which wraps the module
    and adds `_orig_mod.` to every parameter name.

    Under tensor parallel two torch 2.13 bugs shape what is compiled (measured on CPU/gloo):
    - a whole compiled block whose sequence-parallel RMSNorms work on DTensors fails in backward
      ("'Tensor' object has no attribute '_local_tensor'" in Redistribute.backward), so only
      attention and feed-forward (or MoE) are compiled, the norms and residual adds stay eager;
    - graphs loaded from the AOTAutograd cache (a second run on the same machine) give the
      sequence-parallel norms wrong gradients, while a fresh compile matches eager to 1e-8,
      so that cache is turned off for the process (inductor's FX graph cache stays on).
    """
    if tensor_parallel:
        torch._functorch.config.enable_autograd_cache = False
    for block in model.layers.values():
        if tensor_parallel:
            for name in ("attention", "feed_forward", "moe"):  # an MoE block has `moe` instead
                if getattr(block, name, None) is not None:
                    getattr(block, name).compile()
        else:
            block.compile()
