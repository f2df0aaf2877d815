"""A torchrun worker stops when the agent that started it is gone — at any moment, start-up included.

torchrun starts every worker in a session of its own, so a SIGKILLed agent (an OOM kill, a lost
node's supervisor) leaves its workers running unsupervised: they go on training, or retrying the
dead agent's store, while nothing can restart or stop them — on a GPU node holding the devices a
replacement needs. Two checks turn that into an exit within a second: at the start of main(), the
parent must still be the agent (an agent killed while the worker imported torch has already left it
to another parent): the pid scripts/launch.py puts in KILN_AGENT_PID, else a process running torch's
launcher; from then on a daemon thread polls the parent's pid (not prctl's PDEATHSIG, which fires
when the forking *thread* exits). No torch here: it runs before torch loads.
"""

import os
import sys
import threading
import time
from pathlib import Path


def _is_agent(pid: int) -> bool:
    """Whether process `pid` is this worker's agent: the pid Kiln's launcher announced, else any
    process running torch's launcher (torchrun, torch.distributed.run); True where /proc cannot tell."""
    announced = os.environ.get("KILN_AGENT_PID", "")
    if announced.isdigit():
        return pid == int(announced)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid != 1
    return b"torch" in cmdline


def _stop(rank: str, agent: int, when: str = "") -> None:
    print(f"kiln: error: rank {rank}: the torchrun agent of this node (pid {agent}) died{when}; "
          "stopping this worker", file=sys.stderr, flush=True)
    os._exit(1)


def watch_agent(poll_seconds: float = 0.5) -> None:
    """Under torchrun (an elastic run id in the environment): exit now if the agent is already gone,
    else watch it from a daemon thread and exit the moment it dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    rank = os.environ.get("RANK", "?")
    agent = os.getppid()
    if not _is_agent(agent):
        _stop(rank, agent, " while this worker started")

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_seconds)
        _stop(rank, agent)

    threading.Thread(target=watch, name="kiln-agent-watch", daemon=True).start()
