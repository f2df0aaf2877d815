"""A GPT-2-style model (examples/gpt2_model.py: LayerNorm, learned positions, GELU MLP) registered
from a folder outside the repository trains under FSDP 2, TP 2 and PP 2 exactly like one process,
with no edit inside Kiln; a TP plan that leaves parameters plain is refused with one clear line."""

import shutil

import pytest
from conftest import REPO, check_ok, fails_with, run_train, train_rows

GPT2 = ["--config", "llama_debug", "--job.custom_import", "gpt2_model", "--model.name", "gpt2",
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


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> dict:
    """The example copied into a folder of its own, found through PYTHONPATH as a user's would be."""
    folder = tmp_path_factory.mktemp("my_models")
    shutil.copy(REPO / "examples" / "gpt2_model.py", folder / "gpt2_model.py")
    (folder / "gpt2_plain_norms.py").write_text(PLAIN_NORMS)
    return {"PYTHONPATH": str(folder)}


@pytest.fixture(scope="module")
def reference(outside, tmp_path_factory, data_cache) -> list[dict]:
    dump = tmp_path_factory.mktemp("gpt2_ref")
    check_ok(run_train([*GPT2, "--job.dump_folder", str(dump), "--training.data_cache_dir", str(data_cache)],
                       extra_env=outside))
    rows = train_rows(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, "the GPT-2 reference did not learn"
    return rows


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outside_model_matches_single_process(layout, outside, reference, tmp_path, data_cache):
    proc = run_train([*GPT2, *LAYOUTS[layout], "--job.dump_folder", str(tmp_path),
                      "--training.data_cache_dir", str(data_cache)], nproc=2, extra_env=outside)
    check_ok(proc)
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= tol * ref[key], (layout, key, ref["step"], got[key], ref[key])


def test_tp_plan_leaving_parameters_plain_is_refused(outside, tmp_path, data_cache):
    proc = run_train([*GPT2, "--job.custom_import", "gpt2_plain_norms", "--model.name", "gpt2_plain_norms",
                      "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path),
                      "--training.data_cache_dir", str(data_cache)], nproc=2, extra_env=outside)
    fails_with(proc, "leaves parameters plain", "ln_1.weight", "ReplicateParallel", torchrun=True)
