"""The families table of benchmarks/benchmark.py (`--tables families`): each model family's debug
model beside a Llama 3 of the nearest parameter count (the debug shape, dim 256, with as many blocks
as it takes: benchmarks/matched_llama.py), one process, the debug configs' shape (seq 256, global
batch 8). Runs alternate family / Llama, so drift on a shared machine hits both alike; a cell is the
median over runs of tokens/s between the warm-up step and the last. MoE models compute with their
active parameters only, so the table gives parameters in all and active, the FLOPs a token costs
(train.py's count) and the compute rate (tokens/s × FLOPs per token) beside tokens/s.
"""

import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models import get_model_args, get_model_spec  # noqa: E402

# (row, model name, flavor, train.py arguments beyond the model)
FAMILIES = [
    ("Qwen3 dense", "qwen3", "debug", []),
    ("Qwen3 MoE", "qwen3", "moe_debug", []),
    ("MoE (Llama blocks)", "moe", "debug", []),
    ("DeepSeek-V3", "deepseek_v3", "debug", []),
    ("DeepSeek-V3 + MTP 1", "deepseek_v3", "debug", ["--model.mtp_depth", "1"]),
]


def model_size(name: str, flavor: str, mtp_depth: int = 0) -> tuple[int, int, int]:
    """(parameters, active parameters, training FLOPs per token at seq 256) of a flavor, on meta."""
    spec = get_model_spec(name)
    args = get_model_args(spec, flavor)
    if mtp_depth:
        args = dataclasses.replace(args, mtp_depth=mtp_depth)
    with torch.device("meta"):
        model = spec.model_cls(args)
    params = sum(p.numel() for p in model.parameters())
    moe = getattr(args, "moe", None)
    inactive = 0
    if moe is not None:
        blocks = [m for m in model.modules() if getattr(m, "moe_enabled", False)]
        inactive = len(blocks) * (moe.num_experts - moe.top_k) * 3 * args.dim * moe.hidden_dim
    return params, params - inactive, spec.flops_per_token_fn(args, params, 256)


def matched_llama(params: int) -> tuple[str, int, int]:
    """(flavor, parameters, FLOPs per token) of the layers_N Llama nearest to `params`."""
    import benchmarks.matched_llama  # noqa: F401  (registers the layers_N flavors)

    sizes = {f"layers_{n}": model_size("llama3", f"layers_{n}") for n in range(1, 33)}
    flavor = min(sizes, key=lambda f: abs(sizes[f][0] - params))
    return flavor, sizes[flavor][0], sizes[flavor][2]


def families_table(steps: int, warmup: int, repeats: int,
                   tps: Callable[[list[str]], float]) -> None:
    """Print the table; tps(train.py arguments) runs one process and returns its tokens/s."""
    print("\n| model | parameters (active) | MFLOP/token | tok/s | Llama of that size | its tok/s | "
          "tok/s ratio | compute-rate ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row, name, flavor, extra in FAMILIES:
        mtp = int(extra[1]) if extra else 0
        params, active, flops = model_size(name, flavor, mtp)
        llama, llama_params, llama_flops = matched_llama(params)
        ours = ["--model.name", name, "--model.flavor", flavor, *extra]
        theirs = ["--job.custom_import", "benchmarks/matched_llama.py", "--model.name", "llama3",
                  "--model.flavor", llama]
        a, b = [], []
        for _ in range(repeats):  # A B A B ...
            a.append(tps(ours))
            b.append(tps(theirs))
        fam, base = statistics.median(a), statistics.median(b)
        print(f"| {row} | {params / 1e6:.2f}M ({active / 1e6:.2f}M) | {flops / 1e6:.1f} | {fam:,.0f} | "
              f"{llama} ({llama_params / 1e6:.2f}M, {llama_flops / 1e6:.1f} MFLOP/token) | {base:,.0f} | "
              f"{fam / base:.2f} | {fam * flops / (base * llama_flops):.2f} |")
