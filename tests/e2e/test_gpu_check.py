"""scripts/gpu_check.py in its CPU mode: the same checks on tiny shapes, so the GPU check is never a
stub — bf16 compiled vs eager, exact resume, throughput eager and compiled, shard-only init, CP's
chunked attention against SDPA, and FSDP 2 / TP 2 / CP 2 parity over two processes (gloo here)."""

import subprocess
import sys

from tests.helpers.runs import REPO


def test_gpu_check_runs_on_cpu():
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| check")}
    resume = next(v for k, v in rows.items() if k.startswith("resume"))
    assert resume == "exact", resume
    compiled = next(v for k, v in rows.items() if k.startswith("bf16: compiled vs eager"))
    # bf16 rounds to 8 bits (2^-9 relative per operation); compiled and eager fuse differently,
    # so their losses drift apart within bf16 rounding, far from a wrong result (≥ 1e-1).
    assert float(compiled.split()[0]) < 2e-2, compiled
    for name in ("throughput eager", "throughput compiled"):
        assert "tok/s/device" in rows[name] and "MFU" in rows[name], rows
    init = next(v for k, v in rows.items() if k.startswith("init tiny"))
    assert init.startswith("peak "), init
    cp = next(v for k, v in rows.items() if k.startswith("CP attention"))
    assert float(cp.split()[3]) < 1e-5, cp  # fp32: chunked and whole attention agree to rounding
    parity = {k: v for k, v in rows.items() if k.startswith("parity ")}
    assert len(parity) == 3 and all(v.startswith("ok: ") for v in parity.values()), parity
