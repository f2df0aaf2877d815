"""Bad input ends with one clear message naming the culprit, a non-zero exit and no traceback."""

import os
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO, TINY, dump_args, fails_with, run_train


@pytest.mark.parametrize("args,fragments", [
    (["--training.step", "3"], ["training.step", "did you mean 'training.steps'"]),
    (["--trainin.steps", "3"], ["trainin", "training"]),
    (["--training.steps", "three"], ["training.steps", "three"]),
    (["--config", "no_such_config"], ["no_such_config"]),
    (["--model.name", "gpt5"], ["gpt5", "llama3"]),
    (["--model.flavor", "7T"], ["7T", "debug", "8B"]),
    (["--parallelism.data_parallel_shard_degree", "2"], ["multiply to 2", "world size is 1"]),
    (["--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "1"],
     ["multiply to 3"]),
    (["--training.global_batch_size", "12"], ["global_batch_size 12", "local_batch_size 8"]),
    (["--training.dataset", "c5"], ["c5", "shakespeare"]),
    (["--training.dataset_path", "/no/such/corpus.jsonl"], ["/no/such/corpus.jsonl"]),
    (["--model.tokenizer_path", "/no/tokenizer.json"], ["/no/tokenizer.json"]),
    (["--training.seq_len", "4096"], ["seq_len 4096", "max_seq_len"]),
    (["--parallelism.context_parallel_rotate_method", "spiral"],
     ["context_parallel_rotate_method", "spiral", "allgather", "ring"]),
], ids=lambda v: v[0] if isinstance(v, list) and v and str(v[0]).startswith("--") else None)
def test_bad_input_single_process(args, fragments, tmp_path):
    fails_with(run_train([*TINY, *dump_args(tmp_path), *args]), *fragments)


def test_malformed_toml_names_the_line(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[training]\nsteps = 3\nseq_len = = 64\n')
    fails_with(run_train(["--config", str(cfg), *dump_args(tmp_path)]),
                "bad.toml", "line 3")


def test_corpus_too_short(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text('{"text": "To be, or not to be."}\n')
    fails_with(run_train([*TINY, *dump_args(tmp_path),
                           "--training.dataset_path", str(corpus)]), "too short")


def test_vocab_mismatch(tmp_path):
    # The 1B flavor's vocabulary is larger; a larger tokenizer than the model is the error case,
    # so point a small flavor at a model whose vocab is smaller than the tokenizer's.
    fails_with(run_train([*TINY, *dump_args(tmp_path), "--job.custom_import",
                           "tests.helpers.variant_models", "--model.name", "small_vocab"]),
                "4096 tokens", "vocabulary of 1000")


@pytest.mark.parametrize("nproc,args,fragment", [
    (3, ["--parallelism.tensor_parallel_degree", "3"], "4 attention heads"),  # tiny has 4 heads
    (2, ["--parallelism.data_parallel_shard_degree", "4"], "world size is 2"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"], "CUDA"),
    (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "62"],
     "2 × context_parallel_degree"),
], ids=["heads_not_divisible_by_tp", "degrees_not_matching_world", "async_tp_needs_cuda",
        "seq_not_divisible_by_2cp"])
def test_bad_layout_under_torchrun(nproc, args, fragment, tmp_path):
    fails_with(run_train([*TINY, *dump_args(tmp_path), *args], nproc=nproc), fragment,
               torchrun=True)


def test_error_on_one_rank_is_printed_once_with_its_rank(tmp_path):
    """A KilnError that rank 1 alone finds: one line, prefixed with the rank; rank 0, whose next
    collective fails because rank 1 left, adds none; the run exits non-zero."""
    proc = run_train([*TINY, *dump_args(tmp_path), "--job.custom_import",
                      "tests.helpers.rank_error"], nproc=2)
    fails_with(proc, "rank 1: cannot read /data/shard-1.bin", torchrun=True)
    assert "lost contact" not in proc.stderr


def test_dump_folder_that_is_a_file_is_one_line(tmp_path):
    """The whole trainer, as a user meets it: one line, no NotADirectoryError from the data cache."""
    (tmp_path / "a_file").write_text("x")
    fails_with(run_train([*TINY, *dump_args(tmp_path / "a_file")]), "job.dump_folder", "a file")


def test_kiln_error_under_run_train_sh_is_not_followed_by_torchrun_report(tmp_path):
    """scripts/run_train.sh's launcher ends Kiln's one line with one line of its own, exit 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU="2", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_train.sh"), "--config", "llama_debug",
                           "--training.step", "3", *dump_args(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    fails_with(proc, "unknown key 'training.step'", torchrun=True)
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "stopped on the error above" in proc.stderr
