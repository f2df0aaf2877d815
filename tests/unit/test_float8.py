"""float8 through torchao (`--model.converters float8`) and the model-converter registry, on one
process: which modules convert, that they compute in float8 (emulated off CUDA), and what is refused.
Training with float8 in several layouts, and what FSDP sends, is tests/e2e/test_float8_runs.py."""

import sys

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from components.config.sections import JobConfig
from components.quantization.converters import (
    ConverterContext,
    ModelConverter,
    after_optimizer_step,
    convert_model,
    register_model_converter,
    resolve_converters,
)
from components.runtime.errors import KilnError
from tests.helpers.runs import tiny_llama


def _ctx(fsdp: bool = False, tp: bool = False, **float8) -> ConverterContext:
    cfg = JobConfig()
    for key, value in float8.items():
        setattr(cfg.float8, key, value)
    return ConverterContext(cfg, fsdp=fsdp, tp=tp, device_type="cpu")


def _converted(**float8) -> nn.Module:
    model, ctx = tiny_llama(), _ctx(**float8)
    convert_model(model, resolve_converters("float8", ctx), ctx)
    return model


def test_float8_converts_block_linears_only() -> None:
    model = _converted()
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("output") is nn.Linear  # the head stays in high precision
    assert len(kinds) == 14 and set(kinds.values()) == {Float8Linear}
    assert list(tiny_llama().state_dict()) == list(model.state_dict())  # same names, plain float32
    assert all(t.dtype == torch.float32 and type(t) in (torch.Tensor, nn.Parameter)
               for t in model.state_dict().values())


def test_float8_filter_keeps_named_linears() -> None:
    model = _converted(filter_fqns="w2, wo")
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    kept = ("attention.wo", "feed_forward.w2")
    assert plain == {"output", *(f"layers.{i}.{w}" for i in "01" for w in kept)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_computes_in_float8(recipe: str) -> None:
    """Forward and backward run, and differ from the plain model by float8 rounding (not 0, small)."""
    x = torch.randint(0, 4096, (2, 32))
    plain, model = tiny_llama(), _converted(recipe_name=recipe)
    want, got = plain(x), model(x)
    gap = ((got - want).abs().max() / want.abs().max()).item()
    assert 1e-4 < gap < 0.1, gap
    got.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_float8_matmul_emulated_off_cuda(monkeypatch) -> None:
    """On CPU the float8 matmuls never reach torch._scaled_mm (oneDNN's float8 kernel crawls on CPUs
    with AMX but no float8 instructions); on CUDA they do. The float8 casts happen either way."""
    def no_scaled_mm(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch._scaled_mm called on cpu")

    monkeypatch.setattr(torch, "_scaled_mm", no_scaled_mm)
    model = _converted()
    model(torch.randint(0, 4096, (2, 32))).sum().backward()
    assert all(m.config.emulate for m in model.modules() if isinstance(m, Float8Linear))
    cuda_model, ctx = tiny_llama(), ConverterContext(JobConfig(), fsdp=False, tp=False, device_type="cuda")
    convert_model(cuda_model, resolve_converters("float8", ctx), ctx)
    assert not any(m.config.emulate for m in cuda_model.modules() if isinstance(m, Float8Linear))


def test_float8_without_torchao_is_one_line(monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import torchao.float8 raises ImportError
    with pytest.raises(KilnError, match=r"needs torchao.*pip install 'kiln\[float8\]'"):
        resolve_converters("float8", _ctx())


def test_float8_tensor_parallel_refused_on_cpu() -> None:
    with pytest.raises(KilnError, match="float8 with tensor parallel runs on CUDA only"):
        resolve_converters("float8", _ctx(tp=True))


def test_user_converter_registers_and_runs() -> None:
    """A converter from outside Kiln: registered by name, found by model.converters, applied in the
    order given, its hook run after the optimizer step; an unknown name lists the registered ones."""
    calls = []

    def freeze_embeddings(model: nn.Module, ctx: ConverterContext) -> None:
        model.tok_embeddings.weight.requires_grad_(False)

    register_model_converter(ModelConverter(
        "test_freeze_embeddings", freeze_embeddings,
        after_optimizer_step=lambda parts, ctx: calls.append(len(parts))))
    ctx = _ctx()
    chosen = resolve_converters("float8, test_freeze_embeddings", ctx)
    assert [c.name for c in chosen] == ["float8", "test_freeze_embeddings"]
    model = tiny_llama()
    convert_model(model, chosen, ctx)
    assert not model.tok_embeddings.weight.requires_grad
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    after_optimizer_step([model], chosen, ctx)
    assert calls == [1]
    with pytest.raises(KilnError, match="unknown model.converters entry 'nope'.*float8.*test_freeze"):
        resolve_converters("nope", ctx)


def test_float8_leaves_moe_routers_alone() -> None:
    from models import get_model_args, get_model_spec

    spec = get_model_spec("moe")
    with torch.device("meta"):
        model = spec.model_cls(get_model_args(spec, "tiny"))
    ctx = _ctx()
    convert_model(model, resolve_converters("float8", ctx), ctx)
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    routers = [n for n in linears if ".router." in n]
    assert routers and all(linears[n] is nn.Linear for n in routers)
    assert any(kind is Float8Linear for kind in linears.values())


def test_float8_converts_deepseek_v3_blocks_and_its_mtp_block() -> None:
    """MLA's projections whose sides are multiples of 16 convert (the tiny flavor's 24-wide query
    latent and 40-wide kv latent + rotary key do not), and so does the multi-token prediction
    module's block; its joining projection and the routers stay plain."""
    import dataclasses

    from models import get_model_args, get_model_spec

    spec = get_model_spec("deepseek_v3")
    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(get_model_args(spec, "tiny"), mtp_depth=1))
    ctx = _ctx()
    convert_model(model, resolve_converters("float8", ctx), ctx)
    float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert {"layers.0.attention.wkv_b", "layers.0.attention.wo", "layers.0.feed_forward.w1",
            "layers.1.moe.shared_experts.w2", "mtp.2.block.attention.wkv_b", "mtp.2.block.attention.wo",
            "mtp.2.block.moe.shared_experts.w1"} <= float8
    assert {"layers.0.attention.wq_a", "layers.0.attention.wkv_a", "layers.1.moe.router.gate",
            "mtp.2.eh_proj", "mtp.2.block.moe.router.gate", "output"} <= plain


def test_float8_all_gather_refuses_float8_only_blocks_on_cpu() -> None:
    """A block of float8 weights alone would be all-gathered as float8, which gloo cannot carry."""
    def linears_only() -> nn.Module:
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(16, 16, bias=False))})
        return model

    ctx = _ctx(fsdp=True)
    with pytest.raises(KilnError, match="block 0 holds float8 weights only"):
        convert_model(linears_only(), resolve_converters("float8", ctx), ctx)
    ctx = _ctx(fsdp=True, enable_fsdp_float8_all_gather=False)  # weights gathered in float32: fine
    model = linears_only()
    convert_model(model, resolve_converters("float8", ctx), ctx)
    assert isinstance(model.layers["0"][0], Float8Linear)
