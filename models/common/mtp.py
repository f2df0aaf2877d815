"""Multi-token prediction (MTP, DeepSeek-V3 §2.2): D extra modules after the main model, module k
predicting the token k + 1 positions ahead, each a small pre-norm step and one more block.

Module k at position i takes the previous depth's hidden state (for k = 1 the main model's normed
output) and the embedding of token i + k, normalises both, joins them with a linear projection
(eh_proj, embedding first as in DeepSeek's released weights) and runs one block; its own RMSNorm
feeds the model's shared output head. The embedding and the head are the main model's, so an MTP
model has no second copy of either, except that under pipeline parallel the last stage keeps its
own copy of the embedding (a tied weight: parallelisms/tied_weights.py).

Everything the modules need comes from the labels: `next_tokens[..., j]` is the token j + 1 positions
ahead of each position (the labels shifted left by j), so module k embeds `next_tokens[..., k - 1]`
and predicts `next_tokens[..., k]`. The trainer builds next_tokens before context parallel cuts the
sequence, so each rank's positions see the right future tokens whatever its share.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_
from models.common.norm import RMSNorm

IGNORE_INDEX = -100  # as the trainer's labels: past the end of a window, or a token not trained on


class MultiTokenPredictionModule(nn.Module):
    """One MTP depth: h' = eh_proj([enorm(embedding); hnorm(previous)]), then `block`, then `norm`
    before the shared output head."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """previous, embedded [batch, seq, dim] → this depth's hidden state (the next depth's
        `previous`) and its normed twin for the output head. Both come out of one forward: FSDP
        gathers the module's weights for its forward only."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1)
        hidden = self.block(self.eh_proj(joined), rope, doc_ids)
        return hidden, self.norm(hidden)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()


def next_tokens_of(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq] labels → [batch, seq, depth + 1]: entry j is the label j positions further on
    (IGNORE_INDEX past the end of the window)."""
    shifted = [labels]
    for j in range(1, depth + 1):
        pad = torch.full_like(labels[:, :j], IGNORE_INDEX)
        shifted.append(torch.cat([labels[:, j:], pad], dim=1))
    return torch.stack(shifted, dim=-1)


def depth_inputs_and_targets(next_tokens: torch.Tensor, depth: int
                             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per depth k = 1..depth: the token ids its module embeds and the ones it predicts. A position
    whose input or target is unknown (IGNORE_INDEX) predicts nothing; its input becomes id 0."""
    inputs, targets = [], []
    for k in range(1, depth + 1):
        ids, target = next_tokens[..., k - 1], next_tokens[..., k]
        known = (ids != IGNORE_INDEX) & (target != IGNORE_INDEX)
        inputs.append(torch.where(known, ids, torch.zeros_like(ids)))
        targets.append(torch.where(known, target, torch.full_like(target, IGNORE_INDEX)))
    return inputs, targets


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32 (vocabulary-sharded DTensor logits under loss parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
