"""A warm launcher for the test suite: torchrun's job (N worker processes, their rank variables, a
rendezvous port) done by forking a process that has already imported torch and Kiln.

Each fresh `torchrun train.py` spends ~5.5 s of CPU per process importing torch and its
distributed, checkpoint and compiler modules before the first step (measured on 2 cores: a
2-process tiny run takes 14.5 s, 1.8 s of it training), three processes with the agent. The
parity, pipeline, MoE and checkpoint tests launch hundreds of such runs; forking them from one
warm process keeps every check and most of the time. Each run is still separate processes
running train.py's own `main` from the top with its own environment, gloo process group and
exit code; only the import is shared. Tests of the launch itself (torchrun's agent, signals,
restarts, multi-node, run_train.sh) keep launching real torchrun.

    python tests/helpers/warm_launcher.py SOCKET   # the server; tests reach it through WarmClient
"""

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STOP_GRACE_SECONDS = 10.0  # after one worker fails, how long the others have to stop on SIGTERM


def _worker(request: dict, rank: int, port: int, out_fd: int, err_fd: int) -> None:
    """In a forked child: become rank `rank` of the job and run the script as __main__; never returns."""
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        nproc = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        if nproc > 1:  # what torchrun --standalone gives each worker (no agent, no elastic run id)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(request["cwd"])
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        script = str(Path(request["cwd"]) / request["script"])
        sys.argv = [script, *request["argv"]]
        sys.path[0] = str(Path(script).parent)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _manage(conn: socket.socket) -> None:
    """In a forked child: run one request's workers, stop the rest when one fails (as torchrun
    does), answer the exit code (the first failure's, else 0); never returns."""
    os.setpgid(0, 0)  # the client stops the whole job with one killpg on its timeout
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stream = conn.makefile("rw")
    request = json.loads(stream.readline())
    stream.write(json.dumps({"pgid": os.getpid()}) + "\n")
    stream.flush()
    out_fd = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err_fd = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    from scripts.tutorial.common import free_port  # the server has imported torch, which it needs

    port = free_port()
    ranks = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _worker(request, rank, port, out_fd, err_fd)
        ranks[pid] = rank
    code, kill_at = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG if kill_at else 0)
        if pid == 0:  # after a failure: the others get STOP_GRACE_SECONDS, as under torchrun
            if time.monotonic() > kill_at:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        ranks.pop(pid, None)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code = exit_code if exit_code > 0 else 128 - exit_code
            kill_at = time.monotonic() + STOP_GRACE_SECONDS
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    stream.write(json.dumps({"returncode": code}) + "\n")
    stream.flush()
    os._exit(0)


def serve(path: str) -> None:
    """Import what every run imports, then fork a manager per connection (one connection per run)."""
    sys.path[0] = str(REPO)  # as for `python train.py`: the repository, not this helper's folder
    os.chdir(REPO)
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer)

    import train  # noqa: F401  (torch, torch.distributed, checkpointing, Kiln's modules)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # managers are reaped without waiting
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            _manage(conn)
        conn.close()


class WarmClient:
    """Starts the warm server on first use and runs scripts through it like subprocess.run."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.server = folder, env, None
        self.path = str(folder / "warm.sock")
        self.count = 0
        self.last_pgid = 0  # the process group of the latest run (manager and workers)
        self.lock = threading.Lock()  # runs side by side (threads) start one server, number runs apart

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        Path(self.path).unlink(missing_ok=True)  # a server that died left its socket behind
        self.server = subprocess.Popen([sys.executable, __file__, self.path], cwd=REPO, env=self.env,
                                       stdout=subprocess.PIPE, text=True)
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm launcher did not start (exit {self.server.wait()})")

    def run(self, script: str, argv: list[str], nproc: int, env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        with self.lock:
            if self.server is None or self.server.poll() is not None:
                self._start()
            self.count += 1
            out, err = self.folder / f"run{self.count}.out", self.folder / f"run{self.count}.err"
        request = {"script": script, "argv": argv, "nproc": nproc, "env": env, "cwd": str(cwd),
                   "stdout": str(out), "stderr": str(err)}
        cmd = ["warm", script, *argv]
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.path)
            conn.settimeout(timeout)
            stream = conn.makefile("rw")
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            pgid = self.last_pgid = json.loads(stream.readline())["pgid"]
            try:
                code = json.loads(stream.readline())["returncode"]
            except TimeoutError:
                os.killpg(pgid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
        done = subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
