"""Context parallel: the sharded attention equals full attention, and CP checkpoints move across layouts.

Training parity of every CP layout with the single process is in test_parity.py; bad input in
test_errors_runs.py; the one-process parts (positions, pair kernels) in tests/unit/test_context_parallel.py.
"""

import shutil

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, run_train, train_rows

CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_full_attention(cp):
    """Output and q/k/v gradients of both rotate methods (allgather through funcol's all-gather and
    through the gloo accelerations' overlapped broadcasts; MHA and GQA) within 1e-5 of full SDPA."""
    proc = run_train([], nproc=cp, script="tests/helpers/cp_attention_check.py")
    check_ok(proc)
    lines = [line for line in proc.stdout.splitlines() if "max abs diff" in line]
    assert len(lines) == 9, proc.stdout  # 3 routes × 3 head layouts, each checked
    assert all(line.startswith(f"cp {cp} ") for line in lines)


def _ckpt_args(dump, data_cache, steps: int) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "5",
            *dump_args(dump, data_cache)]


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["cp2_to_single", "single_to_cp2"])
def test_resume_across_cp(first, then, tmp_path, data_cache):
    """A checkpoint written with CP 2 resumes in one process, and one from one process under CP 2:
    the continuation matches the uninterrupted run."""
    straight = tmp_path / "straight"
    check_ok(run_train(_ckpt_args(straight, data_cache, 10) + (CP2 if first == 2 else []), nproc=first))
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    proc = run_train(_ckpt_args(resumed, data_cache, 10) + (CP2 if then == 2 else []), nproc=then)
    check_ok(proc)
    assert "step-5" in proc.stdout
    ref = {r["step"]: r for r in train_rows(straight)}
    got = {r["step"]: r for r in train_rows(resumed)}
    assert sorted(got) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * ref[step]["loss"], step
        assert abs(got[step]["grad_norm"] - ref[step]["grad_norm"]) <= 1e-4 * ref[step]["grad_norm"], step


def test_exception_during_overlapped_gather_exits_cleanly():
    """An exception while the gloo accelerations' CP broadcasts or gradient all-to-all are in flight:
    both ranks go on (memory intact, the next attention right) and exit 0 — no double free."""
    proc = run_train([], nproc=2, script="tests/helpers/cp_exception_check.py")
    check_ok(proc)
    assert "ok" in proc.stdout.splitlines()
    assert "double free" not in proc.stderr and "corruption" not in proc.stderr
