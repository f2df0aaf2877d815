"""Tests grad-norm measuring and clipping on plain tensors against a float64 NumPy reference."""

import numpy as np
import pytest
import torch

from components.optim.grad_norm import clip_grad_norm, total_grad_norm


def params_with_grads(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are the given tensors (copied, so tests can compare before/after)."""
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def reference_norm(params: list[torch.nn.Parameter]) -> float:
    """The 2-norm of every gradient, summed in float64 by NumPy."""
    squares = [np.sum(p.grad.double().numpy() ** 2) for p in params if p.grad is not None]
    return float(np.sqrt(sum(squares)))


def wide_range_grads() -> list[torch.Tensor]:
    """An output-head-sized 1M-element gradient spanning ~6 decades, plus small ordinary ones."""
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp(2 * torch.randn(4096, 256, generator=gen))
    head = torch.randn(4096, 256, generator=gen) * spread
    return [head, torch.randn(64, 64, generator=gen) * 1e-3, torch.randn(7, generator=gen)]


def test_total_norm_matches_float64() -> None:
    params = params_with_grads(*wide_range_grads())
    params.append(torch.nn.Parameter(torch.ones(3)))  # no grad: ignored
    got = total_grad_norm(params)
    assert got.dtype == torch.float32 and got.dim() == 0
    # float32 accumulation is ~1e-5..1e-4 off on this gradient; the contract is float32 rounding.
    assert got.item() == pytest.approx(reference_norm(params), rel=1e-6)


def test_no_grads_is_zero() -> None:
    assert total_grad_norm([torch.nn.Parameter(torch.ones(2))]).item() == 0.0


def test_clip_scales_to_max_norm() -> None:
    grads = wide_range_grads()
    params = params_with_grads(*grads)
    before = reference_norm(params)
    returned = clip_grad_norm(params, max_norm=1.0)
    assert returned.item() == pytest.approx(before, rel=1e-6)  # the norm before clipping
    assert reference_norm(params) == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, grads, strict=True):  # same direction, uniform scale
        torch.testing.assert_close(p.grad.double(), g.double() / before, rtol=1e-5, atol=1e-12)


def test_small_norm_is_not_scaled() -> None:
    grads = [torch.tensor([0.3, -0.4])]  # norm 0.5
    params = params_with_grads(*grads)
    assert clip_grad_norm(params, max_norm=1.0).item() == pytest.approx(0.5)
    assert torch.equal(params[0].grad, grads[0])


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_non_positive_max_norm_only_measures(max_norm: float) -> None:
    grads = [torch.tensor([30.0, 40.0]), torch.tensor([[0.0, 120.0]])]  # norm 130
    params = params_with_grads(*grads)
    assert clip_grad_norm(params, max_norm).item() == pytest.approx(130.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
