"""An independent reference for benchmarks/benchmark.py: a Llama written here from scratch, nanoGPT
style — none of Kiln's model code — trained by the shortest loop, one process or FSDP2 under
torchrun. Same shape, init scheme, data windows, optimizer and clipping as Kiln's debug run, so
`Kiln / reference` in the speed table says how fast Kiln's model and trainer are, not just how
much its machinery costs (benchmarks/plain_loop.py, which trains Kiln's own model, says that).

    python benchmarks/reference_loop.py --tokens data_cache/train-….bin [--batch 4 --seq-len 128]
    torchrun --nproc-per-node 2 benchmarks/reference_loop.py --tokens … (FSDP2 over the ranks)

Prints one JSON line: the global tokens/s of the median timed step and the peak RSS of rank 0.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


class Block(nn.Module):
    """Pre-norm attention (complex RoPE, SDPA) and SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k = rotate(q, freqs), rotate(k, freqs)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on [b, s, heads, head_dim] with complex frequencies [s, head_dim / 2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3).type_as(x)


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / (500000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads)))
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 init, residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.trunc_normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.freqs[: tokens.shape[1]])
        return self.head(self.norm(x))


def batches(path: Path, seq: int, batch: int, rank: int, world: int, seed: int = 42):
    """Random windows of seq + 1 tokens; each rank takes its rows of the global batch."""
    meta = json.loads(path.with_suffix(".json").read_text()) if path.with_suffix(".json").exists() else {}
    tokens = np.memmap(path, dtype=np.dtype(meta.get("dtype", "uint16")), mode="r")
    starts = np.random.default_rng(seed)
    while True:
        idx = starts.integers(0, len(tokens) - seq - 1, batch * world)[rank * batch:(rank + 1) * batch]
        rows = torch.from_numpy(np.stack([tokens[i:i + seq + 1].astype(np.int64) for i in idx]))
        yield rows[:, :-1], rows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", required=True, type=Path, help="a token .bin file (Kiln's data cache)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=4, help="rows per rank")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--ac", action="store_true", help="recompute each block in backward (full AC)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(42)
    model = Llama(a.vocab, a.dim, a.layers, a.heads, a.hidden, a.seq_len)
    for i, block in enumerate(model.blocks):
        if a.ac:
            block = checkpoint_wrapper(block)
        if a.compile:
            block.compile()  # in place: FSDP below still sees the block module
        model.blocks[i] = block
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    data = batches(a.tokens, a.seq_len, a.batch, rank, world)
    for step in range(1, a.steps + 1):
        if step == a.warmup + 1:
            t0, step_times = time.perf_counter(), []
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > a.warmup:
            step_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
    elapsed = statistics.median(step_times) * (a.steps - a.warmup)
    if rank == 0:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"tps": (a.steps - a.warmup) * a.batch * world * a.seq_len / elapsed,
                          "peak_rss_mib": round(rss)}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
