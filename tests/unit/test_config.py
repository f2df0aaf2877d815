"""Tests for components/config/loading.py: TOML, command-line overrides, errors, --help, --print-config."""

import dataclasses
import sys
from pathlib import Path

import pytest

from components.config.loading import (
    REPO_ROOT,
    ConfigError,
    config_to_dict,
    config_to_toml,
    load_config,
    validate_config,
)
from components.config.sections import JobConfig
from components.runtime.errors import KilnError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def all_keys() -> list[str]:
    """Every section.key of JobConfig, read from the dataclasses themselves."""
    return [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(JobConfig)
        for f in dataclasses.fields(s.type)
    ]


def write(tmp_path: Path, text: str) -> Path:
    """A TOML file under tmp_path holding text."""
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def error(argv: list[str]) -> str:
    """The ConfigError message load_config(argv) raises."""
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return str(info.value)


# --- defaults and overrides ---


def test_defaults_without_config() -> None:
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.model.name == "llama3" and cfg.training.steps == 100 and cfg.optimizer.lr == 8e-4
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.comm.timeout_seconds == 300
    validate_config(cfg)


def test_both_override_syntaxes() -> None:
    cfg = load_config(["--training.steps", "7", "--training.seq_len=64", "--job.description=a b"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.job.description) == (7, 64, "a b")


def test_equals_value_may_contain_equals_and_start_with_dashes() -> None:
    cfg = load_config(["--job.description=x=--y"])
    assert cfg.job.description == "x=--y"


def test_dashes_in_key_names_are_accepted() -> None:
    assert load_config(["--training.local-batch-size", "3"]).training.local_batch_size == 3


def test_bare_bool_flag_means_true() -> None:
    cfg = load_config(["--compile.enable", "--training.steps", "3"])
    assert cfg.compile.enable is True and cfg.training.steps == 3
    assert load_config(["--checkpoint.enable"]).checkpoint.enable is True


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--compile.enable", "false"], False),
        (["--compile.enable=false"], False),
        (["--compile.enable", "true"], True),
        (["--compile.enable", "1"], True),
        (["--compile.enable", "0"], False),
        (["--compile.enable=yes"], True),
        (["--compile.enable", "NO"], False),
    ],
)
def test_bool_values(argv: list[str], expected: bool) -> None:
    assert load_config(argv).compile.enable is expected


def test_float_and_int_conversion() -> None:
    argv = ["--optimizer.lr", "1e-3", "--optimizer.eps=1e-10", "--training.max_norm", "2"]
    cfg = load_config(argv)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.eps == 1e-10
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    cfg = load_config(["--training.global_batch_size", "-1", "--checkpoint.load_step=12"])
    assert cfg.training.global_batch_size == -1 and cfg.checkpoint.load_step == 12


def test_toml_int_is_accepted_for_float(tmp_path: Path) -> None:
    cfg = load_config(["--config", str(write(tmp_path, "[optimizer]\nweight_decay = 0\n"))])
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)


def test_override_beats_toml_wherever_it_sits(tmp_path: Path) -> None:
    path = str(write(tmp_path, "[training]\nsteps = 50\nseq_len = 32\n"))
    cfg = load_config(["--training.steps", "5", "--config", path])
    assert cfg.training.steps == 5 and cfg.training.seq_len == 32
    assert load_config(["--config", path, "--training.steps=6"]).training.steps == 6


def test_later_override_wins() -> None:
    assert load_config(["--training.steps=3", "--training.steps=4"]).training.steps == 4


def test_choice_values() -> None:
    cfg = load_config(["--optimizer.name", "Adam", "--lr_scheduler.decay_type=cosine"])
    assert cfg.optimizer.name == "Adam" and cfg.lr_scheduler.decay_type == "cosine"
    cfg = load_config(["--activation_checkpoint.selective_ac_option", "op"])
    assert cfg.activation_checkpoint.selective_ac_option == "op"


# --- --config lookup ---


def test_config_by_name_with_and_without_suffix() -> None:
    for name in ["llama_debug", "llama_debug.toml"]:
        cfg = load_config(["--config", name])
        assert cfg.job.dump_folder == "./outputs/llama_debug"
        assert cfg.metrics.log_freq == 1 and cfg.model.flavor == "debug"


