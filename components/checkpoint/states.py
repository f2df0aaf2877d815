"""The Stateful parts of a run, with layout-free state dicts, and a load planner that never unpickles code."""

import io
import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element  # private: what DCP's planner uses
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from components.runtime.errors import KilnError


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor values are read with torch.load(weights_only=True).

    DCP's default unpickles them freely; a checkpoint from elsewhere could then run code.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # write through to the caller's nested dict, as DCP's own does
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def plain_tensor(value: Any) -> Any:
    """A tensor as a plain tensor (or a DTensor of plain local tensors), sharing its storage: wrapper
    subclasses that only hold one tensor of the same shape (torchao's float8 all-gather weights, and
    the optimizer states made like them) are unwrapped, so checkpoints hold plain tensors and load
    with float8 on or off. Anything else is returned as it is."""
    if isinstance(value, DTensor):
        local = value.to_local()
        plain = plain_tensor(local)
        if plain is local:
            return value
        return DTensor.from_local(plain, value.device_mesh, value.placements, shape=value.shape,
                                  stride=value.stride())
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, nn.Parameter):
        return value
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        inner = getattr(value, names[0])
        if inner.shape == value.shape and inner.dtype == value.dtype:
            return plain_tensor(inner)
    return value


def _plain_values(state: dict) -> dict:
    return {key: plain_tensor(value) for key, value in state.items()}


class ModelState(Stateful):
    """All model parts (several with pipeline parallel) as one dict keyed by plain parameter names."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return _plain_values(merged)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """Optimizer states flattened to `state.<param name>.<field>` keys, so they reshard like the model.

    aliases maps a tied weight's second name to its first (output.weight → tok_embeddings.weight):
    one process keeps a tied weight's state under its first name only, so a pipeline stage that
    holds the weight's copy under the second name saves and loads it under the first as well.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 aliases: dict[str, str] | None = None) -> None:
        self.pairs = list(zip(parts, optimizers, strict=True))
        self.aliases = aliases or {}

    def state_dict(self) -> dict:
        merged: dict = {}
        for part, opt in self.pairs:
            state = get_optimizer_state_dict(part, opt, options=self._OPTIONS)
            merged.update(_renamed(state, self.aliases))
        return _plain_values(merged)

    def load_state_dict(self, state: dict) -> None:
        for part, opt in self.pairs:
            names = set(get_model_state_dict(part))
            back = {first: second for second, first in self.aliases.items()
                    if second in names and first not in names}
            set_optimizer_state_dict(part, opt, _renamed(state, back, copy=True), options=self._OPTIONS)


def _renamed(state: dict, names: dict[str, str], copy: bool = False) -> dict:
    """Flattened optimizer keys (`state.<fqn>.<field>`, `param_groups.<fqn>.<field>`) with each
    parameter name in `names` replaced by the name it maps to; copy: renamed tensors are cloned, so
    two copies of a tied weight never share (and doubly update) one optimizer state."""
    if not names:
        return state
    out = {}
    for key, value in state.items():
        kind, rest = key.split(".", 1)
        fqn, field = rest.rsplit(".", 1)
        if fqn in names and copy and isinstance(value, torch.Tensor):
            value = value.clone()
        out[f"{kind}.{names.get(fqn, fqn)}.{field}"] = value
    return out


class SchedulerState(Stateful):
    """LR schedules are functions of the step: their state is the step count (a tensor, no pickles)."""

    def __init__(self, schedulers: list[LambdaLR]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"last_epoch": torch.tensor(self.schedulers[0].last_epoch)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        epoch = int(state["last_epoch"])
        # LambdaLR keeps its position in private fields (_step_count, _last_lr); set them as its
        # own step() would, since it has no public way to jump to a step.
        for sched in self.schedulers:
            sched.last_epoch = epoch
            sched._step_count = epoch + 1
            lrs = [base * fn(epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
            for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            sched._last_lr = lrs


class TrainState(Stateful):
    """Step, tokens seen and the RNG states: what the loop itself must carry across a restart."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        # No CUDA RNG: training draws no random numbers after init, and a checkpoint written on a
        # CPU must resume on a GPU (and the other way round) with the same keys.
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen),
                "cpu_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        torch.set_rng_state(state["cpu_rng"])


class StreamingLoaderState(Stateful):
    """The streaming loader's position, one entry per data-parallel rank (each reads its own share)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        # One JSON string per rank: DCP would flatten a nested dict into keys whose set changes with
        # the stream's position, and a load template must have the saved keys.
        return {"dp_degree": torch.tensor(self.loader.dp_degree),
                f"dp_rank_{self.loader.dp_rank}": json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dp_degree"]) != self.loader.dp_degree:
            saved = int(state["dp_degree"])
            raise KilnError(f"the checkpoint's streaming loader ran on {saved} data-parallel "
                            f"ranks, this run has {self.loader.dp_degree}: each rank's position cannot be "
                            f"carried over. Keep the degree, or add 'dataloader' to "
                            f"checkpoint.exclude_from_loading")
        self.loader.load_state_dict(json.loads(state[f"dp_rank_{self.loader.dp_rank}"]))


class MixtureLoaderState(Stateful):
    """A mixture's phase and every source's position at the saved step (one JSON string: the same
    key whatever the sources), so that a resume continues each source, with new weights too."""

    def __init__(self, loader, train_state: TrainState) -> None:
        self.loader, self.train_state = loader, train_state

    def state_dict(self) -> dict[str, Any]:
        return {"mixture": json.dumps(self.loader.state_dict(self.train_state.step), sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(json.loads(state["mixture"]))


class DataLoaderState(Stateful):
    """What the data order depends on besides the step: seed, global batch and sequence length.

    The position itself is the train state's step. Loading checks that this run reads the same
    order; a run that wants another one leaves "dataloader" out of loading.
    """

    def __init__(self, loader) -> None:
        self.loader = loader

    def _order(self) -> dict[str, int]:
        return {"seed": self.loader.seed, "global_batch_size": self.loader.global_batch_size,
                "seq_len": self.loader.windows.seq_len}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v) for k, v in self._order().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, now in self._order().items():
            saved = int(state[key])
            if saved != now:
                raise KilnError(
                    f"the checkpoint was trained with {key} {saved} but this run uses {now}: the data "
                    f"order would change. Set training.{key} to {saved}, or add 'dataloader' to "
                    f"checkpoint.exclude_from_loading to continue with the new order"
                )
