"""Tests the model registry: lookups, helpful errors, copied flavor args, outside registration."""

import contextlib
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
from models.protocol import ModelContractError


@dataclass
class ToyArgs:
    """Shape of the toy model a user might register from outside models/ (the contract's fields)."""

    dim: int = 3
    n_layers: int = 2
    n_heads: int = 1
    kv_heads: int = 1
    vocab_size: int = 16
    max_seq_len: int = 8


class ToyModel(nn.Module):
    """The smallest model that meets the contract (models/protocol.py): blocks in `layers`, and
    init_weights / init_buffers."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(args.dim, args.dim) for i in range(args.n_layers)})

    def init_weights(self, buffer_device=None) -> None:
        for layer in self.layers.values():
            layer.reset_parameters()

    def init_buffers(self, device=None) -> None:
        pass


def toy_spec(name: str = "toy_outside", model_cls=ToyModel, **arg_changes) -> ModelSpec:
    """A minimal ModelSpec defined here, not in models/, as a custom_import module would."""
    return ModelSpec(
        name=name,
        flavors={"small": ToyArgs(3, **arg_changes), "big": ToyArgs(7, **arg_changes)},
        model_cls=model_cls,
        parallelize_fn=lambda model, *_: model,
        flops_per_token_fn=lambda args, n, s: 6 * n,
    )


@contextlib.contextmanager
def saved_registry() -> Iterator[None]:
    """Restores the registry afterwards so registrations never leak into other tests."""
    saved = dict(models._REGISTRY)
    try:
        yield
    finally:
        models._REGISTRY.clear()
        models._REGISTRY.update(saved)


@pytest.fixture(autouse=True)
def isolated_registry() -> Iterator[None]:
    """Every test starts from the registry as importing Kiln leaves it, and leaves it so: no test's
    outcome depends on which ran before it (or on a module another test file imported)."""
    with saved_registry():
        models._REGISTRY.clear()
        models._REGISTRY.update(BUILT_IN)
        yield


BUILT_IN = {name: models._REGISTRY[name] for name in ("llama3", "moe")}


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


def test_register_from_outside() -> None:
    with saved_registry():
        spec = toy_spec()
        register_model_spec(spec)
        assert get_model_spec("toy_outside") is spec
        assert "toy_outside" in registered_models()
        args = get_model_args(spec, "big")
        assert spec.model_cls(args).layers["1"].weight.shape == (7, 7)
        register_model_spec(spec)  # the same object again is harmless (a re-import)
        assert get_model_spec("toy_outside") is spec
    assert "toy_outside" not in registered_models()  # the helper restored the registry


class NoLayers(nn.Module):
    """Breaks the contract: its blocks are a list, and it cannot initialise itself."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(args.dim, args.dim)])


@dataclass
class ArgsWithoutHeads:
    dim: int = 3
    n_layers: int = 1
    vocab_size: int = 16
    max_seq_len: int = 8


def test_contract_is_checked_at_registration() -> None:
    with pytest.raises(ModelContractError) as e:
        register_model_spec(toy_spec("no_layers", model_cls=NoLayers))
    msg = str(e.value)
    for words in ("'no_layers'", "models/protocol.py", "init_weights", "init_buffers", "model.layers"):
        assert words in msg, msg
    bad_args = ModelSpec(name="no_heads", flavors={"small": ArgsWithoutHeads()}, model_cls=ToyModel,
                         parallelize_fn=lambda model, *_: model, flops_per_token_fn=lambda a, n, s: 6 * n)
    with pytest.raises(ModelContractError) as e:
        register_model_spec(bad_args)
    assert "flavor 'small'" in str(e.value) and "`n_heads`" in str(e.value) and "`kv_heads`" in str(e.value)
    assert "no_layers" not in registered_models() and "no_heads" not in registered_models()


def test_double_registration_with_other_spec_fails() -> None:
    register_model_spec(toy_spec())
    with pytest.raises(ValueError, match="toy_outside"):
        register_model_spec(toy_spec())
    with pytest.raises(ValueError, match="llama3"):
        register_model_spec(toy_spec("llama3"))
    assert get_model_spec("llama3").model_cls is Transformer
