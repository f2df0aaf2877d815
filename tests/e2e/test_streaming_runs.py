"""Streaming data in real runs: a resumed run reads exactly the tokens an uninterrupted one would
(world 1 and 2), and another data-parallel degree is refused. The loader alone is
tests/unit/test_streaming.py."""

import shutil

import pytest

from tests.helpers.documents import DOCS, write_jsonl
from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, read_metrics, run_train


@pytest.mark.parametrize("nproc", [1, 2])
def test_training_resume_is_exact(nproc, tmp_path, data_cache):
    source = write_jsonl(tmp_path / "corpus.jsonl", [d * 3 for d in DOCS])
    args = [*TINY, "--training.global_batch_size", "8", "--training.local_batch_size", str(8 // nproc),
            "--training.dataset_mode", "streaming", "--training.dataset_path", source,
            "--checkpoint.enable", "--checkpoint.interval", "5", "--training.data_cache_dir", str(data_cache)]
    straight = tmp_path / "straight"
    check_ok(run_train([*args, *dump_args(straight)], nproc=nproc))
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    check_ok(run_train([*args, *dump_args(resumed)], nproc=nproc))
    ref = {r["step"]: r["loss"] for r in read_metrics(straight)}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(got) == list(range(6, 11))
    assert all(got[s] == ref[s] for s in got), (got, ref)  # the same tokens, bit for bit
    if nproc == 2:  # another data-parallel degree cannot take over the ranks' positions
        other = tmp_path / "other"
        (other / "checkpoint").mkdir(parents=True)
        shutil.copytree(straight / "checkpoint" / "step-5", other / "checkpoint" / "step-5")
        fails_with(run_train([*args, "--training.local_batch_size", "8", *dump_args(other)]),
                   "2 data-parallel ranks", "this run has 1")
