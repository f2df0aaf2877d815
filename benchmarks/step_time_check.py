"""The planner's step-time model against measured steps on this CPU: each layout planned (fake
tensors, planning/step_time.py) and then trained for real, predicted and measured seconds per step
side by side, with the error of each and the rank agreement.

    python benchmarks/step_time_check.py [--steps 10] [--layouts one,fsdp2,...]

The CPU as the model sees it: one process's fp32 matmul rate (measured here, one thread), shared
when more processes than cores run (each gets cores / processes of it); gloo's all-reduce over
loopback between two processes, measured here at 4 KB (latency) and 32 MB (bandwidth); FSDP's
traffic not hidden behind compute (gloo's threads and the matmuls share the same cores). One
constant is fitted: the compute efficiency, on the one-process debug row; every other row is a
prediction. Measured: the median of steps 4..N (metrics.jsonl `time`), one process per run of
`torchrun --standalone`, OMP_NUM_THREADS=1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from components.config.loading import load_config  # noqa: E402
from planning.devices import Device  # noqa: E402
from planning.plan import make_plan  # noqa: E402
from planning.step_time import Efficiency, Links  # noqa: E402

DEBUG = ["--config", "llama_debug", "--training.seq_len", "256", "--training.local_batch_size", "4",
         "--training.global_batch_size", "8"]
M125 = ["--config", "llama_debug", "--model.flavor", "125M", "--training.seq_len", "256",
        "--training.local_batch_size", "2"]
MOE = ["--config", "moe_debug", "--training.seq_len", "256", "--training.local_batch_size", "4"]
# name → (processes, arguments); each model's rows share one global batch.
LAYOUTS = {
    "one": (1, DEBUG),
    "fsdp2": (2, DEBUG),
    "tp2": (2, [*DEBUG, "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, [*DEBUG, "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, [*DEBUG, "--parallelism.context_parallel_degree", "2"]),
    "fsdp2_full_ac": (2, [*DEBUG, "--activation_checkpoint.mode", "full"]),
    "fsdp4": (4, [*DEBUG, "--training.local_batch_size", "2"]),
    "hsdp2x2": (4, [*DEBUG, "--training.local_batch_size", "2",
                    "--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2_fsdp2": (4, [*DEBUG, "--parallelism.tensor_parallel_degree", "2"]),
    "pp2_fsdp2": (4, [*DEBUG, "--parallelism.pipeline_parallel_degree", "2"]),
    "m125_one": (1, [*M125, "--training.global_batch_size", "4"]),
    "m125_fsdp2": (2, [*M125, "--training.global_batch_size", "4"]),
    "m125_tp2": (2, [*M125, "--training.global_batch_size", "4", "--training.local_batch_size", "4",
                     "--parallelism.tensor_parallel_degree", "2"]),
    "moe_fsdp2": (2, [*MOE, "--training.global_batch_size", "8"]),
    "moe_ep2": (2, [*MOE, "--training.global_batch_size", "8", "--parallelism.expert_parallel_degree", "2"]),
}


def _gloo_worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times = {}
    for nbytes in (4096, 32 << 20):
        x = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(x)
        start, rounds = time.perf_counter(), 20 if nbytes < 1 << 20 else 5
        for _ in range(rounds):
            dist.all_reduce(x)
        times[nbytes] = (time.perf_counter() - start) / rounds
    if rank == 0:
        out.update(times)
    dist.destroy_process_group()


def gloo_links() -> Links:
    """Loopback gloo between two processes: latency from a 4 KB all-reduce, bandwidth from 32 MB
    (a two-rank all-reduce puts its bytes on the wire once, in 2 ring steps)."""
    from scripts.tutorial.common import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_worker, args=(free_port(), out), nprocs=2)
        small, big = out[4096], out[32 << 20]
    latency_us = small / 2 * 1e6
    bandwidth = (32 << 20) / (big - small) / 1e9
    return Links(per_node=1024, intra_gb_s=bandwidth, inter_gb_s=bandwidth, intra_us=latency_us,
                 inter_us=latency_us)


def matmul_tflops() -> float:
    """One thread's fp32 matmul rate (1024², best of 5)."""
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(8):
            a @ b
        best = min(best, (time.perf_counter() - start) / 8)
    return 2 * 1024**3 / best / 1e12


