"""No orphans: a torchrun agent SIGKILLed while its workers start (importing torch, reading the
config, connecting to its store) leaves no worker running — each sees its agent gone and exits within
seconds (components/runtime/agent_watch.py). Killing the agent mid-training is
tests/e2e/test_multinode.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.runs import REPO, TINY


def workers_alive(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"], "launch.py": ["scripts/launch.py"]}


@pytest.mark.parametrize(("launcher", "after_seconds"),
                         [("torchrun", 0.3), ("torchrun", 2.5), ("launch.py", 0.3)])
def test_workers_of_a_killed_agent_exit_at_any_moment_of_start_up(tmp_path, launcher, after_seconds):
    """torchrun itself, and scripts/launch.py (run_train.sh's torchrun, which names itself to its
    workers), killed 0.3 s (workers importing torch) or 2.5 s (reading the config, joining) in."""
    marker = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [sys.executable, *LAUNCHERS[launcher], "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "localhost:0", "--nnodes", "1", "train.py", *TINY, "--job.dump_folder", marker],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(workers_alive(marker)) < 3 and time.monotonic() < deadline:  # the agent and 2 workers
            time.sleep(0.05)
        assert len(workers_alive(marker)) >= 3, "torchrun did not start its workers"
        time.sleep(after_seconds)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        killed = time.monotonic()
        while workers_alive(marker) and time.monotonic() - killed < 20:
            time.sleep(0.1)
        left = workers_alive(marker)
        assert not left, f"workers still running {time.monotonic() - killed:.0f} s after their agent died"
        print(f"after {after_seconds} s of start-up: gone {time.monotonic() - killed:.1f} s after the kill")
    finally:
        for pid in workers_alive(marker):
            os.kill(pid, signal.SIGKILL)
