"""Pipeline parallel: split a model into stages by layers and drive them with a torch schedule.

Stages are made on the meta device by deleting what a stage does not own (layers, embedding,
final norm and head), so every kept parameter keeps its name and checkpoints stay layout-free.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.runtime.errors import KilnError
from components.runtime.tensor_utils import local_tensor

# torch.distributed.pipelining imports the compiler, which is slow to import, so it is imported
# only where a pipeline is built: runs without one start faster.
if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# Schedules Kiln offers: one stage per rank, several stages per rank (loop layout), or "v" layout.
SINGLE_STAGE = ("GPipe", "1F1B")
LOOP_STAGES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_STAGES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOP_STAGES + V_STAGES


def stages_per_rank(schedule: str) -> int:
    """Single-stage schedules hold one stage per rank; the others here hold two."""
    if schedule not in SCHEDULES:
        raise KilnError(f"unknown parallelism.pipeline_parallel_schedule {schedule!r}; "
                         f"choose from {', '.join(SCHEDULES)}")
    return 1 if schedule in SINGLE_STAGE else 2


def stage_ids(pp_rank: int, pp_size: int, schedule: str) -> list[int]:
    """Which stages this rank runs: rank r gets r, r + pp, ... ("loop") or r and 2·pp−1−r ("v")."""
    per_rank = stages_per_rank(schedule)
    if schedule in V_STAGES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]


def split_layers(n_layers: int, num_stages: int, layers_per_stage: int = -1) -> list[list[int]]:
    """Layer indices per stage: `layers_per_stage` each (the last stage takes the rest), or evenly.

    Evenly, the first and last stages take one layer fewer when layers do not divide, since they
    also carry the embedding and the output head.
    """
    if num_stages > n_layers:
        raise KilnError(f"{num_stages} pipeline stages are more than the model's {n_layers} layers")
    if layers_per_stage > 0:
        if layers_per_stage * (num_stages - 1) >= n_layers:
            raise KilnError(f"pipeline_parallel_layers_per_stage {layers_per_stage} leaves no layer for "
                             f"the last of {num_stages} stages ({n_layers} layers)")
        sizes = [layers_per_stage] * (num_stages - 1) + [n_layers - layers_per_stage * (num_stages - 1)]
    else:
        base, extra = divmod(n_layers, num_stages)
        sizes = [base] * num_stages
        # Give the extra layers to the middle stages first, then to the ends.
        order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(
            range(num_stages))
        for i in order[:extra]:
            sizes[i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def parse_stage_layers(spec: str, n_layers: int, num_stages: int) -> list[list[int]]:
    """'0-1,2-4,5' → [[0, 1], [2, 3, 4], [5]]: explicit layers per stage, which must cover every
    layer once, in order, and name one group per stage."""
    stages = []
    for group in spec.split(","):
        first, _, last = group.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise KilnError(
                f"pipeline_parallel_stage_layers: {group!r} is not a layer or a range a-b") from None
        stages.append(list(range(lo, hi + 1)))
    if len(stages) != num_stages:
        raise KilnError(f"pipeline_parallel_stage_layers names {len(stages)} stages but the schedule "
                         f"runs {num_stages}")
    if [i for s in stages for i in s] != list(range(n_layers)) or any(not s for s in stages):
        raise KilnError(f"pipeline_parallel_stage_layers {spec!r} must cover layers 0..{n_layers - 1} "
                         f"once each, in order, with at least one layer per stage")
    return stages


def make_stage_model(whole: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of the (meta-device) model that keeps only `layers`, plus the ends it owns. Multi-token
    prediction modules (`mtp`) run after the output norm, on the last stage, which then keeps its own
    copy of the embedding for them (a weight two stages hold: parallelisms/tied_weights.py)."""
    stage = copy.deepcopy(whole)
    for name in list(stage.layers.keys()):
        if int(name) not in layers:
            del stage.layers[name]
    mtp = getattr(stage, "mtp", None) is not None
    if not first and not (last and mtp):
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
        if mtp:
            stage.mtp = None
    return stage


# stage index → PipelineStage's static metadata of one microbatch: example input_args and
# output_args (and input_grads / output_grads, which it needs when they are DTensors).
StageShapes = Callable[[int], dict[str, tuple[torch.Tensor | None, ...]]]


def build_stages(parts: list[nn.Module], ids: list[int], num_stages: int, device: torch.device,
                 pp_mesh: DeviceMesh, after_metadata_inference: Callable[[], None] | None = None,
                 shapes: StageShapes | None = None) -> list[PipelineStage]:
    """Wrap each (parallelized, materialised) model part in a PipelineStage.

    On the first step each stage runs a forward and backward of one microbatch to learn the
    shapes it sends; after_metadata_inference() runs once that is done, before the real
    microbatches (it undoes side effects of that extra pass, e.g. MoE load counts). `shapes`
    gives the shapes instead (the planner's fake tensors cannot run that inference).
    """
    from torch.distributed.pipelining import PipelineStage

    group = pp_mesh.get_group()
    stages = []
    for part, i in zip(parts, ids, strict=True):
        static = shapes(i) if shapes is not None else {}
        stages.append(PipelineStage(part, stage_index=i, num_stages=num_stages, device=device, group=group,
                                    **static))
    if after_metadata_inference is not None:
        for stage in stages:
            # torch has no public hook here (docs/compatibility.md); its schedules call this
            # private method on every stage right after metadata inference.
            cleanup = stage._post_metadata_inference_cleanup

            def cleanup_then_hook(cleanup: Callable[[], None] = cleanup) -> None:
                cleanup()
                after_metadata_inference()

            stage._post_metadata_inference_cleanup = cleanup_then_hook
    return stages


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The torch schedule `name` over this rank's stages, splitting each batch in n_microbatches."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        get_schedule_class,
    )

    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    assert issubclass(cls, PipelineScheduleMulti)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class PipelineRunner:
    """Runs one training or evaluation step of this rank's stages through the schedule.

    The first stage is fed the inputs, the last stage the labels; the loss function is applied
    per microbatch on the last stage, scaled by `scale` (set per step), and the returned sum is
    unscaled again so it reports the plain summed cross-entropy of this rank's tokens.
    """

    def __init__(self, schedule_name: str, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], num_stages: int) -> None:
        self.scale = 1.0
        self.loss_fn = loss_fn
        self.has_first = any(s.stage_index == 0 for s in stages)
        self.has_last = any(s.stage_index == num_stages - 1 for s in stages)
        self.n_microbatches = n_microbatches
        self.stages = stages
        self.schedule = build_schedule(schedule_name, stages, n_microbatches, self._scaled_loss)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.scale

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
            train: bool = True, **kwargs: torch.Tensor) -> torch.Tensor:
        """Forward (and backward when train) of the whole batch; the summed loss on the last stage, else 0.
        kwargs (cut into microbatches along with the inputs) reach every stage's forward."""
        self.scale = scale
        losses: list[torch.Tensor] = []
        target = labels if self.has_last else None
        args = (inputs,) if self.has_first else ()
        if train:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.eval(*args, target=target, losses=losses)
        total = torch.zeros((), dtype=torch.float32, device=labels.device)
        for loss in losses:
            total += local_tensor(loss.detach()).float()
        return total / scale

