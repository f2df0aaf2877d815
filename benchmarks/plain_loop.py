"""The baseline for benchmarks/benchmark.py: the debug model trained by the shortest plain PyTorch loop.

Same model, init, data windows, optimizer and clipping as Kiln's single-process run, with none of
Kiln's machinery; prints one JSON line with the tokens/s of the timed steps.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from components.data.loader import BatchLoader, TokenWindows
from models import get_model_args, get_model_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", required=True, help="a token .bin file (Kiln's data cache)")
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    spec = get_model_spec("llama3")
    args = get_model_args(spec, a.flavor)
    torch.manual_seed(42)
    model = spec.model_cls(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    loader = BatchLoader(TokenWindows(Path(a.tokens), a.seq_len, args.vocab_size), a.batch, a.batch,
                         0, 1, 42)
    for step in range(1, a.steps + 1):
        if step == a.warmup + 1:
            t0 = time.perf_counter()
        (x, y), = next(loader)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"tps": (a.steps - a.warmup) * a.batch * a.seq_len / elapsed}))


if __name__ == "__main__":
    main()
