"""Plan one rank: the trainer's own build and training step, run on fake tensors under a fake
process group, measured as it goes.

The model is built on the meta device and parallelized by the family's parallelize_fn (real
DTensors, real FSDP) outside fake mode; inside FakeTensorMode it is allocated (to_empty), and two
training steps run through training.step.TrainStep — microbatches or the real pipeline schedule,
the grad-norm clip, the real optimizer. The first step creates the optimizer state; the second is
the steady state the plan reports (its peak and its collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.observability.memory_report import bytes_by_dtype, state_bytes
from components.runtime.errors import KilnError
from components.runtime.tensor_utils import local_tensor
from models import ModelSpec
from parallelisms.materialize import to_empty_keeping_ties
from planning.balanced_routing import balance_routing
from planning.cuda_attention import cuda_attention
from planning.fake_world import fake_world, mesh_group_names
from planning.model_shape import TensorParallelRows, expert_parameters, in_blocks, tensor_parallel_rows
from planning.pipeline_bubble import schedule_bubble
from planning.step_tracker import StepTracker
from training.assembly import (
    ModelParts,
    OptimizerFactory,
    build_layout,
    build_model_parts,
    build_optimizers,
    build_train_step,
)
from training.step import Batch, Microbatch, TrainStep


@dataclass
class RankPlan:
    """What one rank holds and moves in a steady-state training step."""

    rank: int
    coordinates: dict[str, int]  # its place on every mesh dimension of degree > 1
    stages: list[int]
    parameters: dict[str, int]  # bytes by dtype, as stored (FSDP padding included)
    gradients: dict[str, int]  # bytes by dtype at the optimizer step
    optimizer: dict[str, int]  # bytes of optimizer state by dtype
    buffers: int
    peak: int  # the most tensor memory alive at once during a step
    peak_breakdown: dict[str, int]
    optimizer_step_peak: int  # the most alive while the optimizer stepped
    communication: dict[str, dict[str, int]]  # mesh dim → kind → bytes per step
    calls: dict[str, dict[str, int]]  # mesh dim → kind → collectives per step
    bubble: float | None = None  # pipeline idle fraction (None without PP)
    moe_layers: int = 0  # layers routed by the balanced assumption
    # what TP gathers and reduces at least per token (model_shape.tensor_parallel_rows); None without
    # sequence-parallel TP or where its plan is not Kiln's
    tensor_parallel_rows: TensorParallelRows | None = None
    # of the parameters the blocks' (FSDP gathers them again for backward) and the routed experts'
    # (under EP sharded over another group than the rest): planning/comm_floor.py
    block_parameters: dict[str, int] = field(default_factory=dict)
    expert_parameters: dict[str, int] = field(default_factory=dict)
    forward_keeps: int = 0  # bytes a stage's second forward left alive for its backward (the least
    # over this rank's stages; 0 below two microbatches): what each forward in flight holds
    stage_keeps: list[int] = field(default_factory=list)  # the same per local stage (empty below two)
    forwards_peak: int = 0  # the most alive while the step's forwards and backwards ran (not its optimizer's)
    steady_peak: int = 0  # the same while a pipeline's most forwards were in flight (PipelineMicrobatchWatch)
    # the collectives one more microbatch adds to the step (mesh dim → kind → bytes; calls alike):
    # without a pipeline its first microbatch's, with one PipelineMicrobatchWatch's; empty below two
    microbatch_communication: dict[str, dict[str, int]] = field(default_factory=dict)
    microbatch_calls: dict[str, dict[str, int]] = field(default_factory=dict)
    # (bytes alive, forwards in flight, the most alive until it ended) as the rank's first two
    # backwards began: what its pipelined peak holds at least then, with more forwards in flight
    # under another schedule
    backward_starts: list[tuple[int, int, int]] = field(default_factory=list)
    # bytes one more pipeline microbatch keeps alive through the whole step: torch's stages hold a
    # receive buffer per microbatch (activations in, gradients back) and the step holds its rows
    microbatch_bytes: int = 0
    # the most alive during the rank's last backward: its own forward alone in flight, every other
    # backward of the step done (torch reduces the gradients after it) — in any schedule's step
    last_backward_peak: int = 0
    seconds: float = 0.0  # how long planning this rank took
    ac_peaks: dict[str, int] = field(default_factory=dict)  # peak per activation-checkpoint mode


def _tensor_parallel_rows(parts: list[nn.Module], dims: Any) -> TensorParallelRows | None:
    """The rank's parts' TP floor rows, summed: under sequence-parallel TP (apply_tp marks the
    model), where every part's blocks are of Kiln's kind."""
    if dims.tp == 1 or not all(getattr(part, "tp_sequence_parallel", False) for part in parts):
        return None
    rows = [tensor_parallel_rows(part, dims.ep > 1) for part in parts]
    return None if None in rows else TensorParallelRows(*(sum(n) for n in zip(*rows, strict=True)))


class LocalOptimizer:
    """The run's optimizer (built by training.assembly.build_optimizers, with the trainer's weight
    decay groups) over the local pieces of the parameters: the same state and temporaries as over the
    DTensors, without DTensor's sharding propagation for every foreach/fused kernel (most of a fake
    step's time). The gradients are handed to the local pieces just before each step."""

    def __init__(self, part: nn.Module, make: OptimizerFactory) -> None:
        named = [(name, p, local_tensor(p).detach().requires_grad_(p.requires_grad))
                 for name, p in part.named_parameters()]
        self.pairs = [(p, local) for _, p, local in named]
        self.inner = make([(name, local) for name, _, local in named])

    @property
    def state(self) -> dict:
        return self.inner.state

    def register_step_pre_hook(self, hook: Any) -> None:
        self.inner.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> None:
        self.inner.register_step_post_hook(hook)

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        for p, local in self.pairs:
            grad = p.grad
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                # e.g. a vocabulary-sharded embedding's gradient, which comes back whole: DTensor
                # redistributes it to the parameter's layout inside the optimizer's kernels
                grad = grad.redistribute(p.device_mesh, p.placements)
            local.grad = local_tensor(grad) if grad is not None else None
        self.inner.step()
        for _, local in self.pairs:
            local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            p.grad = None

    def make_state(self) -> None:
        """One step on zero gradients: the state exists, as after a run's first step."""
        for _, local in self.pairs:
            local.grad = torch.zeros_like(local) if local.requires_grad else None
        self.inner.step()
        for _, local in self.pairs:
            local.grad = None


