"""Apply Kiln's parallelisms to a Llama model in the fixed order TP → CP → AC → compile → FSDP/HSDP/DDP."""

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from components.config import JobConfig
from components.errors import KilnError
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import apply_cp
from parallelisms.fsdp import apply_ddp, apply_fsdp, mixed_precision
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import apply_tp, enable_async_tp


def llama_tp_plan(loss_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """The tensor-parallel plan: (top-level modules, every transformer block).

    Between blocks activations are sharded along the sequence (sequence parallel: norms run on
    a slice of the tokens); attention and feed-forward gather the sequence, split heads / hidden
    units column-wise, and reduce-scatter back to sequence shards row-wise.
    """
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            # Loss parallel keeps the logits sharded over the vocabulary into the cross-entropy.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig, param_dtype: str) -> nn.Module:
    """Turn the plain (meta-device) model into this rank's part of the parallel model, in place."""
    if dims.ep > 1:
        raise KilnError(f"expert_parallel_degree {dims.ep} needs a Mixture-of-Experts model "
                        f"(e.g. --model.name moe); {cfg.model.name} is dense")
    _, block = llama_tp_plan(loss_parallel=not cfg.parallelism.disable_loss_parallel)
    tensor_parallelize(model, dims, cfg, lambda _: block)
    return finish_parallelize(model, dims, cfg, param_dtype)


def tensor_parallelize(model: nn.Module, dims: ParallelDims, cfg: JobConfig,
                       block_plan: Callable[[nn.Module], dict[str, ParallelStyle]]) -> None:
    """TP with the Llama top-level plan and block_plan(block) for each block (and async TP if asked)."""
    if dims.tp > 1:
        if dims.ddp_enabled:
            raise KilnError("DDP cannot be combined with tensor parallel; use FSDP or HSDP "
                            "(data_parallel_shard_degree > 1) with TP")
        if model.args.tie_embeddings:
            raise KilnError("tensor parallel does not support tied embeddings (the embedding is "
                            "split by rows, the output head by columns)")
        top, _ = llama_tp_plan(loss_parallel=not cfg.parallelism.disable_loss_parallel)
        apply_tp(model, dims.mesh("tp"), top, block_plan)
        if cfg.parallelism.enable_async_tensor_parallel:
            try:
                enable_async_tp(dims.mesh("tp"), dims.world_mesh.device_type, cfg.compile.enable)
            except ValueError as e:
                raise KilnError(str(e)) from None
    elif cfg.parallelism.enable_async_tensor_parallel:
        raise KilnError("parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")


def finish_parallelize(model: nn.Module, dims: ParallelDims, cfg: JobConfig, param_dtype: str,
                       before_fsdp: Callable[[MixedPrecisionPolicy], None] | None = None) -> nn.Module:
    """CP → AC → compile → FSDP/HSDP or DDP; before_fsdp(policy) may shard some modules first."""
    if dims.cp > 1:
        apply_cp(model, dims.mesh("cp"), cfg.training.seq_len, cfg.parallelism.context_parallel_rotate_method)
    apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable:
        apply_compile(model, tensor_parallel=dims.tp > 1)
    if dims.fsdp_enabled:
        policy = mixed_precision(param_dtype, cfg.training.mixed_precision_reduce)
        if before_fsdp is not None:
            before_fsdp(policy)
        apply_fsdp(model, dims.fsdp_mesh(), policy, cfg.parallelism.fsdp_reshard_after_forward,
                   pipeline_parallel=dims.pp > 1)
    elif dims.ddp_enabled:
        apply_ddp(model, dims.mesh("dp"))
    return model
