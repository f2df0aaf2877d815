"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries and keys/values pass through low-rank
latents, and RoPE acts on a few extra dimensions per head whose key is shared by every head.

Per head the query is [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)] and the key
[k_nope | k_pe], with k_pe the same for all heads; values have v_head_dim. The softmax scale is
(qk_nope + qk_rope)^-0.5, times YaRN's mscale² when YaRN is on: that extra factor is folded into the
query, so `core_attention` stays plain causal SDPA over (q, k, v) and can be swapped like the one in
models/common/attention.py (context parallel, generation's KV cache).

Generation caches what MLA compresses (`make_kv_cache`, models/protocol.py): per token the normed KV
latent and the rotary key, kv_lora_rank + qk_rope_head_dim numbers (576 in V3, against 128 heads ×
(192 + 128) keys and values), and attends in the latent space: wkv_b's key half is absorbed into the
query and its value half applied after the softmax, so the cached tokens are never expanded.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import causal_attention, document_causal_attention
from models.common.init import trunc_normal_
from models.common.norm import RMSNorm
from models.common.rope import YarnScaling, apply_rope, yarn_softmax_factor


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


LATENT_NORM_EPS = 1e-6  # the latents' RMSNorms keep DeepSeek's eps whatever the model's norm_eps


class LatentKVCache:
    """Generation's cache of one MLA layer: the normed KV latent [batch, tokens, kv_lora_rank] and
    the rotated shared key [batch, tokens, qk_rope_head_dim] of every token so far. Installed as the
    layer's core_attention for the duration of generate(); MLA's forward reads it instead."""

    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None
        self.k_pe: torch.Tensor | None = None

    def extend(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' latent and rotary key; returns those of every token so far."""
        self.latent = latent if self.latent is None else torch.cat([self.latent, latent], dim=1)
        self.k_pe = k_pe if self.k_pe is None else torch.cat([self.k_pe, k_pe], dim=1)
        return self.latent, self.k_pe

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LatentKVCache is read by MultiHeadLatentAttention.forward, not called")


class MultiHeadLatentAttention(nn.Module):
    """MLA: q from x by wq (q_lora_rank None) or wq_b(q_norm(wq_a(x))); [kv latent | k_pe] from
    wkv_a(x); k_nope and v per head from wkv_b(kv_norm(kv latent)); RoPE on q_pe and k_pe."""

    def __init__(self, dim: int, n_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 rope_scaling: YarnScaling | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        # SDPA scales by qk_head_dim^-0.5 itself; YaRN's extra factor goes into the query.
        self.query_factor = yarn_softmax_factor(rope_scaling)
        self.core_attention = causal_attention
        # Tensor parallel: each rank uses the shared rotary key for its own heads only, so the
        # gradient of k_pe is a partial sum there; TP sets this to sum it (parallelize.py).
        self.shared_key_grad_sync: Callable[[torch.Tensor], torch.Tensor] = _identity
        # Context parallel's ring attention gathers keys and values stacked, so it needs them equally
        # wide: CP sets this to pad values with zeros to the key width (and cut the output back).
        self.pad_values_to_keys = False

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; rope [seq, qk_rope_head_dim] (or per row [batch, seq, ...]); doc_ids
        [batch, seq] keeps attention inside each token's document."""
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        # -1 instead of the head count: under tensor parallel each rank holds a slice of the heads.
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if isinstance(self.core_attention, LatentKVCache):
            return self._latent_cached(q_nope, q_pe, self.kv_norm(latent), k_pe, rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        rope = rope[:seqlen] if rope.dim() == 2 else rope[:, :seqlen]
        q_pe = apply_rope(q_pe, rope)
        k_pe = apply_rope(self.shared_key_grad_sync(k_pe).unsqueeze(2), rope)  # one key, every head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bsz, heads, seq, head_dim]
        pad = q.shape[-1] - v.shape[-1] if self.pad_values_to_keys else 0
        if pad > 0:
            v = F.pad(v, (0, pad))
        if doc_ids is None:
            out = self.core_attention(q, k, v)
        else:
            out = document_causal_attention(q, k, v, doc_ids)
        if pad > 0:
            out = out[..., : self.v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def make_kv_cache(self) -> LatentKVCache:
        """Generation's cache for this layer: the compressed latent, not the expanded keys and values."""
        return LatentKVCache()

    def _latent_cached(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       k_pe: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Attention of the new tokens over every cached one, in the latent space (one process)."""
        bsz, new, heads, _ = q_nope.shape
        rope = rope[:new] if rope.dim() == 2 else rope[:, :new]
        q_pe = apply_rope(q_pe, rope) * self.query_factor
        k_pe = apply_rope(k_pe.unsqueeze(2), rope).squeeze(2)
        latent, k_pe = self.core_attention.extend(latent, k_pe)
        w = self.wkv_b.weight.view(heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_key, w_value = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.einsum("bshd,hdr->bshr", q_nope * self.query_factor, w_key)
        scores = (torch.einsum("bshr,btr->bhst", q_latent, latent)
                  + torch.einsum("bshd,btd->bhst", q_pe, k_pe)).float() * self.qk_head_dim**-0.5
        total = latent.shape[1]
        if new > 1:  # new token i sits at position total - new + i
            seen = torch.ones(new, total, dtype=torch.bool, device=scores.device).tril(total - new)
            scores = scores.masked_fill(~seen, float("-inf"))
        probs = scores.softmax(-1).to(latent.dtype)
        out = torch.einsum("bhst,btr->bshr", probs, latent)
        out = torch.einsum("bshr,hdr->bshd", out, w_value)
        return self.wo(out.reshape(bsz, new, -1))

    def init_weights(self, std_out: float) -> None:
        """Truncated-normal init, the latent norms at one; the output projection gets a depth-scaled std."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            lin = getattr(self, name, None)
            if lin is not None:
                trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for norm in (getattr(self, "q_norm", None), self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
        trunc_normal_(self.wo.weight, mean=0.0, std=std_out)
