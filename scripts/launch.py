"""torchrun with quiet edges: what scripts/run_train.sh starts in place of torchrun itself.

    python scripts/launch.py --standalone --nproc-per-node 2 train.py --config llama_debug

The arguments and semantics are torchrun's (`python -m torch.distributed.run`), except for two
endings that torchrun reports at length although nothing went wrong in it:
- SIGTERM (a scheduler's preemption, a person's `kill`) is passed on to the workers, which finish
  their step, save (with checkpoint.enable) and exit 0; the agent keeps watching them and ends as
  for any run, exit 0 when they did, rather than with torchrun's SignalException traceback. A
  second SIGTERM, or one before there are workers, is torchrun's own (stop them, then raise).
  SIGUSR1 (SLURM's `--signal=USR1@secs`) is passed on the same way; torchrun itself does not
  handle it, so without this it would kill the agent.
- workers that stopped on an error Kiln already printed in one `kiln: error:` line (exit code 2)
  are followed by one short line instead of torchrun's ChildFailedError report; any other
  failure (a crash, a signal) keeps torchrun's full report.
"""

import os
import signal
import sys
from pathlib import Path
from types import FrameType

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

KILN_ERROR_EXIT = 2  # train.py's exit code after it printed a `kiln: error:` line


def workers() -> list[int]:
    """PIDs of this agent's child processes (torchrun starts each worker in a session of its own,
    so a signal to the agent's process group does not reach them)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(entry.name))
    return found


class PassStopToWorkers:
    """The agent's handler for torchrun's death signals: the first SIGTERM goes on to the workers;
    anything else goes to torchrun's own handler."""

    def __init__(self, torch_handler) -> None:
        self.torch_handler = torch_handler
        self.passed = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        pids = workers() if signum == signal.SIGTERM and not self.passed else []
        if not pids:
            self.torch_handler(signum, frame)
            return
        self.passed = True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        print(f"launcher: SIGTERM passed on to {len(pids)} worker(s): they finish their step, save (with "
              "checkpoint.enable) and exit", file=sys.stderr, flush=True)


def pass_usr1_to_workers(signum: int, frame: FrameType | None) -> None:
    """The agent's SIGUSR1 handler: the workers get it (they stop as for SIGTERM), the agent goes on."""
    pids = workers()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    print(f"launcher: SIGUSR1 passed on to {len(pids)} worker(s)", file=sys.stderr, flush=True)


def reported_by_kiln(error: ChildFailedError) -> bool:
    """Whether the workers failed on Kiln's own one-line error (the others killed, or exit 2 too)."""
    codes = [failure.exitcode for failure in error.failures.values()]
    return KILN_ERROR_EXIT in codes and all(c == KILN_ERROR_EXIT or c < 0 for c in codes)


@record
def launch(argv: list[str]) -> None:
    """torchrun's run; a failure Kiln already explained ends in one line and exit 2."""
    # torchrun registers its handler when it starts the workers, looking this name up then.
    torch_handler = elastic_processes._terminate_process_handler
    elastic_processes._terminate_process_handler = PassStopToWorkers(torch_handler)
    signal.signal(signal.SIGUSR1, pass_usr1_to_workers)
    # The workers' agent is this process: they check for it by pid (components/runtime/agent_watch.py).
    os.environ["KILN_AGENT_PID"] = str(os.getpid())
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as e:
        if not reported_by_kiln(e):
            raise
        ranks = ", ".join(str(rank) for rank in sorted(e.failures))
        print(f"launcher: worker(s) of rank {ranks} stopped on the error above (exit {KILN_ERROR_EXIT})",
              file=sys.stderr, flush=True)
        sys.exit(KILN_ERROR_EXIT)


if __name__ == "__main__":
    launch(sys.argv[1:])
