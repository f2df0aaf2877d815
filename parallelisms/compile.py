"""torch.compile per transformer block, in place, so parameter names and checkpoints do not change."""

from torch import nn


def apply_compile(model: nn.Module, whole_blocks: bool = True) -> None:
    """Compile each block of model.layers (blocks share one graph, so compile time stays small).

    With tensor parallel (whole_blocks=False) only attention and feed-forward are compiled: a
    compiled block whose sequence-parallel RMSNorm works on DTensors failed in backward on torch
    2.13 ("'Tensor' object has no attribute '_local_tensor'" in Redistribute.backward).
    `Module.compile()` compiles in place, unlike `torch.compile(module)`, which wraps the module
    and adds `_orig_mod.` to every parameter name.
    """
    for block in model.layers.values():
        if whole_blocks:
            block.compile()
        else:
            block.attention.compile()
            block.feed_forward.compile()
