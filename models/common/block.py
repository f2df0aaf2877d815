"""The pre-norm residual block every family shares: x + attention(norm(x)), then + mlp(norm(x))."""

from typing import Any

import torch
from torch import nn

from models.common.norm import RMSNorm


class PreNormBlock(nn.Module):
    """A family's block builds `attention` and `feed_forward` (or `moe`, with `moe_enabled`) and calls
    `add_norms`; the forward, the choice of feed-forward and the init are the same for every family."""

    moe_enabled = False

    def add_norms(self, layer_id: int, args: Any) -> None:
        """The two RMSNorms, and the init std of the output projections (scaled by depth, as
        TorchTitan does, when args.depth_init)."""
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def mlp(self) -> nn.Module:
        """The module after the second norm: the MoE layer where this block has one, else the
        dense feed-forward."""
        return self.moe if self.moe_enabled else self.feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, doc_ids)
        return h + self.mlp()(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.mlp().init_weights(self.init_std)
