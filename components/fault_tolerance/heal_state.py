"""The run's state as a healthy group sends it to a joining one: local shards, no DTensor metadata.

torchft moves a state dict between groups over HTTP with its own pickling; a DTensor would carry
its device mesh (process groups) with it. Rank r of one group sends to rank r of another, and the
groups run one layout, so each shard goes as a plain tensor and is put back into the receiver's
own DTensor of the same placement.
"""

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from components.runtime.errors import KilnError


def _local(value: object) -> object:
    """A DTensor's local shard, detached and on the CPU (the transport's format); other values as they are."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return value


def heal_state_fns(states: dict[str, Stateful], loaded: Callable[[], None]
                   ) -> tuple[Callable[[dict], None], Callable[[], dict]]:
    """(load, save) for torchft's Manager.register_state_dict_fn over the named Stateful parts;
    load calls loaded() when it is done."""

    def save() -> dict:
        return {name: tree_map(_local, state.state_dict()) for name, state in states.items()}

    def load(received: dict) -> None:
        for name, state in states.items():
            state.load_state_dict(_like(state.state_dict(), received[name], name))
        loaded()

    return load, save


def _like(mine: object, received: object, name: str) -> object:
    """received, with each value placed as the matching value of mine (DTensor shards back into
    DTensors, tensors on mine's device)."""
    own, spec = tree_flatten(mine)
    got, got_spec = tree_flatten(received)
    if spec != got_spec:
        raise KilnError(f"fault_tolerance: the {name} state sent by a live group does not match this "
                        "group's: every replica group must run the same model and layout")
    return tree_unflatten([_place(m, g) for m, g in zip(own, got, strict=True)], spec)


def _place(mine: object, got: object) -> object:
    if isinstance(mine, DTensor):
        local = got.to(mine.to_local().device)
        return DTensor.from_local(local, mine.device_mesh, mine.placements, shape=mine.shape,
                                  stride=mine.stride(), run_check=False)
    if isinstance(mine, torch.Tensor) and isinstance(got, torch.Tensor):
        return got.to(mine.device)
    return got
