"""The job config's schema: one dataclass per TOML section, each field with its default, the line
--help shows and an optional value rule."""

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

if sys.version_info >= (3, 11):
    pass
else:  # tomli is the backport of the standard library's tomllib
    pass


@dataclass(frozen=True)
class _Rule:
    """A value rule for one field: a predicate, and the words that explain it in errors/--help."""

    ok: Callable[[Any], bool]
    text: str


def _ge(low: float, *, or_: int | None = None) -> _Rule:
    """Values >= low, plus an optional sentinel such as -1 meaning 'work it out'."""
    text = f">= {low}" if or_ is None else f"{or_} or >= {low}"
    return _Rule(lambda v: v == or_ or v >= low, text)


def _between(low: float, high: float, *, open_high: bool = False) -> _Rule:
    """Values in [low, high], or [low, high) when open_high."""
    return _Rule(
        lambda v: low <= v < high if open_high else low <= v <= high,
        f"a value in [{low}, {high}{')' if open_high else ']'}",
    )


_AC_OPTION = _Rule(
    lambda v: v == "op" or (v.isascii() and v.isdigit() and int(v) > 0),
    "'op' or a positive integer",
)


def _opt(default: Any, help: str, rule: _Rule | None = None) -> Any:
    """A dataclass field with the one-line doc --help shows and an optional value rule."""
    return field(default=default, metadata={"help": help, "rule": rule})


@dataclass
class Job:
    """Where the run writes its outputs, and what it is."""

    dump_folder: str = _opt("./outputs", "root folder for checkpoints, metrics and traces")
    description: str = _opt("", "free-text description of the run")
    custom_import: str = _opt(
        "", "module imported before the model lookup, so a model outside the repo can register"
    )


@dataclass
class Model:
    """Which registered model to build, and its tokenizer."""

    name: str = _opt("llama3", "registered model name")
    flavor: str = _opt("debug", "size preset of the model")
    tokenizer_path: str = _opt("assets/tokenizer/tokenizer.json",
                               "Hugging Face tokenizer.json, a folder of HF tokenizer files, or a hub id "
                               "(owner/name, resolved through the Hugging Face cache)")
    converters: str = _opt(
        "", "comma-separated model converters applied before parallelizing, e.g. 'float8' (the [float8] "
        "extra); more can be registered with components.converters.register_model_converter"
    )
    mtp_depth: int = _opt(
        -1, "multi-token prediction modules after the main model (DeepSeek-V3's MTP; a family whose args "
        "have mtp_depth): 0 = none, -1 = the flavor's"
    )
    mtp_loss_weight: float = _opt(
        0.3, "weight of the MTP loss (the mean over its depths) added to the main loss (DeepSeek-V3: 0.3, "
        "then 0.1 late in training)"
    )


@dataclass
class Float8:
    """float8 linears through torchao (with model.converters float8)."""

    recipe_name: Literal["tensorwise", "rowwise"] = _opt(
        "tensorwise", "scaling: one scale per tensor, or one per row (rowwise: no float8 all-gather)"
    )
    filter_fqns: str = _opt(
        "", "comma-separated name fragments of block linears to keep in high precision, e.g. 'w2,wo' "
        "(the output head and linears with sides not divisible by 16 always are)"
    )
    enable_fsdp_float8_all_gather: bool = _opt(
        True, "with FSDP and tensorwise: all-gather the weights in float8 (cast before the all-gather)"
    )