class PlannedStep(TrainStep):
    """TrainStep with the two data-dependent values supplied — every label counts as a token, the
    MoE load is balanced (its all-reduce still issued, so it is counted) — and gradient
    accumulation over more than three microbatches run as three: the first, one that stands for
    every middle one (its collectives counted that many times) and the last (they differ in what
    they reduce), since identical microbatches reach the same peak. The first's collectives are
    kept apart too (`first_microbatch`): a step's collectives at one microbatch fewer."""

    tracker: StepTracker
    first_microbatch: tuple[dict, dict] | None = None  # (mesh dim, kind) → bytes, and → calls

    def _microbatch(self, microbatch: Microbatch, scale: float, last: bool) -> torch.Tensor:
        if last or self.first_microbatch is not None:
            return super()._microbatch(microbatch, scale, last)
        with self.tracker.collectives_during() as self.first_microbatch:
            return super()._microbatch(microbatch, scale, last)

    def count_tokens(self, microbatches: Batch) -> tuple[torch.Tensor, float]:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.loss_group is not None:
            torch.distributed.all_reduce(local.clone(), group=self.loss_group)
        count = sum(y.numel() for _, y in microbatches)
        return local, float(count * self.dims.dp * self.dims.cp)

    def balance_experts(self) -> dict[str, list[int]]:
        if self.moe_layers and self.loss_group is not None:
            counts = torch.stack([m.tokens_per_expert for _, m in self.moe_layers]).double()
            torch.distributed.all_reduce(counts, group=self.loss_group)
        return {}

    def _forward_backward(self, microbatches: list[Microbatch], scale: float) -> torch.Tensor:
        middle = len(microbatches) - 2
        if middle <= 1:
            return super()._forward_backward(microbatches, scale)
        loss = self._microbatch(microbatches[0], scale, last=False)
        with self.tracker.collectives_during() as added:
            loss = loss + self._microbatch(microbatches[1], scale, last=False)
        for counts, one in zip((self.tracker.comm_bytes, self.tracker.comm_calls), added, strict=True):
            for key, n in one.items():  # one middle microbatch measured: counted for all of them
                counts[key] += n * (middle - 1)
        return loss + self._microbatch(microbatches[-1], scale, last=True)


