"""float8 through torchao (`--model.converters float8`) and the model-converter registry.

Layout parity: with the tensorwise recipe a weight's scale is the amax of the whole weight (FSDP
all-reduces the shards' amax before it casts for the float8 all-gather) and an activation's scale
is the amax of its microbatch, which holds the same rows in one process (2 microbatches of 8) and
in FSDP 2 (8 rows per rank): both layouts cast the same numbers to float8, and only float32
reduction order differs, as in fp32 parity. Measured over 10 steps of the tiny model: loss within
6e-8 relative, grad norm equal; the bounds are the fp32 parity tests' (1e-5 at step 1, 1e-4 after),
since a reduction-order difference that lands on a float8 rounding boundary can move a value by
one float8 step (2^-3 relative) in a few elements. A converter that silently did nothing would
pass parity, so the conversion itself is checked module by module, and FSDP's float8 all-gather
by the bytes it puts on the wire.
"""

import json
import shutil
import sys

import pytest
import torch
from conftest import (
    TINY,
    check_ok,
    fails_with,
    read_metrics,
    run_train,
    run_trains_side_by_side,
    tiny_llama,
    train_rows,
)
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

FLOAT8 = ["--model.converters", "float8"]
BATCH16 = ["--training.global_batch_size", "16", "--training.local_batch_size", "8"]
WIRE = "tests/helpers/fsdp_wire.py"


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


def test_float8_missing_torchao_run_fails_with_one_line(tmp_path, data_cache) -> None:
    """The trainer's own line when torchao cannot be imported (a stand-in package that fails to
    import shadows the installed one), before any data is read."""
    fake = tmp_path / "shadow" / "torchao"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named torchao (simulated)')\n")
    proc = run_train([*TINY, *FLOAT8, "--job.dump_folder", str(tmp_path / "run"),
                      "--training.data_cache_dir", str(data_cache)],
                     extra_env={"PYTHONPATH": str(tmp_path / "shadow")})
    fails_with(proc, "model.converters float8 needs torchao", "simulated", "pip install 'kiln[float8]'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _close(rows: list[dict], ref: list[dict], bound: float, keys=("loss", "grad_norm")) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for got, want in zip(rows, ref, strict=True):
        for key in keys:
            tol = 1e-5 if got["step"] == 1 and bound < 1e-3 else bound
            assert abs(got[key] - want[key]) <= tol * abs(want[key]), (key, got["step"], got[key], want[key])


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory, data_cache) -> dict:
    """float8 in one process and under FSDP 2 (saving step-5), 10 steps of the tiny model."""
    root = tmp_path_factory.mktemp("float8")
    common = [*TINY, *FLOAT8, *BATCH16, "--training.data_cache_dir", str(data_cache)]
    one = run_train([*common, "--job.dump_folder", str(root / "one")])
    fsdp = run_train([*common, "--job.dump_folder", str(root / "fsdp2"), "--checkpoint.enable",
                      "--checkpoint.interval", "5"], nproc=2)
    for proc in (one, fsdp):
        check_ok(proc)
    assert "float8 block linears (tensorwise, all-gathered in float8)" in fsdp.stdout
    return {"root": root, "one": train_rows(root / "one"), "fsdp2": train_rows(root / "fsdp2")}


@pytest.mark.slow
def test_float8_fsdp2_matches_one_process(float8_runs) -> None:
    _close(float8_runs["fsdp2"], float8_runs["one"], 1e-4)


@pytest.mark.slow
def test_float8_checkpoints_resume_with_float8_on_or_off(float8_runs, data_cache) -> None:
    """FSDP 2 float8's step-5 resumes in one plain process, whose step-6 checkpoint resumes with
    float8 again. float8 and float32 steps differ by float8 rounding — measured at most 1.4e-4
    relative in loss over steps 6-10 — so a resumed run lies within 2e-3 of the float8 run, while
    a run that ignored the checkpoint would restart from the initial loss (3% higher at step 6)."""
    root, fsdp2, one = float8_runs["root"], float8_runs["fsdp2"], float8_runs["one"]
    common = [*TINY, *BATCH16, "--training.data_cache_dir", str(data_cache), "--checkpoint.enable",
              "--checkpoint.interval", "1"]
    shutil.copytree(root / "fsdp2" / "checkpoint" / "step-5", root / "plain" / "checkpoint" / "step-5")
    plain = run_train([*common, "--job.dump_folder", str(root / "plain")])
    check_ok(plain)
    assert "resumed from" in plain.stdout and "step-5" in plain.stdout
    shutil.copytree(root / "plain" / "checkpoint" / "step-6", root / "again" / "checkpoint" / "step-6")
    again = run_train([*common, *FLOAT8, "--job.dump_folder", str(root / "again")])
    check_ok(again)
    assert "step-6" in again.stdout
    _close(train_rows(root / "plain"), fsdp2[5:], 2e-3, keys=("loss",))
    _close(train_rows(root / "again"), one[6:], 2e-3, keys=("loss",))
    assert fsdp2[0]["loss"] - fsdp2[5]["loss"] > 0.02 * fsdp2[5]["loss"]
    assert read_metrics(root / "again")[0]["step"] == 7


