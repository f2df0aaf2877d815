"""The job config: typed dataclass sections read from TOML, then overridden by --section.key."""

import dataclasses
import difflib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

from components.errors import KilnError

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomli is the backport of the standard library's tomllib
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str) -> Path:
    """A relative path is looked up in the working directory first, then in the repository."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


class ConfigError(KilnError):
    """A bad config file or command-line override, explained in one message."""


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
    keep_latest_k: int = _opt(0, "keep only the newest K checkpoints; 0 = keep all", _ge(0))
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
    # The --config file's folder, where job.custom_import is also looked for (not a setting).
    config_dir: ClassVar[str] = ""


# The schema, flattened once: section name -> class, and "section.key" -> its dataclass field.
_SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(JobConfig)}
_KEYS: dict[str, dataclasses.Field] = {
    f"{section}.{f.name}": f for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
}
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
# TOML basic-string escapes; other control characters are written as \uXXXX.
_ESCAPES = {
    '"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f",
}
_TYPE_WORDS = {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}


def _base_type(annotation: Any) -> type:
    """The Python type behind a field's annotation; for a Literal, the type of its choices."""
    return type(get_args(annotation)[0]) if get_origin(annotation) is Literal else annotation


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """A ' — did you mean ...?' hint for a misspelt or misplaced name, or ''."""
    tail = name.rsplit(".", 1)[-1]
    # An exact key name in another section ("training.lr") beats a near spelling in this one.
    match = [c for c in candidates if c.rsplit(".", 1)[-1] == tail]
    match = match or difflib.get_close_matches(name, candidates, n=1)
    return f" — did you mean '{match[0]}'?" if match else ""


def _check(key: str, value: Any, where: str) -> None:
    """Raise unless value is one of the field's choices and passes its rule."""
    annotation, rule = _KEYS[key].type, _KEYS[key].metadata["rule"]
    choices = get_args(annotation) if get_origin(annotation) is Literal else ()
    if choices and value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: {key} expects one of {valid}, got {value!r}")
    if rule is not None and not rule.ok(value):
        raise ConfigError(f"{where}: {key} expects {rule.text}, got {value!r}")


def _set(cfg: JobConfig, key: str, value: Any, where: str) -> None:
    """Check a value of the right type against its field's rules, then store it."""
    _check(key, value, where)
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


def _from_toml(key: str, value: Any, where: str) -> Any:
    """Type-check a TOML value; an int is accepted where a float is expected."""
    expected = _base_type(_KEYS[key].type)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        hint = " (quote it)" if expected is str and isinstance(value, (int, float)) else ""
        raise ConfigError(
            f"{where}: {key} expects {_TYPE_WORDS[expected]}, "
            f"got {value!r} ({type(value).__name__}){hint}"
        )
    return value


def _from_text(key: str, text: str) -> Any:
    """Convert a command-line string to its field's type."""
    expected = _base_type(_KEYS[key].type)
    if expected is bool and text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    if expected is not bool:
        try:
            return expected(text)
        except ValueError:
            pass
    raise ConfigError(f"command line: {key} expects {_TYPE_WORDS[expected]}, got {text!r}")


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, Any]], bool]:
    """Split argv into the --config value, typed (key, value) overrides and --print-config."""
    config, overrides, print_config = None, [], False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(
                f"command line: unexpected argument {arg!r}; "
                "overrides look like --section.key value"
            )
        name, has_eq, value = arg[2:].partition("=")
        if name == "print-config":
            print_config = True
            continue
        if name == "config":
            if not has_eq and (not args or args[0].startswith("--")):
                raise ConfigError("command line: --config needs a file path or a config name")
            config = value if has_eq else args.pop(0)
            continue
        key = name.replace("-", "_")
        if key not in _KEYS:
            hint = _did_you_mean(key, list(_KEYS))
            raise ConfigError(f"command line: unknown key '{name}'{hint}")
        if not has_eq:
            if _base_type(_KEYS[key].type) is bool:
                # A bool flag followed by another flag, or by nothing, means true.
                value = args.pop(0) if args and not args[0].startswith("--") else "true"
            elif not args or args[0].startswith("--"):
                raise ConfigError(f"command line: --{key} needs a value")
            else:
                value = args.pop(0)
        overrides.append((key, _from_text(key, value)))
    return config, overrides, print_config


