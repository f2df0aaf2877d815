"""Newcomer frictions turned into one clear line that names the fix: a model's functions and ends checked
at registration, did-you-mean for config keys, values and flavors (case, synonyms), the untied flavor
suggested under TP, the planner's single changes, the generation path said, checkpoints kept bounded."""

import runpy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from components.config.loading import ConfigError, help_text, load_config
from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.generation import generate
from components.runtime.errors import KilnError
from models import ModelSpec, UnknownModelError, get_model_args, get_model_spec, register_model_spec
from models.llama3.flavors import LLAMA3_FLAVORS
from models.protocol import ModelContractError
from parallelisms.layout_checks import ModelShape
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import make_stage_model

# --- 1. registration checks the functions' arity and where pipeline parallel finds the ends ---


@dataclass
class Args:
    dim: int = 8
    n_layers: int = 2
    n_heads: int = 2
    kv_heads: int = 2
    vocab_size: int = 16
    max_seq_len: int = 8


class Ends(nn.Module):
    """A model that meets the contract, its ends named as pipeline parallel looks for them."""

    def __init__(self, args: Args) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): nn.Linear(args.dim, args.dim) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size)

    def init_weights(self, buffer_device=None) -> None:
        pass

    def init_buffers(self, device=None) -> None:
        pass


class OtherEnds(Ends):
    """The same model with its ends named the Hugging Face / nanoGPT way."""

    def __init__(self, args: Args) -> None:
        super().__init__(args)
        self.embed, self.ln_f, self.lm_head = self.tok_embeddings, self.norm, self.output
        del self.tok_embeddings, self.norm, self.output


def parallelize(model, dims, options):
    return model


def old_parallelize(model, world_mesh, parallel_dims, job_config):
    return model


def spec(name: str = "hint_toy", **changes) -> ModelSpec:
    base = ModelSpec(name=name, flavors={"small": Args()}, model_cls=Ends, parallelize_fn=parallelize,
                     flops_per_token_fn=lambda args, n, s: 6 * n)
    return replace(base, **changes)


@pytest.fixture(autouse=True)
def restored_registry() -> Iterator[None]:
    """No registration made here outlives its test."""
    saved = dict(models._REGISTRY)
    try:
        yield
    finally:
        models._REGISTRY.clear()
        models._REGISTRY.update(saved)


def refusal(model_spec: ModelSpec) -> str:
    with pytest.raises(ModelContractError) as e:
        register_model_spec(model_spec)
    assert model_spec.name not in models.registered_models()
    return str(e.value)


def test_an_old_four_argument_parallelize_fn_is_refused_at_registration() -> None:
    msg = refusal(spec(parallelize_fn=old_parallelize))
    for words in ("'hint_toy'", "`old_parallelize(model, world_mesh, parallel_dims, job_config)`",
                  "parallelize_fn(model, dims, options)", "4-argument form",
                  "`def old_parallelize(model, dims, options)`", "models/llama3/parallelize.py"):
        assert words in msg, (words, msg)


def test_a_wrong_arity_is_refused_and_a_callable_that_takes_three_arguments_is_not() -> None:
    msg = refusal(spec(parallelize_fn=lambda model, dims: model))
    assert "`<lambda>(model, dims)`" in msg and "4-argument" not in msg
    msg = refusal(spec(pipeline_fn=lambda whole, layers: whole))
    assert "pipeline_fn `<lambda>(whole, layers)`" in msg and "(model, layers, is_first, is_last)" in msg
    assert "parallelisms.pipeline.make_stage_model" in msg
    for ok in (lambda model, *_: model, lambda model, dims, options=None, extra=1: model, parallelize):
        register_model_spec(spec(f"hint_ok_{len(models.registered_models())}", parallelize_fn=ok))


def test_a_pipelined_model_whose_ends_have_other_names_is_refused_at_registration() -> None:
    msg = refusal(spec("hint_other_ends", model_cls=OtherEnds, pipeline_fn=make_stage_model))
    for words in ("'hint_other_ends'", "pipeline_fn `make_stage_model(",
                  "no `tok_embeddings`, `norm`, `output`", "embed.weight", "ln_f.weight", "lm_head.weight",
                  "name the token embedding `tok_embeddings`", "without pipeline_fn"):
        assert words in msg, (words, msg)
    # Without pipeline parallel the names are free; with the contract's names PP is accepted.
    register_model_spec(spec("hint_other_ends_no_pp", model_cls=OtherEnds))
    register_model_spec(spec("hint_ends_pp", pipeline_fn=make_stage_model))


