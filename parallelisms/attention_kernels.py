"""One chunk pair of attention through the device's fused kernel, which returns the log-sum-exp in
forward and takes it in backward: context parallel merges pairs by it (online softmax) and so never
materialises a [chunk, chunk] score matrix — the matrix that would not fit at long context, the
case context parallel exists for.

- CPU: torch's CPU flash kernel.
- CUDA: the flash kernel where it takes the dtype and head size (fp16/bf16, head dim a multiple of
  8 up to 256, compute capability 8.0 or newer), else the memory-efficient kernel (fp32 too, and a
  value head dim unlike the query's).

These are the ops torch's own SDPA and its context parallel dispatch to; they are private
(components/runtime/torch_private.py lists them). There is no slow fallback: a device with neither kernel
fails here, loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class PairKernel:
    """Which kernel ran a pair, and what its backward needs from its forward (dropout is 0, so the
    random-number state is only passed through)."""

    name: str  # "cpu_flash", "flash" or "efficient"
    extra: tuple = ()


def choose_kernel(q: torch.Tensor, v: torch.Tensor) -> str:
    """The fused kernel for q [b, heads, c, d] and v on their device."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type != "cuda":
        raise NotImplementedError(f"context parallel attention has no fused kernel on {q.device.type}")
    head_dim = q.shape[-1]
    flash_shape = head_dim == v.shape[-1] and head_dim % 8 == 0 and head_dim <= 256
    half = q.dtype in (torch.float16, torch.bfloat16)
    recent = torch.cuda.get_device_capability(q.device) >= (8, 0)
    if half and flash_shape and recent and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    return "efficient"


def pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor, PairKernel]:
    """(output [b, h, c, dv], log-sum-exp [b, h, c] in fp32, what backward needs) of attention of
    q over k/v (same heads; causal: aligned at the top left, the diagonal pair of equal chunks)."""
    kernel = kernel or choose_kernel(q, v)
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.float(), PairKernel(kernel)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, PairKernel(kernel, (cum_q, cum_k, max_q, max_k, seed, offset))
    if kernel == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal)
        # The kernel pads the log-sum-exp's length (to a multiple of 32); its backward wants it so.
        return out, lse[..., :q.shape[2]], PairKernel(kernel, (lse.shape[-1], seed, offset))
    raise ValueError(f"unknown attention kernel {kernel!r}")


def pair_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, kernel: PairKernel
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of one pair, given the queries' merged output and log-sum-exp (over
    every pair they attend): the kernel recomputes this pair's probabilities from them."""
    lse = lse.contiguous()
    if kernel.name == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    if kernel.name == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = kernel.extra
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
    if kernel.name == "efficient":
        padded, seed, offset = kernel.extra
        lse = F.pad(lse, (0, padded - lse.shape[-1]))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)
        return dq, dk, dv
    raise ValueError(f"unknown attention kernel {kernel.name!r}")
