"""The suite's warm launcher (tests/helpers/warm_launcher.py) stands in for torchrun: the same run
gives the same numbers both ways, failures keep their exit code and line, a timeout ends the job."""

import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.runs import TINY, WARM, check_ok, dump_args, fails_with, run_train, train_rows

FSDP2 = [*TINY, "--training.steps", "4", "--parallelism.data_parallel_shard_degree", "2"]


def test_warm_run_matches_torchrun(tmp_path):
    """FSDP 2 forked from the warm process and under a fresh torchrun: identical losses and grad norms."""
    rows = {}
    for launcher in ("warm", "torchrun"):
        proc = run_train([*FSDP2, *dump_args(tmp_path / launcher)], nproc=2, launcher=launcher)
        check_ok(proc)
        rows[launcher] = [(r["step"], r["loss"], r["grad_norm"]) for r in train_rows(tmp_path / launcher)]
    assert len(rows["warm"]) == 4
    assert rows["warm"] == rows["torchrun"]


def test_warm_run_fails_with_kiln_line_and_exit_code(tmp_path):
    bad_layout = [*FSDP2, "--parallelism.tensor_parallel_degree", "3"]
    proc = run_train([*bad_layout, *dump_args(tmp_path)], nproc=2)
    assert proc.returncode == 2
    fails_with(proc, "tensor_parallel_degree")


def test_warm_timeout_ends_every_process_of_the_job(tmp_path):
    before = WARM.count
    with pytest.raises(subprocess.TimeoutExpired):
        run_train([*TINY, "--training.steps", "100000", "--parallelism.data_parallel_shard_degree", "2",
                   *dump_args(tmp_path)], nproc=2, timeout=15)
    assert WARM.count == before + 1
    deadline = time.monotonic() + 10
    while live_members(WARM.last_pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_members(WARM.last_pgid) == []


def live_members(pgid: int) -> list[int]:
    """PIDs of the processes of group pgid that are still running (zombies count as ended)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found
