"""Run under torchrun: context-parallel attention (both rotate methods; allgather through funcol's
all-gather — every backend's route — and through the gloo accelerations' overlapped broadcasts; MHA
and GQA) against full causal attention on the gathered sequence; prints the worst differences,
exits 1 if any > 1e-5."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, ".")
from parallelisms.context_parallel import ContextParallelAttention, shard_sequence  # noqa: E402
from parallelisms.gloo_accelerations import overlapped_gather_attention  # noqa: E402


def check(mesh, method: str, heads: int, kv_heads: int, seq: int = 32, dim: int = 16) -> float:
    """Max abs difference of the output and the q/k/v gradients at this rank's positions."""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    q = torch.randn(2, heads, seq, dim, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, dim, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, dim, generator=gen, requires_grad=True)
    weight = torch.randn(2, heads, seq, dim, generator=gen)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    (full * weight).sum().backward()

    core = ContextParallelAttention(mesh, seq, method.removesuffix("-overlapped"))
    if method.endswith("-overlapped"):
        core.attend = overlapped_gather_attention
    pos = core.positions
    local = [shard_sequence(t.detach().transpose(1, 2), pos).transpose(1, 2).requires_grad_()
             for t in (q, k, v)]
    out = core(*local)
    (out * shard_sequence(weight.transpose(1, 2), pos).transpose(1, 2)).sum().backward()
    diffs = [(out - shard_sequence(full.detach().transpose(1, 2), pos).transpose(1, 2)).abs().max()]
    for mine, ref in zip(local, (q, k, v), strict=True):
        diffs.append((mine.grad - shard_sequence(ref.grad.transpose(1, 2), pos).transpose(1, 2)).abs().max())
    return max(d.item() for d in diffs)


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    worst = 0.0
    for method in ("allgather", "allgather-overlapped", "ring"):
        for heads, kv_heads in ((4, 4), (4, 2), (6, 1)):
            diff = torch.tensor(check(mesh, method, heads, kv_heads))
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            worst = max(worst, diff.item())
            if dist.get_rank() == 0:
                print(f"cp {dist.get_world_size()} {method:16s} heads {heads} kv_heads {kv_heads}: "
                      f"max abs diff {diff.item():.2e}", flush=True)
    dist.barrier()
    mesh = None
    dist.destroy_process_group()
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
