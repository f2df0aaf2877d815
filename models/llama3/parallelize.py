"""Llama 3's tensor-parallel plan; every other parallelism comes in the shared order of
parallelisms/compose.py."""

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from components.config.parallel_options import ParallelOptions
from models.common.feed_forward import swiglu_hidden_dim
from parallelisms.compose import finish_parallelize, tensor_parallelize
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import linear_styles


def attention_plan(float8: bool = False) -> dict[str, ParallelStyle]:
    """What every Llama-style block has: both norms on sequence shards (sequence parallel), and
    attention that gathers the sequence, splits the heads column-wise and reduce-scatters its
    output back to sequence shards row-wise (float8: torchao's float8 styles)."""
    ColwiseParallel, RowwiseParallel, PrepareModuleInput = linear_styles(float8)  # noqa: N806
    return {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def feed_forward_plan(float8: bool = False) -> dict[str, ParallelStyle]:
    """The SwiGLU feed-forward: hidden units split column-wise, output reduce-scattered row-wise."""
    ColwiseParallel, RowwiseParallel, PrepareModuleInput = linear_styles(float8)  # noqa: N806
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def parallelize_llama(model: nn.Module, dims: ParallelDims, options: ParallelOptions) -> nn.Module:
    """Turn the plain (meta-device) model into this rank's part of the parallel model, in place."""
    block = attention_plan(options.float8) | feed_forward_plan(options.float8)
    tensor_parallelize(model, dims, options, lambda _: block)
    return finish_parallelize(model, dims, options)


def check_llama(args: Any, dims: ParallelDims) -> list[str]:
    """The Llama family's own check (ModelSpec.check_fn): TP splits the feed-forward's hidden units
    evenly, or the row-wise projection would get another width than its weight (uneven DTensor
    shards)."""
    # A family that reuses this check with args of its own may lack ffn_dim (Meta's sizing then).
    given = getattr(args, "ffn_hidden_dim", None)
    hidden = given if given is not None else swiglu_hidden_dim(args.dim, args.multiple_of,
                                                               args.ffn_dim_multiplier)
    if dims.tp > 1 and hidden % dims.tp:
        source = ("ffn_hidden_dim" if given is not None else
                  f"from dim {args.dim}, multiple_of {args.multiple_of}, ffn_dim_multiplier "
                  f"{args.ffn_dim_multiplier}")
        return [f"tensor_parallel_degree {dims.tp} must divide the feed-forward hidden size {hidden} "
                f"({source})"]
    return []
