"""Tests the model registry: lookups, helpful errors, copied flavor args, outside registration."""

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from torch import nn

import models
from models import (
    ModelSpec,
    UnknownModelError,
    get_model_args,
    get_model_spec,
    register_model_spec,
    registered_models,
)
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import LlamaArgs, Transformer


@dataclass
class ToyArgs:
    """Shape of the toy model a user might register from outside models/."""

    width: int = 3


def toy_spec(name: str = "toy_outside") -> ModelSpec:
    """A minimal ModelSpec defined here, not in models/, as a custom_import module would."""
    return ModelSpec(
        name=name,
        flavors={"small": ToyArgs(3), "big": ToyArgs(7)},
        model_cls=lambda args: nn.Linear(args.width, args.width),
        parallelize_fn=lambda model, *_: model,
        flops_per_token_fn=lambda args, n, s: 6 * n,
    )


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Restores the registry afterwards so registrations in a test never leak into others."""
    saved = dict(models._REGISTRY)
    yield
    models._REGISTRY.clear()
    models._REGISTRY.update(saved)


def test_llama3_is_registered() -> None:
    spec = get_model_spec("llama3")
    assert spec.name == "llama3"
    assert spec.model_cls is Transformer
    assert {"debug", "tiny", "1B", "3B", "8B", "70B", "405B"} <= set(spec.flavors)
    assert "llama3" in registered_models()


def test_unknown_model_lists_registered() -> None:
    with pytest.raises(UnknownModelError) as e:
        get_model_spec("gpt5")
    assert "'gpt5'" in str(e.value) and "llama3" in str(e.value)


def test_unknown_flavor_lists_flavors() -> None:
    with pytest.raises(UnknownModelError) as e:
        get_model_args(get_model_spec("llama3"), "7B")
    msg = str(e.value)
    assert "'7B'" in msg and "llama3" in msg
    for flavor in ("debug", "tiny", "8B", "405B"):
        assert flavor in msg


def test_model_args_are_a_copy() -> None:
    spec = get_model_spec("llama3")
    args = get_model_args(spec, "debug")
    assert isinstance(args, LlamaArgs)
    original_layers = LLAMA3_FLAVORS["debug"].n_layers
    args.n_layers = original_layers + 5
    assert spec.flavors["debug"].n_layers == original_layers
    assert get_model_args(spec, "debug").n_layers == original_layers
    # Nested dataclasses are copied too, not shared.
    scaled = get_model_args(spec, "8B")
    scaled.rope_scaling.scale_factor = 1.0
    assert spec.flavors["8B"].rope_scaling.scale_factor == 8.0


def test_register_from_outside(clean_registry: None) -> None:
    spec = toy_spec()
    register_model_spec(spec)
    assert get_model_spec("toy_outside") is spec
    assert "toy_outside" in registered_models()
    args = get_model_args(spec, "big")
    assert spec.model_cls(args).weight.shape == (7, 7)
    register_model_spec(spec)  # the same object again is harmless (a re-import)
    assert get_model_spec("toy_outside") is spec


def test_registry_cleaned_up() -> None:
    # Runs after test_register_from_outside in file order: its fixture restored the registry.
    assert "toy_outside" not in registered_models()


def test_double_registration_with_other_spec_fails(clean_registry: None) -> None:
    register_model_spec(toy_spec())
    with pytest.raises(ValueError, match="toy_outside"):
        register_model_spec(toy_spec())
    with pytest.raises(ValueError, match="llama3"):
        register_model_spec(toy_spec("llama3"))
    assert get_model_spec("llama3").model_cls is Transformer
