"""Ring attention over head-tail sharded sequences: K/V chunks travel around the cp ranks.

Each rank holds two chunks of the sequence (chunk r and chunk 2·cp−1−r, see
context_parallel.head_tail_positions). At ring step t it has the K/V of rank (r − t) mod cp,
attends its query chunks to those key chunks — a query chunk after a key chunk sees all of it,
the same chunk is causal, a query chunk before a key chunk is skipped — and merges the partial
outputs by their log-sum-exp (online softmax). The next K/V block is already in flight while it
computes. Backward runs the ring again with exact recomputation of each block's probabilities
from the saved log-sum-exp; the key/value gradients travel with their block and arrive home after
cp steps. Written for Kiln because torch's ring attention does not run on CPU.
"""

import torch
import torch.distributed as dist


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over the ring's k/v [b, kv_heads, s, d] (GQA allowed)."""
    return _RingAttention.apply(q, k, v, group)


def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _pairs(my_rank: int, kv_rank: int, cp: int) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) for every pair that is not fully masked."""
    out = []
    for qs, qc in enumerate(_chunk_ids(my_rank, cp)):
        for ks, kc in enumerate(_chunk_ids(kv_rank, cp)):
            if qc >= kc:
                out.append((qs, ks, qc == kc))
    return out


def _scores(qc: torch.Tensor, kc: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scores [b, kv_heads, group, cq, ck] of grouped queries against one key chunk."""
    s = torch.matmul(qc, kc.unsqueeze(2).transpose(-1, -2)).float() * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


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
        b, h, s, d = q.shape
        hk = k.shape[1]
        c = s // 2
        scale = d**-0.5
        qg = q.reshape(b, hk, h // hk, s, d)  # query heads grouped by the kv head they share
        kv = torch.stack([k, v])
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        for step in range(cp):
            if step < cp - 1:
                kv_next, works = _rotate(kv, group)
            for qs, ks, causal in _pairs(r, (r - step) % cp, cp):
                kc, vc = kv[0, :, :, ks * c:(ks + 1) * c], kv[1, :, :, ks * c:(ks + 1) * c]
                sc = _scores(qg[..., qs * c:(qs + 1) * c, :], kc, causal, scale)
                lse = torch.logsumexp(sc, dim=-1)
                o = torch.matmul(torch.exp(sc - lse.unsqueeze(-1)).to(vc.dtype), vc.unsqueeze(2)).float()
                if outs[qs] is None:
                    outs[qs], lses[qs] = o, lse
                else:  # online softmax: rescale both parts to the merged normaliser
                    merged = torch.logaddexp(lses[qs], lse)
                    outs[qs] = (outs[qs] * torch.exp(lses[qs] - merged).unsqueeze(-1)
                                + o * torch.exp(lse - merged).unsqueeze(-1))
                    lses[qs] = merged
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        out = torch.cat(outs, dim=3)  # [b, hk, group, s, d] fp32
        lse = torch.cat(lses, dim=3)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.reshape(b, h, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        b, h, s, d = q.shape
        hk = k.shape[1]
        c = s // 2
        scale = d**-0.5
        qg = q.reshape(b, hk, h // hk, s, d)
        dout = grad_out.reshape(b, hk, h // hk, s, d).float()
        delta = (dout * out).sum(-1)  # rowsum(dO · O), the softmax-backward correction
        dq = torch.zeros_like(qg, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp):
            if step < cp - 1:
                kv_next, works = _rotate(kv, group)
            for qs, ks, causal in _pairs(r, (r - step) % cp, cp):
                qsl, ksl = slice(qs * c, (qs + 1) * c), slice(ks * c, (ks + 1) * c)
                qc, kc, vc = qg[..., qsl, :], kv[0, :, :, ksl], kv[1, :, :, ksl]
                p = torch.exp(_scores(qc, kc, causal, scale) - lse[..., qsl].unsqueeze(-1))
                do = dout[..., qsl, :]
                dkv[1, :, :, ksl] += torch.einsum("bkgqc,bkgqd->bkcd", p, do)
                dp = torch.matmul(do, vc.unsqueeze(2).float().transpose(-1, -2))
                ds = p * (dp - delta[..., qsl].unsqueeze(-1)) * scale
                dq[..., qsl, :] += torch.matmul(ds, kc.unsqueeze(2).float())
                dkv[0, :, :, ksl] += torch.einsum("bkgqc,bkgqd->bkcd", ds, qc.float())
            if cp > 1:  # the gradients follow their block; after cp steps they are home
                dkv, dworks = _rotate(dkv, group)
                _wait(dworks)
            if step < cp - 1:
                _wait(works)
                kv = kv_next
        return dq.reshape(b, h, s, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