class PipelineMicrobatchWatch:
    """The collectives one more pipeline microbatch adds to a step: each stage's second forward and
    first backward that is not its last (the step's first forward gathers FSDP's parameters, which
    stay gathered; its last backward reduces the gradients), the last stage's second loss (loss
    parallel reduces there), and the sends and receives, all per microbatch. Also what is alive as
    the rank's first two backwards begin (`backward_starts`), the most alive in its last, and what
    each microbatch keeps to the step's end (`microbatch_bytes`), and the most alive while it ran
    with (nearly) its most forwards in flight (`steady_peak`)."""

    def __init__(self, runner: Any, tracker: StepTracker, shapes: Callable[[int], dict]) -> None:
        self.tracker = tracker
        self.bytes: dict[tuple[str, str], int] = {}
        self.calls: dict[tuple[str, str], int] = {}
        self.backward_starts: list[tuple[int, int, int]] = []
        self.last_backward_peak = 0
        self.windows: list[tuple[int, int]] = []  # per forward, loss and backward but the last: (forwards
        # in flight as it began, the most alive while it ran)
        self.in_flight = 0
        # each microbatch's receive buffers, which torch's stages make for every microbatch of a step:
        # activations in, but on the first stage; gradients back, but on the last — each the size of
        # what flows between stages (`shapes`: what they are built with; the first stage's own, as
        # asking for the last's runs its forward)
        between = _nbytes(shapes(0)["output_grads"])
        self.buffers = between * sum((not stage.is_first) + (not stage.is_last) for stage in runner.stages)
        mark, run = tracker.born, runner.run  # made just before the step's rows
        self.rows_kept = 0

        def counted_run(*args: Any, **kwargs: Any) -> Any:
            self.rows_kept = tracker.alive_since(mark)  # the rows, and what the step made of them
            return run(*args, **kwargs)

        runner.run = counted_run
        forwards: dict[int, int] = {}
        backwards: set[int] = set()
        run_backwards = itertools.count()
        for stage in runner.stages:
            forward, backward, index = stage.forward_one_chunk, stage.backward_one_chunk, stage.stage_index

            def counted_forward(*args: Any, _run: Callable = forward, _i: int = index, **kwargs: Any) -> Any:
                forwards[_i] = forwards.get(_i, 0) + 1
                out = self._windowed(_run, forwards[_i] == 2, *args, **kwargs)
                self.in_flight += 1
                return out

            def counted_backward(*args: Any, _run: Callable = backward, _i: int = index,
                                 last_backward: bool = False, **kwargs: Any) -> Any:
                done = next(run_backwards)
                first = not last_backward and _i not in backwards
                if first:
                    backwards.add(_i)
                start = tracker.now
                out = self._windowed(_run, first, *args, last=last_backward, last_backward=last_backward,
                                     **kwargs)
                self.in_flight -= 1
                if done < 2:
                    self.backward_starts.append((start, sum(forwards.values()) - done, tracker.window_peak))
                self.last_backward_peak = tracker.window_peak  # the step's last, once it has run
                return out

            stage.forward_one_chunk, stage.backward_one_chunk = counted_forward, counted_backward
        losses, loss_fn = itertools.count(1), runner.loss_fn

        def counted_loss(*args: Any) -> Any:
            return self._windowed(loss_fn, next(losses) == 2, *args)

        runner.loss_fn = counted_loss

    def _windowed(self, run: Callable, count: bool, *args: Any, last: bool = False, **kwargs: Any) -> Any:
        """_counted, noting the forwards in flight as it began and the most alive while it ran (but
        for the step's last backward, which reduces the gradients, alone in any schedule)."""
        in_flight, self.tracker.window_peak = self.in_flight, self.tracker.now
        out = self._counted(run, count, *args, **kwargs)
        if not last:
            self.windows.append((in_flight, self.tracker.window_peak))
        return out

    @property
    def steady_peak(self) -> int:
        """The most alive while a forward, loss or backward ran with the most forwards in flight of the
        step, or one fewer (a steady state's forward follows a backward): what more forwards in flight,
        in a deeper pipeline, add to (planning/shallow_pipeline.py)."""
        most = max((n for n, _ in self.windows), default=0)
        return max((peak for n, peak in self.windows if n >= most - 1), default=0)

    def _counted(self, run: Callable, count: bool, *args: Any, **kwargs: Any) -> Any:
        if not count:
            return run(*args, **kwargs)
        with self.tracker.collectives_during() as added:
            out = run(*args, **kwargs)
        for total, one in zip((self.bytes, self.calls), added, strict=True):
            for key, n in one.items():
                if key[1] != "send/recv":  # the sends: per microbatch, see one_microbatch
                    total[key] = total.get(key, 0) + n
        return out

    def microbatch_bytes(self, microbatches: int) -> int:
        """What each microbatch keeps alive through the step: its rows and its receive buffers."""
        return self.rows_kept // microbatches + self.buffers

    def one_microbatch(self, microbatches: int) -> tuple[dict, dict]:
        """(mesh dim, kind) → bytes, and → calls, of one microbatch (of a step of `microbatches`)."""
        out = dict(self.bytes), dict(self.calls)
        for table, counts in zip(out, (self.tracker.comm_bytes, self.tracker.comm_calls), strict=True):
            for key, n in counts.items():
                if key[1] == "send/recv":
                    table[key] = n // microbatches
        return out


