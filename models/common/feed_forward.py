"""SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_


def swiglu_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's hidden size: 2/3 of 4·dim, times an optional multiplier, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """The gated SwiGLU MLP of Llama."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std_out: float) -> None:
        """Truncated-normal init; the down projection gets a depth-scaled std."""
        trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        trunc_normal_(self.w3.weight, mean=0.0, std=std_out)
        trunc_normal_(self.w2.weight, mean=0.0, std=std_out)
