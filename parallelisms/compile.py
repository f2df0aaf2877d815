"""torch.compile per transformer block, in place, so parameter names and checkpoints do not change."""

import torch
import torch._functorch.config  # holds the AOTAutograd cache switch; nothing before compile loads it
from torch import nn
from torch.torch_version import TorchVersion

from parallelisms.tensor_parallel import model_blocks

# The torch releases with the tensor-parallel compile bugs apply_compile works around, [from, to).
# A release outside it gets torch's defaults: check the bugs there before widening pyproject.toml's
# torch range.
TP_COMPILE_BUGS = ((2, 13), (2, 15))


def tp_compile_bugs(version: str) -> bool:
    """Whether this torch version has the tensor-parallel compile bugs (see apply_compile)."""
    low, high = TP_COMPILE_BUGS
    return low <= TorchVersion(version) < high


def apply_compile(model: nn.Module, tensor_parallel: bool = False) -> None:
    """Compile each block of model.layers and of its multi-token prediction modules (blocks share one
    graph, so compile time stays small).

    `Module.compile()` compiles in place, unlike `torch.compile(module)`, which wraps the module
    and adds `_orig_mod.` to every parameter name.

    Under tensor parallel on the releases in TP_COMPILE_BUGS, compiled graphs mishandle the tensors
    of TP's asynchronous redistributes (on every device; docs/compatibility.md): a whole block whose
    sequence-parallel norms work on DTensors fails in backward, so only attention and feed-forward
    (or MoE) are compiled and the norms and residual adds stay eager; and graphs loaded from the
    AOTAutograd cache give those norms wrong gradients, so that cache is off for the process
    (inductor's FX graph cache stays on).
    """
    per_part = tensor_parallel and tp_compile_bugs(torch.__version__)
    if per_part:
        torch._functorch.config.enable_autograd_cache = False
    for block in model_blocks(model):
        if per_part:
            for name in ("attention", "feed_forward", "moe"):  # an MoE block has `moe` instead
                if getattr(block, name, None) is not None:
                    getattr(block, name).compile()
        else:
            block.compile()
