"""Apply Kiln's parallelisms to a Llama model, in the fixed order TP → AC → compile → FSDP/HSDP or DDP."""

from torch import nn

from components.config import JobConfig
from components.errors import KilnError
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.fsdp import apply_ddp, apply_fsdp, mixed_precision
from parallelisms.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig, param_dtype: str) -> nn.Module:
    """Turn the plain (meta-device) model into this rank's part of the parallel model, in place."""
    for name, degree in (("tensor", dims.tp), ("pipeline", dims.pp), ("context", dims.cp),
                         ("expert", dims.ep)):
        if degree > 1:
            raise KilnError(f"{name} parallelism is not available in this version of Kiln yet "
                            f"(parallelism.{name}_parallel_degree = {degree})")
    apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable:
        apply_compile(model)
    if dims.fsdp_enabled:
        policy = mixed_precision(param_dtype, cfg.training.mixed_precision_reduce)
        apply_fsdp(model, dims.fsdp_mesh(), policy, cfg.parallelism.fsdp_reshard_after_forward)
    elif dims.ddp_enabled:
        apply_ddp(model, dims.mesh("dp"))
    return model
