"""Kiln's own collectives, against torch's, on 3 ranks (odd world, odd lengths): FSDP's gloo
all-gather and reduce-scatter (parallelisms/cpu_collectives.py), also in flight through backward,
tensor parallel's sequence gathers and reduce-scatters on them (parallelisms/tp_cpu_collectives.py),
and the one-bucket reduction of partial gradients (parallelisms/partial_gradients.py). The parity
suite holds the FSDP, HSDP, DDP and TP runs that use them to the single process."""

import pytest
from conftest import run_train


@pytest.fixture(scope="module")
def checks() -> dict[str, str]:
    """Each check's verdict over all ranks, from one launch of the helper."""
    proc = run_train([], nproc=3, script="tests/helpers/collectives_check.py")
    verdicts = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    names = {"collectives", "overlapped_reduce_scatter", "partial_gradients", "sequence_redistribute"}
    assert set(verdicts) >= names, proc.stdout + proc.stderr[-3000:]
    return verdicts


@pytest.mark.parametrize("check", ["collectives", "overlapped_reduce_scatter", "partial_gradients",
                                   "sequence_redistribute"])
def test_matches_torch(checks, check):
    assert checks[check] == "ok", checks[check]
