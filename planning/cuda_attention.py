"""Attention in a plan for CUDA as CUDA computes it.

The planner's fake tensors live on the CPU, so F.scaled_dot_product_attention picks among the CPU's
kernels. Where the values' head dim differs from the queries' (DeepSeek-V3's latent attention: 192
and 128), the CPU has no fused kernel and takes its math path, which keeps a [heads, seq, seq] score
matrix for backward, while CUDA runs its memory-efficient kernel, which keeps the output and the
log-sum-exp (what that did to DeepSeek-V3's plans: docs/planning.md). A plan for CUDA runs that
kernel's fake implementation in such a call (torch.ops.aten._scaled_dot_product_efficient_attention,
what CUDA's SDPA dispatches to, and what context parallel's pairs call already:
parallelisms/attention_kernels.py). Every other call is left to torch: the CPU's flash kernel keeps
what CUDA's flash kernel keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def _needs_cuda_kernel(query: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
                       enable_gqa: bool) -> bool:
    """A call the CPU computes by its math path and CUDA by the memory-efficient kernel."""
    return (attn_mask is None and dropout_p == 0.0 and not enable_gqa
            and query.shape[-1] != value.shape[-1])


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """For the duration: F.scaled_dot_product_attention runs CUDA's memory-efficient kernel where the
    CPU would take its math path (the planner's fake tensors only: that kernel has no CPU code)."""
    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        if not _needs_cuda_kernel(query, value, attn_mask, dropout_p, enable_gqa):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # backward needs the log-sum-exp; a forward without a graph (AC's first pass) skips it, as SDPA does
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, grad, 0.0, is_causal, scale=scale)
        return out

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
