"""Grouped-query causal self-attention through F.scaled_dot_product_attention."""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_
from models.common.norm import RMSNorm
from models.common.rope import apply_rope


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over [batch, heads, seq, head_dim]; fewer k/v heads are shared by query groups."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              doc_ids: torch.Tensor) -> torch.Tensor:
    """Block-causal SDPA: a token sees earlier tokens of its own document only (doc_ids [batch, seq])."""
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # [batch, seq, seq]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                          enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Multi-head attention where n_kv_heads key/value heads are shared by groups of query heads.

    `core_attention` (q, k, v → output) is plain causal SDPA; context parallel swaps it for one
    that also attends to the other ranks' keys (parallelisms/context_parallel.py).

    Llama's is the default. Qwen3 adds two options: `head_dim` set apart from dim / n_heads, and
    `qk_norm_eps`, which gives every head's queries and keys an RMSNorm over head_dim (`q_norm`,
    `k_norm`, one weight shared by all heads) before RoPE. Without them the module and its parameter
    names are Llama's.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int | None = None,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim or dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core_attention = causal_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; rope [seq, head_dim] (or per row [batch, seq, head_dim]); doc_ids
        [batch, seq] restricts attention to each token's document (packed windows)."""
        bsz, seqlen, _ = x.shape
        # -1 instead of the head count: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:  # per head, over head_dim, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        # The table covers max_seq_len (or this rank's positions under context parallel); this
        # attention sees the whole sequence (gathered under SP).
        rope = rope[:seqlen] if rope.dim() == 2 else rope[:, :seqlen]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bsz, heads, seq, head_dim]
        if doc_ids is None:
            out = self.core_attention(q, k, v)
        else:
            out = document_causal_attention(q, k, v, doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, std_out: float) -> None:
        """Truncated-normal init; the output projection gets a depth-scaled std."""
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=std_out)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()


def attention_flops_per_token(n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Forward+backward FLOPs per token of the causal score and value matmuls (12·L·H·Q·T as in PaLM
    and TorchTitan: the causal mask is not credited)."""
    return 12 * n_layers * n_heads * head_dim * seq_len

