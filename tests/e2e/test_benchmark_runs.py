"""The speed benchmark's independent reference (benchmarks/reference_loop.py) trains and reports, run
as the benchmark runs it. Its shape and the table's arithmetic are tests/unit/test_benchmark.py."""

import json
import os
import subprocess
import sys

import numpy as np

from tests.helpers.runs import REPO


def test_reference_loop_trains_and_reports(tmp_path) -> None:
    tokens = tmp_path / "train-0.bin"
    np.random.default_rng(0).integers(0, 512, 20_000, dtype=np.uint16).tofile(tokens)
    shape = ["--vocab", "512", "--dim", "64", "--layers", "2", "--heads", "4", "--hidden", "128",
             "--seq-len", "32", "--steps", "4", "--warmup", "1"]
    proc = subprocess.run([sys.executable, "benchmarks/reference_loop.py", "--tokens", str(tokens), *shape],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["tps"] > 0 and row["peak_rss_mib"] > 0
