"""The GPU check: on a machine with one GPU, in one call of under ten minutes, the measurements a
CPU cannot give, as one table.

    python scripts/gpu_check.py            # on the GPU machine
    python scripts/gpu_check.py --cpu      # the same code path on the CPU, tiny shapes (the test)

1. bf16 numerics: the compiled step against the eager one (one GPU cannot hold two ranks: NCCL
   refuses two ranks on one device), and exact resume (8 steps straight = 4 + resume 4).
2. Throughput: the 1B flavor at seq 2048 (batch 2 per step with selective AC), tokens/s and MFU,
   eager and compiled (median of the steps after the first three).
3. Initialisation at size: the 8B flavor materialised shard-only on one device, its peak memory
   (the whole model is one rank's shard here: 32 GB of fp32 weights).
"""

from __future__ import annotations

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

GPU = {"numerics": ["--model.flavor", "debug", "--training.seq_len", "512"],
       "speed": ["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "2",
                 "--training.global_batch_size", "2", "--activation_checkpoint.mode", "selective"],
       "init_flavor": "8B", "speed_steps": 12}
CPU = {"numerics": ["--model.flavor", "tiny", "--training.seq_len", "64"],
       "speed": ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "2",
                 "--training.global_batch_size", "2"],
       "init_flavor": "tiny", "speed_steps": 6}


def train(args: list[str], dump: Path, cache: Path, timeout: int = 400) -> list[dict]:
    """Run train.py (one process) and return its step rows."""
    cmd = [sys.executable, "train.py", "--config", "llama_debug", "--training.mixed_precision_param",
           "bfloat16", "--metrics.log_freq", "1", "--job.dump_folder", str(dump), "--training.data_cache_dir",
           str(cache), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def numerics(shape: dict, work: Path, cache: Path) -> list[tuple[str, str]]:
    """Compiled vs eager bf16 losses, and a run resumed at step 4 against a straight one."""
    steps = ["--training.steps", "8", "--training.deterministic", *shape["numerics"]]
    eager = train([*steps, "--checkpoint.enable", "--checkpoint.interval", "4"], work / "eager", cache)
    compiled = train([*steps, "--compile.enable"], work / "compiled", cache)
    worst = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(eager, compiled, strict=True))
    resumed = train([*steps, "--checkpoint.initial_load_path", str(work / "eager" / "checkpoint" / "step-4"),
                     "--checkpoint.initial_load_model_only", "false"], work / "resumed", cache)
    straight = eager[4:]
    same = [a["loss"] for a in resumed] == [b["loss"] for b in straight]
    return [("bf16: compiled vs eager, worst loss difference over 8 steps", f"{worst:.2e} relative"),
            ("resume: steps 5-8 after a restart at step 4 equal a straight run", "exact" if same else
             f"DIFFERENT: {[r['loss'] for r in resumed]} vs {[r['loss'] for r in straight]}")]


def speed(shape: dict, work: Path, cache: Path) -> list[tuple[str, str]]:
    """Tokens/s and MFU of the speed shape, eager and compiled."""
    out = []
    for name, extra in (("eager", []), ("compiled", ["--compile.enable"])):
        rows = train(["--training.steps", str(shape["speed_steps"]), *shape["speed"], *extra], work / name,
                     cache)
        timed = rows[3:]
        tps = statistics.median(r["tps"] for r in timed)
        mfu = statistics.median(r["mfu"] for r in timed)
        mem = max(r["mem_gib"] for r in rows)
        out.append((f"throughput {name}", f"{tps:,.0f} tok/s/device, MFU {mfu:.1f}%, peak {mem:.1f} GiB"))
    return out


def init_peak(flavor: str) -> list[tuple[str, str]]:
    """Materialise `flavor` on this process's device, shard-only, and report its peak memory."""
    import torch

    from components.parallel_options import ParallelOptions
    from models import get_model_args, get_model_spec
    from parallelisms.materialize import materialize_and_init
    from parallelisms.parallel_dims import ParallelDims

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_model_spec("llama3")
    args = get_model_args(spec, flavor)
    with torch.device("meta"):
        model = spec.model_cls(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    spec.parallelize_fn(model, dims, ParallelOptions(device_type=device.type))
    start = time.perf_counter()
    materialize_and_init(model, lambda: spec.model_cls(args), 0, device)
    seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return [(f"init {flavor} on one {device.type} device ({weights / 1e9:,.2f} GB of fp32 weights)",
             f"peak {peak / 2**30:,.2f} GiB in {seconds:,.1f} s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true",
                    help="tiny shapes on the CPU: the same code path, for tests")
    a = ap.parse_args()
    import torch

    if not a.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no GPU here; --cpu runs the same checks on tiny shapes")
    shape = CPU if a.cpu else GPU
    os.environ.setdefault("OMP_NUM_THREADS", "1" if a.cpu else os.environ.get("OMP_NUM_THREADS", "8"))
    device = "CPU" if a.cpu else torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        rows = numerics(shape, work / "n", cache) + speed(shape, work / "s", cache)
        rows += init_peak(shape["init_flavor"])
    print(f"\nKiln GPU check on {device} (torch {torch.__version__})\n")
    width = max(len(k) for k, _ in rows)
    print(f"| {'check':<{width}} | result |\n|{'-' * (width + 2)}|--------|")
    for check, result in rows:
        print(f"| {check:<{width}} | {result} |")


if __name__ == "__main__":
    main()
