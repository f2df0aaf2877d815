"""Tensor parallel with sequence parallel and loss parallel, from a plan the model writes as data.

A plan maps submodule names to torch's ParallelStyles (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput); apply_tp only walks it, so any model can bring its own.
"""

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, top_plan: dict[str, ParallelStyle],
             block_plan: dict[str, ParallelStyle]) -> None:
    """Parallelize the model's own modules with top_plan and every block of model.layers with block_plan."""
    parallelize_module(model, tp_mesh, {k: v for k, v in top_plan.items() if _has(model, k)})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


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

