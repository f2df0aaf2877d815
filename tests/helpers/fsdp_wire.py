"""What FSDP really sends: the dtype and bytes of every all-gather and reduce-scatter input of the
Trainer's own model (Kiln's builders, converters and FSDP), over a few training steps.

    torchrun --nproc-per-node 2 tests/helpers/fsdp_wire.py OUT.json --config ... [overrides]

After the Trainer is built, every FSDP module gets a recording all-gather and reduce-scatter
(FSDP2's public set_custom_all_gather / set_custom_reduce_scatter) that call torch.distributed's
own all_gather_into_tensor / reduce_scatter_tensor, in place of whichever collectives the layout
installed: FSDP packs a group's inputs into the one buffer it hands them (mixed dtypes as raw
bytes, uint8), so that buffer's bytes are what travels. Rank 0 writes OUT.json:

    {"losses": [...],
     "modules": {name: {"all_gather": [[dtype, bytes], ...], "reduce_scatter": [[dtype, bytes], ...],
                        "float8_elements": n, "other_elements": m}}}

float8_elements / other_elements: this rank's shard elements (FSDP's padding included) of the
module's float8-linear weights and of its other parameters, to size what each dtype would carry.
"""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from components.config.loading import load_config
from components.runtime.distributed import exit_cleanly, init_distributed
from train import Trainer  # noqa: E402

STEPS = 2  # the second step all-gathers with the float8 scales precomputed after the first
# torch's collectives into one tensor (torch 2.14 renamed them *_single and deprecated the old names).
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class RecordingAllGather:
    """FSDP2's all-gather comm (allocate + call), recording each input's dtype and bytes."""

    def __init__(self, log: list) -> None:
        self.log = log

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self.log.append([str(input_tensor.dtype).removeprefix("torch."),
                         input_tensor.numel() * input_tensor.element_size()])
        return ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(RecordingAllGather):
    """FSDP2's reduce-scatter comm, recording each input's dtype and bytes."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        self.log.append([str(input_tensor.dtype).removeprefix("torch."),
                         input_tensor.numel() * input_tensor.element_size()])
        return REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def own_parameters(module: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(owning module, parameter) for the parameters this FSDP module manages: its subtree's,
    less those of nested FSDP modules."""
    nested = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
              for p in m.parameters()}
    return [(m, p) for m in module.modules() for p in m.parameters(recurse=False) if id(p) not in nested]


def shard_elements(param: torch.Tensor, world: int) -> int:
    """Elements of one rank's FSDP shard (dim 0 split evenly, padded up)."""
    return math.ceil(param.shape[0] / world) * math.prod(param.shape[1:])


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = load_config(argv)
    info = init_distributed(cfg.comm.timeout_seconds)
    trainer = Trainer(cfg, info)
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:  # torchao is an extra: without it no linear is float8
        Float8Linear = ()  # noqa: N806

    model, world = trainer.model.parts[0], info.world_size
    modules = {}
    fsdp_modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    tail = [fsdp_modules.pop(name) for name in ("norm", "output") if name in fsdp_modules]
    groups = {name: [m] for name, m in fsdp_modules.items()}
    groups["norm+output"] = tail  # apply_fsdp shards the two as one group
    for name, members in groups.items():
        owned = [pair for m in members for pair in own_parameters(m)]
        if not owned:
            continue  # the root: every parameter sits in a nested group
        record = {"all_gather": [], "reduce_scatter": []}
        members[0].set_custom_all_gather(RecordingAllGather(record["all_gather"]))
        members[0].set_custom_reduce_scatter(RecordingReduceScatter(record["reduce_scatter"]))
        record["float8_elements"] = sum(shard_elements(p, world) for m, p in owned
                                        if isinstance(m, Float8Linear) and p is m.weight)
        record["other_elements"] = sum(shard_elements(p, world) for m, p in owned
                                       if not (isinstance(m, Float8Linear) and p is m.weight))
        modules[name] = record
    losses = []
    for step in range(1, STEPS + 1):
        loss_sum, tokens, _ = trainer.train_step(trainer.data.loader.batch(step))
        losses.append((loss_sum / tokens).item())
    if info.is_main:
        Path(out).write_text(json.dumps({"losses": losses, "modules": modules}, indent=1))
    exit_cleanly(0, trainer.dims.release)


if __name__ == "__main__":
    main()
