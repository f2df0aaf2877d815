"""ParallelOptions: the few config values the parallelisms need, as one frozen object.

A model's `parallelize_fn(model, dims, options)` and the `apply_*` functions read these, never
the JobConfig: they stay usable from a script or a test that has no config at all.
"""

from dataclasses import dataclass

from components.config.sections import JobConfig


@dataclass(frozen=True)
class ParallelOptions:
    """Numerics, FSDP, TP, CP, AC, compile and pipeline choices of a run (defaults = plain fp32)."""

    device_type: str = "cpu"  # where the model runs: "cpu" or "cuda"
    param_dtype: str = "float32"  # compute dtype of the parameters ("auto" already resolved)
    reduce_dtype: str = "float32"  # dtype of the data-parallel gradient reduction
    reshard_after_forward: str = "default"  # FSDP: default / always / never
    loss_parallel: bool = True  # under TP, keep the logits sharded over the vocabulary into the loss
    async_tp: bool = False
    cp_rotate_method: str = "allgather"
    seq_len: int = 2048
    ac_mode: str = "none"  # none / full / selective
    ac_option: str = "2"  # selective: every Nth block, or "op"
    compile: bool = False
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_layers_per_stage: int = -1
    pp_stage_layers: str = ""
    float8: bool = False  # the blocks' linears are torchao float8 linears (TP takes torchao's float8 styles)
    gloo_accelerations: bool = False  # parallelisms/gloo_accelerations.py, applied after parallelizing

    @classmethod
    def from_config(cls, cfg: JobConfig, device_type: str) -> "ParallelOptions":
        """The options of a run; param dtype "auto" becomes bfloat16 on GPU and float32 elsewhere."""
        t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
        param_dtype = t.mixed_precision_param
        if param_dtype == "auto":
            param_dtype = "bfloat16" if device_type == "cuda" else "float32"
        return cls(
            device_type=device_type, param_dtype=param_dtype, reduce_dtype=t.mixed_precision_reduce,
            reshard_after_forward=p.fsdp_reshard_after_forward, loss_parallel=not p.disable_loss_parallel,
            async_tp=p.enable_async_tensor_parallel, cp_rotate_method=p.context_parallel_rotate_method,
            seq_len=t.seq_len, ac_mode=ac.mode, ac_option=ac.selective_ac_option, compile=cfg.compile.enable,
            pp_schedule=p.pipeline_parallel_schedule, pp_microbatch_size=p.pipeline_parallel_microbatch_size,
            pp_layers_per_stage=p.pipeline_parallel_layers_per_stage,
            pp_stage_layers=p.pipeline_parallel_stage_layers,
            float8="float8" in {n.strip() for n in cfg.model.converters.split(",")},
            gloo_accelerations=cfg.comm.gloo_accelerations,
        )
