"""torch.compile per transformer block (in place, so parameter names and checkpoints do not change)."""

from torch import nn


def apply_compile(model: nn.Module) -> None:
    """Compile each block of model.layers; blocks share one graph, so compile time stays small.

    `Module.compile()` compiles in place, unlike `torch.compile(module)`, which wraps the block and
    adds `_orig_mod.` to every parameter name.
    """
    for block in model.layers.values():
        block.compile(fullgraph=False)
