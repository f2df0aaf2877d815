"""float8 training through torchao (`--model.converters float8`, the `[float8]` extra): the blocks'
linear layers compute their matmuls in float8 with dynamic scales; the output head, MoE routers,
linears whose name matches float8.filter_fqns and linears whose sides are not multiples of 16 stay
as they are.

Parameters stay float32 (checkpoints stay plain, and resume with float8 on or off). With FSDP and
the tensorwise recipe, weights are cast to float8 before FSDP's all-gather (half bf16's bytes).
gloo refuses float8 tensors (docs/compatibility.md), but FSDP2 packs a group whose inputs have
mixed dtypes — every Kiln block holds its norms' weights beside the float8 ones — into one uint8
buffer, so the float8 weights travel as bytes on gloo too; a block of float8 weights alone would
not, and is refused on cpu.

Off CUDA the matmul itself is emulated (torchao's `emulate`: the float8 values, scaled back, multiplied
in float32). The casts to float8 — the numerics float8 training is about — stay the same; only the
kernel changes. torch's CPU `_scaled_mm` sends float8 to oneDNN on CPUs with AMX and emulates it
elsewhere, at very different speeds from one CPU to the next (benchmarks/notes.md); emulating here
gives every CPU the same float32-matmul speed.
"""

import dataclasses

from torch import nn

from components.quantization.converters import ConverterContext, ModelConverter, register_model_converter
from components.runtime.errors import KilnError

INSTALL = "pip install 'kiln[float8]' (torchao)"


def _torchao_float8():  # noqa: ANN202
    """torchao.float8, or a KilnError saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise KilnError(f"model.converters float8 needs torchao, which cannot be imported ({e}); "
                        f"{INSTALL}") from None
    return float8


def check(ctx: ConverterContext) -> None:
    """torchao importable; float8 tensor parallel only on CUDA (torchao's float8 TP styles)."""
    _torchao_float8()
    if ctx.tp and ctx.device_type != "cuda":
        raise KilnError("float8 with tensor parallel runs on CUDA only (torchao's float8 TP styles need "
                        "nccl); on cpu use float8 without parallelism.tensor_parallel_degree")


def fsdp_float8_all_gather(ctx: ConverterContext) -> bool:
    """Whether FSDP all-gathers float8 weights: FSDP on, the tensorwise recipe, and asked for."""
    f = ctx.cfg.float8
    return ctx.fsdp and f.recipe_name == "tensorwise" and f.enable_fsdp_float8_all_gather


def convertible(module: nn.Module, fqn: str, skip: list[str]) -> bool:
    """A linear inside a block (model.layers, or a multi-token prediction module's block), not an MoE
    router (its scores choose the experts), not named by float8.filter_fqns, with both sides a
    multiple of 16 (float8 matmuls need it)."""
    in_block = fqn.startswith("layers.") or (fqn.startswith("mtp.") and ".block." in fqn)
    return (isinstance(module, nn.Linear) and in_block and ".router." not in fqn
            and not any(s in fqn for s in skip)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model: nn.Module, ctx: ConverterContext) -> None:
    """Swap the convertible linears for torchao's Float8Linear (on the meta device, in place)."""
    float8, f = _torchao_float8(), ctx.cfg.float8
    if f.recipe_name == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather(ctx))
    else:
        config = float8.Float8LinearConfig.from_recipe_name(f.recipe_name)
    config = dataclasses.replace(config, emulate=ctx.device_type != "cuda")
    skip = [s.strip() for s in f.filter_fqns.split(",") if s.strip()]
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda mod, fqn: convertible(mod, fqn, skip))
    from torchao.float8.float8_linear import Float8Linear

    if not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise KilnError("model.converters float8 found no linear layer to convert in the blocks "
                        "(sides must be multiples of 16; see float8.filter_fqns)")
    if fsdp_float8_all_gather(ctx) and ctx.device_type != "cuda":
        _refuse_float8_only_blocks(model, Float8Linear)


def _refuse_float8_only_blocks(model: nn.Module, float8_linear: type) -> None:
    """gloo cannot all-gather a block whose parameters are all float8 (no mixed dtypes, no bytes)."""
    for name, block in model.layers.items():
        plain = [p for m in block.modules() if not isinstance(m, float8_linear)
                 for p in m.parameters(recurse=False)]
        if not plain:
            raise KilnError(f"float8 all-gather on gloo: block {name} holds float8 weights only, which gloo "
                            "cannot carry; set --float8.enable_fsdp_float8_all_gather false")


def after_optimizer_step(parts: list[nn.Module], ctx: ConverterContext) -> None:
    """With float8 all-gather: every weight's float8 scale for the next step, in one all-reduce."""
    if fsdp_float8_all_gather(ctx):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

register_model_converter(ModelConverter("float8", convert, check, after_optimizer_step))
