"""What `scripts/plan.py --search` finds and what it costs at real sizes: Llama 3 8B / 70B / 405B and
the MoE families at the scales their runs are published at, on H100s, each search timed on this
machine (every plan on fake tensors, as many side by side as there are cores).

    python benchmarks/search_real_sizes.py [--rows 8b,70b_64,...] [--top 3]

Prints one table row per search: the layouts enumerated, refused, distinct and timed, sized and
ranked, checked against memory, the fake plans run, the seconds, and the fastest layout that fits
with its predicted tokens/s/GPU.
"""

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config.loading import load_config  # noqa: E402
from planning.devices import DEVICES  # noqa: E402
from planning.search import search  # noqa: E402

SEQ_8K = ["--training.seq_len", "8192"]

# name → (what, world, arguments): the global batches of TorchTitan's Llama 3 tables (8B: 2 rows per
# GPU; 70B: 512 on 256 GPUs; 405B: 256 on 512), the worked example of docs/planning.md (70B on 64),
# DeepSeek-V3's config batch, and 256 sequences for Qwen3 30B-A3B (its config sets none).
ROWS = {
    "8b": ("Llama 3 8B, 8 H100", 8, ["--config", "llama3_8b", *SEQ_8K, "--training.global_batch_size", "16"]),
    "70b_64": ("Llama 3 70B, 64 H100", 64, ["--config", "llama3_70b", *SEQ_8K,
                                            "--training.global_batch_size", "128"]),
    "70b_256": ("Llama 3 70B, 256 H100", 256, ["--config", "llama3_70b", *SEQ_8K,
                                               "--training.global_batch_size", "512"]),
    "405b": ("Llama 3 405B, 512 H100", 512, ["--config", "llama3_405b", *SEQ_8K,
                                             "--training.global_batch_size", "256"]),
    "qwen3_moe": ("Qwen3 30B-A3B, 64 H100", 64, ["--config", "qwen3_30b_a3b",
                                                 "--training.global_batch_size", "256"]),
    "deepseek_v3": ("DeepSeek-V3 671B, 512 H100", 512, ["--config", "deepseek_v3_671b"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--top", type=int, default=10, help="layouts that fit to find, as plan.py --top")
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"{os.cpu_count()} cores; the best of each search, on H100 80GB\n")
    print("| search | enumerated | refused | distinct | timed | sized | checked | fake plans | seconds | "
          "best layout | tokens/s/GPU | peak GiB |\n" + "|---" + "|---:" * 8 + "|---|---:|---:|", flush=True)
    for name in opts.rows.split(","):
        what, world, args = ROWS[name]
        r = search(load_config(args), world, DEVICES["h100"], top=opts.top)
        best = r.ranked[0] if r.ranked else None
        layout = best.describe() if best else "nothing fits"
        speed = f"{best.tokens_per_second_per_device:,.0f}" if best else "–"
        peak = f"{best.peak / 2**30:.1f}" if best else "–"
        print(f"| {what} | {r.considered} | {r.refused} | {r.distinct} | {r.distinct - r.untimed} | "
              f"{r.sized} | {r.checked} | {r.planned} | {r.seconds:.0f} | {layout} | {speed} | {peak} |",
              flush=True)
        for failure in r.failed:
            print(f"  plan failed: {failure}", file=sys.stderr)


if __name__ == "__main__":
    main()
