"""Layout-invariant initialisation: the same seed gives the same full weights in every layout.

torch's route (meta → shard → to_empty → init_weights on DTensors) gives every shard the same
random values on a CPU mesh (torch warns "DTensor random operators may not have complete support
on cpu device mesh", measured on torch 2.13), so Kiln initialises one full, plain copy of the
model from the seed and gives each rank its slice of every tensor. No communication is needed:
every rank computes the same full tensors and distribute_tensor(src_data_rank=None) only slices.
This holds the full model once per rank for a moment; a model that does not fit should start
from a seed checkpoint instead.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that prefix parameter names without changing the weights.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name with wrapper prefixes removed (the name in the plain model)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """module.to_empty(), then re-share parameters that were shared before (tied embeddings).

    to_empty() replaces each module's tensors one module at a time, so a parameter shared by two
    modules would come back as two unrelated tensors.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    module.to_empty(device=device)
    for group in owners.values():
        first_mod, first_name = group[0]
        for mod, name in group[1:]:
            mod._parameters[name] = first_mod._parameters[first_name]


@torch.no_grad()
def materialize_and_init(
    model: nn.Module, make_plain_model: Callable[[], nn.Module], seed: int, device: torch.device
) -> None:
    """Allocate the parallelized meta-device model on `device` and fill it from a seeded full copy.

    make_plain_model() must build the unparallelized model (on the current default device); its
    init_weights(buffer_device) defines the initial weights. `model` keeps only the parameters
    it owns (a pipeline stage owns some), each possibly a DTensor shard.
    """
    to_empty_keeping_ties(model, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device("meta"):
            full = make_plain_model()
        full.to_empty(device=device)
        full.init_weights(buffer_device=device)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        source = full_params[canonical_name(name)]
        if isinstance(param, DTensor):
            piece = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(source)
    del full, full_params
    model.init_buffers(device)
