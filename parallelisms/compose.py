"""The fixed order every model family applies the parallelisms in: TP → (EP) → CP → AC → compile →
FSDP/HSDP/DDP (all three through fully_shard). A model's parallelize_fn brings its TP plan (and any
step of its own, such as expert parallel) and calls these two for the rest.
"""

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from components.config.parallel_options import ParallelOptions
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.autocast import apply_autocast
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import apply_cp
from parallelisms.fsdp import apply_fsdp, mixed_precision
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import apply_tp, enable_async_tp, require_plan_covers, transformer_top_plan


def tensor_parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions,
                       block_plan: Callable[[nn.Module], dict[str, ParallelStyle]],
                       top_plan: dict[str, ParallelStyle] | None = None) -> None:
    """TP over the tp mesh (nothing when tp is 1): top_plan for the model's own modules (default: the
    sequence-parallel ends of the model contract), block_plan(block) for each block."""
    if dims.tp == 1:
        return
    tp_mesh = dims.mesh("tp")
    apply_tp(model, tp_mesh, transformer_top_plan(options.loss_parallel) if top_plan is None else top_plan,
             block_plan)
    if options.async_tp:
        enable_async_tp(tp_mesh)


def finish_parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions,
                       before_fsdp: Callable[[MixedPrecisionPolicy], None] | None = None) -> nn.Module:
    """CP → AC → compile → FSDP/HSDP or DDP, and bf16 autocast where FSDP does not cast; before_fsdp
    (policy) may shard some modules first (e.g. expert weights over their own mesh)."""
    if dims.tp > 1:
        require_plan_covers(model)
    if dims.cp > 1:
        apply_cp(model, dims.mesh("cp"), options.seq_len, options.cp_rotate_method)
    apply_ac(model, options.ac_mode, options.ac_option)
    if options.compile:
        apply_compile(model, tensor_parallel=dims.tp > 1)
    if dims.data_parallel_enabled:  # FSDP, HSDP, and DDP as HSDP with a shard degree of 1
        policy = mixed_precision(options.param_dtype, options.reduce_dtype)
        if before_fsdp is not None:
            before_fsdp(policy)
        apply_fsdp(model, dims.fsdp_mesh(), policy, options.reshard_after_forward,
                   pipeline_parallel=dims.pp > 1)
    if options.param_dtype == "bfloat16" and not dims.data_parallel_enabled:  # FSDP casts them itself
        apply_autocast(model, options.device_type)
    return model
