"""Two nodes on one machine: two torchrun agents launched by scripts/run_train.sh, rendezvous over c10d.

Each "node" is an agent with 2 workers; together they form world 4 (FSDP 4). The run must match
one process, leave a checkpoint that one node resumes in another layout, and fail fast — with a
clear line, never a hang — when one node dies or stops answering.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, TINY, check_ok, dump_args, read_metrics, relative, run_train, train_rows

STEPS = ["--training.steps", "10", "--training.global_batch_size", "8"]
SCRIPT = REPO / "scripts" / "run_train.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(args_by_node: list[list[str]], port: int, logs: Path,
                extra_env: dict | None = None) -> list[subprocess.Popen]:
    """Start one agent per node (scripts/run_train.sh, NGPU=2), each in a session of its own."""
    procs = []
    logs.mkdir(parents=True, exist_ok=True)
    for node, args in enumerate(args_by_node):
        env = dict(os.environ, NGPU="2", NNODES=str(len(args_by_node)), NODE_RANK=str(node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=f"test-{port}",
                   RDZV_TIMEOUT="120", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
        out = open(logs / f"node{node}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(["bash", str(SCRIPT), *args], cwd=REPO, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def workers_of(agent: subprocess.Popen) -> list[int]:
    """The worker pids a torchrun agent started (bash execs torchrun, so the agent is the Popen)."""
    out = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout
    return sorted(int(pid) for pid in out.split())


def stop_everything(procs: list[subprocess.Popen], marker: str) -> None:
    """Kill the agents and any worker left (workers run in sessions of their own)."""
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    subprocess.run(["pkill", "-CONT", "-f", marker])
    subprocess.run(["pkill", "-KILL", "-f", marker])
    for p in procs:
        p.wait(timeout=30)


def run_nodes(args_by_node: list[list[str]], logs: Path, timeout: int = 300) -> list[str]:
    """Run the agents to the end; their outputs, node by node."""
    procs = start_nodes(args_by_node, free_port(), logs)
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        stop_everything(procs, str(logs))
    outputs = [(logs / f"node{i}.log").read_text() for i in range(len(procs))]
    for code, out in zip(codes, outputs, strict=True):
        assert code == 0, out[-6000:]
    return outputs


def base_args(dump: Path, cache: Path, *extra: str) -> list[str]:
    return [*TINY, *STEPS, *dump_args(dump, cache), *extra]


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    dump = tmp_path_factory.mktemp("single")
    check_ok(run_train(base_args(dump, data_cache)))
    return dump


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, data_cache):
    """FSDP 4 over two agents of 2 processes, checkpoints every 5 steps."""
    dump = tmp_path_factory.mktemp("two_nodes")
    args = base_args(dump, data_cache, "--training.local_batch_size", "2", "--checkpoint.enable",
                     "--checkpoint.interval", "5")
    outputs = run_nodes([args, args], dump / "logs")
    return dump, outputs


def test_two_node_fsdp4_matches_single_process(two_nodes, single):
    dump, outputs = two_nodes
    ref, got = train_rows(single), train_rows(dump)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.2, "the reference run did not learn"
    for r, g in zip(ref, got, strict=True):
        tol = 1e-5 if r["step"] == 1 else 1e-4
        assert relative(g["loss"], r["loss"]) <= tol, (r["step"], g["loss"], r["loss"])
        assert relative(g["grad_norm"], r["grad_norm"]) <= tol, (r["step"], g["grad_norm"], r["grad_norm"])
    # One console for the job: only the agent holding global rank 0 prints the run's lines.
    printing = [out for out in outputs if "step 10/10" in out]
    assert len(printing) == 1, outputs
    assert "world 4 on 2 nodes × 2 processes" in printing[0]
    assert "FSDP2 over 4 ranks" in printing[0]


def test_two_node_checkpoint_resumes_on_one_node_in_fsdp2(two_nodes, tmp_path, data_cache):
    dump, _ = two_nodes
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-10", "step-5"]
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(dump / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    proc = run_train(base_args(tmp_path, data_cache, "--training.local_batch_size", "4",
                               "--checkpoint.enable", "--checkpoint.interval", "5"), nproc=2)
    check_ok(proc)
    assert "resumed from" in proc.stdout
    before = {r["step"]: r for r in train_rows(dump)}
    after = train_rows(tmp_path)
    assert [r["step"] for r in after] == list(range(6, 11))
    for r in after:
        assert relative(r["loss"], before[r["step"]]["loss"]) <= 1e-5, (r, before[r["step"]])
        assert relative(r["grad_norm"], before[r["step"]]["grad_norm"]) <= 1e-5, (r, before[r["step"]])


def _wait_for_steps(dump: Path, steps: int, procs: list[subprocess.Popen], limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= steps:
            return
        assert all(p.poll() is None for p in procs), "a node stopped before the fault was injected"
        time.sleep(0.2)
    raise AssertionError(f"the two-node run did not reach step {steps} in {limit} s")


@pytest.mark.parametrize("fault", ["kill_agent", "stop_node"])
def test_lost_node_fails_the_other_within_the_timeout(fault, tmp_path, data_cache):
    """kill_agent: node 1's agent is SIGKILLed (its workers notice and stop); the other node fails at
    once. stop_node: node 1 freezes (SIGSTOP, as a hung machine or a cut network looks); the other
    node's collectives give up after comm.timeout_seconds. Either way: a clear line, no hang."""
    timeout = 15
    args = base_args(tmp_path, data_cache, "--training.steps", "100000", "--training.local_batch_size", "2",
                     "--comm.timeout_seconds", str(timeout))
    logs = tmp_path / "logs"
    procs = start_nodes([args, args], free_port(), logs)
    try:
        _wait_for_steps(tmp_path, 2, procs)
        victim = procs[1]
        start = time.monotonic()
        if fault == "kill_agent":
            os.kill(victim.pid, signal.SIGKILL)
        else:
            workers = workers_of(victim)
            assert len(workers) == 2, workers
            for pid in [victim.pid, *workers]:
                os.kill(pid, signal.SIGSTOP)
        code = procs[0].wait(timeout=timeout + 90)
        elapsed = time.monotonic() - start
    finally:
        stop_everything(procs, str(tmp_path))
    survivor = (logs / "node0.log").read_text()
    assert code != 0, survivor[-3000:]
    lines = [line for line in survivor.splitlines() if line.startswith("kiln: error:")]
    assert lines and all("lost contact with the other ranks" in line for line in lines), survivor[-6000:]
    assert f"comm.timeout_seconds = {timeout} s" in lines[0]
    if fault == "kill_agent":
        assert elapsed < timeout, elapsed  # sockets close at once: no need to wait for the timeout
        assert "the torchrun agent of this node" in (logs / "node1.log").read_text()
    else:
        assert timeout - 1 <= elapsed < timeout + 60, elapsed  # the configured timeout, not gloo's 30 min