@pytest.mark.slow
def test_float8_learns_like_bf16(tmp_path, data_cache) -> None:
    """100 steps of the debug model, float8 against bf16 (the comparison float8 is made for), one
    process each, side by side, on small batches (4 × 32 tokens: both see the same batches, so the
    gap is float8's alone). Measured: both fall from 8.76 to about 6.16 (mean of the last 10 steps),
    the largest gap at any step is 0.011 nats (0.18%), the last-10 means 4e-5 apart. Bounds: 1% at
    any step, 0.5% for the last-10 means; and float8 must differ from bf16 somewhere by > 1e-3."""
    args = [*TINY[:2], "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--training.steps", "100", "--metrics.log_freq", "1",
            "--training.mixed_precision_param", "bfloat16", "--training.data_cache_dir", str(data_cache)]
    runs = [[*args, *FLOAT8, "--job.dump_folder", str(tmp_path / "float8")],
            [*args, "--job.dump_folder", str(tmp_path / "bf16")]]
    float8, bf16 = run_trains_side_by_side(runs, timeout=600)
    check_ok(float8)
    check_ok(bf16)
    assert "float8 block linears (tensorwise)" in float8.stdout
    f8, ref = train_rows(tmp_path / "float8"), train_rows(tmp_path / "bf16")
    assert len(f8) == len(ref) == 100
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(f8, ref, strict=True)]
    assert max(gaps) <= 0.01, max(gaps)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(f8, ref, strict=True)) > 1e-3
    tail = [sum(r["loss"] for r in rows[-10:]) / 10 for rows in (f8, ref)]
    assert abs(tail[0] - tail[1]) <= 0.005 * tail[1]
    assert ref[0]["loss"] - tail[1] > 2.0 and f8[0]["loss"] - tail[0] > 2.0


def _on_the_wire(dump, data_cache, *args: str) -> dict:
    """What FSDP 2 hands its collectives in 2 float8 steps of the tiny model (tests/helpers/fsdp_wire.py)."""
    out = dump / "wire.json"
    check_ok(run_train([str(out), *TINY, *FLOAT8, *BATCH16, *args, "--job.dump_folder", str(dump),
                        "--training.data_cache_dir", str(data_cache)], nproc=2, script=WIRE))
    return json.loads(out.read_text())


def test_fsdp_float8_all_gather_sends_float8_bytes(tmp_path, data_cache) -> None:
    """FSDP 2's all-gathers as recorded on the wire, torch's own collectives carrying them. With
    float8 all-gather (the default) each block's buffer holds its float8 linears' weight shards at
    one byte an element beside its norms' float32 at four, packed by FSDP as raw bytes (uint8);
    with float8.enable_fsdp_float8_all_gather false the block travels as float32, four bytes an
    element. The embeddings and the head (norm + output) are float32 either way. Each block is
    gathered twice a step (forward, and again for backward). Both send the same numbers: a
    tensorwise scale is the whole weight's amax, cast before or after the gather alike, so the
    losses agree (measured: equal to the last digit)."""
    on = _on_the_wire(tmp_path / "on", data_cache)
    off = _on_the_wire(tmp_path / "off", data_cache, "--float8.enable_fsdp_float8_all_gather", "false")
    blocks = [name for name in on["modules"] if name.startswith("layers.")]
    assert blocks == ["layers.0", "layers.1"]
    for name in blocks:
        block_on, block_off = on["modules"][name], off["modules"][name]
        float8, other = block_on["float8_elements"], block_on["other_elements"]
        assert float8 > 0 and other > 0, name  # 7 float8 linears, 2 float32 norms
        assert block_on["all_gather"] == [["uint8", float8 * 1 + other * 4]] * 4, (name, block_on)
        assert block_off["all_gather"] == [["float32", (float8 + other) * 4]] * 4, (name, block_off)
    for wire in (on, off):
        for name in ("tok_embeddings", "norm+output"):
            gathered = wire["modules"][name]
            assert gathered["float8_elements"] == 0 and gathered["all_gather"], name
            assert all(sent == ["float32", gathered["other_elements"] * 4] for sent in gathered["all_gather"])
    for a, b in zip(on["losses"], off["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * b, (on["losses"], off["losses"])


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
