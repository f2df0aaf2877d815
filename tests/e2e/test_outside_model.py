"""A GPT-2-style model (examples/gpt2_model.py: LayerNorm, learned positions, GELU MLP) registered
from a folder outside the repository — named by its file path, or as a module beside the config
file, with no PYTHONPATH — trains under FSDP 2, TP 2 and PP 2 exactly like one process, with no
edit inside Kiln; a TP plan that leaves parameters plain and args that lack a field the trainer
reads are refused with one clear line."""

import shutil
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, check_ok, dump_args, fails_with, run_train, train_rows

GPT2 = ["--model.name", "gpt2",
        "--model.flavor", "tiny", "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--training.local_batch_size", "8", "--training.steps", "8", "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
LAYOUTS = {
    "fsdp2": ["--training.local_batch_size", "4"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}
# A user's slip: the same model with a TP plan that forgets its LayerNorms and positions.
PLAIN_NORMS = '''
import gpt2_model
from models import ModelSpec, get_model_spec, register_model_spec
from parallelisms.compose import finish_parallelize, tensor_parallelize

def parallelize(model, dims, options):
    top, block = gpt2_model.gpt2_tp_plan(options.loss_parallel)
    top = {k: v for k, v in top.items() if k.startswith(("tok_embeddings.tokens", "output"))}
    block = {k: v for k, v in block.items() if not k.startswith("ln_")}
    tensor_parallelize(model, dims, options, lambda _: block, top_plan=top)
    return finish_parallelize(model, dims, options)

spec = get_model_spec("gpt2")
register_model_spec(ModelSpec(name="gpt2_plain_norms", flavors=spec.flavors, model_cls=spec.model_cls,
                              parallelize_fn=parallelize, flops_per_token_fn=spec.flops_per_token_fn))
'''
# Another slip: args without the head count the trainer reads.
NO_HEADS = '''
import dataclasses
import gpt2_model
from models import ModelSpec, register_model_spec

@dataclasses.dataclass
class HeadlessArgs:
    dim: int = 64
    n_layers: int = 2
    vocab_size: int = 4096
    max_seq_len: int = 256

register_model_spec(ModelSpec(name="gpt2_no_heads", flavors={"tiny": HeadlessArgs()},
                              model_cls=gpt2_model.GPT2, parallelize_fn=gpt2_model.parallelize_gpt2,
                              flops_per_token_fn=gpt2_model.gpt2_flops_per_token))
'''


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """The example copied into a folder of its own with a config beside it, as a user's would be
    (no PYTHONPATH: the runs name the file, or a module beside the config)."""
    folder = tmp_path_factory.mktemp("my_models")
    shutil.copy(REPO / "examples" / "gpt2_model.py", folder / "gpt2_model.py")
    shutil.copy(REPO / "train_configs" / "llama_debug.toml", folder / "gpt2.toml")
    (folder / "gpt2_plain_norms.py").write_text(PLAIN_NORMS)
    (folder / "gpt2_no_heads.py").write_text(NO_HEADS)
    return folder


@pytest.fixture(scope="module")
def reference(outside, tmp_path_factory, data_cache) -> list[dict]:
    dump = tmp_path_factory.mktemp("gpt2_ref")
    check_ok(run_train(["--config", "llama_debug", *GPT2, "--job.custom_import",
                        str(outside / "gpt2_model.py"), *dump_args(dump, data_cache)]))
    rows = train_rows(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, "the GPT-2 reference did not learn"
    return rows


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outside_model_matches_single_process(layout, outside, reference, tmp_path, data_cache):
    proc = run_train(["--config", "llama_debug", *GPT2, *LAYOUTS[layout], "--job.custom_import",
                      str(outside / "gpt2_model.py"), *dump_args(tmp_path, data_cache)], nproc=2)
    check_ok(proc)
    if layout == "tp2":  # its plan has no sequence parallel, and the start-up line says so
        assert "TP 2 (no sequence parallel, loss parallel on)" in proc.stdout
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= tol * ref[key], (layout, key, ref["step"], got[key], ref[key])


def test_tp_plan_leaving_parameters_plain_is_refused(outside, tmp_path, data_cache):
    proc = run_train(["--config", str(outside / "gpt2.toml"), *GPT2, "--job.custom_import",
                      "gpt2_plain_norms", "--model.name", "gpt2_plain_norms",
                      "--parallelism.tensor_parallel_degree", "2", *dump_args(tmp_path, data_cache)], nproc=2)
    fails_with(proc, "leaves parameters plain", "ln_1.weight", "ReplicateParallel", torchrun=True)


def test_args_without_a_field_the_trainer_reads_are_one_line(outside, tmp_path):
    proc = run_train(["--config", str(outside / "gpt2.toml"), *GPT2, "--job.custom_import", "gpt2_no_heads",
                      "--model.name", "gpt2_no_heads", *dump_args(tmp_path)])
    fails_with(proc, "'gpt2_no_heads'", "`n_heads`", "`kv_heads`", "models/protocol.py")
