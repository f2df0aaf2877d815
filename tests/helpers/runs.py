"""What the tests share: launch train.py (or a script) as a user would, read its metrics.jsonl, check
how it ended, and a few small models and numbers.

    from tests.helpers.runs import TINY, check_ok, dump_args, run_train, train_rows

tests/conftest.py gives the suite a home folder of its own before this module is first imported, so
the warm launcher below, and every run it forks, inherits that environment.
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tests.helpers.warm_launcher import WarmClient

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# A small, fast shape for multi-process tests: the tiny flavor, short sequences, few steps.
TINY = [
    "--config", "llama_debug", "--model.flavor", "tiny", "--training.seq_len", "64",
    "--training.local_batch_size", "8", "--training.global_batch_size", "-1", "--training.steps", "10",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
]


# Runs of train.py fork from one process that has imported torch and Kiln already
# (tests/helpers/warm_launcher.py): the same processes, environment and exit codes as
# `torchrun --standalone train.py`, without ~5.5 s of imports per process. launcher="torchrun"
# launches the real thing, for the tests of the launch itself.
ONE_THREAD_UNBUFFERED = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
_WARM_FOLDER = Path(tempfile.mkdtemp(prefix="kiln-tests-warm-"))
atexit.register(shutil.rmtree, _WARM_FOLDER, ignore_errors=True)
WARM = WarmClient(_WARM_FOLDER, {**os.environ, **ONE_THREAD_UNBUFFERED})
atexit.register(WARM.close)  # registered last, so it runs before the folder is removed
READ_AT_START = ("PYTHON", "TORCH", "PYTORCH")  # variables read at start-up: such runs start fresh


def run_train(args: list[str], nproc: int = 1, *, script: str = "train.py", timeout: int = 300,
              extra_env: dict | None = None, launcher: str = "warm") -> subprocess.CompletedProcess:
    """Run train.py (or a helper script) as one process, or as nproc workers of one standalone job:
    forked by the warm launcher, or (launcher="torchrun", or extra_env setting a variable that
    Python or torch reads at start-up) a fresh `python` / `torchrun --standalone`. One thread per process
    unless extra_env says otherwise."""
    env = {**os.environ, **ONE_THREAD_UNBUFFERED, **(extra_env or {})}
    if launcher == "warm" and not any(k.startswith(READ_AT_START) for k in extra_env or {}):
        return WARM.run(script, args, nproc, env, REPO, timeout)
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_trains_side_by_side(runs: list[list[str]], timeout: int = 300,
                            extra_env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Several independent one-process runs at once (one core each), so a long fixture takes the
    time of its slowest run rather than the sum."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda args: run_train(args, timeout=timeout, extra_env=extra_env), runs))


def dump_args(dump: Path, data_cache: Path | None = None) -> list[str]:
    """train.py's arguments for a run that writes into `dump` (and reads the tokenized corpus from
    `data_cache`, the session's shared copy, when given)."""
    cache = ["--training.data_cache_dir", str(data_cache)] if data_cache is not None else []
    return ["--job.dump_folder", str(dump), *cache]


def read_metrics(dump: Path) -> list[dict]:
    """The rows of <dump>/metrics.jsonl."""
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def train_rows(dump: Path) -> list[dict]:
    """Training rows only (validation rows carry val_loss instead of loss)."""
    return [r for r in read_metrics(dump) if "loss" in r]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    """Fail with the run's output when it did not exit 0."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}")


def fails_with(proc: subprocess.CompletedProcess, *fragments: str, torchrun: bool = False) -> None:
    """The run failed with exactly one `kiln: error:` line containing every fragment, and no Python
    traceback from Kiln (under torchrun, torchrun's own failure summary follows our line)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr
    assert ('train.py", line' not in err) if torchrun else ("Traceback" not in err), err[-4000:]
    ours = [line for line in err.splitlines() if line.startswith("kiln: error:")]
    assert len(ours) == 1, err[-4000:]
    for fragment in fragments:
        assert fragment in ours[0], (fragment, ours[0])


def relative(a: float, b: float) -> float:
    """|a - b| relative to b: how the parity tests compare a layout's numbers with one process's."""
    return abs(a - b) / max(abs(b), 1e-12)


def unigram_entropy(token_file: Path) -> float:
    """Entropy (nats/token) of the corpus's token frequencies: the best loss without any context."""
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    p = np.bincount(tokens).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def tiny_llama(seed: int = 0):
    """The tiny Llama, initialised from seed, on CPU, for one-process model tests."""
    import torch

    from models import get_model_spec

    spec = get_model_spec("llama3")
    torch.manual_seed(seed)
    model = spec.model_cls(spec.flavors["tiny"])
    model.init_weights()
    return model
