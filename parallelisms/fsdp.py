"""Data parallelism through FSDP2's fully_shard: FSDP over a 1-D mesh, HSDP over a 2-D (replicate,
shard) mesh, and DDP as HSDP with a shard degree of 1 — so DDP composes with TP, PP and CP wherever
FSDP does, runs under the planner's fake process group, and saves layout-free checkpoints."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from components.errors import KilnError
from parallelisms.cpu_collectives import on_gloo, use_cpu_collectives

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
    """Shard each block, the embeddings, final norm + output, then the root, with FSDP2.

    A 2-D mesh (dp_replicate, dp_shard_cp) gives HSDP: sharded within a row, replicated across rows
    (DDP when a row is one rank). On gloo the shards move through faster collectives
    (parallelisms/cpu_collectives.py).
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
    # Every block reshards, the last one too: keeping it whole would save one all-gather (1% of a
    # debug FSDP 2 step, within noise) but holds its full weights through the loss, the step's peak
    # (+3.3 MiB planned and measured for the debug model, a whole bf16 block at 8B).
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The norm and the head run last and are needed first in backward: never reshard them. A
    # tied embedding must live in the same FSDP group as the head that shares its weight.
    tail = [m for m in (embed if tied else None, getattr(model, "norm", None), output) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if on_gloo(mesh):
        use_cpu_collectives(model, overlap_reduce_scatter=mesh.ndim == 1)
        prefetch_forward([m for m in (embed if not tied else None, *model.layers.values(), *tail[:1])
                          if m is not None], model)
    return model


def prefetch_forward(order: list[nn.Module], model: nn.Module) -> None:
    """On CPU: each FSDP module starts the next one's all-gather before it computes, and every
    unshard (backward's implicit prefetch too) runs as async gloo work, so the transfer overlaps
    this module's compute instead of stalling the step.

    GPUs overlap through FSDP's all-gather stream without this; CPU has no streams, so without it
    every all-gather blocks (FSDP 2 debug model on 2 cores: +8% tokens/s, same losses). One more
    block is whole during forward, as on a GPU with FSDP's own prefetch.
    """
    for module, following in zip(order, order[1:], strict=False):
        module.set_modules_to_forward_prefetch([following])
    # torch's only switch for async unshards (FSDP2's, underscored in torch 2.13 and 2.14).
    model._set_unshard_async_op(True)


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
