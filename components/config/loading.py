"""The job config read: a TOML file (a bare name is looked up in train_configs/), then --section.key
overrides, every bad key or value one error naming it; and the config written back as TOML and --help."""

import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from components.config.sections import JobConfig
from components.runtime.errors import KilnError

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomli is the backport of the standard library's tomllib
    import tomli as tomllib


REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> Path:
    """A relative path is looked up in the working directory first, then in the repository."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


class ConfigError(KilnError):
    """A bad config file or command-line override, explained in one message."""


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


# Names other trainers (Hugging Face, Megatron, nanoGPT, older TorchTitan) give to Kiln's keys, by
# the last part of the key: a newcomer types these first, and no spelling is near enough to find them.
_SYNONYMS_OF = {
    "optimizer.lr": ("learning_rate", "lr_max", "max_lr"),
    "lr_scheduler.warmup_steps": ("lr_warmup", "warmup", "warmup_iters", "num_warmup_steps",
                                  "lr_warmup_steps"),
    "training.local_batch_size": ("batch_size", "micro_batch_size", "per_device_train_batch_size"),
    "training.global_batch_size": ("global_batch", "train_batch_size"),
    "training.steps": ("max_steps", "num_steps", "train_steps", "train_iters", "max_iters", "total_steps"),
    "training.seq_len": ("seq_length", "max_seq_len", "max_seq_length", "sequence_length", "block_size",
                         "context_length"),
    "training.max_norm": ("grad_clip", "max_grad_norm", "clip_grad_norm", "gradient_clipping"),
    "parallelism.tensor_parallel_degree": ("tp", "tp_degree", "tp_size", "tensor_parallel_size"),
    "parallelism.pipeline_parallel_degree": ("pp", "pp_degree", "pp_size", "pipeline_parallel_size"),
    "parallelism.context_parallel_degree": ("cp", "cp_degree", "cp_size", "context_parallel_size"),
    "parallelism.expert_parallel_degree": ("ep", "ep_degree", "ep_size", "expert_parallel_size"),
    "parallelism.data_parallel_shard_degree": ("dp", "fsdp", "dp_shard", "fsdp_degree", "data_parallel_size"),
    "parallelism.data_parallel_replicate_degree": ("dp_replicate", "ddp", "replicate_degree"),
    "parallelism.pipeline_parallel_schedule": ("pp_schedule", "pipeline_schedule"),
    "checkpoint.interval": ("save_interval", "save_steps", "checkpoint_interval", "ckpt_interval"),
    "checkpoint.keep_latest_k": ("save_total_limit", "keep_last", "keep_latest"),
    "metrics.log_freq": ("log_interval", "logging_steps", "log_every"),
    "job.dump_folder": ("output_dir", "out_dir", "dump_dir"),
    "activation_checkpoint.mode": ("gradient_checkpointing", "activation_checkpointing", "ac"),
    "compile.enable": ("torch_compile",),
    "model.name": ("model_name", "arch"),
    "model.flavor": ("size", "model_size"),
}
_SYNONYMS = {synonym: key for key, synonyms in _SYNONYMS_OF.items() for synonym in synonyms}


def did_you_mean(name: str, candidates: list[str], *, spelling: bool = True) -> str:
    """A ' — did you mean ...?' hint for a misspelt, miscased or misplaced name, or a synonym of a
    key (`learning_rate` → `optimizer.lr`); ''. With spelling=False only a different case is
    corrected (for presets such as flavors, where a near spelling is another size, not a typo)."""
    folded = {c.lower(): c for c in candidates}
    lower = name.lower()
    tail = lower.rsplit(".", 1)[-1]
    match = [folded[lower]] if lower in folded else []
    # An exact key name in another section ("training.lr") beats a near spelling in this one.
    match = match or [c for c in candidates if c.lower().rsplit(".", 1)[-1] == tail]
    if spelling and not match and _SYNONYMS.get(tail) in candidates:
        match = [_SYNONYMS[tail]]
    if spelling and not match:
        match = [folded[m] for m in difflib.get_close_matches(lower, list(folded), n=1)]
    return f" — did you mean '{match[0]}'?" if match else ""


def _check(key: str, value: Any, where: str) -> None:
    """Raise unless value is one of the field's choices and passes its rule."""
    annotation, rule = _KEYS[key].type, _KEYS[key].metadata["rule"]
    choices = get_args(annotation) if get_origin(annotation) is Literal else ()
    if choices and value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        hint = did_you_mean(value, list(choices)) if isinstance(value, str) else ""
        raise ConfigError(f"{where}: {key} expects one of {valid}, got {value!r}{hint}")
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
            hint = did_you_mean(key, list(_KEYS))
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
            hint = did_you_mean(section, list(_KEYS))
            raise ConfigError(f"{path}: key '{section}' is outside any [section]{hint}")
        if section not in _SECTIONS:
            hint = did_you_mean(section, list(_SECTIONS))
            raise ConfigError(f"{path}: unknown section '{section}'{hint}")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key == "training.sources" and isinstance(value, list):  # [[training.sources]] tables
                if not all(isinstance(t, dict) for t in value):
                    raise ConfigError(f"{path}: training.sources expects [[training.sources]] tables or a "
                                      "string PATH=WEIGHT,...")
                value = json.dumps(value)
            if key not in _KEYS:
                raise ConfigError(f"{path}: unknown key '{key}'{did_you_mean(key, list(_KEYS))}")
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