@dataclass
class Training:
    """Data, batch shape, length of the run and numerics."""

    dataset: str = _opt("shakespeare", "registered dataset name")
    sources: str = _opt(
        "", "a weighted mixture instead of one dataset: PATH=WEIGHT,PATH=WEIGHT,... (each a file, folder, "
        "glob or dataset name), or in the TOML [[training.sources]] tables with path, weight and optional "
        "text_field and name"
    )
    dataset_path: str = _opt(
        "", "a folder with train.*/val.* files, one file, or a prepared .bin token stream; with "
        "dataset_mode streaming also a glob, a folder of jsonl/parquet/csv/txt files or a hub dataset name"
    )
    dataset_mode: Literal["memmap", "streaming"] = _opt(
        "memmap", "memmap: tokenize once, read windows by step (layout-invariant); streaming: tokenize "
        "documents on the fly, each data-parallel rank its own share (resumable, not layout-invariant)"
    )
    dataset_text_field: str = _opt("text", "the field holding the text in jsonl/json/parquet/csv rows")
    data_cache_dir: str = _opt(
        "", "where tokenized datasets are cached ('' = <dump_folder>/data_cache)"
    )
    local_batch_size: int = _opt(8, "sequences per rank per micro-batch", _ge(1))
    global_batch_size: int = _opt(
        -1,
        "sequences per optimizer step; -1 = local_batch_size x data-parallel degree, "
        "larger = gradient accumulation",
        _ge(1, or_=-1),
    )
    seq_len: int = _opt(256, "tokens per sequence", _ge(1))
    steps: int = _opt(100, "optimizer steps to train for", _ge(1))
    seed: int = _opt(42, "random seed for weights and data order", _ge(0))
    document_mask: bool = _opt(
        False, "attention stays inside each document of a packed window (a BOS token starts one)"
    )
    document_positions_restart: bool = _opt(
        False, "with document_mask: RoPE positions start at 0 in every document"
    )
    max_norm: float = _opt(1.0, "clip the gradient norm to this; <= 0 disables clipping")
    gc_freq: int = _opt(50, "collect Python garbage every N steps, on all ranks at once; 0 = automatic GC",
                        _ge(0))
    deterministic: bool = _opt(False, "deterministic kernels (slower), for reproducible runs")
    mixed_precision_param: Literal["auto", "float32", "bfloat16"] = _opt(
        "auto", "compute dtype of forward/backward (FSDP casts the fp32 parameters, other layouts use "
        "autocast; master weights and optimizer state stay fp32); auto = bfloat16 on GPU, float32 on CPU"
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = _opt(
        "float32", "dtype of FSDP/HSDP's gradient reduce-scatter (DDP reduces the fp32 gradients)"
    )


@dataclass
class Optimizer:
    """The optimizer and its hyperparameters."""

    name: Literal["AdamW", "Adam"] = _opt("AdamW", "optimizer class from torch.optim")
    lr: float = _opt(8e-4, "peak learning rate", _ge(0))
    beta1: float = _opt(0.9, "decay of the first-moment average", _between(0, 1, open_high=True))
    beta2: float = _opt(0.95, "decay of the second-moment average", _between(0, 1, open_high=True))
    eps: float = _opt(1e-8, "added to the denominator for numerical stability", _ge(0))
    weight_decay: float = _opt(0.1, "weight decay coefficient", _ge(0))
    weight_decay_exclude: str = _opt(
        "norms,biases", "comma-separated kinds of parameters trained without weight decay: norms (every "
        "1-D weight), biases, embeddings (and a head tied to them); '' = decay everything"
    )
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = _opt(
        "auto", "torch.optim kernel; auto lets torch pick"
    )


@dataclass
class LRScheduler:
    """Learning-rate warmup and decay."""

    warmup_steps: int = _opt(10, "steps of linear warmup from near zero to lr", _ge(0))
    decay_ratio: float = _opt(
        1.0,
        "fraction of the post-warmup steps spent decaying at the end; 1 = decay right after warmup, "
        "< 1 = warmup-stable-decay",
        _between(0, 1),
    )
    decay_type: Literal["linear", "cosine", "sqrt"] = _opt("linear", "shape of the decay")
    min_lr_factor: float = _opt(0.0, "final lr as a fraction of lr", _between(0, 1))


@dataclass
class Parallelism:
    """How the ranks are split over the device mesh dimensions."""

    data_parallel_replicate_degree: int = _opt(
        1, "data-parallel replicas (DDP, or HSDP's outer dimension)", _ge(1)
    )
    data_parallel_shard_degree: int = _opt(
        -1, "FSDP shards per replica; -1 = the ranks left over", _ge(1, or_=-1)
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = _opt(
        "default", "free gathered parameters after forward; default = always unless pipelining"
    )
    tensor_parallel_degree: int = _opt(1, "tensor-parallel ranks", _ge(1))
    disable_loss_parallel: bool = _opt(False, "gather logits before the loss under tensor parallel")
    enable_async_tensor_parallel: bool = _opt(
        False, "overlap TP communication with compute (CUDA + compile only)"
    )
    pipeline_parallel_degree: int = _opt(1, "ranks the layers are pipelined over", _ge(1))
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
        "DualPipeV",
    ] = _opt("1F1B", "pipeline schedule; the last five run two stages per rank")
    pipeline_parallel_microbatch_size: int = _opt(
        1, "sequences per pipeline microbatch; a step's rows per rank split into such microbatches", _ge(1)
    )
    pipeline_parallel_layers_per_stage: int = _opt(
        -1, "layers per pipeline stage (the last stage takes the rest); -1 = split evenly", _ge(1, or_=-1)
    )
    pipeline_parallel_stage_layers: str = _opt(
        "", "explicit layers of each stage, e.g. '0-1,2-4,5' (stage 0: layers 0 and 1, ...); '' = split "
        "by the rules above"
    )
    context_parallel_degree: int = _opt(1, "ranks a sequence is split over", _ge(1))
    context_parallel_rotate_method: Literal["allgather", "ring"] = _opt(
        "allgather", "how context-parallel attention sees the other ranks' keys/values: all-gather them, "
        "or pass them around a ring (less memory)"
    )
    expert_parallel_degree: int = _opt(1, "ranks an MoE layer's experts are split over", _ge(1))


@dataclass
class Checkpoint:
    """Saving and resuming training state."""

    enable: bool = _opt(False, "save checkpoints and resume from them")
    folder: str = _opt("checkpoint", "checkpoint folder, inside job.dump_folder")
    interval: int = _opt(500, "save every N steps", _ge(1))
    keep_latest_k: int = _opt(
        3, "keep only the newest K whole checkpoints (model-only exports stay); 0 = keep all. 3: the newest "
        "to resume from and two to fall back to if it is damaged or the loss went bad, while disk use "
        "stays bounded (every checkpoint is a whole training state)", _ge(0))
    load_step: int = _opt(-1, "step to resume from; -1 = the latest", _ge(0, or_=-1))
    async_mode: Literal["disabled", "async"] = _opt(
        "disabled", "async = write checkpoints in the background while training goes on"
    )
    last_save_model_only: bool = _opt(False, "the checkpoint at the last step holds the model only")
    export_dtype: Literal["float32", "bfloat16", "float16"] = _opt(
        "float32", "dtype of model-only checkpoints (last_save_model_only, seed checkpoints)"
    )
    initial_load_path: str = _opt(
        "", "a checkpoint step folder to start from when the run has no checkpoint of its own"
    )
    initial_load_model_only: bool = _opt(True, "load only the model from initial_load_path")
    initial_load_in_hf: bool = _opt(
        False, "initial_load_path is a Hugging Face folder (config.json + safetensors)"
    )
    exclude_from_loading: str = _opt(
        "", "comma-separated parts not to load: model, optimizer, lr_scheduler, dataloader, train_state"
    )
    create_seed_checkpoint: bool = _opt(
        False, "write the initial weights as step-0 and exit (each rank its shards, any world size); any "
        "layout can start from it"
    )
    shared_folder_wait_seconds: float = _opt(
        10.0, "at start, how long ranks wait to see rank 0's probe file in the folder (NFS caches "
        "directory listings for seconds) before calling it not shared", _ge(0)
    )


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in backward to save memory."""

    mode: Literal["none", "full", "selective"] = _opt("none", "which activations to recompute")
    selective_ac_option: str = _opt(
        "2", "selective mode: checkpoint every Nth block, or 'op' for per-op", _AC_OPTION
    )


@dataclass
class Compile:
    """torch.compile of the model."""

    enable: bool = _opt(False, "compile each transformer block with torch.compile")


@dataclass
class Metrics:
    """Logging of loss, throughput and memory."""

    log_freq: int = _opt(10, "log metrics every N steps", _ge(1))
    enable_tensorboard: bool = _opt(False, "also write TensorBoard event files")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, inside job.dump_folder")
    enable_wandb: bool = _opt(False, "also log to Weights & Biases (the [wandb] extra; files in "
                              "<dump_folder>/wandb, WANDB_MODE=offline to stay local)")
    wandb_project: str = _opt("kiln", "W&B project")
    wandb_run_name: str = _opt("", "W&B run name; '' = the dump folder's name")
    wandb_run_id: str = _opt(
        "", "W&B run id; '' = a new one, kept in <dump_folder>/wandb_run_id so that a resumed run "
        "continues the same W&B run"
    )
    peak_tflops: float = _opt(
        0.0, "peak TFLOP/s for MFU; 0 = the GPU table or a measured CPU peak", _ge(0)
    )


@dataclass
class Validation:
    """Periodic loss on the validation split."""

    enable: bool = _opt(False, "run validation during training")
    freq: int = _opt(50, "validate every N steps", _ge(1))
    steps: int = _opt(10, "batches per validation; -1 = the whole split", _ge(1, or_=-1))
    dataset: str = _opt(
        "", "what to validate on: a dataset name (its val split), a file, folder, glob or hub dataset; "
        "'' = the training dataset's val split"
    )


@dataclass
class Profiling:
    """torch.profiler traces."""

    enable_profiling: bool = _opt(False, "record profiler traces")
    save_traces_folder: str = _opt("profile_traces", "trace folder, inside job.dump_folder")
    profile_freq: int = _opt(100, "record a trace every N steps", _ge(1))
    profiler_warmup: int = _opt(1, "steps the profiler warms up before each recorded window", _ge(0))
    profiler_active: int = _opt(1, "steps recorded in each window (ending at a multiple of profile_freq)",
                                _ge(1))
    enable_memory_snapshot: bool = _opt(
        False, "CUDA memory snapshots (allocation history) at the same steps as the traces; CUDA only"
    )
    save_memory_snapshot_folder: str = _opt("memory_snapshot", "snapshot folder, inside job.dump_folder")
    memory_report: bool = _opt(
        False, "write memory_rank<R>.json after step 2: parameter, gradient and optimizer bytes by dtype and "
        "the allocator's peak in step 2 (what scripts/plan.py predicts); slows steps 1-2 on CPU"
    )


@dataclass
class Comm:
    """Collective communication."""

    timeout_seconds: int = _opt(
        300, "process-group timeout, so a mismatched collective fails instead of hanging", _ge(1)
    )
    gloo_accelerations: bool = _opt(
        False, "on gloo (CPU) process groups only: FSDP's all-gather as broadcasts with forward prefetch, "
        "its reduce-scatter as an all-to-all, context parallel's K/V gather overlapped with attention "
        "(parallelisms/gloo_accelerations.py); off, every layout runs torch's own collectives, as on GPUs"
    )


@dataclass
class FaultTolerance:
    """Replica groups through torchft (the [ft] extra): each group is its own torchrun job running any
    layout; groups join and leave a quorum kept by a lighthouse, and a joining group heals from a
    live one (docs/fault_tolerance.md)."""

    enable: bool = _opt(False, "train as one replica group of a fault-tolerant job")
    replica_id: int = _opt(0, "this group's number, 0 .. group_size - 1", _ge(0))
    group_size: int = _opt(1, "replica groups the data is split over (live or not)", _ge(1))
    lighthouse: str = _opt(
        "", "the lighthouse's address, e.g. http://host:29510; '' = the TORCHFT_LIGHTHOUSE variable"
    )
    min_replicas: int = _opt(1, "groups a step needs to commit", _ge(1))
    timeout_seconds: float = _opt(
        60.0, "cross-group collectives, commits and healing give up after this", _ge(0.1)
    )
    quorum_timeout_seconds: float = _opt(
        120.0, "how long a step waits for a quorum (enough live groups) before the run fails", _ge(0.1)
    )
    semi_sync: Literal["none", "diloco"] = _opt(
        "none", "none: gradients averaged across groups every step; diloco: each group steps alone "
        "and the groups average their progress every sync_every steps (outer Nesterov step)"
    )
    sync_every: int = _opt(20, "DiLoCo: inner steps between outer steps", _ge(1))
    outer_lr: float = _opt(0.7, "DiLoCo: the outer optimizer's learning rate", _ge(0))
    outer_momentum: float = _opt(0.9, "DiLoCo: the outer optimizer's Nesterov momentum", _between(0, 1))
    weights_digest_freq: int = _opt(
        0, "every N steps log `weights_digest` and `optimizer_digest`, hashes of this group's weights and "
        "optimizer state (groups that agree log the same ones); 0 = never", _ge(0)
    )


@dataclass
class JobConfig:
    """The whole run's configuration: one instance of each section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    float8: Float8 = field(default_factory=Float8)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    # The --config file's folder, where job.custom_import is also looked for (not a setting).
    config_dir: ClassVar[str] = ""
