"""Tests components/optim/: LR shapes against hand formulas, the scheduler, optimizers, errors."""

import math

import pytest
import torch
from torch import nn

from components.optim.lr_schedule import build_lr_scheduler, lr_factor
from components.optim.optimizer import build_optimizer
from components.runtime.errors import KilnError

WARMUP, TOTAL, MIN = 10, 100, 0.1


def factor(step: int, decay_type: str, decay_ratio: float = 1.0, min_lr: float = MIN) -> float:
    """lr_factor with this module's warmup and total."""
    return lr_factor(step, warmup_steps=WARMUP, total_steps=TOTAL, decay_ratio=decay_ratio,
                     decay_type=decay_type, min_lr_factor=min_lr)


SHAPES = {  # progress p in [0, 1] → fraction of the way from min_lr back up to the peak
    "linear": lambda p: 1 - p,
    "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
    "sqrt": lambda p: 1 - p**0.5,
}


@pytest.mark.parametrize("decay_type", list(SHAPES))
def test_warmup_then_full_decay(decay_type: str) -> None:
    # Warmup: optimizer step k (1-based) uses k/WARMUP of the peak, reaching 1 at step WARMUP.
    for k in range(1, WARMUP + 1):
        assert factor(k - 1, decay_type) == pytest.approx(k / WARMUP)
    # Decay over the remaining 90 steps: optimizer step k is (k - WARMUP)/90 of the way down.
    for k in (11, 30, 55, 77, 99, 100):
        p = (k - WARMUP) / (TOTAL - WARMUP)
        assert factor(k - 1, decay_type) == pytest.approx(MIN + (1 - MIN) * SHAPES[decay_type](p))
    assert factor(TOTAL - 1, decay_type) == pytest.approx(MIN)  # the last step ends at min_lr
    assert factor(TOTAL + 5, decay_type) == pytest.approx(MIN)  # and stays there if run longer
    values = [factor(s, decay_type) for s in range(WARMUP - 1, TOTAL)]
    assert all(a >= b for a, b in zip(values[:-1], values[1:], strict=True))  # monotone after the peak


@pytest.mark.parametrize("decay_type", list(SHAPES))
def test_wsd_stable_phase(decay_type: str) -> None:
    # decay_ratio 0.2 of the 90 post-warmup steps = 18 decay steps: steps 83..100 decay.
    for k in range(WARMUP + 1, TOTAL - 18 + 1):
        assert factor(k - 1, decay_type, decay_ratio=0.2) == 1.0
    for k in (83, 91, 100):
        p = (k - 82) / 18
        want = MIN + (1 - MIN) * SHAPES[decay_type](p)
        assert factor(k - 1, decay_type, decay_ratio=0.2) == pytest.approx(want)
    assert factor(TOTAL - 1, decay_type, decay_ratio=0.2) == pytest.approx(MIN)


def test_scheduler_drives_adamw() -> None:
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param], lr=2e-3)
    sched = build_lr_scheduler(opt, warmup_steps=4, total_steps=12, decay_ratio=1.0,
                               decay_type="linear", min_lr_factor=0.0)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(3)
        opt.step()
        sched.step()
    warmup = [2e-3 * k / 4 for k in range(1, 5)]
    expected = warmup + [2e-3 * (1 - (k - 4) / 8) for k in range(5, 13)]
    assert seen == pytest.approx(expected)
    assert seen[-1] == 0.0
    # A fresh scheduler loaded with the state after 6 steps uses step 7's LR next.
    resumed_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=2e-3)
    resumed = build_lr_scheduler(resumed_opt, warmup_steps=4, total_steps=12, decay_ratio=1.0,
                                 decay_type="linear", min_lr_factor=0.0)
    replay = build_lr_scheduler(torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=2e-3),
                                warmup_steps=4, total_steps=12, decay_ratio=1.0,
                                decay_type="linear", min_lr_factor=0.0)
    for _ in range(6):
        replay.optimizer.step()
        replay.step()
    resumed.load_state_dict(replay.state_dict())
    resumed_opt.step()
    resumed.step()
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(expected[7])


def test_schedule_errors() -> None:
    with pytest.raises(KilnError, match="exponential"):
        factor(50, "exponential")
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(KilnError, match="decay_type"):  # no warmup: the first LR already decays
        build_lr_scheduler(opt, warmup_steps=0, total_steps=10, decay_ratio=1.0,
                           decay_type="exponential", min_lr_factor=0.0)
    for ratio in (-0.1, 1.5):
        with pytest.raises(KilnError, match="decay_ratio"):
            build_lr_scheduler(opt, warmup_steps=0, total_steps=10, decay_ratio=ratio,
                               decay_type="linear", min_lr_factor=0.0)


