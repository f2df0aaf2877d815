"""What fault tolerance costs and how fast it recovers: two replica groups of two processes (FSDP 2
inside) against the same four processes as one HSDP 2 × 2 job, then a group killed and restarted.

    python benchmarks/benchmark_fault_tolerance.py [--flavor debug] [--seq 256] [--steps 20]

Rows:
- tokens/s of HSDP 2 × 2 (no fault tolerance), of 2 groups × FSDP 2 (gradients averaged across the
  groups every step through torchft), and of DiLoCo (each group alone, an outer step every 20 steps):
  all tokens of steps 6..last over their wall time (metrics.jsonl `time`), both groups together;
- the stall after kill -9 of one group: from the kill to the survivor's next committed step, with
  the lighthouse's heartbeat timeout beside it (the tiny flavor at seq 64, 200 steps, so that the
  survivor trains on while the killed group is started again);
- the heal: the restarted group's own `healed ... in X s` (the quorum that found it behind, the
  transfer of weights, optimizer and train state from the live group, and loading them).
Every group is a real `scripts/launch.py --standalone` job (torchrun), the lighthouse torchft's own.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HEARTBEAT_MS = 1000

from components.fault_tolerance.lighthouse import lighthouse as serve_lighthouse  # noqa: E402


def lighthouse(min_replicas: int):
    return serve_lighthouse(min_replicas, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=500)


def start(args: list[str], nproc: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "scripts/launch.py", "--standalone", f"--nproc-per-node={nproc}",
                             "train.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]


def tokens_per_second(groups: list[list[dict]], each_alone: bool = False) -> float:
    """Labelled tokens of steps 6..last over the span of those steps (the slowest group's). A row's
    loss_tokens counts every live group's tokens, except under DiLoCo (each group's own)."""
    span = max(r[-1]["time"] - r[4]["time"] for r in groups)
    tokens = sum(row["loss_tokens"] for row in groups[0][5:])
    return tokens * (len(groups) if each_alone else 1) / span


def ft_args(common: list[str], group: int, address: str, dump: Path, *extra: str) -> list[str]:
    return [*common, "--job.dump_folder", str(dump), "--fault_tolerance.enable",
            "--fault_tolerance.replica_id", str(group), "--fault_tolerance.group_size", "2",
            "--fault_tolerance.lighthouse", address, "--fault_tolerance.timeout_seconds", "10", *extra]


def run_groups(common: list[str], dump: Path, *extra: str) -> list[list[dict]]:
    with lighthouse(2) as address:
        procs = [start(ft_args(common, g, address, dump, "--fault_tolerance.min_replicas", "2", *extra), 2)
                 for g in (0, 1)]
        for p in procs:
            out = p.communicate()[0]
            assert p.returncode == 0, out[-3000:]
    return [rows(dump / f"replica_{g}" / "metrics.jsonl") for g in (0, 1)]


def kill_and_heal(common: list[str], dump: Path, steps: int) -> tuple[float, float, float]:
    """(stall after kill -9, mean step time before it, heal seconds) of a 2-group run."""
    args = [*common, "--training.steps", str(steps)]
    with lighthouse(1) as address:
        procs = [start(ft_args(args, g, address, dump), 2) for g in (0, 1)]
        survivor = dump / "replica_0" / "metrics.jsonl"
        while len([r for r in rows(survivor) if r.get("replicas") == 2]) < 8:
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed, before = time.monotonic(), rows(survivor)
        while not any(r["step"] > before[-1]["step"] + 1 for r in rows(survivor)):
            time.sleep(0.02)
        stall = time.monotonic() - killed
        step = (before[-1]["time"] - before[-5]["time"]) / 4
        procs[1].wait()
        restarted = start(ft_args(args, 1, address, dump), 2)
        out = restarted.communicate()[0]
        procs[0].communicate()
    healed = re.search(r"healed from a live replica group in ([0-9.]+) s", out)
    assert healed, out[-3000:]
    return stall, step, float(healed.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    common = ["--config", "llama_debug", "--model.flavor", a.flavor, "--training.seq_len", str(a.seq),
              "--training.local_batch_size", "4", "--training.steps", str(a.steps), "--metrics.log_freq", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = ["--training.data_cache_dir", str(root / "cache")]
        common += cache
        hsdp = start([*common, "--job.dump_folder", str(root / "hsdp"),
                      "--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "2"], 4)
        out = hsdp.communicate()[0]
        assert hsdp.returncode == 0, out[-3000:]
        base = tokens_per_second([rows(root / "hsdp" / "metrics.jsonl")])
        ft = tokens_per_second(run_groups(common, root / "ft"))
        diloco_rows = run_groups(common, root / "diloco", "--fault_tolerance.semi_sync", "diloco",
                                 "--fault_tolerance.sync_every", "20")
        diloco = tokens_per_second(diloco_rows, each_alone=True)
        # the recovery on the tiny flavor: many short steps, so the survivor outlasts the restart
        tiny = [*common, "--model.flavor", "tiny", "--training.seq_len", "64"]
        stall, step, heal = kill_and_heal(tiny, root / "kill", steps=200)
    print(f"llama3/{a.flavor}, seq {a.seq}, 4 processes (2 cores), {a.steps} steps, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| run | tokens/s | vs HSDP 2 × 2 |\n|---|---:|---:|")
    for name, value in [("HSDP 2 × 2, one job", base), ("2 groups × FSDP 2, fault tolerant", ft),
                        ("2 groups × FSDP 2, DiLoCo (sync every 20)", diloco)]:
        print(f"| {name} | {value:,.0f} | {value / base:.2f} |")
    print("\n| recovery (tiny flavor, seq 64) | seconds |\n|---|---:|\n"
          f"| heartbeat timeout | {HEARTBEAT_MS / 1000:.2f} |\n"
          f"| one step before the kill | {step:.3f} |\n| kill -9 → survivor's next committed step | "
          f"{stall:.2f} |\n| restarted group's heal (quorum + transfer + load) | {heal:.2f} |")


if __name__ == "__main__":
    main()