def predicted_seconds(args: list[str], nproc: int, device: Device) -> float:
    cfg = load_config(args)
    return make_plan(cfg, nproc, device, device_type="cpu", ac_modes=False).step_seconds


def measured_seconds(args: list[str], nproc: int, steps: int, cache: Path) -> float:
    with tempfile.TemporaryDirectory() as dump:
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
               if nproc > 1 else [sys.executable])
        run = [*args, "--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", dump,
               "--training.data_cache_dir", str(cache)]
        proc = subprocess.run([*cmd, "train.py", *run], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if "loss" in r]
    return statistics.median(b - a for a, b in zip(times[3:], times[4:], strict=False))


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[int]:
        order = sorted(range(len(x)), key=x.__getitem__)
        out = [0] * len(x)
        for r, i in enumerate(order):
            out[i] = r
        return out
    ra, rb, n = ranks(a), ranks(b), len(a)
    if n < 2:
        return 1.0
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    a = p.parse_args()
    names = a.layouts.split(",")
    cores, links, rate = os.cpu_count() or 1, gloo_links(), matmul_tflops()
    with tempfile.TemporaryDirectory() as cache:
        measured = {n: measured_seconds(LAYOUTS[n][1], LAYOUTS[n][0], a.steps, Path(cache)) for n in names}

    def device(nproc: int, compute: float) -> Device:
        return Device("CPU", 64.0, rate * min(1.0, cores / nproc), links=links,
                      efficiency=Efficiency(compute=compute, comm=1.0, overlap=0.0))

    # The one constant fitted: compute efficiency, on the one-process debug row.
    base = predicted_seconds(LAYOUTS["one"][1], 1, device(1, 1.0))
    efficiency = base / measured["one"] if "one" in measured else 1.0
    predicted = {n: predicted_seconds(LAYOUTS[n][1], LAYOUTS[n][0], device(LAYOUTS[n][0], efficiency))
                 for n in names}
    print(f"{time.strftime('%Y-%m-%d')}, CPU, {cores} cores: fp32 matmul {rate * 1e3:.1f} GFLOP/s a thread; "
          f"gloo loopback {links.intra_gb_s:.2f} GB/s, {links.intra_us:.0f} µs per ring step; "
          f"compute efficiency {efficiency:.2f} (fitted on `one`)\n")
    print("| layout | processes | predicted s/step | measured s/step | error |\n|---|---:|---:|---:|---:|")
    for n in names:
        err = (predicted[n] - measured[n]) / measured[n]
        print(f"| {n} | {LAYOUTS[n][0]} | {predicted[n]:.3f} | {measured[n]:.3f} | {err:+.0%} |")
    errors = [abs(predicted[n] - measured[n]) / measured[n] for n in names if n != "one"]
    print(f"\nmean |error| over the {len(errors)} predicted rows: {statistics.mean(errors):.0%}")
    for model in ("debug", "125M", "moe"):
        group = [n for n in names if (n.startswith("m125") if model == "125M" else
                                      n.startswith("moe") if model == "moe" else
                                      not n.startswith(("m125", "moe")))]
        if len(group) > 1:  # tokens/s per device (one global batch per model): higher is better
            speed_p = [1 / (predicted[n] * LAYOUTS[n][0]) for n in group]
            speed_m = [1 / (measured[n] * LAYOUTS[n][0]) for n in group]
            best_p, best_m = group[speed_p.index(max(speed_p))], group[speed_m.index(max(speed_m))]
            print(f"{model}: Spearman {spearman(speed_p, speed_m):+.2f} over {len(group)} layouts "
                  f"(tokens/s per device); best predicted {best_p}, best measured {best_m}")


if __name__ == "__main__":
    main()
