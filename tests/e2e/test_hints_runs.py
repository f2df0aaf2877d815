"""Newcomer frictions end to end: a model registered with an old parallelize signature or with ends that
pipeline parallel cannot find is one `kiln: error:` line, a plan that does not fit says what would, the
generate script says which path it takes, and a run keeps only the newest checkpoints by default."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, TINY, check_ok, fails_with, run_train

GPT2 = ["--model.name", "gpt2", "--model.flavor", "tiny", "--training.seq_len", "64",
        "--training.steps", "2", "--training.local_batch_size", "4", "--training.global_batch_size", "8"]
# A user's model written the TorchTitan-0.1 way: parallelize_fn(model, world_mesh, parallel_dims, job_config).
OLD_SIGNATURE = '''
import gpt2_model
from models import ModelSpec, get_model_spec, register_model_spec

def parallelize_old(model, world_mesh, parallel_dims, job_config):
    return model

spec = get_model_spec("gpt2")
register_model_spec(ModelSpec(name="gpt2_old", flavors=spec.flavors, model_cls=spec.model_cls,
                              parallelize_fn=parallelize_old, flops_per_token_fn=spec.flops_per_token_fn))
'''
# The same GPT-2 with its ends named the Hugging Face way, opting into pipeline parallel.
OTHER_ENDS = '''
import gpt2_model
from models import ModelSpec, get_model_spec, register_model_spec
from parallelisms.pipeline import make_stage_model

class HFNamed(gpt2_model.GPT2):
    def __init__(self, args):
        super().__init__(args)
        self.wte, self.ln_f, self.lm_head = self.tok_embeddings, self.norm, self.output
        del self.tok_embeddings, self.norm, self.output

    def forward(self, tokens):
        h = self.wte(tokens) if self.wte is not None else tokens
        for block in self.layers.values():
            h = block(h)
        h = self.ln_f(h) if self.ln_f is not None else h
        return self.lm_head(h) if self.lm_head is not None else h

spec = get_model_spec("gpt2")
register_model_spec(ModelSpec(name="gpt2_hf_names", flavors=spec.flavors, model_cls=HFNamed,
                              parallelize_fn=spec.parallelize_fn, flops_per_token_fn=spec.flops_per_token_fn,
                              pipeline_fn=make_stage_model))
'''


@pytest.fixture(scope="module")
def user_models(tmp_path_factory) -> Path:
    """A user's model folder: the GPT-2 example, two slips on it, and a config beside them."""
    folder = tmp_path_factory.mktemp("user_models")
    shutil.copy(REPO / "examples" / "gpt2_model.py", folder / "gpt2_model.py")
    shutil.copy(REPO / "train_configs" / "llama_debug.toml", folder / "cfg.toml")
    (folder / "gpt2_old.py").write_text(OLD_SIGNATURE)
    (folder / "gpt2_hf_names.py").write_text(OTHER_ENDS)
    return folder


def test_an_old_parallelize_signature_is_one_line_naming_the_fix(user_models, tmp_path):
    proc = run_train(["--config", str(user_models / "cfg.toml"), *GPT2, "--job.custom_import", "gpt2_old",
                      "--model.name", "gpt2_old", "--job.dump_folder", str(tmp_path)])
    fails_with(proc, "'gpt2_old'", "`parallelize_old(model, world_mesh, parallel_dims, job_config)`",
               "`def parallelize_old(model, dims, options)`")


def test_ends_pipeline_parallel_cannot_find_are_one_line_under_pp(user_models, tmp_path):
    proc = run_train(["--config", str(user_models / "cfg.toml"), *GPT2, "--job.custom_import",
                      "gpt2_hf_names", "--model.name", "gpt2_hf_names",
                      "--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder", str(tmp_path)],
                     nproc=2)
    fails_with(proc, "'gpt2_hf_names'", "no `tok_embeddings`, `norm`, `output`", "wte.tokens.weight",
               "without pipeline_fn", torchrun=True)


def test_a_plan_that_does_not_fit_says_which_single_changes_would(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/plan.py", "--config", "llama_debug", "--model.flavor",
                           "tiny", "--world-size", "1", "--device-memory", "0.05GiB", "--reserve-gib", "0",
                           "--no-ac-modes"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "DOES NOT FIT" in out and "what would fit" in out, out[-3000:]
    fit = out.split("what would fit")[1].split("still short")[0]
    # Halving the rows per microbatch halves the activations, the largest part of the peak here.
    assert "--training.local_batch_size 2 --training.global_batch_size 16  ≈ " in fit, out[-3000:]
    assert " tokens/s/device, peak " in fit
    assert "to spare" in fit
    assert "change(s) tried in" in out


@pytest.fixture(scope="module")
def five_checkpoints(tmp_path_factory, data_cache) -> Path:
    """5 steps of the tiny model, a checkpoint after each one, keep_latest_k left at its default."""
    dump = tmp_path_factory.mktemp("keep")
    check_ok(run_train([*TINY, "--training.steps", "5", "--checkpoint.enable", "--checkpoint.interval", "1",
                        "--job.dump_folder", str(dump), "--training.data_cache_dir", str(data_cache)]))
    return dump / "checkpoint"


def test_only_the_newest_checkpoints_are_kept_by_default(five_checkpoints):
    assert sorted(p.name for p in five_checkpoints.iterdir()) == ["step-3", "step-4", "step-5"]


def test_the_generate_script_says_it_uses_the_kv_cache(five_checkpoints):
    proc = run_train(["--config", "llama_debug", "--model.flavor", "tiny", "--checkpoint",
                      str(five_checkpoints / "step-5"), "--prompt", "ROMEO:", "--max-new-tokens", "5"],
                     script="scripts/generate.py")
    check_ok(proc)
    notes = [line for line in proc.stderr.splitlines() if line.startswith("generation:")]
    assert len(notes) == 1 and "KV cache" in notes[0], proc.stderr[-2000:]
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout.strip()) > len("ROMEO:")
