"""Causal attention over head-tail sharded sequences, one chunk pair at a time (both CP methods).

A cp rank holds two chunks of the sequence (chunk r and chunk 2·cp−1−r, see
context_parallel.head_tail_positions). Its queries attend chunk by chunk: a query chunk after a
key chunk sees all of it, the same chunk is causal, a query chunk before a key chunk is skipped.
Partial results are merged by their log-sum-exp (online softmax); backward recomputes each pair
from the merged output and log-sum-exp (flash-attention style), so only one pair's work exists
at a time, and each pair runs the device's fused kernel (parallelisms/attention_kernels.py). The
keys and values come from
- `gathered_attention`: all ranks' chunks, already all-gathered (autograd through the gather);
- `ring_attention`: the ring — at step t a rank holds the K/V of rank (r − t) mod cp, the next
  block already in flight; in backward the K/V gradients travel with their block and are home
  after cp steps.
Kiln's own code: torch's context-parallel attention does not run on CPU.
"""

import torch
import torch.distributed as dist

from parallelisms.attention_kernels import PairKernel, pair_backward, pair_forward


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over the ring's k/v [b, kv_heads, s, d] (GQA allowed)."""
    return _RingAttention.apply(q, k, v, group)


def gathered_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, rank: int,
                       cp: int) -> torch.Tensor:
    """Causal attention of rank's q [b, heads, s, d] over k_all/v_all [b, kv_heads, cp·s, d], every
    rank's chunks in rank order."""
    return _GatheredAttention.apply(q, k_all, v_all, rank, cp)


def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _pairs(my_rank: int, kv_rank: int, cp: int) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) for every pair that is not fully masked."""
    return [(qs, ks, qc == kc) for qs, qc in enumerate(_chunk_ids(my_rank, cp))
            for ks, kc in enumerate(_chunk_ids(kv_rank, cp)) if qc >= kc]


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, c, d] → [b, heads, c, d]: each kv head serves heads / kv_heads query heads."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of an expanded [b, heads, c, d] back to [b, kv_heads, c, d]."""
    b, h, c, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, c, d).sum(2)


class Merged:
    """Running output and log-sum-exp of each local query chunk (online softmax)."""

    def __init__(self) -> None:
        self.out: list[torch.Tensor | None] = [None, None]
        self.lse: list[torch.Tensor | None] = [None, None]

    def add(self, slot: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        out, lse = out.float(), lse.float()
        if self.out[slot] is None:
            self.out[slot], self.lse[slot] = out, lse
            return
        merged = torch.logaddexp(self.lse[slot], lse)
        self.out[slot] = (self.out[slot] * torch.exp(self.lse[slot] - merged).unsqueeze(-1)
                          + out * torch.exp(lse - merged).unsqueeze(-1))
        self.lse[slot] = merged

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.out, dim=2).to(dtype), torch.cat(self.lse, dim=2)


def _chunk(t: torch.Tensor, slot: int, c: int) -> torch.Tensor:
    return t[:, :, slot * c:(slot + 1) * c]


def forward_pairs(merged: Merged, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, my_rank: int,
                  kv_rank: int, cp: int) -> PairKernel | None:
    """Add rank kv_rank's two K/V chunks (k, v [b, kv_heads, 2c, d]) to the local queries' results;
    returns the kernel the pairs ran (equal chunks: the same for every pair), None if all masked."""
    c, h = q.shape[2] // 2, q.shape[1]
    kernel = None
    for qs, ks, causal in _pairs(my_rank, kv_rank, cp):
        kc, vc = _expand(_chunk(k, ks, c), h), _expand(_chunk(v, ks, c), h)
        out, lse, kernel = pair_forward(_chunk(q, qs, c), kc, vc, causal)
        merged.add(qs, out, lse)
    return kernel


def backward_pairs(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, my_rank: int,
                   kv_rank: int, cp: int, kernel: PairKernel) -> None:
    """Accumulate the gradients of the pairs of the local queries with rank kv_rank's K/V chunks."""
    c, h, hk = q.shape[2] // 2, q.shape[1], k.shape[1]
    for qs, ks, causal in _pairs(my_rank, kv_rank, cp):
        g_q, g_k, g_v = pair_backward(
            _chunk(dout, qs, c), _chunk(q, qs, c), _expand(_chunk(k, ks, c), h), _expand(_chunk(v, ks, c), h),
            _chunk(out, qs, c), lse[:, :, qs * c:(qs + 1) * c], causal, kernel)
        _chunk(dq, qs, c).add_(g_q)
        _chunk(dk, ks, c).add_(_fold(g_k.float(), hk))
        _chunk(dv, ks, c).add_(_fold(g_v.float(), hk))


def _rotate(t: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Send t to the next rank of the ring and receive the previous rank's (returns before done)."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, (r + 1) % cp), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % cp), group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):  # noqa: ANN001, ANN205 (autograd.Function signature)
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        merged, kernels = Merged(), []
        kv = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:
                kv_next, works = _rotate(kv, group)
            kernels.append(forward_pairs(merged, q, kv[0], kv[1], r, (r - step) % cp, cp))
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel = group, kernels[0]  # the own chunks' pairs: never all masked
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp):
            if step < cp - 1:
                kv_next, works = _rotate(kv, group)
            backward_pairs(dq, dkv[0], dkv[1], dout, q, kv[0], kv[1], out, lse, r, (r - step) % cp, cp,
                           ctx.kernel)
            if cp > 1:  # the gradients follow their block; after cp steps they are home
                dkv, dworks = _rotate(dkv, group)
                _wait(dworks)
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_all, v_all, rank, cp):  # noqa: ANN001, ANN205
        s = q.shape[2]
        merged = Merged()
        kernels = [forward_pairs(merged, q, k_all[:, :, j * s:(j + 1) * s], v_all[:, :, j * s:(j + 1) * s],
                                 rank, j, cp) for j in range(cp)]
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.rank, ctx.cp, ctx.kernel = rank, cp, kernels[rank]
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k_all, v_all, out, lse = ctx.saved_tensors
        s = q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k_all, dtype=torch.float32)
        dv = torch.zeros_like(v_all, dtype=torch.float32)
        for j in range(ctx.cp):
            part = slice(j * s, (j + 1) * s)
            backward_pairs(dq, dk[:, :, part], dv[:, :, part], dout, q, k_all[:, :, part], v_all[:, :, part],
                           out, lse, ctx.rank, j, ctx.cp, ctx.kernel)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None
