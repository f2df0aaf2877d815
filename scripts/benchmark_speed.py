"""The speed table of scripts/benchmark.py (`--tables speed`): Kiln against an independent
reference (scripts/reference_loop.py, a Llama written without Kiln's model code) per layout.

Shape of TorchTitan's CPU comparison in issue 20: dim 256, 6 layers, 16 heads, seq 128, local
batch 4, fp32, one thread per process. Runs alternate Kiln / reference so drift on a shared
machine hits both alike; each cell is the median over runs of the median step's global tokens/s.
Layouts the reference cannot run (TP, PP, CP) are compared against the reference's FSDP 2 figure
(the same global batch rate a data-parallel run reaches on the same processes), marked "vs FSDP 2".
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--training.seq_len", "128", "--training.local_batch_size", "4"]

# name: (processes, Kiln options, reference options or None when the reference has no such layout)
LAYOUTS: dict[str, tuple[int, list[str], list[str] | None]] = {
    "1 process": (1, [], []),
    "FSDP 2": (2, [], []),
    "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2"], None),
    "PP 2 (Interleaved1F1B, microbatch 1)": (2, [
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "1"], None),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2"], None),
    "1 process, compile": (1, ["--compile.enable"], ["--compile"]),
    "FSDP 2, compile": (2, ["--compile.enable"], ["--compile"]),
    "1 process, full AC": (1, ["--activation_checkpoint.mode", "full"], ["--ac"]),
    "FSDP 2 × TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"], None),
    "HSDP 2 × 2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"], None),
}


def _launch(nproc: int, script: str, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            script, *args]


def kiln_run(nproc: int, extra: list[str], steps: int, warmup: int, cache: Path) -> tuple[float, float]:
    """(median step's global tokens/s, peak memory GiB of rank 0) of train.py in this layout."""
    with tempfile.TemporaryDirectory() as dump:
        args = ["--config", "llama_debug", *SHAPE, "--training.global_batch_size", "-1",
                "--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", dump,
                "--training.data_cache_dir", str(cache), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(_launch(nproc, "train.py", args), cwd=REPO, env=env, check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    rates = [(b["tokens"] - a["tokens"]) / (b["time"] - a["time"])
             for a, b in zip(rows, rows[1:], strict=False)]
    return statistics.median(rates[warmup:]), rows[-1]["mem_gib"]


def reference_run(nproc: int, extra: list[str], steps: int, warmup: int, cache: Path) -> tuple[float, float]:
    """(median step's global tokens/s, peak RSS GiB of rank 0) of the independent reference loop."""
    tokens = next(cache.glob("train-*.bin"))
    args = ["--tokens", str(tokens), "--batch", "4", "--seq-len", "128", "--steps", str(steps),
            "--warmup", str(warmup), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(_launch(nproc, "scripts/reference_loop.py", args), cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return row["tps"], row["peak_rss_mib"] / 1024


def speed_table(steps: int, warmup: int, repeats: int, cache: Path) -> None:
    """Print Kiln vs reference tokens/s and peak memory per layout."""
    kiln: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
    ref: dict[str, list[tuple[float, float]]] = {name: [] for name, v in LAYOUTS.items() if v[2] is not None}
    for _ in range(repeats):
        for name, (nproc, kiln_args, ref_args) in LAYOUTS.items():
            kiln[name].append(kiln_run(nproc, kiln_args, steps, warmup, cache))
            if ref_args is not None:
                ref[name].append(reference_run(nproc, ref_args, steps, warmup, cache))
    med = {name: tuple(statistics.median(col) for col in zip(*v, strict=True)) for name, v in kiln.items()}
    ref_med = {name: tuple(statistics.median(col) for col in zip(*v, strict=True)) for name, v in ref.items()}
    print(f"\ndebug shape (dim 256, 6 layers, 16 heads), seq 128, local batch 4, fp32, 1 thread per process,"
          f" {steps} steps ({warmup} untimed), median step, median of {repeats} run(s)\n")
    print("| layout | Kiln tok/s | reference tok/s | Kiln / reference | Kiln peak GiB | reference |")
    print("|---|---|---|---|---|---|")
    for name, (tps, mem) in med.items():
        if name in ref_med:
            rtps, rmem = ref_med[name]
            print(f"| {name} | {tps:,.0f} | {rtps:,.0f} | {tps / rtps:.2f} | {mem:.2f} | {rmem:.2f} |")
        else:
            rtps = ref_med["FSDP 2"][0]
            print(f"| {name} | {tps:,.0f} | — | {tps / rtps:.2f} vs FSDP 2 | {mem:.2f} | — |")
