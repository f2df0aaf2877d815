"""What a run is built from, written once for the trainer (train.py) and the planner (scripts/plan.py):
the model family, the checked layout, this rank's model parts on the meta device (parallelized), their
optimizers and LR schedules, and the training step over them.

The planner runs exactly these under a fake process group, so a layout the trainer refuses is
refused there with the same message, and the sizes it measures are the trainer's.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.optim.lr_schedule import build_lr_scheduler
from components.optim.optimizer import build_optimizer, embedding_names
from components.runtime.custom_import import import_custom
from components.runtime.errors import KilnError
from models import ModelSpec, UnknownModelError, get_model_args, get_model_spec, with_mtp_depth
from models.protocol import args_problems
from parallelisms.gloo_accelerations import apply_gloo_accelerations
from parallelisms.layout_checks import ModelShape, stage_layers
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import stage_ids
from parallelisms.tied_weights import shared_parameter_names
from training.step import StepSetup, TrainStep


def load_model_family(cfg: JobConfig) -> tuple[ModelSpec, Any]:
    """The registered ModelSpec of model.name (after job.custom_import) and a copy of its flavor's args."""
    if cfg.job.custom_import:
        import_custom(cfg.job.custom_import, cfg.config_dir)
    try:
        spec = get_model_spec(cfg.model.name)
        args = with_mtp_depth(spec, get_model_args(spec, cfg.model.flavor), cfg.model.mtp_depth)
    except UnknownModelError as e:
        raise KilnError(str(e)) from None
    problems = args_problems(args)  # a flavor added after registration is checked here
    if problems:
        raise KilnError(f"model {spec.name!r} flavor {cfg.model.flavor!r} does not meet the model contract "
                        f"(models/protocol.py): {'; '.join(problems)}")
    return spec, args


def global_batch_size(cfg: JobConfig, dp: int) -> int:
    """training.global_batch_size, or local_batch_size × dp when it is -1."""
    t = cfg.training
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp


def build_layout(cfg: JobConfig, spec: ModelSpec, args: Any, world_size: int, options: ParallelOptions,
                 device_type: str) -> tuple[ParallelDims, int]:
    """The degrees of the config, checked against the world size, the model and the run — every
    problem in one KilnError — and the global batch size; no mesh yet."""
    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.unchecked(dp_replicate=p.data_parallel_replicate_degree,
                                  dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                                  tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                                  ep=p.expert_parallel_degree, world_size=world_size)
    batch = global_batch_size(cfg, dims.dp)
    dims.check_layout(ModelShape.from_args(args, spec.pipeline_fn is not None), options,
                      device_type=device_type, global_batch=batch, local_batch=t.local_batch_size,
                      document_mask=t.document_mask,
                      extra=spec.check_fn(args, dims) if spec.check_fn else [])
    return dims, batch


@dataclass
class ModelParts:
    """This rank's model: its parts (the whole model, or its pipeline stages), still on meta."""

    parts: list[nn.Module]
    stage_ids: list[int]  # the pipeline stage of each part ([0] without PP)
    num_stages: int
    num_params: int  # of the whole model, a tied weight once
    tied_names: list[list[str]]  # the names of each weight two modules or two stages hold (tied embeddings)
    accelerations: list[str]  # what comm.gloo_accelerations changed (nothing off gloo)
    mtp_depth: int = 0  # multi-token prediction modules of the model (on its last stage)


def build_model_parts(spec: ModelSpec, args: Any, dims: ParallelDims, options: ParallelOptions,
                      convert: Callable[[nn.Module], None] | None = None) -> ModelParts:
    """The model on the meta device, converted (model.converters, e.g. float8 linears), cut into this
    rank's pipeline stages (if any), each part parallelized by the family's parallelize_fn (the mesh
    must be built); then, with comm.gloo_accelerations, gloo's faster collectives."""
    with torch.device("meta"):
        whole = spec.model_cls(args)
    num_params = sum(p.numel() for p in whole.parameters())
    tied = shared_parameter_names(whole)
    mtp_depth = len(getattr(whole, "mtp", None) or ())
    if mtp_depth and dims.pp > 1 and not any("tok_embeddings.weight" in names for names in tied):
        tied.append(["tok_embeddings.weight"])  # the last stage's copy for the MTP modules
    if convert is not None:
        convert(whole)
    if dims.pp == 1:
        parts, ids, num_stages = [whole], [0], 1
    else:
        layers = stage_layers(args.n_layers, dims.pp, options)
        ids = stage_ids(dims.mesh("pp").get_local_rank(), dims.pp, options.pp_schedule)
        last = len(layers) - 1
        parts = [spec.pipeline_fn(whole, layers[i], i == 0, i == last) for i in ids]
        num_stages = len(layers)
    accelerations: list[str] = []
    for part in parts:
        spec.parallelize_fn(part, dims, options)
        if options.gloo_accelerations:
            accelerations += [a for a in apply_gloo_accelerations(part) if a not in accelerations]
    return ModelParts(parts, ids, num_stages, num_params, tied, accelerations, mtp_depth)


OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


def build_optimizers(cfg: JobConfig, model: ModelParts, device_type: str,
                     wrap: Callable[[nn.Module, OptimizerFactory], Any] | None = None
                     ) -> tuple[list[Any], list[torch.optim.lr_scheduler.LRScheduler]]:
    """One optimizer and LR schedule per model part (pipeline stages keep separate state dicts).
    `wrap(part, make)` lets the planner build each optimizer over its own copies of the parameters;
    it must return an object whose `.inner` is what `make` built."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizers, inner = [], []
    for part in model.parts:
        embeddings = embedding_names(part, model.tied_names)

        def make(named: list[tuple[str, nn.Parameter]], embeddings: set[str] = embeddings
                 ) -> torch.optim.Optimizer:
            return build_optimizer(named, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay,
                                   o.implementation, device_type, exclude=o.weight_decay_exclude,
                                   embeddings=embeddings)

        built = wrap(part, make) if wrap is not None else make(list(part.named_parameters()))
        optimizers.append(built)
        inner.append(built.inner if wrap is not None else built)
    schedulers = [build_lr_scheduler(opt, warmup_steps=s.warmup_steps, total_steps=cfg.training.steps,
                                     decay_ratio=s.decay_ratio, decay_type=s.decay_type,
                                     min_lr_factor=s.min_lr_factor) for opt in inner]
    return optimizers, schedulers


def build_train_step(cfg: JobConfig, model: ModelParts, optimizers: list[Any], schedulers: list[Any],
                     dims: ParallelDims, options: ParallelOptions, device: torch.device, global_batch: int,
                     after_optimizer_step: Callable[[], None] | None = None, *,
                     step_class: type[TrainStep] = TrainStep, stage_shapes: Any = None) -> TrainStep:
    """The training step over this rank's parts (the planner passes its measuring subclass)."""
    setup = StepSetup(dims, options, device, cfg.training.max_norm, global_batch, after_optimizer_step,
                      mtp_loss_weight=cfg.model.mtp_loss_weight)
    return step_class(model, optimizers, schedulers, setup, stage_shapes=stage_shapes)