def test_config_by_path(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\nflavor = "tiny"\n')
    assert load_config(["--config", str(path)]).model.flavor == "tiny"
    assert load_config([f"--config={path}"]).model.flavor == "tiny"


def test_shipped_configs_load() -> None:
    for path in sorted((REPO_ROOT / "train_configs").glob("*.toml")):
        validate_config(load_config(["--config", str(path)]))


# --- errors ---


def test_config_error_is_a_kiln_error() -> None:
    assert issubclass(ConfigError, KilnError)


def test_missing_config_names_what_was_tried() -> None:
    msg = error(["--config", "no_such_cfg"])
    assert "no_such_cfg" in msg and "no_such_cfg.toml" in msg and "train_configs" in msg
    assert "llama_debug" in msg  # the known names are listed


def test_config_without_value() -> None:
    assert "--config" in error(["--config"])


def test_unknown_cli_key_suggests() -> None:
    msg = error(["--training.step", "3"])
    assert "unknown key 'training.step'" in msg and "did you mean 'training.steps'?" in msg


def test_unknown_cli_key_in_other_section_suggests() -> None:
    assert "did you mean 'optimizer.lr'?" in error(["--training.lr", "1"])
    assert "did you mean 'training.steps'?" in error(["--trainng.steps", "1"])


def test_unknown_toml_key_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nseq_lne = 3\n")
    msg = error(["--config", str(path)])
    assert str(path) in msg and "unknown key 'training.seq_lne'" in msg
    assert "did you mean 'training.seq_len'?" in msg


def test_unknown_toml_section_suggests(tmp_path: Path) -> None:
    msg = error(["--config", str(write(tmp_path, "[optimiser]\nlr = 1.0\n"))])
    assert "unknown section 'optimiser'" in msg and "did you mean 'optimizer'?" in msg


def test_toml_key_outside_section(tmp_path: Path) -> None:
    msg = error(["--config", str(write(tmp_path, "steps = 3\n"))])
    assert "'steps'" in msg and "did you mean 'training.steps'?" in msg


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nsteps = 3\nseq_len 5\n")
    msg = error(["--config", str(path)])
    assert str(path) in msg and "line 3" in msg


def test_wrong_type_in_toml(tmp_path: Path) -> None:
    msg = error(["--config", str(write(tmp_path, '[training]\nsteps = "ten"\n'))])
    assert "training.steps" in msg and "'ten'" in msg and "an int" in msg
    msg = error(["--config", str(write(tmp_path, "[compile]\nenable = 1\n"))])
    assert "compile.enable" in msg and "a bool" in msg
    path = write(tmp_path, "[activation_checkpoint]\nselective_ac_option = 2\n")
    msg = error(["--config", str(path)])
    assert "selective_ac_option" in msg and "a string" in msg and "quote" in msg


@pytest.mark.parametrize(
    "argv, key, value, expected",
    [
        (["--training.steps", "ten"], "training.steps", "'ten'", "an int"),
        (["--training.steps=1.5"], "training.steps", "'1.5'", "an int"),
        (["--optimizer.lr", "fast"], "optimizer.lr", "'fast'", "a float"),
        (["--compile.enable=maybe"], "compile.enable", "'maybe'", "a bool"),
    ],
)
def test_wrong_type_on_command_line(argv: list[str], key: str, value: str, expected: str) -> None:
    msg = error(argv)
    assert key in msg and value in msg and expected in msg


def test_bad_choice_lists_valid_ones(tmp_path: Path) -> None:
    msg = error(["--optimizer.name", "SGD"])
    assert "optimizer.name" in msg and "'SGD'" in msg and "'AdamW', 'Adam'" in msg
    msg = error(["--config", str(write(tmp_path, '[training]\nmixed_precision_param = "fp16"\n'))])
    assert "'auto', 'float32', 'bfloat16'" in msg and "'fp16'" in msg


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.steps", "0"], "training.steps"),
        (["--training.seq_len=-4"], "training.seq_len"),
        (["--training.local_batch_size", "0"], "training.local_batch_size"),
        (["--training.global_batch_size", "-2"], "training.global_batch_size"),
        (["--optimizer.lr=-1e-3"], "optimizer.lr"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio"),
        (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree"),
        (["--validation.steps", "0"], "validation.steps"),
        (["--activation_checkpoint.selective_ac_option", "x"], "selective_ac_option"),
    ],
)
def test_out_of_range(argv: list[str], key: str) -> None:
    msg = error(argv)
    assert key in msg and "expects" in msg


def test_range_applies_to_toml_too(tmp_path: Path) -> None:
    msg = error(["--config", str(write(tmp_path, "[training]\nsteps = 0\n"))])
    assert str(tmp_path) in msg and "training.steps" in msg and ">= 1" in msg


def test_validate_config_catches_code_built_values() -> None:
    cfg = JobConfig()
    cfg.lr_scheduler.decay_type = "step"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="lr_scheduler.decay_type"):
        validate_config(cfg)


def test_positional_argument() -> None:
    assert "'train.toml'" in error(["train.toml"])
    assert "'-x'" in error(["-x"])


def test_override_without_value() -> None:
    assert "--training.steps needs a value" in error(["--training.steps"])
    assert "--training.steps needs a value" in error(["--training.steps", "--compile.enable"])


def test_bool_flag_takes_the_next_word_as_its_value() -> None:
    msg = error(["--compile.enable", "maybe"])
    assert "compile.enable" in msg and "'maybe'" in msg and "a bool" in msg


# --- --help and --print-config ---


def test_help_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ["--help", "-h"]:
        with pytest.raises(SystemExit) as info:
            load_config(["--training.steps", "oops", flag])
        assert info.value.code == 0
        out = capsys.readouterr().out
        for key in all_keys():
            assert f"--{key} " in out, key
        for section in dataclasses.fields(JobConfig):
            assert f"[{section.name}]" in out
        assert "{AdamW,Adam}" in out and "(default: 100, >= 1)" in out
    for section in dataclasses.fields(JobConfig):
        assert all(f.metadata["help"] in out for f in dataclasses.fields(section.type))


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--config", "llama_debug",
        "--job.description", 'tricky "quotes" \\ back\nslash\ttab \x01\x7f é ✓',
        "--optimizer.eps", "1e-12",
        "--training.max_norm=-1",
        "--compile.enable",
    ]  # fmt: skip
    expected = load_config(argv)
    with pytest.raises(SystemExit) as info:
        load_config([*argv, "--print-config"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert tomllib.loads(text) == config_to_dict(expected)
    path = tmp_path / "printed.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(["--config", str(path)]) == expected


def test_config_to_toml_and_dict_round_trip() -> None:
    cfg = JobConfig()
    assert tomllib.loads(config_to_toml(cfg)) == config_to_dict(cfg)
    assert list(config_to_dict(cfg)) == [f.name for f in dataclasses.fields(JobConfig)]
