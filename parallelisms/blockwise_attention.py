"""Causal attention over head-tail sharded sequences, one chunk pair at a time (both CP methods).

A cp rank holds two chunks of the sequence (chunk r and chunk 2·cp−1−r, see
context_parallel.head_tail_positions). Its queries attend chunk by chunk: a query chunk after a
key chunk sees all of it, the same chunk is causal, a query chunk before a key chunk is skipped.
Partial results are merged by their log-sum-exp (online softmax); backward recomputes each pair
from the saved output and log-sum-exp (flash-attention style), so only one pair's scores exist
at a time. The keys and values come from
- `gathered_attention`: all ranks' chunks, already all-gathered (autograd through the gather);
- `overlapped_gather_attention` (gloo): the gather in flight while the local chunk pairs compute,
  and in backward the remote chunks' gradients reduce-scattered while the local pairs' backward
  computes;
- `ring_attention`: the ring — at step t a rank holds the K/V of rank (r − t) mod cp, the next
  block already in flight; in backward the K/V gradients travel with their block and are home
  after cp steps.
On CPU each pair runs torch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`
and its backward, which return and take the log-sum-exp); elsewhere plain matmuls. Kiln's own
code: torch's context-parallel attention does not run on CPU.
"""

import torch
import torch.distributed as dist

from parallelisms.cpu_collectives import BroadcastAllGather, unowned


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over the ring's k/v [b, kv_heads, s, d] (GQA allowed)."""
    return _RingAttention.apply(q, k, v, group)


def gathered_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, rank: int,
                       cp: int) -> torch.Tensor:
    """Causal attention of rank's q [b, heads, s, d] over k_all/v_all [b, kv_heads, cp·s, d], every
    rank's chunks in rank order."""
    return _GatheredAttention.apply(q, k_all, v_all, rank, cp)


def overlapped_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over every cp rank's k/v [b, kv_heads, s, d], gathered
    through gloo broadcasts that move while this rank's own chunk pairs compute."""
    return _OverlappedGatherAttention.apply(q, k, v, group)


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


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, h, c, d], log-sum-exp [b, h, c] fp32) of one chunk pair (k, v expanded);
    fused (default: on CPU) uses torch's CPU flash kernel, else plain matmuls."""
    if q.device.type == "cpu" if fused is None else fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.float()
    s = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(v.dtype), v), lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, fused: bool | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of one chunk pair, given the merged output and log-sum-exp of the queries."""
    if q.device.type == "cpu" if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    scale = q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dout32 = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout32)
    dp = torch.matmul(dout32, v.float().transpose(-1, -2))
    ds = p * (dp - (dout32 * out.float()).sum(-1, keepdim=True)) * scale
    return torch.matmul(ds, k.float()), torch.matmul(ds.transpose(-1, -2), q.float()), dv


class _Merged:
    """Running output and log-sum-exp of each local query chunk (online softmax)."""

    def __init__(self) -> None:
        self.out: list[torch.Tensor | None] = [None, None]
        self.lse: list[torch.Tensor | None] = [None, None]

    def add(self, slot: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        out = out.float()
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


def _forward_pairs(merged: _Merged, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, my_rank: int,
                   kv_rank: int, cp: int) -> None:
    """Add rank kv_rank's two K/V chunks (k, v [b, kv_heads, 2c, d]) to the local queries' results."""
    c, h = q.shape[2] // 2, q.shape[1]
    for qs, ks, causal in _pairs(my_rank, kv_rank, cp):
        kc, vc = _expand(_chunk(k, ks, c), h), _expand(_chunk(v, ks, c), h)
        out, lse = _block_forward(_chunk(q, qs, c), kc, vc, causal)
        merged.add(qs, out, lse)


def _backward_pairs(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, my_rank: int,
                    kv_rank: int, cp: int) -> None:
    """Accumulate the gradients of the pairs of the local queries with rank kv_rank's K/V chunks."""
    c, h, hk = q.shape[2] // 2, q.shape[1], k.shape[1]
    for qs, ks, causal in _pairs(my_rank, kv_rank, cp):
        g_q, g_k, g_v = _block_backward(
            _chunk(dout, qs, c), _chunk(q, qs, c), _expand(_chunk(k, ks, c), h), _expand(_chunk(v, ks, c), h),
            _chunk(out, qs, c), lse[:, :, qs * c:(qs + 1) * c], causal)
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
        merged = _Merged()
        kv = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:
                kv_next, works = _rotate(kv, group)
            _forward_pairs(merged, q, kv[0], kv[1], r, (r - step) % cp, cp)
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
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
            _backward_pairs(dq, dkv[0], dkv[1], dout, q, kv[0], kv[1], out, lse, r, (r - step) % cp, cp)
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
        merged = _Merged()
        for j in range(cp):
            part = slice(j * s, (j + 1) * s)
            _forward_pairs(merged, q, k_all[:, :, part], v_all[:, :, part], rank, j, cp)
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.rank, ctx.cp = rank, cp
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
            _backward_pairs(dq, dk[:, :, part], dv[:, :, part], dout, q, k_all[:, :, part], v_all[:, :, part],
                            out, lse, ctx.rank, j, ctx.cp)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None


class _OverlappedGatherAttention(torch.autograd.Function):
    """Forward: K/V of every rank gathered by async broadcasts (CPU has no streams: gloo's threads
    move the bytes) while the queries attend this rank's own chunks, then the other ranks' chunks.
    Backward: the other ranks' chunk pairs first, their K/V gradients sent home by one async
    all-to-all while the own pairs' backward runs, then summed with what the other ranks sent."""

    @staticmethod
    def forward(ctx, q, k, v, group):  # noqa: ANN001, ANN205
        cp, r = group.size(), group.rank()
        kv = torch.stack([k, v])
        gathered = kv.new_empty((cp, *kv.shape))  # [cp, 2, b, kv_heads, s, d], rank order
        work = BroadcastAllGather()(gathered, kv, group, async_op=True)
        merged = _Merged()
        _forward_pairs(merged, q, k, v, r, r, cp)
        work.wait()
        for j in range(cp):
            if j != r:
                _forward_pairs(merged, q, gathered[j, 0], gathered[j, 1], r, j, cp)
        out, lse = merged.result(q.dtype)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, gathered, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = group.size(), group.rank()
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(gathered.shape, dtype=torch.float32, device=q.device)
        for j in range(cp):
            if j != r:
                _backward_pairs(dq, dkv[j, 0], dkv[j, 1], dout, q, gathered[j, 0], gathered[j, 1], out, lse, r, j, cp)
        send = dkv.to(gathered.dtype)  # slot r stays zero: the own gradient is added below
        received = torch.empty_like(send)
        work = dist.all_to_all_single(unowned(received), unowned(send), group=group, async_op=True)
        own = torch.zeros(gathered.shape[1:], dtype=torch.float32, device=q.device)
        _backward_pairs(dq, own[0], own[1], dout, q, gathered[r, 0], gathered[r, 1], out, lse, r, r, cp)
        work.wait()
        dk, dv = (own + received.float().sum(0)).to(gathered.dtype)
        return dq.to(q.dtype), dk, dv, None