def test_the_built_in_families_and_the_outside_example_still_register() -> None:
    for name in ("llama3", "moe"):
        register_model_spec(replace(get_model_spec(name), name=f"{name}_again"))
    models._REGISTRY.pop("gpt2", None)  # another test may have imported the example already
    runpy.run_path(str(Path(models.__file__).parents[1] / "examples" / "gpt2_model.py"))
    assert get_model_spec("gpt2").pipeline_fn is make_stage_model


# --- 2. did-you-mean: case-insensitive, and the names other trainers use ---


def error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    return str(e.value)


@pytest.mark.parametrize("typed,real", [
    ("optimizer.learning_rate", "optimizer.lr"), ("learning_rate", "optimizer.lr"),
    ("lr_warmup", "lr_scheduler.warmup_steps"), ("training.warmup", "lr_scheduler.warmup_steps"),
    ("batch_size", "training.local_batch_size"), ("training.batch_size", "training.local_batch_size"),
    ("max_steps", "training.steps"), ("training.num_steps", "training.steps"),
    ("seq_length", "training.seq_len"), ("model.max_seq_len", "training.seq_len"),
    ("tp", "parallelism.tensor_parallel_degree"),
    ("parallelism.tp_degree", "parallelism.tensor_parallel_degree"),
    ("pp", "parallelism.pipeline_parallel_degree"), ("grad_clip", "training.max_norm"),
    ("Training.Steps", "training.steps"), ("OPTIMIZER.LR", "optimizer.lr"),
])
def test_a_synonym_or_another_case_of_a_key_names_the_real_key(typed, real) -> None:
    msg = error([f"--{typed}", "2"])
    assert f"unknown key '{typed}'" in msg and f"did you mean '{real}'?" in msg, msg


def test_a_synonym_in_a_toml_file_names_the_real_key(tmp_path) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("[optimizer]\nlearning_rate = 3e-4\n")
    assert "did you mean 'optimizer.lr'?" in error(["--config", str(path)])
    path.write_text("[parallelism]\npipeline_parallel_schedule = \"interleaved1f1b\"\n")
    assert "did you mean 'Interleaved1F1B'?" in error(["--config", str(path)])


def test_a_value_choice_in_another_case_is_suggested() -> None:
    msg = error(["--parallelism.pipeline_parallel_schedule", "1f1b"])
    assert "got '1f1b' — did you mean '1F1B'?" in msg, msg
    assert "did you mean 'AdamW'?" in error(["--optimizer.name", "adamw"])


def test_a_flavor_or_model_name_in_another_case_is_suggested_and_no_other_size_is() -> None:
    llama = get_model_spec("llama3")
    with pytest.raises(UnknownModelError) as e:
        get_model_args(llama, "8b")
    assert "'8b'" in str(e.value) and "did you mean '8B'?" in str(e.value)
    with pytest.raises(UnknownModelError) as e:
        get_model_args(llama, "7B")  # a near spelling is another size, not a typo: only the list
    assert "did you mean" not in str(e.value) and "70B" in str(e.value)
    with pytest.raises(UnknownModelError) as e:
        get_model_spec("Llama3")
    assert "did you mean 'llama3'?" in str(e.value)


# --- 3. tied embeddings under TP name the untied flavors ---


def test_tied_embeddings_under_tp_suggest_an_untied_flavor_and_fsdp() -> None:
    shape = ModelShape.from_args(get_model_args(get_model_spec("llama3"), "1B"), True)
    assert shape.tied_embeddings and set(shape.untied_flavors) == {"8B", "125M"}
    assert all(not LLAMA3_FLAVORS[f].tie_embeddings for f in shape.untied_flavors)
    with pytest.raises(KilnError) as e:
        ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2).check_layout(
            shape, ParallelOptions(seq_len=64))
    msg = str(e.value)
    for words in ("tied embeddings", "--model.flavor 8B or 125M", "--parallelism.tensor_parallel_degree 1"):
        assert words in msg, (words, msg)


def test_tied_args_of_no_registered_flavor_still_say_what_to_change() -> None:
    # An odd width no registered flavor has (other tests register tied variants of "tiny").
    args = replace(LLAMA3_FLAVORS["tiny"], tie_embeddings=True, dim=72)
    shape = ModelShape.from_args(args, True)
    with pytest.raises(KilnError, match="tie_embeddings=False"):
        ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2).check_layout(
            shape, ParallelOptions(seq_len=64))


# --- 4. a plan that does not fit: the single changes worth planning ---