def _find_config(name: str) -> Path:
    """A --config value is a path if that file exists, else a name under train_configs/."""
    filename = name if name.endswith(".toml") else name + ".toml"
    tried = [Path(name), REPO_ROOT / "train_configs" / filename]
    for path in tried:
        if path.is_file():
            return path
    known = ", ".join(sorted(p.stem for p in (REPO_ROOT / "train_configs").glob("*.toml")))
    raise ConfigError(
        f"config file not found: tried {', '.join(str(p) for p in tried)} "
        f"(known names: {known or 'none'})"
    )


def _apply_toml(cfg: JobConfig, path: Path) -> None:
    """Read a TOML file and store each of its values into cfg."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:  # its message carries the line and column
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            hint = _did_you_mean(section, list(_KEYS))
            raise ConfigError(f"{path}: key '{section}' is outside any [section]{hint}")
        if section not in _SECTIONS:
            hint = _did_you_mean(section, list(_SECTIONS))
            raise ConfigError(f"{path}: unknown section '{section}'{hint}")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in _KEYS:
                raise ConfigError(f"{path}: unknown key '{key}'{_did_you_mean(key, list(_KEYS))}")
            _set(cfg, key, _from_toml(key, value, str(path)), str(path))


def validate_config(cfg: JobConfig) -> None:
    """Check every value against its choices and rules, e.g. for a config built in code."""
    for key in _KEYS:
        section, name = key.split(".")
        _check(key, getattr(getattr(cfg, section), name), "config")


def load_config(argv: list[str]) -> JobConfig:
    """Build the config from defaults, then the --config TOML, then --section.key overrides."""
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    config, overrides, print_config = _parse_argv(argv)
    cfg = JobConfig()
    if config is not None:
        path = _find_config(config)
        _apply_toml(cfg, path)
        cfg.config_dir = str(path.resolve().parent)
    for key, value in overrides:
        _set(cfg, key, value, "command line")
    if print_config:
        print(config_to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


def _toml_value(value: Any) -> str:
    """One TOML value: bool, int, float or basic string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's float repr ("1e-08", "inf", "nan") is valid TOML
    # TOML basic strings may not hold raw control characters, DEL included.
    chars = (_ESCAPES.get(c, f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c) for c in value)
    return '"' + "".join(chars) + '"'


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {key: value}}, e.g. for logging or a checkpoint."""
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig) -> str:
    """The config as a TOML file that --config loads back to the same config."""
    lines = []
    for section, values in config_to_dict(cfg).items():
        lines += [f"[{section}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items()), ""]
    return "\n".join(lines)


def _metavar(annotation: Any) -> str:
    """How --help shows a field's value: its choices, or its type."""
    if get_origin(annotation) is Literal:
        return "{" + ",".join(get_args(annotation)) + "}"
    return "[BOOL]" if annotation is bool else annotation.__name__.upper()


def help_text() -> str:
    """Every option grouped by section, with its type, default and one-line doc."""
    lines = [
        "usage: train.py [--config NAME_OR_PATH] [--print-config] [--SECTION.KEY VALUE ...]",
        "",
        "  --config NAME_OR_PATH  a TOML file, or a name under train_configs/ ('.toml' optional)",
        "  --print-config         print the resolved config as TOML and exit",
        "  -h, --help             show this help and exit",
        "",
        "Overrides: --section.key value or --section.key=value; a bare bool flag means true.",
    ]
    for section, cls in _SECTIONS.items():
        lines += ["", f"[{section}]  {cls.__doc__}"]
        for f in dataclasses.fields(cls):
            rule = f.metadata["rule"]
            limits = f", {rule.text}" if rule else ""
            default = _toml_value(f.default)
            lines.append(f"  --{section}.{f.name} {_metavar(f.type)}  (default: {default}{limits})")
            lines.append(f"        {f.metadata['help']}")
    return "\n".join(lines)
