"""Cross-entropy summed over tokens, so the trainer can normalise by the global token count."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (fp32 logits; labels equal to IGNORE_INDEX count nothing)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                           reduction="sum", ignore_index=IGNORE_INDEX)
