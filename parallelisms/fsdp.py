"""Data parallelism through FSDP2's fully_shard: FSDP over a 1-D mesh, HSDP over a 2-D (replicate,
shard) mesh, and DDP as HSDP with a shard degree of 1 — so DDP composes with TP, PP and CP wherever
FSDP does, runs under the planner's fake process group, and saves layout-free checkpoints."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from components.runtime.errors import KilnError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """FSDP's policy: parameters cast to param_dtype for compute, gradients reduced in reduce_dtype."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: str = "default",
    pipeline_parallel: bool = False,
) -> nn.Module:
    """Shard each block (and multi-token prediction module), the embeddings, final norm + output, then
    the root, with FSDP2.

    A 2-D mesh (dp_replicate, dp_shard_cp) gives HSDP: sharded within a row, replicated across rows
    (DDP when a row is one rank).
    reshard_after_forward: "always", "never", or "default" (reshard, except with pipeline parallel
    where each microbatch would gather the weights again).
    """
    if reshard_after_forward == "default":
        reshard = not pipeline_parallel
    elif reshard_after_forward in ("always", "never"):
        reshard = reshard_after_forward == "always"
    else:
        raise KilnError(f"reshard_after_forward must be default/always/never, got {reshard_after_forward!r}")
    kwargs = {"mesh": mesh, "mp_policy": mp_policy}
    embed = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    tied = embed is not None and output is not None and shares_parameters(embed, output)
    if embed is not None and not tied:
        fully_shard(embed, reshard_after_forward=reshard, **kwargs)
        if only_embeddings(embed):
            # An embedding's backward reads the token ids and the output gradient, never the weight:
            # no all-gather in backward (FSDP2's switch for exactly this case).
            embed.set_unshard_in_backward(False)
    # Every block reshards, the last one too: keeping it whole would save one all-gather but hold its
    # full weights through the loss, where the step's memory peaks.
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    for module in (getattr(model, "mtp", None) or {}).values():  # multi-token prediction, as blocks
        fully_shard(module, reshard_after_forward=reshard, **kwargs)
    # The norm and the head run last and are needed first in backward: never reshard them. A
    # tied embedding must live in the same FSDP group as the head that shares its weight.
    tail = [m for m in (embed if tied else None, getattr(model, "norm", None), output) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def only_embeddings(module: nn.Module) -> bool:
    """Whether every parameter of the module belongs to an nn.Embedding (lookups only)."""
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(owners) and all(isinstance(m, nn.Embedding) for m in owners)


def shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold a parameter in common (tied input and output embeddings)."""
    return bool({id(p) for p in a.parameters()} & {id(p) for p in b.parameters()})


def set_gradient_sync(model: nn.Module, last_microbatch: bool) -> None:
    """Set the data-parallel reduction for the next microbatch's backward (gradient accumulation).

    FSDP reduce-scatters every microbatch, so only sharded gradients accumulate (no full-size
    gradient lives between microbatches, as in TorchTitan); HSDP all-reduces the shards across
    replicas on the last microbatch only (and so does DDP, HSDP with shards of one rank). Under
    pipeline parallel torch's schedules do this themselves (and keep a stage's gradients unsharded
    until its last microbatch).
    """
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last_microbatch)