def test_the_changes_tried_for_a_plan_that_does_not_fit() -> None:
    from planning.plan import Device, Plan, _candidates

    cfg = load_config(["--config", "llama_debug", "--model.flavor", "tiny",
                       "--training.local_batch_size", "4", "--training.global_batch_size", "16"])
    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=1, world_size=4)
    plan = Plan(model="llama3/tiny", num_params=0, layout="", world_size=4, global_batch=16, seq_len=256,
                microbatches=1, numerics="", ac_mode="none", device=Device("d", 1.0, 1.0), mfu=0.4,
                flops_per_token=0)
    got = {flags: (why, changed, world)
           for flags, why, changed, world in _candidates(cfg, 4, dims, plan, True)}
    # 8 ranks keep the global batch of 16: 2 rows per rank and microbatch.
    assert set(got) == {"--world-size 8 --training.local_batch_size 2",
                        "--parallelism.tensor_parallel_degree 2", "--parallelism.pipeline_parallel_degree 2",
                        "--training.local_batch_size 2 --training.global_batch_size 16",
                        "--activation_checkpoint.mode full"}, got
    why, _, world = got["--world-size 8 --training.local_batch_size 2"]
    assert world == 8 and "FSDP over 8 instead of 4" in why
    assert got["--parallelism.tensor_parallel_degree 2"][1].parallelism.tensor_parallel_degree == 2
    assert cfg.parallelism.tensor_parallel_degree == 1  # the candidates are copies
    # No PP without a pipeline_fn; nothing is taken from FSDP when it has one rank.
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    flags = [c[0] for c in _candidates(cfg, 1, one, replace(plan, world_size=1), False)]
    assert not any("parallel_degree" in f for f in flags) and "--world-size 2" in flags


def test_a_fixed_global_batch_is_split_over_the_new_data_parallel_degree() -> None:
    from planning.plan import _batch_for

    cfg = JobConfig()
    cfg.training.global_batch_size, cfg.training.local_batch_size = 24, 8
    assert _batch_for(cfg, 3, {}) == {}
    assert _batch_for(cfg, 2, {}) == {"training.local_batch_size": 6}  # 12 rows per rank
    assert _batch_for(cfg, 5, {}) == {"training.global_batch_size": 40}  # 24 rows do not split in 5


def test_the_changes_that_fit_are_printed_with_their_speed_and_peak() -> None:
    from planning.plan import Device, Plan, Suggestion
    from planning.report import format_suggestions

    plan = Plan(model="m", num_params=0, layout="", world_size=8, global_batch=8, seq_len=8, microbatches=1,
                numerics="", ac_mode="none", device=Device("H100", 79.2, 989.0), mfu=0.4, flops_per_token=0)
    plan.suggestions = [Suggestion("--world-size 16", "16 ranks", 60 * 2**30, True, 17.2, 1234.0),
                        Suggestion("--activation_checkpoint.mode full", "recompute", 130 * 2**30, False,
                                   -52.8)]
    plan.suggestions_seconds = 3.0
    text = "\n".join(format_suggestions(plan))
    assert "what would fit" in text
    assert "--world-size 16  ≈ 1,234 tokens/s/device, peak 60.00 GiB, 17.2 GiB to spare" in text
    assert "still short: --activation_checkpoint.mode full (peak 130.00 GiB, 52.8 GiB short)" in text
    plan.suggestions = plan.suggestions[1:]
    assert "no single change tried fits" in "\n".join(format_suggestions(plan))


# --- 5. generation says which path it takes, the KV cache as well as the fallback ---


def test_generation_with_the_kv_cache_says_so_in_one_line() -> None:
    llama = get_model_spec("llama3")
    torch.manual_seed(0)
    model = llama.model_cls(llama.flavors["tiny"])
    model.init_weights()
    notes: list[str] = []
    generate(model, [1, 2, 3], 3, temperature=0, note=notes.append)
    assert len(notes) == 1 and notes[0].startswith("generation: KV cache"), notes
    assert "2 attention layers" in notes[0]


# --- 6. checkpoints are kept bounded by default ---


def test_keep_latest_k_has_a_bounded_default_and_zero_still_keeps_all() -> None:
    assert JobConfig().checkpoint.keep_latest_k == 3
    assert load_config(["--checkpoint.keep_latest_k", "0"]).checkpoint.keep_latest_k == 0
    line = next(line for line in help_text().splitlines() if "--checkpoint.keep_latest_k" in line)
    assert "default: 3" in line
    assert "0 = keep all" in help_text()
