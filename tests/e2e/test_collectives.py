"""The gloo accelerations (parallelisms/gloo_accelerations.py) against torch's own collectives on 3
ranks (odd world, odd lengths), FSDP's exception recovery and reduction options with them off and
on, and the one-bucket reduction of partial gradients (parallelisms/partial_gradients.py). The
parity suite holds whole training runs to the single process with the option off and on."""

import pytest

from tests.helpers.runs import run_train

CHECKS = ["collectives", "installed", "exception_in_backward", "reductions", "partial_gradients"]


@pytest.fixture(scope="module")
def checks() -> dict[str, str]:
    """Each check's verdict over all ranks, from one launch of the helper."""
    proc = run_train([], nproc=3, script="tests/helpers/collectives_check.py")
    verdicts = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert set(verdicts) >= set(CHECKS), proc.stdout + proc.stderr[-3000:]
    return verdicts


@pytest.mark.parametrize("check", CHECKS)
def test_matches_torch(checks, check):
    assert checks[check] == "ok", checks[check]
