"""The model-converter registry: named, in-place rewrites of the model before it is parallelized
(float8 linears; a user's own from a --job.custom_import module), like the model registry.

A converter is looked up and checked once the layout is known (so a missing package or an
impossible combination fails before any data is read), converts the whole meta-device model
before pipeline splitting and parallelizing, and may act after every optimizer step.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from components.runtime.errors import KilnError


@dataclass(frozen=True)
class ConverterContext:
    """What a converter may need to know of the run: its config and the layout's facts."""

    cfg: Any  # the JobConfig (a converter reads its own section, e.g. cfg.float8)
    fsdp: bool  # parameters are FSDP-sharded
    tp: bool  # tensor parallel is on
    device_type: str  # "cpu" or "cuda"


@dataclass(frozen=True)
class ModelConverter:
    """A named model rewrite: check(ctx) refuses what cannot run, convert(model, ctx) rewrites the
    plain meta-device model in place, after_optimizer_step(parts, ctx) runs after each step."""

    name: str
    convert: Callable[[nn.Module, ConverterContext], None]
    check: Callable[[ConverterContext], None] | None = None
    after_optimizer_step: Callable[[list[nn.Module], ConverterContext], None] | None = None


_CONVERTERS: dict[str, ModelConverter] = {}


def register_model_converter(converter: ModelConverter) -> None:
    """Make a converter available to model.converters under its name (a taken name is an error)."""
    if converter.name in _CONVERTERS and _CONVERTERS[converter.name] is not converter:
        raise ValueError(f"a model converter named {converter.name!r} is already registered")
    _CONVERTERS[converter.name] = converter


def registered_converters() -> list[str]:
    return sorted(_CONVERTERS)


def resolve_converters(names: str, ctx: ConverterContext) -> list[ModelConverter]:
    """The converters model.converters names (comma-separated, applied in that order), each checked."""
    chosen = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in _CONVERTERS:
            raise KilnError(f"unknown model.converters entry {name!r}; registered converters: "
                            f"{', '.join(registered_converters()) or 'none'}")
        if _CONVERTERS[name].check is not None:
            _CONVERTERS[name].check(ctx)
        chosen.append(_CONVERTERS[name])
    return chosen


def convert_model(model: nn.Module, converters: list[ModelConverter], ctx: ConverterContext) -> None:
    """Apply the converters to the model in order, in place."""
    for converter in converters:
        converter.convert(model, ctx)


def after_optimizer_step(parts: list[nn.Module], converters: list[ModelConverter],
                         ctx: ConverterContext) -> None:
    """Every converter's hook after the optimizer step (e.g. float8 scales for the next all-gather)."""
    for converter in converters:
        if converter.after_optimizer_step is not None:
            converter.after_optimizer_step(parts, ctx)


from components.quantization import float8  # noqa: E402,F401,I001  (the built-in converters register themselves)
