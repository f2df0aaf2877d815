"""The last stop: the chapter's ideas as Kiln runs them — one train.py command per parallelism.

    python scripts/tutorial/kiln_tour.py               # runs every layout (tiny model, 5 steps each)
    python scripts/tutorial/kiln_tour.py --dry-run     # only prints the commands and where the code is
    python scripts/tutorial/kiln_tour.py --only fsdp2,ep2

Every layout trains the same tiny model on the same global batch as one process does, so its losses
must match the one-process run's to float32 rounding: that equality is what makes a parallelism
correct, and the tour checks it. MoE layouts are compared with a one-process MoE run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--training.global_batch_size", "8", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
        "--optimizer.lr", "3e-3"]


@dataclass
class Stop:
    """One layout of the tour: its name, processes, extra flags, the chapter idea and Kiln's code for it."""

    name: str
    nproc: int
    flags: list[str]
    idea: str
    code: str
    moe: bool = False
    reference: str = field(default="single")


STOPS = [
    Stop("single", 1, [], "one process: the baseline every layout must reproduce",
         "train.py (Trainer.train_step)"),
    Stop("ddp2", 2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1"],
         "data parallel (16.4): replicas, gradients all-reduced across them",
         "parallelisms/fsdp.py: apply_fsdp over (replicate, shard 1), i.e. HSDP with shards of one rank"),
    Stop("fsdp2", 2, ["--training.local_batch_size", "4"],
         "fully sharded data parallel (16.7): shards all-gathered for compute, gradients reduce-scattered",
         "parallelisms/fsdp.py: apply_fsdp (fully_shard per block, then the root)"),
    Stop("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"],
         "tensor parallel (16.5.2): each Linear's weight split by rows or columns",
         "parallelisms/tensor_parallel.py + models/llama3/parallelize.py (the per-block plan)"),
    Stop("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                    "GPipe", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         "pipeline parallel (16.5.1): stages on ranks, microbatches flowing through a GPipe schedule",
         "parallelisms/pipeline.py (torch.distributed.pipelining stages and schedules)"),
    Stop("cp2", 2, ["--parallelism.context_parallel_degree", "2"],
         "context parallel (16.8.1): the sequence split over ranks, attention exchanging keys and values",
         "parallelisms/context_parallel.py + parallelisms/blockwise_attention.py"),
    Stop("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
         "n-D parallelism over one DeviceMesh (16.6): FSDP along one mesh dimension, TP along the other",
         "parallelisms/parallel_dims.py (the mesh) + parallelisms/compose.py (the order of apply_*)"),
    Stop("moe_single", 1, [], "Mixture of Experts on one process: the baseline for expert parallel",
         "models/common/moe.py (router, experts)", moe=True, reference="moe_single"),
    Stop("ep2", 2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"],
         "expert parallel (16.8.2): experts split over ranks, tokens sent to them with all-to-all",
         "parallelisms/expert_parallel.py (ExpertParallelDispatch)", moe=True, reference="moe_single"),
]


def command(stop: Stop, steps: int, dump: Path) -> list[str]:
    """The train.py command line a user would type for this stop."""
    model = ["--model.name", "moe"] if stop.moe else []
    args = ["--config", "llama_debug", *TINY, *model, "--training.steps", str(steps), *stop.flags,
            "--job.dump_folder", str(dump)]
    if stop.nproc == 1:
        return [sys.executable, "train.py", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stop.nproc}",
            "train.py", *args]


def shown(cmd: list[str]) -> str:
    """The command as a person would type it (torchrun, not python -m torch.distributed.run)."""
    text = " ".join(cmd[1:]).replace("-m torch.distributed.run", "torchrun")
    return text if text.startswith("torchrun") else f"python {text}"


def losses(dump: Path) -> list[float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated stop names (references are added)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--out", type=Path, default=None, help="dump folders go here (default: a temp dir)")
    args = parser.parse_args()
    wanted = {s for s in args.only.split(",") if s}
    unknown = wanted - {s.name for s in STOPS}
    if unknown:
        parser.error(f"unknown stops {sorted(unknown)}; known: {', '.join(s.name for s in STOPS)}")
    stops = [s for s in STOPS if not wanted or s.name in wanted or any(
        w.reference == s.name for w in STOPS if w.name in wanted)]
    out = args.out or Path(tempfile.gettempdir() if args.dry_run else tempfile.mkdtemp(prefix="kiln_tour_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    results: dict[str, list[float]] = {}
    for stop in stops:
        cmd = command(stop, args.steps, out / stop.name)
        print(f"\n== {stop.name}: {stop.idea}\n   {shown(cmd)}\n   code: {stop.code}", flush=True)
        if args.dry_run:
            continue
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{stop.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        results[stop.name] = losses(out / stop.name)
        ref = results[stop.reference]
        worst = max(abs(a - b) / abs(b) for a, b in zip(results[stop.name], ref, strict=True))
        print(f"   losses {' '.join(f'{x:.4f}' for x in results[stop.name])}", flush=True)
        if stop.name != stop.reference:
            if worst > 1e-4:
                sys.exit(f"check failed: {stop.name} differs from {stop.reference} by {worst:.2e} (relative)")
            print(f"   check: same losses as {stop.reference} (max relative diff {worst:.1e})", flush=True)
    if not args.dry_run:
        print(f"\nevery layout reproduced its one-process run; dump folders in {out}")


if __name__ == "__main__":
    main()
