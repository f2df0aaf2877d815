"""Which modules torch.compile gets, and whether the AOTAutograd cache stays on: the tensor-parallel
workarounds apply to the torch versions that have the bugs (checked by test_ac_compile's TP runs),
torch's defaults elsewhere and without tensor parallel."""

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from parallelisms.compile import apply_compile


def block(mlp: str) -> nn.Module:
    """A transformer block's shape: two norms, attention and `feed_forward` or `moe`."""
    b = nn.Module()
    for name in ("attention_norm", "attention", "ffn_norm", mlp):
        setattr(b, name, nn.Identity())
    return b


@pytest.fixture
def compile_calls(monkeypatch) -> Iterator[Callable[[bool], list[str]]]:
    """apply_compile on a two-block model (a dense and an MoE block) -> the names of the modules
    Module.compile() was called on; nothing is compiled, and the cache switch is restored after."""
    def run(tensor_parallel: bool) -> list[str]:
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": block("feed_forward"), "1": block("moe")})
        names = {id(m): n for n, m in model.named_modules()}
        calls = []
        monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: calls.append(names[id(self)]))
        apply_compile(model, tensor_parallel=tensor_parallel)
        return calls

    with torch._functorch.config.patch(enable_autograd_cache=True):
        yield run


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1+cu130", "2.14.0+cpu"])
def test_tp_on_a_torch_with_the_bugs_compiles_attention_and_mlp_without_the_cache(compile_calls, monkeypatch,
                                                                                  version):
    monkeypatch.setattr(torch, "__version__", version)
    assert compile_calls(True) == ["layers.0.attention", "layers.0.feed_forward",
                                   "layers.1.attention", "layers.1.moe"]
    assert torch._functorch.config.enable_autograd_cache is False


@pytest.mark.parametrize("version", ["2.15.0", "2.16.1+cu130"])
def test_tp_on_a_later_torch_follows_torchs_defaults(compile_calls, monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    assert compile_calls(True) == ["layers.0", "layers.1"]
    assert torch._functorch.config.enable_autograd_cache is True


def test_without_tp_whole_blocks_compile_with_the_cache_on(compile_calls):
    assert compile_calls(False) == ["layers.0", "layers.1"]
    assert torch._functorch.config.enable_autograd_cache is True

