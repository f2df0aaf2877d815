"""Rotary position embeddings: a real cos/sin table (sliceable, indexable, storable like any
tensor), applied as one complex multiply per tensor (fewer, larger kernels than rotating real halves)."""

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeScaling:
    """Llama 3.1 long-context frequency scaling (`scale_factor` 1.0 disables it)."""

    scale_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of the rotary pairs, optionally rescaled as in Llama 3.1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None or scaling.scale_factor == 1.0:
        return inv_freq.float()
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by the factor, short ones kept, the band between blended.
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.scale_factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.scale_factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out).float()


def rope_cache(head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """A [max_seq_len, head_dim] table: cos in the first half of the last dim, sin in the second."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by the table rows for its positions: [seq, head_dim],
    or [batch, seq, head_dim] when rows have their own positions (documents restarting at 0).

    Pairs are interleaved (x[2i], x[2i+1]) as in Meta's Llama checkpoints; each pair is a complex
    number turned by the angle of its frequency (computed in at least float32).
    """
    work = torch.promote_types(x.dtype, torch.float32)
    half = cache.shape[-1] // 2
    turn = torch.complex(cache[..., :half].to(work), cache[..., half:].to(work)).unsqueeze(-2)
    pairs = torch.view_as_complex(x.to(work).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)