def test_checkpoint_folder_not_shared_is_a_clear_error(tmp_path, data_cache):
    """Each node writing checkpoints to its own disk could never resume: refused at start."""
    args = [base_args(tmp_path / f"node{i}_disk", data_cache, "--training.local_batch_size", "2",
                      "--checkpoint.enable", "--checkpoint.shared_folder_wait_seconds", "2")
            for i in range(2)]
    procs = start_nodes(args, free_port(), tmp_path / "logs")
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        stop_everything(procs, str(tmp_path))
    outputs = "\n".join((tmp_path / "logs" / f"node{i}.log").read_text() for i in range(2))
    assert all(code != 0 for code in codes), outputs[-4000:]
    lines = [line for line in outputs.splitlines() if line.startswith("kiln: error:")]
    assert len(lines) == 1, outputs[-6000:]  # raised on every rank, said once (by global rank 0)
    assert "is not shared" in lines[0] and "rank(s) " in lines[0], lines[0]
    assert not any((tmp_path / f"node{i}_disk" / "metrics.jsonl").exists() for i in range(2))


def test_run_train_sh_reads_slurm(tmp_path):
    """Under SLURM the launcher takes nodes, node rank, first host, job id and GPUs from SLURM."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] '
                        "&& printf 'gpu07\\ngpu08\\n'\n")
    scontrol.chmod(0o755)
    ours = ("SLURM_", "MASTER_", "NNODES", "NODE_RANK", "NGPU", "OMP_NUM_THREADS", "RDZV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_NODEID="1",
               SLURM_JOB_NODELIST="gpu[07-08]", SLURM_GPUS_ON_NODE="8", TORCHRUN="echo torchrun")
    out = subprocess.run(["bash", str(SCRIPT), "--training.steps", "5"], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[:13] == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29500", "--rdzv-id", "4242"]
    assert "is_host=0,join_timeout=600" in out
    assert out[-5:] == ["train.py", "--config", "train_configs/llama_debug.toml", "--training.steps", "5"]
    # Node 0 hosts the rendezvous store; a bad node rank is refused before torchrun starts.
    env["SLURM_NODEID"] = "0"
    out0 = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True).stdout
    assert "is_host=1" in out0
    env["NODE_RANK"] = "2"
    bad = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "NODE_RANK=2 is not in 0 … NNODES-1 = 1" in bad.stderr


def test_sbatch_script_trains_on_two_nodes(single, tmp_path, data_cache):
    """scripts/multinode_trainer.slurm under stand-ins for srun (one task per node, started
    side by side with its SLURM_NODEID, as --ntasks-per-node=1 gives) and scontrol: a real
    two-node run that matches one process."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (fake_bin / "srun").write_text(
        "#!/bin/bash\n"
        'while [[ "$1" == -* ]]; do shift; done\n'
        "pids=()\n"
        'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n SLURM_PROCID=$n "$@" & pids+=($!); done\n'
        'code=0; for p in "${pids[@]}"; do wait "$p" || code=$?; done; exit $code\n')
    for tool in ("scontrol", "srun"):
        (fake_bin / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}", SLURM_JOB_ID=str(free_port()),
               SLURM_NNODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(REPO),
               MASTER_PORT=str(free_port()), NGPU="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "multinode_trainer.slurm"),
                           *base_args(tmp_path, data_cache, "--training.local_batch_size", "2")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    check_ok(proc)
    assert "world 4 on 2 nodes × 2 processes" in proc.stdout
    ref, got = train_rows(single), train_rows(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 11))
    for r, g in zip(ref, got, strict=True):
        assert relative(g["loss"], r["loss"]) <= (1e-5 if r["step"] == 1 else 1e-4), (r, g)


def test_killed_worker_restarts_both_nodes_and_resumes(two_nodes, tmp_path, data_cache):
    """MAX_RESTARTS=1: a worker of node 1 killed after the step-5 checkpoint makes both agents
    re-form the world; the workers resume from step 5 and finish with the uninterrupted losses."""
    dump, _ = two_nodes
    args = base_args(tmp_path, data_cache, "--training.local_batch_size", "2", "--checkpoint.enable",
                     "--checkpoint.interval", "5")
    procs = start_nodes([args, args], free_port(), tmp_path / "logs", extra_env={"MAX_RESTARTS": "1"})
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "checkpoint" / "step-5").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        os.kill(workers_of(procs[1])[-1], signal.SIGKILL)
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        stop_everything(procs, str(tmp_path))
    outputs = "\n".join((tmp_path / "logs" / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], outputs[-6000:]
    assert outputs.count("resumed from") == 1, outputs[-6000:]
    straight = {r["step"]: r["loss"] for r in train_rows(dump)}
    last = {r["step"]: r["loss"] for r in train_rows(tmp_path)}  # a repeated step keeps its last row
    assert max(last) == 10
    for step in range(6, 11):
        assert relative(last[step], straight[step]) <= 1e-5, (step, last[step], straight[step])