def allocate_fake(module: nn.Module) -> None:
    """module.to_empty("cpu") inside FakeTensorMode. DTensor parameters (FSDP, TP) go through
    to_empty, which FSDP supports. Plain meta parameters cannot be filled in place with fake tensors
    (the tensor types differ, and fake tensors refuse swap_tensors), so they are replaced by fake
    parameters of their shapes, shared where the meta ones were (tied weights), and so are the
    buffers."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        to_empty_keeping_ties(module, "cpu")
        return
    fakes: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for table, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in fakes:
                    empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    fakes[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if wrap else empty
                table[name] = fakes[id(t)]


def fsdp_lazy_init(part: nn.Module) -> None:
    """FSDP's lazy initialization, which a run does in its first forward, done before the optimizer
    exists. It pads an uneven shard again unless the storage is the one it padded, which it tells by
    data_ptr — 0 for every fake tensor, so on fake tensors it always does. Done before the optimizer
    holds the shard, the copy replaces it instead of counting beside it."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(part, FSDPModule):
        fully_shard.state(part)._lazy_init()  # private: what the root's first forward runs


def _probe_stage(spec: ModelSpec, args: Any, dims: Any, options: ParallelOptions) -> nn.Module:
    """A first stage of the embedding and block 0, parallelized like every stage (on meta, outside
    fake mode: FSDP cannot be applied inside it): what it emits is what flows between stages. Built
    from a model of that one block: the rest would be built only to be dropped."""
    with torch.device("meta"):
        whole = spec.model_cls(dataclasses.replace(args, n_layers=1))
    probe = spec.pipeline_fn(whole, [0], True, False)
    spec.parallelize_fn(probe, dims, options)
    return probe


def _stage_shapes(probe: nn.Module, built: ModelParts, rows: int, seq: int, device_type: str):
    """Static example inputs/outputs (and gradients) per pipeline stage, in fake mode: the probe's
    output between stages, the last stage's own forward for its output."""
    allocate_fake(probe)
    probe.init_buffers("cpu")
    balance_routing([probe], device_type)
    tokens = torch.zeros(rows, seq, dtype=torch.long)
    with torch.no_grad():
        hidden = probe(tokens)
    hidden = torch.empty_like(local_tensor(hidden))
    sent = torch.empty_like(hidden).requires_grad_()  # an output that gets a gradient back
    parts = dict(zip(built.stage_ids, built.parts, strict=True))
    last = built.num_stages - 1

    def shapes(i: int) -> dict[str, tuple[torch.Tensor | None, ...]]:
        inputs = (tokens,) if i == 0 else (sent,)
        if i != last:
            outputs, output_grads = (sent,), (hidden,)
        else:  # the loss is taken on the last stage: no gradient comes into its output
            with torch.no_grad():
                outputs, output_grads = (parts[i](*inputs),), (None,)
        return {"input_args": inputs, "output_args": outputs,
                "input_grads": (None,) if i == 0 else (hidden,), "output_grads": output_grads}

    return shapes


