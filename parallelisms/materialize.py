"""Layout-invariant, shard-only initialisation: every parameter is a pure function of the seed and
its name, and a rank holds at most one full parameter at a time besides its own shards.

torch's route (meta → shard → to_empty → init_weights on DTensors) gives every shard the same
random values on a CPU mesh (torch warns "DTensor random operators may not have complete support
on cpu device mesh"; docs/compatibility.md). Kiln instead runs the model's own init_weights on a
plain meta-device copy in which exactly one parameter is real: random ops on meta tensors do
nothing and draw no random numbers, so the real parameter gets exactly what init_weights gives
it, from a generator seeded by (seed, parameter name). The rank keeps its slice of it
(distribute_tensor with src_data_rank=None only slices, no communication) and frees it before the
next. So the gathered weights are bit-identical in every layout and world size, and the memory
of initialisation is the rank's shards plus the largest single parameter, never the model
(models/protocol.py asks init_weights to initialise each parameter on its own).
"""

import hashlib
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


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of the run's seed and the parameter's plain name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _slots(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter, by parameter id (a tied one has several)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    return slots


@torch.no_grad()
def materialize_and_init(
    model: nn.Module, make_plain_model: Callable[[], nn.Module], seed: int, device: torch.device
) -> None:
    """Allocate the parallelized meta-device model on `device` and fill in its initial weights, one
    full parameter at a time.

    make_plain_model() builds the unparallelized model; its init_weights(buffer_device) defines
    the initial weights. `model` keeps only the parameters it owns (a pipeline stage owns some),
    each possibly a DTensor shard; only those are generated.
    """
    to_empty_keeping_ties(model, device)
    owned: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owned.setdefault(canonical_name(name), []).append(param)
    with torch.device("meta"):
        plain = make_plain_model()
    slots = _slots(plain)
    names = {id(p): [n for n, q in plain.named_parameters(remove_duplicate=False) if q is p]
             for p in plain.parameters()}
    for meta_param in list(plain.parameters()):
        aliases = [n for n in names[id(meta_param)] if n in owned]
        if not aliases:
            continue  # another pipeline stage's parameter
        full = _init_one(plain, slots[id(meta_param)], meta_param, seed, names[id(meta_param)][0], device)
        for alias in aliases:
            for param in owned[alias]:
                _copy_my_slice(full, param)
        del full
    model.init_buffers(device)


def _init_one(plain: nn.Module, slots: list[tuple[nn.Module, str]], meta_param: torch.Tensor, seed: int,
              name: str, device: torch.device) -> torch.Tensor:
    """The full initial value of one parameter: real in every slot that holds it, the rest of the
    model on meta, init_weights run under the parameter's own seed."""
    real = nn.Parameter(torch.empty(meta_param.shape, dtype=meta_param.dtype, device=device),
                        requires_grad=meta_param.requires_grad)
    for mod, attr in slots:
        mod._parameters[attr] = real
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(parameter_seed(seed, name))
        with torch.device("meta"):  # buffers and temporaries of init_weights cost nothing
            plain.init_weights(buffer_device="meta")
    for mod, attr in slots:
        mod._parameters[attr] = meta_param
    return real.detach()


def _copy_my_slice(full: torch.Tensor, param: torch.Tensor) -> None:
    """Copy this rank's piece of a full tensor into a parameter (a DTensor shard or a whole tensor)."""
    if isinstance(param, DTensor):
        piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(piece.to_local())
    else:
        param.copy_(full)
