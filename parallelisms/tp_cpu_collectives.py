"""Tensor parallel's sequence gathers and reduce-scatters on CPU (gloo), through the collectives
FSDP uses there (parallelisms/cpu_collectives.py: broadcasts, one all-to-all + sum).

Sequence parallel moves each block's activations between sequence shards and whole sequences
four times in forward and four in backward: Shard(1) -> Replicate before attention and the
feed-forward (an all-gather, whose backward reduce-scatters the gradient), Partial -> Shard(1)
after their row-wise projections (a reduce-scatter, whose backward all-gathers). torch's styles
do them with DTensor.redistribute, i.e. gloo's all-gather and, for the reduce-scatter, an
all-reduce of the whole tensor. `on_gloo_styles` gives a TP plan twins of torch's styles that take
these two transitions through `SequenceRedistribute` instead; every other transition, anything
under torch.compile (dynamo traces torch's functional collectives, not these) and torchao's float8
styles keep torch's path. GPUs (NCCL) keep torch's styles: apply_tp uses the twins on gloo only.
"""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
)

from parallelisms.cpu_collectives import AllToAllReduceScatter, BroadcastAllGather


def gather(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor from every rank's equal slice along dim, in rank order."""
    world = group.size()
    local = local.contiguous()
    slices = local.new_empty((world, *local.shape))
    BroadcastAllGather()(slices, local, group)
    return slices.flatten(0, 1) if dim == 0 else slices.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(full: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice along dim of the sum over ranks of `full` (summed in rank order)."""
    chunks = full.unflatten(dim, (group.size(), -1)).movedim(dim, 0).contiguous()
    mine = chunks.new_empty(chunks.shape[1:])
    AllToAllReduceScatter()(mine, chunks, group, dist.ReduceOp.SUM)
    return mine


class SequenceRedistribute(torch.autograd.Function):
    """Shard(d) -> Replicate (gather; backward: Partial -> Shard(d) reduce-scatter, or a local slice
    of a Replicate gradient) and Partial -> Shard(d) (reduce-scatter; backward: gather) of a DTensor
    on a 1-D mesh, as torch's Redistribute does them, with the collectives above."""

    @staticmethod
    def forward(ctx, t: DTensor, dim: int, gathering: bool) -> DTensor:  # noqa: ANN001
        mesh = t.device_mesh
        ctx.mesh, ctx.dim, ctx.gathering = mesh, dim, gathering
        if gathering:
            out, placement = gather(t._local_tensor, dim, mesh.get_group()), Replicate()
        else:
            out, placement = reduce_scatter(t._local_tensor, dim, mesh.get_group()), Shard(dim)
        return DTensor.from_local(out, mesh, (placement,), run_check=False, shape=t.shape, stride=t.stride())

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple:  # noqa: ANN001
        mesh, dim, group = ctx.mesh, ctx.dim, ctx.mesh.get_group()
        placement, local = grad.placements[0], grad._local_tensor
        if ctx.gathering and isinstance(placement, Partial) and placement.reduce_op == "sum":
            out, target = reduce_scatter(local, dim, group), Shard(dim)
        elif ctx.gathering and isinstance(placement, Replicate):
            out, target = local.chunk(group.size(), dim)[group.rank()], Shard(dim)
        elif not ctx.gathering and placement == Shard(dim):
            out, target = gather(local, dim, group), Replicate()  # a Partial input's grad: Replicate, as torch
        else:  # any other gradient layout: torch's own redistribution
            return grad.redistribute(mesh, (Shard(dim) if ctx.gathering else Replicate(),)), None, None
        return DTensor.from_local(out, mesh, (target,), run_check=False, shape=grad.shape,
                                  stride=grad.stride()), None, None


def redistribute(t: DTensor, placements: tuple[Placement, ...], async_op: bool = False) -> DTensor:
    """t.redistribute(placements=placements): Shard(d) -> Replicate and Partial(sum) -> Shard(d) of
    evenly divisible 1-D DTensors through SequenceRedistribute, everything else through torch (a
    row-wise embedding's masked partial sum among them)."""
    if t.device_mesh.ndim == 1 and len(placements) == 1 and not torch.compiler.is_compiling():
        src, dst, world = t.placements[0], placements[0], t.device_mesh.size()
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            dim = src.dim % t.ndim
            if t.shape[dim] % world == 0:
                return SequenceRedistribute.apply(t, dim, True)
        # type, not isinstance: a row-wise embedding's _MaskPartial must release its mask in torch's own
        # reduction (the next lookup refuses a mask left behind).
        elif type(src) is Partial and src.reduce_op == "sum" and isinstance(dst, Shard):
            dim = dst.dim % t.ndim
            if t.shape[dim] % world == 0:
                return SequenceRedistribute.apply(t, dim, False)
    return t.redistribute(placements=placements, async_op=async_op)


def _as_dtensor(t: torch.Tensor, mesh: DeviceMesh, layouts: tuple[Placement, ...]) -> DTensor:
    return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, layouts, run_check=False)


class _LinearHooks:
    """ColwiseParallel's and RowwiseParallel's input and output hooks (torch 2.13/2.14) with
    `redistribute` above in place of DTensor.redistribute."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # noqa: ANN001, ANN205
        t = _as_dtensor(inputs[0], device_mesh, input_layouts)
        return redistribute(t, desired_input_layouts, async_op=True) if input_layouts != desired_input_layouts else t

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        if outputs.placements != output_layouts:
            outputs = redistribute(outputs, output_layouts, async_op=True)
        return outputs.to_local() if use_local_output else outputs


class GlooColwiseParallel(_LinearHooks, ColwiseParallel):
    """ColwiseParallel whose sequence gather runs through gloo-friendly collectives."""


class GlooRowwiseParallel(_LinearHooks, RowwiseParallel):
    """RowwiseParallel whose reduce-scatter to sequence shards runs through gloo-friendly collectives."""


class GlooPrepareModuleInput(PrepareModuleInput):
    """PrepareModuleInput (torch 2.13/2.14) with `redistribute` above."""

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):  # noqa: ANN001, ANN202, A002
        if input_layout is None:
            return input
        t = _as_dtensor(input, mesh, (input_layout,))
        if desired_layout is not None and input_layout != desired_layout:
            t = redistribute(t, (desired_layout,))
        return t.to_local() if self.use_local_output else t


class GlooPrepareModuleOutput(PrepareModuleOutput):
    """PrepareModuleOutput (torch 2.13/2.14) with `redistribute` above."""

    def _prepare_out_fn(self, outputs, device_mesh):  # noqa: ANN001, ANN202
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if len(outputs) != len(self.output_layouts):
            raise ValueError("module outputs and output_layouts should have same length!")
        prepared = []
        for out, layout, desired in zip(outputs, self.output_layouts, self.desired_output_layouts, strict=True):
            if layout is None:
                prepared.append(out)
                continue
            t = _as_dtensor(out, device_mesh, (layout,))
            if layout != desired:
                t = redistribute(t, (desired,))
            prepared.append(t.to_local() if self.use_local_output else t)
        return prepared[0] if single else tuple(prepared)


_TWINS: dict[type, type] = {
    ColwiseParallel: GlooColwiseParallel,
    RowwiseParallel: GlooRowwiseParallel,
    PrepareModuleInput: GlooPrepareModuleInput,
    PrepareModuleOutput: GlooPrepareModuleOutput,
}


def gloo_twin(style: ParallelStyle) -> ParallelStyle:
    """A copy of one of torch's styles as its twin above (PrepareModuleInputOutput: both halves);
    any other style (float8's, Kiln's own) as it is."""
    if type(style) is PrepareModuleInputOutput:
        twin = copy.copy(style)
        twin.prepare_module_input = gloo_twin(style.prepare_module_input)
        twin.prepare_module_output = gloo_twin(style.prepare_module_output)
        return twin
    if type(style) not in _TWINS:
        return style
    twin = object.__new__(_TWINS[type(style)])
    twin.__dict__.update(style.__dict__)
    return twin


def on_gloo_styles(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan with torch's styles replaced by their gloo twins."""
    return {name: gloo_twin(style) for name, style in plan.items()}