def _microbatches(cfg: JobConfig, dims: Any, global_batch: int, vocab: int) -> Batch:
    """This rank's microbatches of a step, as fake token tensors of the real shapes."""
    t = cfg.training
    n = global_batch // (t.local_batch_size * dims.dp)
    return [(torch.randint(0, vocab, (t.local_batch_size, t.seq_len)),
             torch.randint(0, vocab, (t.local_batch_size, t.seq_len))) for _ in range(n)]


def plan_rank(cfg: JobConfig, spec: ModelSpec, args: Any, options: ParallelOptions, world_size: int,
              rank: int, device_type: str, with_optimizer: bool = True) -> RankPlan:
    """Build rank `rank` of `world_size` as the trainer would for `device_type` and measure two fake
    steps (without the optimizer: one forward/backward, for another activation-checkpoint mode);
    raises the trainer's KilnError for a layout it would refuse."""
    start = time.perf_counter()
    if cfg.model.converters:
        raise KilnError(f"the planner does not plan model.converters ({cfg.model.converters}) yet: it "
                        "would measure the unconverted model; plan without them")
    dims, global_batch = build_layout(cfg, spec, args, world_size, options, device_type)
    # The fake tensors live on cpu; and the blocks run eager: inductor's compiled kernels would run
    # on fake tensors' (absent) data. Compiling fuses elementwise ops, which only lowers the peak.
    options = dataclasses.replace(options, compile=False)
    build_options = dataclasses.replace(options, device_type="cpu")
    with fake_world(world_size, rank):
        dims.build_mesh("cpu")
        built = build_model_parts(spec, args, dims, build_options)
        probe = _probe_stage(spec, args, dims, build_options) if dims.pp > 1 else None
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            shapes = (_stage_shapes(probe, built, options.pp_microbatch_size, cfg.training.seq_len // dims.cp,
                                    device_type)
                      if probe is not None else None)
            tracker = StepTracker(fake, mesh_group_names(dims), device_type)
            kernels = cuda_attention() if device_type == "cuda" else contextlib.nullcontext()
            with tracker, kernels:
                plan = _run_steps(cfg, args, dims, options, built, global_batch, tracker, shapes,
                                  with_optimizer, device_type)
        coordinates = (dict(zip(dims.world_mesh.mesh_dim_names, dims.world_mesh.get_coordinate(),
                                strict=True)) if dims.world_mesh is not None else {})
        dims.release()
    plan.rank, plan.coordinates, plan.seconds = rank, coordinates, time.perf_counter() - start
    return plan


