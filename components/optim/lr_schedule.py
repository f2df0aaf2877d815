"""The learning-rate schedule: linear warmup, then stable, then linear / cosine / sqrt decay."""

import functools
import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from components.runtime.errors import KilnError

# Decay shapes: progress in [0, 1] through the decay → the fraction of the way from lr to min_lr left.
DECAY_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def decay_shape(decay_type: str) -> Callable[[float], float]:
    """The decay curve named decay_type; an unknown name is an error that lists the known ones."""
    if decay_type not in DECAY_SHAPES:
        raise KilnError(f"unknown lr_scheduler.decay_type {decay_type!r}; choose {'/'.join(DECAY_SHAPES)}")
    return DECAY_SHAPES[decay_type]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float,
              decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak LR at `step` (0-based count of optimizer steps taken so far).

    Warmup rises linearly to 1 over warmup_steps; the last decay_ratio of the steps decays to
    min_lr_factor; anything between is the stable phase (warmup-stable-decay when decay_ratio < 1).
    """
    step = step + 1  # the LR used by the (step+1)-th optimizer step
    if step <= warmup_steps:
        return step / max(1, warmup_steps)
    decay_steps = max(1, round((total_steps - warmup_steps) * decay_ratio))
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    return min_lr_factor + (1.0 - min_lr_factor) * decay_shape(decay_type)(progress)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       decay_ratio: float, decay_type: str, min_lr_factor: float) -> LambdaLR:
    """A LambdaLR over lr_factor (Stateful through its state_dict, so it resumes exactly)."""
    decay_shape(decay_type)  # fails now rather than at the first decaying step
    if not 0.0 <= decay_ratio <= 1.0:
        raise KilnError(f"lr_scheduler.decay_ratio must be in [0, 1], got {decay_ratio}")
    fn = functools.partial(lr_factor, warmup_steps=warmup_steps, total_steps=total_steps,
                           decay_ratio=decay_ratio, decay_type=decay_type, min_lr_factor=min_lr_factor)
    return LambdaLR(optimizer, fn)
