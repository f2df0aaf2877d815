"""The speed table of benchmarks/benchmark.py (`--tables speed`): Kiln beside TorchTitan itself and an
independent reference loop, layout by layout, on the same work.

Shape of TorchTitan's `debugmodel` (dim 256, 6 layers, 16 heads, SwiGLU hidden 768), vocabulary
4096 (Kiln's tokenizer), seq 128, local batch 4, fp32, one thread per process. Three trainers:
- Kiln: train.py, twice: with torch's own collectives (the default, what TorchTitan uses too, so
  the ratio measures the framework) and with --comm.gloo_accelerations;
- TorchTitan: benchmarks/torchtitan_cpu.py, its own Trainer with CPU patches, run by the interpreter
  given as `--torchtitan-python` (an environment where torchtitan is installed; column left out
  without it);
- reference: benchmarks/reference_loop.py, a Llama written without Kiln's model code, the shortest
  loop (one process or FSDP2).
Runs alternate Kiln / TorchTitan / reference in every layout, so drift on a shared machine hits all
alike; each cell is the median over runs of the median step's global tokens/s, and peak RSS of
rank 0. Where a trainer has no such layout, Kiln is set against that trainer's FSDP 2 figure (the
rate data parallel reaches on the same processes), marked "vs FSDP 2"; CP 2 then runs FSDP 2's
global batch (local batch 8 of 64-token shards), so both do the same work per step.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--training.seq_len", "128", "--training.local_batch_size", "4"]

# name: (processes, Kiln options, TorchTitan options, reference options); None = no such layout
LAYOUTS: dict[str, tuple[int, list[str], list[str] | None, list[str] | None]] = {
    "1 process": (1, [], [], []),
    "FSDP 2": (2, [], [], []),
    "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2"], ["--tp", "2"], None),
    "PP 2 (Interleaved1F1B, microbatch 1)": (2, [
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "1"], ["--pp", "2"], None),
    # Local batch 8: the same global batch (8 × 128 tokens) and tokens per rank as FSDP 2, the work
    # it is set against (with local batch 4 it would do half of FSDP 2's tokens per step).
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"],
             None, None),
    "1 process, compile": (1, ["--compile.enable"], ["--compile"], ["--compile"]),
    "FSDP 2, compile": (2, ["--compile.enable"], ["--compile"], ["--compile"]),
    "1 process, full AC": (1, ["--activation_checkpoint.mode", "full"], ["--ac"], ["--ac"]),
    "FSDP 2 × TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"], ["--tp", "2"], None),
    "HSDP 2 × 2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"], ["--dp-replicate", "2"], None),
}

Run = Callable[[int, list[str]], tuple[float, float]]  # (processes, options) → (tokens/s, peak GiB)


def _launch(python: str, nproc: int, script: str, args: list[str]) -> list[str]:
    if nproc == 1:
        return [python, script, *args]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]


def _json_result(cmd: list[str]) -> tuple[float, float]:
    """(tps, peak GiB) from the JSON line a reference or TorchTitan run prints last."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return row["tps"], row["peak_rss_mib"] / 1024


def kiln_runner(steps: int, warmup: int, cache: Path, accelerate: bool = False) -> Run:
    """Kiln's train.py (accelerate: with --comm.gloo_accelerations): the median step's global
    tokens/s, peak RSS GiB of rank 0."""
    def run(nproc: int, extra: list[str]) -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as dump:
            args = ["--config", "llama_debug", *SHAPE, "--training.global_batch_size", "-1",
                    "--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", dump,
                    "--training.data_cache_dir", str(cache), *extra,
                    *(["--comm.gloo_accelerations"] if accelerate else [])]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(_launch(sys.executable, nproc, "train.py", args), cwd=REPO, env=env, check=True,
                           capture_output=True)
            rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        rates = [(b["tokens"] - a["tokens"]) / (b["time"] - a["time"])
                 for a, b in zip(rows, rows[1:], strict=False)]
        return statistics.median(rates[warmup:]), rows[-1]["mem_gib"]
    return run


def reference_runner(steps: int, warmup: int, cache: Path) -> Run:
    """The independent reference loop on Kiln's token cache."""
    tokens = next(cache.glob("train-*.bin"))

    def run(nproc: int, extra: list[str]) -> tuple[float, float]:
        args = ["--tokens", str(tokens), "--batch", "4", "--seq-len", "128", "--steps", str(steps),
                "--warmup", str(warmup), *extra]
        return _json_result(_launch(sys.executable, nproc, "benchmarks/reference_loop.py", args))
    return run


