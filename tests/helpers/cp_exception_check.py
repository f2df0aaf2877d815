"""Run under torchrun (2 ranks): an exception raised while the gloo accelerations' context-parallel
transfers are in flight — the K/V broadcasts in forward, the K/V-gradient all-to-all in backward —
propagates like any other, and every rank can go on: memory reused afterwards is intact, the next
attention is right, and the process exits cleanly (no double free, no abort). Rank 0 prints "ok"."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, ".")
import parallelisms.gloo_accelerations as gloo  # noqa: E402
from components.runtime.distributed import exit_cleanly
from parallelisms.context_parallel import head_tail_positions, shard_sequence  # noqa: E402

SEQ, HEADS, DIM = 1024, 4, 64  # a transfer of a few MiB per rank: long enough to still be in flight


def inputs() -> list[torch.Tensor]:
    """q, k, v of one full sequence [2, heads, SEQ, dim], the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, HEADS, SEQ, DIM, generator=gen) for _ in range(3)]


def local(full: list[torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
    """This rank's head-tail share of q, k, v, as leaves that take gradients."""
    return [shard_sequence(t.transpose(1, 2), positions).transpose(1, 2).contiguous().requires_grad_()
            for t in full]


def raising_on_own_chunks(real, rank: int, kv_arg: int):  # noqa: ANN001, ANN201
    """real, raising when called for this rank's own K/V chunks (argument kv_arg is kv_rank)."""
    def wrapped(*args):  # noqa: ANN002, ANN202
        if args[kv_arg] == rank:
            raise RuntimeError("injected")
        return real(*args)
    return wrapped


def expect_injected(run) -> None:  # noqa: ANN001
    try:
        run()
    except RuntimeError as e:
        if "injected" not in str(e):
            raise
        return
    raise AssertionError("the injected exception did not happen")


def reuse_memory() -> None:
    """Allocate and write what the failed call freed: freed memory still being written shows here."""
    for _ in range(8):
        t = torch.full((2, 2, 2, HEADS, SEQ // 2, DIM), 7.0)
        assert bool((t == 7.0).all())


def main() -> None:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)).get_group()
    positions = head_tail_positions(SEQ, cp, rank)
    full = inputs()

    real_forward, real_backward = gloo.forward_pairs, gloo.backward_pairs
    # forward_pairs(merged, q, k, v, my_rank, kv_rank, cp); backward_pairs(..., my_rank, kv_rank, cp, kernel)
    gloo.forward_pairs = raising_on_own_chunks(real_forward, rank, 5)
    expect_injected(lambda: gloo.overlapped_gather_attention(*local(full, positions), group))
    gloo.forward_pairs = real_forward
    reuse_memory()

    q, k, v = local(full, positions)
    out = gloo.overlapped_gather_attention(q, k, v, group)
    gloo.backward_pairs = raising_on_own_chunks(real_backward, rank, 10)
    expect_injected(lambda: out.sum().backward())
    gloo.backward_pairs = real_backward
    reuse_memory()

    q, k, v = local(full, positions)
    out = gloo.overlapped_gather_attention(q, k, v, group)
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    diff = (out - shard_sequence(want.transpose(1, 2), positions).transpose(1, 2)).abs().max().item()
    assert diff < 1e-5, diff
    if rank == 0:
        print("ok", flush=True)
    exit_cleanly(0)


if __name__ == "__main__":
    main()
