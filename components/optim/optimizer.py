"""AdamW / Adam over a model part, with weight decay off for the kinds of parameters the config names
(norms, biases, embeddings)."""

from collections.abc import Iterable

import torch
from torch import nn

from components.runtime.errors import KilnError

# The kinds of parameters optimizer.weight_decay_exclude can take out of weight decay.
DECAY_KINDS = ("norms", "biases", "embeddings")


def parse_decay_exclude(text: str) -> set[str]:
    """optimizer.weight_decay_exclude ("norms,biases") as a set; an unknown kind is an error."""
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    unknown = sorted(kinds - set(DECAY_KINDS))
    if unknown:
        raise KilnError(f"optimizer.weight_decay_exclude: unknown kind(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(DECAY_KINDS)}")
    return kinds


def embedding_names(model: nn.Module, tied_names: Iterable[Iterable[str]] = ()) -> set[str]:
    """Names of the parameters of the model's nn.Embedding modules, and of every name tied to one
    (a tied output head, also when a pipeline stage holds it as its own copy)."""
    names = {_plain_name(f"{mod_name}.{p_name}" if mod_name else p_name)
             for mod_name, mod in model.named_modules() if isinstance(mod, nn.Embedding)
             for p_name, _ in mod.named_parameters(recurse=False)}
    for group in tied_names:
        group = list(group)
        if names & set(group):
            names |= set(group)
    return names


def decay_kind(name: str, param: torch.Tensor, embeddings: set[str]) -> str | None:
    """The kind of a parameter for weight decay by its plain name and global shape (the same in every
    layout: a DTensor's ndim is the global one): embeddings, biases, norms (every other 1-D weight)
    or None (matrices, always decayed)."""
    if name in embeddings:
        return "embeddings"
    if name.rsplit(".", 1)[-1] == "bias":
        return "biases"
    return "norms" if param.ndim == 1 else None


def decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float,
                 exclude: set[str], embeddings: set[str] = frozenset()) -> list[dict]:
    """Two parameter groups (empty ones left out): the decayed parameters, and those whose kind is in
    exclude with weight decay 0. Names may carry wrapper prefixes (canonical_name strips them)."""
    decayed, kept = [], []
    for name, p in named_params:
        if p.requires_grad:
            plain = _plain_name(name)
            (kept if decay_kind(plain, p, embeddings) in exclude else decayed).append(p)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _plain_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (activation checkpointing, compile, FSDP)."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], name: str, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, implementation: str,
                    device_type: str | None = None, exclude: str = "",
                    embeddings: set[str] = frozenset()) -> torch.optim.Optimizer:
    """The optimizer over the (name, parameter) pairs that need gradients, in decay_groups (exclude:
    optimizer.weight_decay_exclude); implementation auto = fused on CPU and GPU alike (one kernel per
    step; on CPU too it beats foreach); device_type: where the parameters live, default: the
    first's."""
    classes = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
    if name not in classes:
        raise KilnError(f"unknown optimizer.name {name!r}; choose from {', '.join(classes)}")
    groups = decay_groups(named_params, weight_decay, parse_decay_exclude(exclude), embeddings)
    params = [p for g in groups for p in g["params"]]
    if device_type is None:
        device_type = params[0].device.type if params else "cpu"
    if implementation == "auto":
        implementation = "fused" if device_type in ("cuda", "cpu") else "foreach"
    flags = {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }
    if implementation not in flags:
        raise KilnError(f"unknown optimizer.implementation {implementation!r}")
    return classes[name](groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         **flags[implementation])
