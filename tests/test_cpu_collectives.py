"""Kiln's gloo collectives for FSDP (parallelisms/cpu_collectives.py) equal torch's, on 3 ranks
(odd world, odd lengths); the parity suite holds FSDP, HSDP and DDP runs that use them to the
single process."""

from conftest import check_ok, run_train


def test_cpu_collectives_match_torch():
    proc = run_train([], nproc=3, script="tests/helpers/cpu_collectives_check.py")
    check_ok(proc)
    assert "ok" in proc.stdout.splitlines(), proc.stdout
