"""Expert load of MoE layers: the global count per expert after each step, which moves the expert
bias and feeds the metrics. Duck-typed (a layer has `tokens_per_expert` and `update_expert_bias`),
so components/ stays free of models/."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def moe_layers(parts: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(layer index, MoE module) of every MoE layer in this rank's model parts."""
    found = []
    for part in parts:
        for name, module in part.named_modules():
            if hasattr(module, "tokens_per_expert") and hasattr(module, "update_expert_bias"):
                parts_of_name = [p for p in name.split(".") if p.isdigit()]
                found.append((parts_of_name[0] if parts_of_name else name, module))
    return found


def set_aux_loss_scale(layers: list[tuple[str, nn.Module]], scale: float) -> None:
    """Give each layer's auxiliary loss the factor the summed token loss gets (see train_step)."""
    for _, module in layers:
        module.aux_loss_scale = scale


@torch.no_grad()
def reset_expert_load(layers: list[tuple[str, nn.Module]]) -> None:
    """Forget the load counted so far (after a forward that was not training, e.g. shape inference)."""
    for _, module in layers:
        module.tokens_per_expert.zero_()


@torch.no_grad()
def balance_experts(layers: list[tuple[str, nn.Module]], group: dist.ProcessGroup | None,
                    across: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, list[int]]:
    """Sum each layer's expert counts over the ranks that saw different tokens (and, with `across`,
    over the live replica groups, so that every group moves its bias alike), update the expert bias
    from them, reset the counters; returns {layer: tokens per expert} for this step."""
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for _, m in layers]).double()
    if group is not None:
        dist.all_reduce(counts, group=group)
    if across is not None:
        counts = across(counts)
    for (_, module), c in zip(layers, counts, strict=True):
        module.update_expert_bias(c.to(module.tokens_per_expert.dtype))
    return {name: [int(x) for x in c.tolist()] for (name, _), c in zip(layers, counts, strict=True)}


def imbalance(load: dict[str, list[int]]) -> dict[str, float]:
    """max / mean tokens per expert of each layer (1.0 = perfectly balanced)."""
    return {k: (max(v) / (sum(v) / len(v)) if sum(v) else 0.0) for k, v in load.items()}
