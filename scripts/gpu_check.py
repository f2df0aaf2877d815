"""The GPU check: on a machine with one or more GPUs, in one call of under ten minutes, the
measurements a CPU cannot give, as one table.

    python scripts/gpu_check.py            # on the GPU machine
    python scripts/gpu_check.py --cpu      # the same code path on the CPU, tiny shapes (the test)

1. bf16 numerics: the compiled step against the eager one, and exact resume (8 steps straight =
   4 + resume 4).
2. Throughput: the 1B flavor at seq 2048 (batch 2 per step with selective AC), tokens/s and MFU,
   eager and compiled (median of the steps after the first three).
3. Initialisation at size: the 8B flavor materialised shard-only on one device, its peak memory
   (the whole model is one rank's shard here: 32 GB of fp32 weights).
4. Context parallel's attention at long context on one device: every CP rank's chunked attention
   (parallelisms/blockwise_attention.py, fused kernels per chunk pair) against plain SDPA over the
   whole sequence — output and gradients — and one rank's peak memory beside the size of one chunk
   pair's score matrix, which the fused kernels must never hold.
5. With two or more devices: FSDP 2, TP 2 and CP 2 through torchrun (NCCL on GPUs, torch's own
   collectives) against one device, fp32, loss and grad norm over 10 steps.
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
       "init_flavor": "8B", "speed_steps": 12,
       # seq 131,072 over CP 8: chunks of 8,192, whose score matrix for 32 heads is 8 GiB in fp32
       "cp": {"seq": 131072, "cp": 8, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"},
       "parity": ["--model.flavor", "debug", "--training.seq_len", "512", "--training.global_batch_size", "8",
                  "--training.local_batch_size", "4"]}
CPU = {"numerics": ["--model.flavor", "tiny", "--training.seq_len", "64"],
       "speed": ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "2",
                 "--training.global_batch_size", "2"],
       "init_flavor": "tiny", "speed_steps": 6,
       "cp": {"seq": 256, "cp": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "float32"},
       "parity": ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.global_batch_size", "8",
                  "--training.local_batch_size", "4"]}
PARITY_LAYOUTS = {"FSDP 2": [], "TP 2": ["--parallelism.tensor_parallel_degree", "2"],
                  "CP 2": ["--parallelism.context_parallel_degree", "2"]}


def train(args: list[str], dump: Path, cache: Path, timeout: int = 400, nproc: int = 1,
          dtype: str = "bfloat16") -> list[dict]:
    """Run train.py (one process, or nproc under torchrun) and return its step rows."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    launch = [sys.executable] if nproc == 1 else torchrun
    cmd = [*launch, "train.py", "--config", "llama_debug", "--training.mixed_precision_param", dtype,
           "--metrics.log_freq", "1", "--job.dump_folder", str(dump), "--training.data_cache_dir", str(cache),
           *args]
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

    from components.config.parallel_options import ParallelOptions
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


def cp_attention(shape: dict) -> list[tuple[str, str]]:
    """Every CP rank's chunked attention (its head-tail queries over every rank's K/V in rank order,
    as after the all-gather) against SDPA over the whole sequence — outputs, q gradients and the
    K/V gradients summed over ranks — and the most memory one rank's attention took beside one
    chunk pair's fp32 score matrix."""
    import torch
    import torch.nn.functional as F

    from parallelisms.blockwise_attention import gathered_attention
    from parallelisms.context_parallel import head_tail_positions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, seq, cp = getattr(torch, shape["dtype"]), shape["seq"], shape["cp"]
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, weight = (torch.randn(1, h, seq, dim, generator=gen, device=device, dtype=dtype)
                       for h in (heads, kv_heads, kv_heads, heads))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    (want * weight).sum().backward()
    want, grads = want.detach(), [t.grad for t in ref]
    del ref
    shares = [head_tail_positions(seq, cp, r).to(device) for r in range(cp)]
    order = torch.cat(shares)  # the gathered K/V's sequence order: rank 0's share, rank 1's, ...
    k_all, v_all = k[:, :, order].requires_grad_(), v[:, :, order].requires_grad_()

    def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
        return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    worst, peak_extra = 0.0, 0
    for rank, pos in enumerate(shares):
        mine = q[:, :, pos].clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        out = gathered_attention(mine, k_all, v_all, rank, cp)
        (out * weight[:, :, pos]).sum().backward()
        if device.type == "cuda":
            peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - before)
        worst = max(worst, relative(out, want[:, :, pos]), relative(mine.grad, grads[0][:, :, pos]))
        del out, mine
    for got, ref in ((k_all.grad, grads[1]), (v_all.grad, grads[2])):  # summed over every rank's backward
        worst = max(worst, relative(got, ref[:, :, order]))
    scores = heads * (seq // (2 * cp)) ** 2 * 4  # one chunk pair, all heads, fp32, batch 1
    memory = "memory measured on GPUs only"
    if device.type == "cuda":
        memory = (f"one rank's attention peaked {peak_extra / 2**20:,.0f} MiB above its inputs, one pair's "
                  f"scores are {scores / 2**20:,.0f} MiB")
    return [(f"CP attention, seq {seq:,} over CP {cp} ({shape['dtype']}), chunked vs SDPA",
             f"worst relative difference {worst:.1e} (outputs, q/k/v gradients); {memory}")]


def layout_parity(shape: dict, work: Path, cache: Path, devices: int) -> list[tuple[str, str]]:
    """FSDP 2, TP 2 and CP 2 over two devices against one, fp32 (torch's collectives)."""
    steps = ["--training.steps", "10", *shape["parity"]]
    one = train(steps, work / "one", cache, dtype="float32")
    rows = []
    for name, extra in PARITY_LAYOUTS.items():
        two = train([*steps, *extra], work / name.replace(" ", ""), cache, nproc=2, dtype="float32")
        worst = max(max(abs(a[key] - b[key]) / abs(b[key]) for key in ("loss", "grad_norm"))
                    for a, b in zip(two, one, strict=True))
        verdict = "ok" if worst <= 1e-4 else "DIFFERENT"
        rows.append((f"parity {name} vs one device ({devices} devices), 10 steps fp32",
                     f"{verdict}: worst relative loss/grad-norm difference {worst:.1e}"))
    return rows


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
        rows += cp_attention(shape["cp"])
        devices = torch.cuda.device_count() if not a.cpu else 2  # on CPU: two gloo processes
        if devices > 1:
            rows += layout_parity(shape, work / "p", cache, devices)
    print(f"\nKiln GPU check on {device} (torch {torch.__version__})\n")
    width = max(len(k) for k, _ in rows)
    print(f"| {'check':<{width}} | result |\n|{'-' * (width + 2)}|--------|")
    for check, result in rows:
        print(f"| {check:<{width}} | {result} |")


if __name__ == "__main__":
    main()
