"""Activation checkpointing: recompute block activations in backward instead of storing them."""

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Per-op selective AC keeps the outputs of these (the expensive matmuls) and recomputes the rest.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, selective_option: str = "2") -> None:
    """Wrap blocks of model.layers (then those of its multi-token prediction modules) in place: mode
    "full" wraps every block; "selective" wraps every Nth block (selective_option = "N") or every
    block with the per-op policy (selective_option = "op").

    checkpoint_wrapper is non-reentrant and its state-dict hooks keep the parameter names, so
    checkpoints do not depend on this option. The config checks the mode and option.
    """
    if mode == "none":
        return
    per_op = mode == "selective" and selective_option == "op"
    every = int(selective_option) if mode == "selective" and not per_op else 1
    def wrap(block: nn.Module) -> nn.Module:
        if per_op:
            policy = partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint_wrapper(block, context_fn=policy)
        return checkpoint_wrapper(block)

    mtp = list((getattr(model, "mtp", None) or {}).values())
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i % every == 0:
            model.layers[name] = wrap(block)
    for i, module in enumerate(mtp, start=len(model.layers)):
        if i % every == 0:
            module.block = wrap(module.block)
