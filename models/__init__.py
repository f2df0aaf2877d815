"""The model registry: a ModelSpec per family, looked up by `model.name`.

Adding a model is a new folder under models/ whose __init__.py calls register_model_spec(), one
import line at the bottom of this file, and a TOML. A model outside the repo registers itself
the same way from a module named in `--job.custom_import`. What a model must offer is written
down, and checked at registration, in models/protocol.py.
"""

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from components.config.loading import did_you_mean
from components.runtime.custom_import import import_custom
from components.runtime.errors import KilnError
from models.protocol import check_contract


@dataclass
class ModelSpec:
    """Everything the trainer needs to know about a model family."""

    name: str
    flavors: dict[str, Any]  # flavor name → model args dataclass
    model_cls: Callable[[Any], nn.Module]  # model_cls(args) builds the plain model
    # (model, parallel_dims, parallel_options) → the model, parallelized in place
    parallelize_fn: Callable[..., nn.Module]
    flops_per_token_fn: Callable[[Any, int, int], int]  # (args, num_params, seq_len) → FLOPs
    # (whole meta model, layer indices, is_first, is_last) → the stage's model; None = no PP.
    pipeline_fn: Callable[..., nn.Module] | None = None
    state_dict_adapter: type | None = None  # converts to/from Hugging Face names
    # (args, parallel_dims) → problems this family has with a layout, beside the generic checks.
    check_fn: Callable[[Any, Any], list[str]] | None = None
    # Hugging Face config.json model_type values this family imports (e.g. "llama"), and the
    # function that reads such a config.json (a dict) into this family's args, refusing in one
    # KilnError any field it does not implement.
    hf_model_types: tuple[str, ...] = ()
    args_from_hf: Callable[[dict], Any] | None = None


_REGISTRY: dict[str, ModelSpec] = {}


class UnknownModelError(LookupError):
    """Raised for a model name or flavor that is not registered."""


def register_model_spec(spec: ModelSpec) -> None:
    """Make a model family available under spec.name, once its flavors and model meet the contract
    (registering another spec under a taken name is an error)."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"a model named {spec.name!r} is already registered")
    check_contract(spec.name, spec.flavors, spec.model_cls, parallelize_fn=spec.parallelize_fn,
                   pipeline_fn=spec.pipeline_fn)
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec for `name`; an unknown name lists the registered ones."""
    if name not in _REGISTRY:
        raise UnknownModelError(
            f"unknown model.name {name!r}; registered models: {', '.join(sorted(_REGISTRY))}"
            + did_you_mean(name, list(_REGISTRY))
        )
    return _REGISTRY[name]


def get_model_args(spec: ModelSpec, flavor: str) -> Any:
    """A fresh copy of the args of `flavor`; an unknown flavor lists the model's flavors."""
    if flavor not in spec.flavors:
        raise UnknownModelError(
            # Only a different case is corrected: a near spelling ("7B" → "70B") is another size.
            f"unknown model.flavor {flavor!r} for model {spec.name!r}; flavors: {', '.join(spec.flavors)}"
            + did_you_mean(flavor, list(spec.flavors), spelling=False)
        )
    return copy.deepcopy(spec.flavors[flavor])


def with_mtp_depth(spec: ModelSpec, args: Any, mtp_depth: int) -> Any:
    """args with model.mtp_depth applied (-1 keeps the flavor's); a family without multi-token
    prediction is refused by name."""
    if mtp_depth < 0 or getattr(args, "mtp_depth", 0) == mtp_depth:
        return args
    if not hasattr(args, "mtp_depth"):
        raise KilnError(f"model.mtp_depth = {mtp_depth}: model {spec.name!r} has no multi-token prediction "
                        f"(its args {type(args).__name__} have no mtp_depth field)")
    return dataclasses.replace(args, mtp_depth=mtp_depth)


def build_plain_model(name: str, flavor: str, custom_import: str = "", device: str | torch.device = "cpu",
                      config_dir: str = "", mtp_depth: int = -1) -> tuple[nn.Module, ModelSpec, Any]:
    """(model, spec, args) for one-process tools (conversion, generation): built without random
    init, buffers filled and shared weights tied; the weights are meant to be loaded next."""
    if custom_import:
        import_custom(custom_import, config_dir)
    spec = get_model_spec(name)
    args = with_mtp_depth(spec, get_model_args(spec, flavor), mtp_depth)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # re-ties shared weights and fills the buffers
    return model, spec, args


def untied_flavors(args: Any, count: int = 2) -> list[str]:
    """Up to `count` flavors of the family whose flavor `args` is that keep the output head apart
    from the embedding, nearest in size first: what to suggest where tied embeddings cannot run."""
    family = next((spec for spec in _REGISTRY.values() if any(a == args for a in spec.flavors.values())),
                  None)
    if family is None:
        return []

    def size(a: Any) -> float:
        return a.n_layers * a.dim**2

    untied = [name for name, a in family.flavors.items() if not getattr(a, "tie_embeddings", False)]
    return sorted(untied, key=lambda name: abs(math.log(size(family.flavors[name]) / size(args))))[:count]


def registered_models() -> list[str]:
    """Names of every registered model family."""
    return sorted(_REGISTRY)


def registered_specs() -> list[ModelSpec]:
    """Every registered family, in the order they registered (the built-in ones first)."""
    return list(_REGISTRY.values())


# Built-in families register themselves on import (one line per family; isort would merge them).
# isort: off
from models import llama3, moe  # noqa: E402,F401
from models import qwen3  # noqa: E402,F401
from models import deepseek_v3  # noqa: E402,F401