def test_build_optimizer() -> None:
    model = nn.Linear(4, 4)
    opt = build_optimizer(model.named_parameters(), "AdamW", 1e-3, (0.9, 0.95), 1e-8, 0.1, "auto")
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["fused"] is True and not group["foreach"]  # auto on CPU: the fused kernel
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1
    assert len(group["params"]) == 2
    adam = build_optimizer(model.named_parameters(), "Adam", 1e-3, (0.9, 0.95), 1e-8, 0.0, "for-loop")
    assert type(adam) is torch.optim.Adam and not adam.param_groups[0]["foreach"]
    with pytest.raises(KilnError, match="SGD"):
        build_optimizer(model.named_parameters(), "SGD", 1e-3, (0.9, 0.95), 1e-8, 0.1, "auto")
    with pytest.raises(KilnError, match="turbo"):
        build_optimizer(model.named_parameters(), "AdamW", 1e-3, (0.9, 0.95), 1e-8, 0.1, "turbo")


def test_fused_adamw_matches_foreach_on_cpu() -> None:
    """auto picks the fused kernel on CPU: it must take the same steps as foreach (float rounding)."""
    torch.manual_seed(0)
    models = [nn.Linear(16, 8), nn.Linear(16, 8)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0].weight.detach().clone()
    opts = [build_optimizer(m.named_parameters(), "AdamW", 1e-2, (0.9, 0.95), 1e-8, 0.1, impl)
            for m, impl in zip(models, ("fused", "foreach"), strict=True)]
    x = torch.randn(32, 16)
    for _ in range(5):
        for m, opt in zip(models, opts, strict=True):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert (models[0].weight - start).abs().max() > 1e-3  # the steps moved the weights
    torch.testing.assert_close(models[0].weight, models[1].weight, rtol=1e-6, atol=1e-7)


def _groups_by_name(model: nn.Module, exclude: str) -> tuple[set[str], set[str]]:
    """(decayed names, excluded names) of the optimizer build_optimizer makes for model."""
    from components.optim.optimizer import embedding_names

    opt = build_optimizer(model.named_parameters(), "AdamW", 1e-3, (0.9, 0.95), 1e-8, 0.1, "for-loop",
                          exclude=exclude, embeddings=embedding_names(model))
    name_of = {id(p): n for n, p in model.named_parameters()}
    by_decay = {g["weight_decay"]: {name_of[id(p)] for p in g["params"]} for g in opt.param_groups}
    return by_decay.get(0.1, set()), by_decay.get(0.0, set())


def test_weight_decay_exclude_groups_by_kind() -> None:
    from tests.helpers.runs import tiny_llama

    model = tiny_llama()
    decayed, kept = _groups_by_name(model, "norms,biases,embeddings")
    assert kept == {n for n in dict(model.named_parameters()) if "norm" in n} | {"tok_embeddings.weight"}
    assert "output.weight" in decayed and "layers.0.attention.wq.weight" in decayed
    assert all(p.ndim == 2 for n, p in model.named_parameters() if n in decayed)
    decayed, kept = _groups_by_name(model, "")
    assert kept == set() and decayed == set(dict(model.named_parameters()))
    _, kept = _groups_by_name(model, "embeddings")
    assert kept == {"tok_embeddings.weight"}


def test_weight_decay_exclude_leaves_excluded_weights_undecayed() -> None:
    """With zero gradients AdamW only decays: excluded parameters stay put, the others shrink by lr·wd."""
    layer = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    opt = build_optimizer(layer.named_parameters(), "AdamW", 0.5, (0.9, 0.95), 1e-8, 0.1, "for-loop",
                          exclude="norms,biases")
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in layer.named_parameters():
        factor = 1.0 if name in ("1.weight", "1.bias", "2.bias") else 1 - 0.5 * 0.1
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)


def test_weight_decay_exclude_unknown_kind() -> None:
    with pytest.raises(KilnError, match="unknown kind.*norm.*choose from norms, biases, embeddings"):
        build_optimizer([("w", nn.Parameter(torch.ones(2)))], "AdamW", 1e-3, (0.9, 0.95), 1e-8, 0.1,
                        "for-loop", exclude="norm")
