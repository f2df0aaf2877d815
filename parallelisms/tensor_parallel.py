"""Tensor parallel with sequence parallel and loss parallel, from a plan the model writes as data.

A plan maps submodule names to torch's ParallelStyles (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput); apply_tp only walks it, so any model can bring its own.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from components.runtime.errors import KilnError


def transformer_top_plan(shard_logits: bool) -> dict[str, ParallelStyle]:
    """The plan for the ends of a model (models/protocol.py): the embedding split by vocabulary rows
    and sending sequence shards, the final norm sequence-parallel, the output head split by
    vocabulary columns; shard_logits (loss parallel) keeps the logits sharded into the loss."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if shard_logits else Replicate(),
            use_local_output=not shard_logits,
        ),
    }


# A multi-token prediction module's own layers (models/common/mtp.py), around its block: the norms
# sequence-parallel; the projection joining embedding and hidden state gathers the sequence, splits
# its output features, and sends sequence shards on to the block.
MTP_PLAN: dict[str, ParallelStyle] = {
    "enorm": SequenceParallel(),
    "hnorm": SequenceParallel(),
    "eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
}


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of model.layers, then those of its multi-token prediction modules (if any)."""
    return [*model.layers.values(), *(m.block for m in (getattr(model, "mtp", None) or {}).values())]


def linear_styles(float8: bool) -> tuple[type, type, type]:
    """(column-wise, row-wise, prepare-input) styles for a block's linears: torch's, or with float8
    linears torchao's float8 twins, which cast before the collectives so they move float8 bytes."""
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, top_plan: dict[str, ParallelStyle],
             block_plan: Callable[[nn.Module], dict[str, ParallelStyle]]) -> None:
    """Parallelize the model's own modules with top_plan and each block of model.layers (and of its
    multi-token prediction modules) with block_plan(block) (blocks of one model may differ, e.g.
    dense and MoE)."""
    top = {k: v for k, v in top_plan.items() if _has(model, k)}
    parallelize_module(model, tp_mesh, top)
    plans = [top]
    for block in model_blocks(model):
        plans.append(block_plan(block))
        parallelize_module(block, tp_mesh, plans[-1])
    for module in (getattr(model, "mtp", None) or {}).values():
        parallelize_module(module, tp_mesh, MTP_PLAN)
    # What the start-up summary says of this layout: sequence parallel only if the plan has it.
    model.tp_sequence_parallel = any(shards_sequence(style) for plan in plans for style in plan.values())


def shards_sequence(style: ParallelStyle) -> bool:
    """Whether a style keeps activations sharded along the sequence (SequenceParallel, or input or
    output layouts of Shard(1))."""
    if isinstance(style, SequenceParallel):
        return True
    layouts = [*(getattr(style, "input_layouts", None) or ()),
               *(getattr(style, "output_layouts", None) or ())]
    return any(layout == Shard(1) for layout in layouts)


def require_plan_covers(model: nn.Module) -> None:
    """Refuse a TP plan that leaves parameters plain: torch's optimizers and Kiln's grad clipping
    cannot mix plain tensors with DTensors (a foreach kernel fails on "mixed torch.Tensor and
    DTensor"). A small module every TP rank runs whole (a norm, a router) takes ReplicateParallel."""
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        more = f" and {len(plain) - 3} more" if len(plain) > 3 else ""
        raise KilnError(f"the tensor-parallel plan leaves parameters plain: {', '.join(plain[:3])}{more}; "
                        "give every module with parameters a style (ReplicateParallel for one that every "
                        "TP rank runs whole)")


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradients_over(tp_mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Identity in forward, all-reduce of the gradient over the TP ranks in backward: for a tensor
    every TP rank holds whole but whose gradient each rank only knows in part."""
    group = tp_mesh.get_group()
    return lambda t: _SumGradients.apply(t, group)


class ReplicateParallel(ParallelStyle):
    """Parameters as Replicate DTensors, inputs taken as replicated, outputs local.

    For a small module every TP rank runs on the same (gathered) input, such as an MoE router:
    its weights must be DTensors on the TP mesh like their neighbours (FSDP, the optimizer and
    checkpoints see one kind of parameter), but need no communication.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(a, mesh, [Replicate()]) if isinstance(a, torch.Tensor)
                         and not isinstance(a, DTensor) else a for a in args)

        def output(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, output)


class StackedShard(ParallelStyle):
    """Shard named stacked parameters ([experts, ...] tensors) along the given dims; the module's
    forward uses the local pieces itself."""

    def __init__(self, dims: dict[str, int]) -> None:
        super().__init__()
        self.dims = dims

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is not module:
                return
            for pname, dim in self.dims.items():
                param = getattr(mod, pname)
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))

        return distribute_module(module, device_mesh, partition)


def _has(module: nn.Module, name: str) -> bool:
    """Whether a (dotted) submodule exists and is not None (pipeline stages drop some)."""
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """loss_parallel() when the logits stay sharded over the vocabulary, else nothing.

    Forward, loss and backward must all run inside it.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Overlap TP communication with compute (micro-pipelined TP through inductor, CUDA symmetric
    memory; the layout checks make sure of CUDA and compile)."""
    # Private torch APIs, as TorchTitan uses them: async TP has no public switch
    # (docs/compatibility.md).
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
