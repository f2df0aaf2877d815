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


@dataclass
class YarnScaling:
    """YaRN long-context scaling (DeepSeek-V2/V3): wavelengths longer than the original context are
    slowed by `factor`, short ones kept, the band between (set by beta_fast / beta_slow rotations)
    blended linearly; the cos/sin table is multiplied by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), and an MLA model also multiplies its softmax scale by
    mscale(factor, mscale_all_dim)² (yarn_softmax_factor). `factor` 1.0 disables it."""

    factor: float = 1.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # 0 = the table gets yarn_mscale(factor) and the softmax nothing
    truncate: bool = True  # round the blended band outwards to whole pairs


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 · mscale · ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_table_factor(scaling: YarnScaling) -> float:
    """What YaRN multiplies the cos/sin table by (transformers' attention_factor)."""
    if scaling.mscale and scaling.mscale_all_dim:
        f = scaling.factor
        return yarn_mscale(f, scaling.mscale) / yarn_mscale(f, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_softmax_factor(scaling: YarnScaling | None) -> float:
    """What MLA multiplies its softmax scale by: mscale(factor, mscale_all_dim)², 1 when off."""
    if scaling is None or scaling.factor == 1.0 or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def yarn_frequencies(head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """Inverse frequencies of the rotary pairs under YaRN (as transformers' _compute_yarn_parameters)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))

    def pair_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
        return head_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(s.beta_fast), pair_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (short wavelengths) keeps the frequency, ramp 1 (long ones) divides it by the factor.
    return (inv_freq / s.factor * ramp + inv_freq * (1 - ramp)).float()


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


def rope_cache(head_dim: int, max_seq_len: int, theta: float,
               scaling: RopeScaling | YarnScaling | None) -> torch.Tensor:
    """A [max_seq_len, head_dim] table: cos in the first half of the last dim, sin in the second
    (under YaRN both times yarn_table_factor)."""
    if isinstance(scaling, YarnScaling):
        if scaling.factor == 1.0:
            return rope_cache(head_dim, max_seq_len, theta, None)
        inv_freq = yarn_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        return torch.cat([angles.cos(), angles.sin()], dim=-1) * yarn_table_factor(scaling)
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
