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
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, top_plan: dict[str, ParallelStyle],
             block_plan: Callable[[nn.Module], dict[str, ParallelStyle]]) -> None:
    """Parallelize the model's own modules with top_plan and each block of model.layers with
    block_plan(block) (blocks of one model may differ, e.g. dense and MoE)."""
    parallelize_module(model, tp_mesh, {k: v for k, v in top_plan.items() if _has(model, k)})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))


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


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (the loss under loss parallel) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def enable_async_tp(tp_mesh: DeviceMesh, device_type: str, compiled: bool) -> None:
    """Overlap TP communication with compute (micro-pipelined TP, CUDA symmetric memory)."""
    if device_type != "cuda":
        raise ValueError("parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
                         "it is not available on CPU")
    if not compiled:
        raise ValueError("parallelism.enable_async_tensor_parallel needs --compile.enable (the "
                         "overlap is done by inductor)")
    # Private torch APIs, as TorchTitan uses them: async TP has no public switch in torch 2.13.
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)

