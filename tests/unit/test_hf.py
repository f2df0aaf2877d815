"""Hugging Face's rotate-half RoPE against Kiln's interleaved one: the row permutation the converter
applies is exact and makes the two agree. The conversion itself, run as a user runs it, is
tests/e2e/test_hf_runs.py."""

import torch

from models.common.rope import apply_rope, rope_cache
from models.llama3.state_dict_adapter import half_to_interleaved, interleaved_to_half


def test_rope_permutation_is_evens_then_odds():
    """Per head, HF's row j is Kiln's row 2j and row j + head_dim/2 is row 2j+1; inverse is exact."""
    rows = torch.arange(16.0).unsqueeze(1)  # 2 heads of head_dim 8
    got = interleaved_to_half(rows, n_heads=2).flatten().long().tolist()
    assert got == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    w = torch.randn(24, 5)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, 3), 3), w)


def test_permuted_rows_rotate_like_rotate_half():
    """Kiln's interleaved RoPE on x equals HF's rotate-half RoPE on x with the rows permuted."""
    head_dim, seq = 16, 12
    x = torch.randn(2, seq, 3, head_dim)
    cache = rope_cache(head_dim, seq, 500000.0, None)
    perm = interleaved_to_half(torch.arange(head_dim).unsqueeze(1), 1).flatten()
    cos, sin = cache[:, : head_dim // 2].repeat(1, 2), cache[:, head_dim // 2 :].repeat(1, 2)
    xh = x[..., perm]
    rotate_half = torch.cat([-xh[..., head_dim // 2 :], xh[..., : head_dim // 2]], dim=-1)
    hf = xh * cos[:, None] + rotate_half * sin[:, None]
    torch.testing.assert_close(apply_rope(x, cache)[..., perm], hf)