def torchtitan_runner(python: str, steps: int, warmup: int) -> Run:
    """TorchTitan's own trainer through benchmarks/torchtitan_cpu.py, run by `python`."""
    def run(nproc: int, extra: list[str]) -> tuple[float, float]:
        args = ["--steps", str(steps), "--warmup", str(warmup), *extra]
        return _json_result(_launch(python, nproc, "benchmarks/torchtitan_cpu.py", args))
    return run


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def speed_table(steps: int, warmup: int, repeats: int, cache: Path, torchtitan_python: str = "",
                only: list[str] | None = None) -> None:
    """Print Kiln's tokens/s and peak memory per layout (all, or those named in `only`, plus FSDP 2
    where a "vs FSDP 2" cell needs it) beside TorchTitan's and the reference's."""
    unknown = set(only or []) - set(LAYOUTS)
    if unknown:
        raise SystemExit(f"unknown layouts {sorted(unknown)}; known: {'; '.join(LAYOUTS)}")
    runners = {"Kiln": kiln_runner(steps, warmup, cache),
               ACCELERATED: kiln_runner(steps, warmup, cache, accelerate=True)}
    if torchtitan_python:
        runners["TorchTitan"] = torchtitan_runner(torchtitan_python, steps, warmup)
    runners["reference"] = reference_runner(steps, warmup, cache)
    layouts = chosen_layouts(only, list(runners))
    med = measure(layouts, runners, repeats)
    print(f"\ndebug shape (dim 256, 6 layers, 16 heads, vocab 4096), seq 128, local batch 4 (CP 2: 8), fp32, "
          f"1 thread per process, {steps} steps ({warmup} untimed), median step, "
          f"median of {repeats} run(s)\n")
    print(table(med, list(layouts), [who for who in runners if who not in KILN]))


def chosen_layouts(only: list[str] | None, trainers: list[str]) -> dict[str, tuple]:
    """The layouts named (all if none), plus FSDP 2 when one of them lacks a trainer's own run."""
    layouts = {n: v for n, v in LAYOUTS.items() if not only or n in only}
    needs_fsdp = any(LAYOUTS[n][COLUMN[who]] is None for n in layouts for who in trainers)
    if needs_fsdp and "FSDP 2" not in layouts:
        layouts = {"FSDP 2": LAYOUTS["FSDP 2"], **layouts}
    return layouts


ACCELERATED = "Kiln, gloo acc."
KILN = ("Kiln", ACCELERATED)  # Kiln with torch's collectives, then with --comm.gloo_accelerations
COLUMN = {"Kiln": 1, ACCELERATED: 1, "TorchTitan": 2, "reference": 3}  # trainer → its options in LAYOUTS


def measure(layouts: dict[str, tuple], runners: dict[str, Run], repeats: int
            ) -> dict[tuple[str, str], tuple[float, float]]:
    """(trainer, layout) → median (tokens/s, peak GiB) over `repeats` rounds; each round runs every
    layout once per trainer, alternating, so drift on a shared machine hits all trainers alike."""
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for name, layout in layouts.items():
            for who, run in runners.items():
                options = layout[COLUMN[who]]
                if options is not None:
                    runs.setdefault((who, name), []).append(run(layout[0], options))
    return {key: _median(v) for key, v in runs.items()}


def table(med: dict[tuple[str, str], tuple[float, float]], layouts: list[str], others: list[str]) -> str:
    """The markdown table: Kiln's tokens/s (torch's collectives, gloo accelerations), the others',
    each Kiln / each other (against the other's FSDP 2 figure where it has no such layout, marked
    "vs FSDP 2"), and the peak memories."""
    ratios = [(k, w) for k in KILN for w in others]
    head = ["layout", *(f"{k} tok/s" for k in KILN), *(f"{w} tok/s" for w in others),
            *(f"{k} / {w}" for k, w in ratios), *(f"{k} GiB" for k in KILN), *(f"{w} GiB" for w in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in layouts:
        cells = [name, *(f"{med[(k, name)][0]:,.0f}" for k in KILN)]
        cells += [f"{med[(w, name)][0]:,.0f}" if (w, name) in med else "—" for w in others]
        for k, w in ratios:
            tps = med[(k, name)][0]
            cells.append(f"{tps / med[(w, name)][0]:.2f}" if (w, name) in med
                         else f"{tps / med[(w, 'FSDP 2')][0]:.2f} vs FSDP 2")
        cells += [f"{med[(k, name)][1]:.2f}" for k in KILN]
        cells += [f"{med[(w, name)][1]:.2f}" if (w, name) in med else "—" for w in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
