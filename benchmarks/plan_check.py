"""The planner against reality: each layout planned by scripts/plan.py and then run for real
(torchrun train.py, two steps, --profiling.memory_report), rank by rank, in one table.

    python benchmarks/plan_check.py [--layouts fsdp2,tp2,...]

Parameter, gradient and optimizer bytes must be equal; the peak is compared with the allocator's
peak of the measured step, and the planned collectives with those the step issued, bytes per mesh
dimension and kind (components/observability/memory_report.py; expert parallel's all-to-all bytes
per rank follow the routing, which the planner takes as balanced). CPU, gloo, one thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEBUG = ["--config", "llama_debug", "--training.global_batch_size", "8"]
MID = ["--config", "llama_debug", "--model.flavor", "125M", "--training.seq_len", "256",
       "--training.local_batch_size", "2", "--training.global_batch_size", "-1"]
PP = ["--parallelism.pipeline_parallel_degree", "2"]
TP = ["--parallelism.tensor_parallel_degree", "2"]
# name → (processes, train.py arguments)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "debug FSDP 2": (2, DEBUG),
    "debug FSDP 4": (4, [*DEBUG, "--training.local_batch_size", "2"]),
    "debug HSDP 2×2": (4, [*DEBUG, "--training.local_batch_size", "2",
                            "--parallelism.data_parallel_replicate_degree", "2"]),
    "debug DDP 2": (2, [*DEBUG, "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "1"]),
    "debug TP 2": (2, [*DEBUG, *TP]),
    "debug PP 2 (1F1B)": (2, [*DEBUG, *PP]),
    "debug CP 2": (2, [*DEBUG, "--parallelism.context_parallel_degree", "2"]),
    "MoE EP 2": (2, ["--config", "moe_debug", "--training.global_batch_size", "8",
                     "--parallelism.expert_parallel_degree", "2"]),
    "debug PP 2 × FSDP 2 × TP 2": (8, [*DEBUG, "--training.local_batch_size", "4", *PP, *TP]),
    "125M FSDP 2": (2, MID),
    "125M TP 2": (2, [*MID, *TP]),
}
QUICK = ["debug FSDP 2", "debug PP 2 (1F1B)"]


def planned(nproc: int, args: list[str], ranks: list[int]) -> dict[int, dict]:
    """rank → the planner's numbers (plan.py --json, planned for this CPU)."""
    cmd = [sys.executable, "scripts/plan.py", "--world-size", str(nproc), "--device", "cpu",
           "--device-memory", "24GiB", "--peak-tflops", "1", "--no-ac-modes", "--json",
           *[f"--rank={r}" for r in ranks], *args]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {r["rank"]: r for r in json.loads(out)["ranks"]}


def measured(nproc: int, args: list[str], cache: Path) -> dict[int, dict]:
    """rank → what a real two-step run reported (memory_rank<R>.json)."""
    with tempfile.TemporaryDirectory() as dump:
        run = ["train.py", *args, "--training.steps", "2", "--profiling.memory_report",
               "--job.dump_folder", dump, "--training.data_cache_dir", str(cache)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, *run] if nproc == 1 else [*torchrun, *run]
        subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       check=True)
        return {r: json.loads((Path(dump) / f"memory_rank{r}.json").read_text()) for r in range(nproc)}


def compare(name: str, nproc: int, args: list[str], cache: Path) -> list[dict]:
    """One row per planned rank: the planned and measured numbers side by side."""
    real = measured(nproc, args, cache)
    pp = 2 if "--parallelism.pipeline_parallel_degree" in args else 1
    ranks = sorted({0, nproc - nproc // pp})
    plan = planned(nproc, args, ranks)
    keys = ("parameters", "gradients", "optimizer", "peak")
    return [{"layout": name, "rank": r, **{k: (plan[r][k], real[r][k]) for k in keys},
             "communication": (flat(plan[r]["communication"]),
                               {key: v["bytes"] for key, v in flat(real[r]["communication"]).items()}
                               if "communication" in real[r] else None)} for r in ranks]


def flat(nested: dict[str, dict]) -> dict[tuple[str, str], Any]:
    """{mesh dim: {kind: x}} → {(mesh dim, kind): x}."""
    return {(dim, kind): x for dim, kinds in nested.items() for kind, x in kinds.items()}


def total(sizes: dict[Any, int] | int) -> int:
    return sizes if isinstance(sizes, int) else sum(sizes.values())


def table(rows: list[dict]) -> str:
    """The markdown table, then a line for each collective whose bytes differ."""
    lines = ["| layout | rank | parameters | gradients | optimizer | peak planned | peak measured | off "
             "| communication |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        cells = []
        for key in ("parameters", "gradients", "optimizer"):
            plan, real = row[key]
            cells.append(f"{total(plan) / 2**20:,.2f} MiB" + ("" if plan == real else
                                                              f" ≠ {total(real) / 2**20:,.2f}"))
        plan, real = row["peak"]
        cells += [f"{plan / 2**20:,.1f} MiB", f"{real / 2**20:,.1f} MiB", f"{(plan - real) / real:+.1%}"]
        planned_comm, measured_comm = row["communication"]
        cell = f"{total(planned_comm) / 2**20:,.2f} MiB"
        if measured_comm is None:
            cell += " (not measured)"
        elif planned_comm != measured_comm:
            cell += f" ≠ {total(measured_comm) / 2**20:,.2f}"
            for dim, kind in sorted(planned_comm.keys() | measured_comm.keys()):
                ours, theirs = planned_comm.get((dim, kind), 0), measured_comm.get((dim, kind), 0)
                if ours != theirs:
                    notes.append(f"- {row['layout']}, rank {row['rank']}, {dim} {kind}: "
                                 f"planned {ours:,} bytes, measured {theirs:,}")
        lines.append(f"| {row['layout']} | {row['rank']} | " + " | ".join([*cells, cell]) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names, or 'quick'")
    a = ap.parse_args()
    names = QUICK if a.layouts == "quick" else [n.strip() for n in a.layouts.split(",")]
    with tempfile.TemporaryDirectory() as cache:
        rows = [row for name in names for row in compare(name, *LAYOUTS[name], Path(cache))]
    print(table(rows))


if __name__ == "__main__":
    main()