def _run_steps(cfg: JobConfig, args: Any, dims: Any, options: ParallelOptions, built: ModelParts,
               global_batch: int, tracker: StepTracker, shapes: Any, with_optimizer: bool,
               device_type: str) -> RankPlan:
    """Allocate, make the optimizer state as a first step would, then measure one step (without the
    optimizer: its forward and backward)."""
    parts = built.parts
    tracker.category = "parameters"
    for part in parts:
        allocate_fake(part)
    tracker.category = "buffers"
    for part in parts:
        part.init_buffers("cpu")
    tracker.category = "parameters"  # FSDP's new copies of uneven shards
    for part in parts:
        fsdp_lazy_init(part)
    tracker.category = "activations and temporaries"
    moe = balance_routing(parts, device_type)
    optimizers, schedulers = (build_optimizers(cfg, built, device_type, wrap=LocalOptimizer) if with_optimizer
                              else ([], []))
    grads: dict[str, int] = {}
    _watch_optimizers(optimizers, parts, tracker, grads)
    tracker.gradient_storages = lambda: [_storage(p.grad) for part in parts for p in part.parameters()
                                         if p.grad is not None]
    cpu_options = dataclasses.replace(options, device_type="cpu")  # the fake tensors live on cpu
    step = build_train_step(cfg, built, optimizers, schedulers, dims, cpu_options, torch.device("cpu"),
                            global_batch, step_class=PlannedStep, stage_shapes=shapes)
    step.tracker = tracker
    for opt in optimizers:
        opt.make_state()
    tracker.reset_peak()
    second_forwards = _second_forward_growth(parts, tracker)
    watch = PipelineMicrobatchWatch(step.pipeline, tracker, shapes) if step.pipeline is not None else None
    step(_microbatches(cfg, dims, global_batch, args.vocab_size))
    tracker.finish()
    one_more = step.first_microbatch  # without a pipeline; with one:
    if watch is not None and step.pipeline.n_microbatches >= 2:
        one_more = watch.one_microbatch(step.pipeline.n_microbatches)
    sizes = state_bytes(parts, optimizers)
    communication, calls = _by_dim(tracker.comm_bytes), _by_dim(tracker.comm_calls)
    microbatch_communication, microbatch_calls = (_by_dim(t) for t in one_more or ({}, {}))
    bubble = (schedule_bubble(step.pipeline.schedule, built.num_stages).fraction
              if step.pipeline is not None else None)
    buffers = sum(local_tensor(b).untyped_storage().nbytes() for part in parts for b in part.buffers())
    # each stage's second forward's keeps, once every stage has run two (none below two microbatches)
    stage_keeps = ([second_forwards[i] for i in range(len(parts))] if len(second_forwards) == len(parts)
                   else [])
    tp_rows = _tensor_parallel_rows(parts, dims)
    return RankPlan(rank=0, coordinates={}, stages=list(built.stage_ids), parameters=sizes["parameters"],
                    tensor_parallel_rows=tp_rows,
                    block_parameters=bytes_by_dtype([p for part in parts for p in in_blocks(part)]),
                    expert_parameters=bytes_by_dtype([p for part in parts for p in expert_parameters(part)]),
                    gradients=grads, optimizer=sizes["optimizer"], buffers=buffers, peak=tracker.peak,
                    peak_breakdown=dict(tracker.peak_by_category),
                    optimizer_step_peak=tracker.phase_peak.get("optimizer step temporaries", 0),
                    communication=communication, calls=calls, bubble=bubble, moe_layers=moe,
                    forward_keeps=min(stage_keeps, default=0), stage_keeps=stage_keeps,
                    forwards_peak=tracker.phase_peak.get("activations and temporaries", 0),
                    microbatch_communication=microbatch_communication, microbatch_calls=microbatch_calls,
                    backward_starts=watch.backward_starts if watch is not None else [],
                    last_backward_peak=watch.last_backward_peak if watch is not None else 0,
                    steady_peak=watch.steady_peak if watch is not None else 0,
                    microbatch_bytes=watch.microbatch_bytes(step.pipeline.n_microbatches) if watch else 0)


def _nbytes(tensors: tuple[torch.Tensor | None, ...]) -> int:
    """The bytes of the tensors given (None: none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """A tensor's storage (a DTensor's local one) without dispatching an op: asked for when memory is
    freed, which may be inside activation checkpointing's recompute, whose ops must not change."""
    from torch.distributed.tensor import DTensor

    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def _by_dim(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """(mesh dim, kind) → n as mesh dim → kind → n."""
    out: dict[str, dict[str, int]] = {}
    for (dim, kind), n in sorted(counts.items()):
        out.setdefault(dim, {})[kind] = n
    return out


def _second_forward_growth(parts: list[nn.Module], tracker: StepTracker) -> dict[int, int]:
    """Per part (a pipeline stage, or the model), the live bytes its second forward that builds a
    graph adds, filled in as the step runs (the first also gathers FSDP's parameters, which stay
    gathered across a pipeline's microbatches)."""
    growth: dict[int, int] = {}
    before: dict[int, int] = {}
    forwards = dict.fromkeys(range(len(parts)), 0)

    def pre(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            before[i] = tracker.now
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if torch.is_grad_enabled():
                forwards[i] += 1
                if forwards[i] == 2:
                    growth[i] = tracker.now - before[i]
        return hook

    for i, part in enumerate(parts):
        part.register_forward_pre_hook(pre(i))
        part.register_forward_hook(post(i))
    return growth


def _watch_optimizers(optimizers: list[torch.optim.Optimizer], parts: list[nn.Module], tracker: StepTracker,
                      grads: dict[str, int]) -> None:
    """Label what optimizer.step makes: its state as "optimizer state", the rest as its temporaries;
    record the gradient bytes it sees."""
    def before(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads.clear()
        grads.update(state_bytes(parts, [])["gradients"])
        tracker.category = "optimizer step temporaries"

    def after(opt: torch.optim.Optimizer, *_: Any) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.relabel(value, "optimizer state")
        tracker.category = "activations and temporaries"

    for opt in optimizers:
        opt.register_step_pre_hook(before)
        opt.register_step_post_hook(after)
