"""Preemption and elastic restart: a signalled run saves and exits 0; a killed rank restarts all, resumes."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, TINY, check_ok, dump_args, read_metrics, run_train

STEPS = ["--training.steps", "40", "--training.local_batch_size", "4", "--training.global_batch_size", "8"]


def workers_of(pid: int) -> list[int]:
    """PIDs of the processes whose parent is `pid` (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def launch(args: list[str], *torchrun_flags: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *torchrun_flags, "train.py", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def last_rows(dump: Path) -> dict[int, float]:
    """step → loss, the last row of each step (a restarted run repeats some steps)."""
    return {r["step"]: r["loss"] for r in read_metrics(dump) if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_cache):
    dump = tmp_path_factory.mktemp("straight")
    check_ok(run_train([*TINY, *STEPS, *dump_args(dump, data_cache)], nproc=2))
    return last_rows(dump)


def worker_of_rank(agent: int, rank: int) -> int:
    """The PID of the agent's worker whose RANK is `rank`."""
    for pid in workers_of(agent):
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {agent}")


@pytest.mark.parametrize("sig,target", [("SIGTERM", "agent"), ("SIGUSR1", "rank 0"), ("SIGUSR1", "agent")],
                         ids=["sigterm_agent", "sigusr1_rank0", "sigusr1_agent"])
def test_signal_saves_and_exits_zero_then_resumes(straight, sig, target, tmp_path, data_cache):
    """SIGTERM to the agent that scripts/run_train.sh starts (what a scheduler does at preemption),
    which passes it on to the workers; or SIGUSR1 to a worker (SLURM's --signal=USR1 reaches the
    job's processes), here to rank 0 only, so rank 1 stops on the ranks' vote; or SIGUSR1 to the
    agent, which passes it on (torchrun itself would die of it). Either way the
    workers finish their step, save and exit 0, and so does the agent, without torchrun's
    traceback; the run says which signal stopped it, and then resumes exactly."""
    args = [*TINY, *STEPS, "--checkpoint.enable", "--checkpoint.interval", "1000",
            *dump_args(tmp_path, data_cache)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NGPU="2", PYTHON=sys.executable)
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "run_train.sh"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc)
    # bash exec'd the launcher: proc.pid is the agent
    os.kill(proc.pid if target == "agent" else worker_of_rank(proc.pid, 0), getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert f"on {sig}" in out and "run the same command to resume" in out, out[-3000:]
    stopping = re.findall(rf"stopping at step (\d+) on {sig}", out)
    stopped = re.findall(rf"stopped at step (\d+) of 40 on {sig}", out)
    saved = [p.name for p in (tmp_path / "checkpoint").iterdir()]
    assert len(saved) == 1 and stopping == stopped == [saved[0].split("-")[1]], (saved, out[-3000:])
    stop_step = int(stopping[0])
    assert 3 <= stop_step < 40 and max(last_rows(tmp_path)) == stop_step
    check_ok(run_train(args, nproc=2))
    rows = last_rows(tmp_path)
    assert max(rows) == 40
    for step in range(stop_step + 1, 41):
        assert abs(rows[step] - straight[step]) <= 1e-5 * straight[step], step


def test_crashed_rank_restarts_all_and_resumes(straight, tmp_path, data_cache):
    """A rank that crashes in native code (a segfault) says where, every Python thread's stack
    (train.py enables faulthandler); torchrun restarts the job, which resumes from its checkpoint."""
    args = [*TINY, *STEPS, "--checkpoint.enable", "--checkpoint.interval", "5",
            *dump_args(tmp_path, data_cache)]
    proc = launch(args, "--max-restarts=1")
    wait_for(lambda: (tmp_path / "checkpoint" / "step-10").exists(), proc)
    victim = workers_of(proc.pid)[-1]
    os.kill(victim, signal.SIGSEGV)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-12000:]
    assert "Fatal Python error: Segmentation fault" in err and 'train.py", line' in err, err[-12000:]
    assert out.count("resumed from") == 1
    rows = last_rows(tmp_path)
    assert max(rows) == 40
    for step in range(31, 41):
        assert abs(rows[step] - straight[step]) <= 1e-5 * straight[step], step
