"""A whole plan: the layout checked as the trainer checks it, then the ranks that differ planned on
fake tensors, each against a device's memory, with the step time a given peak and MFU imply."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import multiprocessing
import os
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.runtime.errors import KilnError
from models import ModelSpec
from planning.devices import DEVICES, Device  # noqa: F401  (DEVICES: scripts/plan.py's table)
from planning.model_shape import cut_to, moe_flops_per_token
from planning.rank_plan import RankPlan, plan_rank
from planning.step_time import LayoutFacts, StepTime, predict, rank_flops
from training.assembly import build_layout, load_model_family

AC_MODES = ("none", "selective", "full")


@dataclass
class Suggestion:
    """One change to a layout that does not fit, planned: the flags to pass, what they change, and
    the peak of its fullest planned rank against the device."""

    flags: str
    why: str
    peak: int
    fits: bool
    spare_gib: float
    tokens_per_second_per_device: float = 0.0  # the step-time model's, for the changed layout


@dataclass
class Plan:
    """A run's plan: what it is, its layout, each planned rank and the estimates."""

    model: str
    num_params: int
    layout: str
    world_size: int
    global_batch: int
    seq_len: int
    microbatches: int  # per rank and step (pipeline: of the schedule)
    numerics: str
    ac_mode: str
    device: Device
    mfu: float | None  # the compute efficiency, instead of the device's calibrated one
    flops_per_token: int
    facts: LayoutFacts | None = None  # what the step-time model needs besides the measured bytes
    param_dtype: str = "float32"  # what FSDP gathers in
    reduce_dtype: str = "float32"  # what gradients are reduced in
    reshard_after_forward: str = "default"  # FSDP's setting (parallelisms/fsdp.py)
    loss_parallel: bool = True  # under TP, the logits stay sharded over the vocabulary
    hidden: int = 0  # the model's hidden size (what an MoE layer's all-to-alls send per routed token)
    top_k: int = 0  # experts each token is routed to (0: a dense model)
    moe_flops_per_token: float = 0.0  # the MoE layers' (planning/model_shape.py)
    ranks: list[RankPlan] = field(default_factory=list)
    seconds: float = 0.0  # wall time of planning
    suggestions: list[Suggestion] = field(default_factory=list)  # single changes tried (suggest_changes)
    suggestions_seconds: float = 0.0  # wall time of trying them

    @property
    def has_ac_peaks(self) -> bool:
        """Whether every rank was planned in every activation-checkpoint mode."""
        return bool(self.ranks) and all(r.ac_peaks for r in self.ranks)

    @property
    def fits(self) -> bool:
        """Whether every planned rank fits on the device."""
        return all(self.verdict(r)[0] for r in self.ranks)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def bubble(self) -> float:
        return max((r.bubble or 0.0) for r in self.ranks) if self.ranks else 0.0

    @property
    def estimate(self) -> StepTime:
        """The step-time model's prediction for the slowest planned rank (planning/step_time.py)."""
        eff = self.device.efficiency
        if self.mfu is not None:
            eff = dataclasses.replace(eff, compute=self.mfu)
        facts = self.facts or LayoutFacts({"pp": 1, "dp_replicate": 1, "dp_shard": self.world_size, "cp": 1,
                                           "tp": 1, "ep": 1}, 1)
        flops = rank_flops(self.flops_per_token, self.moe_flops_per_token, self.tokens_per_step,
                           self.world_size, facts.degrees)
        per_device = self.tokens_per_step / self.world_size
        times = [predict(flops, r.bubble or 0.0, r.communication, r.calls, per_device, facts,
                         self.device.peak_tflops, self.device.links, eff) for r in self.ranks]
        return max(times, key=lambda t: t.seconds)

    @property
    def step_seconds(self) -> float:
        return self.estimate.seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        seconds = self.step_seconds
        return self.tokens_per_step / self.world_size / seconds if seconds > 0 else 0.0

    def verdict(self, rank: RankPlan) -> tuple[bool, float]:
        """(fits, GiB to spare — negative when short) of a rank's peak on the device."""
        spare = self.device.memory_gib - self.device.reserve_gib - rank.peak / 2**30
        return spare >= 0, spare


def default_ranks(world_size: int, pp: int) -> list[int]:
    """The ranks that differ: the first of the first pipeline stage, of the second (a middle one:
    receive buffers both ways, neither the embedding nor the head, the most forwards in flight of
    the middle ones) and of the last one (EP and the data-parallel ranks hold the same sizes under
    balanced routing)."""
    per_stage = world_size // pp
    return sorted({0, per_stage if pp > 2 else 0, (pp - 1) * per_stage})


@dataclass
class _Pending:
    """A plan whose layout is checked and whose rank tasks are still to run."""

    plan: Plan
    spec: ModelSpec
    args: Any
    dims: Any
    options: ParallelOptions
    ranks: list[int]
    modes: list[str]
    tasks: list[tuple]
    start: float


def make_plan(cfg: JobConfig, world_size: int, device: Device, *, device_type: str = "cuda",
              ranks: list[int] | None = None, mfu: float | None = None, ac_modes: bool = True,
              workers: int | None = None) -> Plan:
    """Check the layout (every problem in one KilnError, as the trainer raises it), then plan each
    rank — with ac_modes, in the other activation-checkpoint modes too — `workers` processes at a
    time (default: one per core)."""
    pending = _prepare(cfg, world_size, device, device_type=device_type, ranks=ranks, mfu=mfu,
                       ac_modes=ac_modes)
    return _finish(pending, _run_tasks(pending.tasks, workers or os.cpu_count() or 1))


def _prepare(cfg: JobConfig, world_size: int, device: Device, *, device_type: str, ranks: list[int] | None,
             mfu: float | None, ac_modes: bool) -> _Pending:
    """The checked layout and the tasks that plan its ranks (a refused layout raises KilnError)."""
    start = time.perf_counter()
    spec, args = load_model_family(cfg)
    options = ParallelOptions.from_config(cfg, device_type)
    dims, global_batch = build_layout(cfg, spec, args, world_size, options, device_type)
    t = cfg.training
    microbatches = (global_batch // dims.dp // options.pp_microbatch_size if dims.pp > 1
                    else global_batch // (t.local_batch_size * dims.dp))
    plan = Plan(model=f"{cfg.model.name}/{cfg.model.flavor}", num_params=0, layout="", world_size=world_size,
                global_batch=global_batch, seq_len=t.seq_len, microbatches=microbatches,
                numerics=_numerics(options, dims.data_parallel_enabled), ac_mode=options.ac_mode,
                device=device, mfu=mfu, flops_per_token=0, facts=_facts(cfg, dims, args),
                param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
                reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                loss_parallel=options.loss_parallel,
                hidden=getattr(args, "dim", 0), top_k=getattr(getattr(args, "moe", None), "top_k", 0))
    ranks = ranks if ranks is not None else default_ranks(world_size, dims.pp)
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"rank {bad[0]} is not in a world of {world_size}")
    # One task per (rank, AC mode); the planned mode's with the optimizer, the others without.
    modes = [options.ac_mode] + ([m for m in AC_MODES if m != options.ac_mode] if ac_modes else [])
    tasks = [(cfg, world_size, rank, device_type, mode, mode == options.ac_mode) for rank in ranks
             for mode in modes]
    return _Pending(plan, spec, args, dims, options, ranks, modes, tasks, start)


def _facts(cfg: JobConfig, dims: Any, args: Any) -> LayoutFacts:
    """The layout as the step-time model sees it."""
    degrees = {name: getattr(dims, name) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    ac = cfg.activation_checkpoint
    return LayoutFacts(degrees, max(getattr(args, "n_layers", 1) // dims.pp, 1), ac.mode,
                       ac.selective_ac_option, cfg.compile.enable, "float8" in cfg.model.converters)


def _finish(pending: _Pending, done: list[RankPlan]) -> Plan:
    """The plan, from the results of its tasks."""
    plan, spec, args, dims, options = pending.plan, pending.spec, pending.args, pending.dims, pending.options
    ac_modes = len(pending.modes) > 1
    results = dict(zip([(t[2], t[4]) for t in pending.tasks], done, strict=True))
    for rank in pending.ranks:
        planned = results[(rank, options.ac_mode)]
        if ac_modes:  # other modes: their forward/backward peak, plus the state a steady step holds
            state = sum(planned.optimizer.values())
            planned.ac_peaks = {m: planned.peak if m == options.ac_mode else
                                max(results[(rank, m)].peak + state, planned.optimizer_step_peak)
                                for m in AC_MODES}
        plan.ranks.append(planned)
    num_stages = max(len(r.stages) for r in plan.ranks) * dims.pp
    plan.layout = dims.describe(options, num_stages, plan.microbatches if dims.pp > 1 else 0)
    plan.num_params = count_parameters(spec, args)
    plan.flops_per_token = spec.flops_per_token_fn(args, plan.num_params, plan.seq_len)
    plan.moe_flops_per_token = moe_flops_per_token(spec, args)
    plan.seconds = time.perf_counter() - pending.start
    return plan


def _plan_task(task: tuple) -> RankPlan:
    """One rank in one activation-checkpoint mode, in a process of its own; a seventh element, when
    present, plans the model cut to that many blocks, all of one kind (planning/depth_scaling.py scales
    such plans to the model's depth)."""
    cfg, world_size, rank, device_type, mode, with_optimizer, *depth = task
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # its notes about fake groups
    warnings.filterwarnings("ignore")
    spec, args = load_model_family(cfg)
    if depth and depth[0] is not None:
        args = cut_to(args, depth[0])
    options = dataclasses.replace(ParallelOptions.from_config(cfg, device_type), ac_mode=mode)
    return plan_rank(cfg, spec, args, options, world_size, rank, device_type, with_optimizer)


def _child(task: tuple, conn: Connection) -> None:
    """Plan one task, send the result (or the error) back, and leave at once: torch can abort a
    process that exits with DeviceMeshes and DTensors still alive, after the result is sent."""
    try:
        conn.send(("ok", _plan_task(task)))
    except BaseException as e:  # the parent re-raises it
        conn.send(("error", e))
    conn.close()
    os._exit(0)


def _run_tasks(tasks: list[tuple], workers: int, *, keep_errors: bool = False, start: str = "spawn"
               ) -> list[Any]:
    """The tasks side by side, `workers` at once, each in a fresh process: torch keeps process groups
    and DTensor's sharding caches per process, so a second fake world in one process finds stale
    groups of the first ("Could not resolve the process group"). A lone task runs here unless
    keep_errors, which also returns a task's exception in its place instead of raising it (a plan
    already ran here then, and one failed candidate must not stop the others). start="fork" skips
    each child's imports, for a parent that has imported everything and built no process group."""
    if len(tasks) == 1 and not keep_errors:
        return [_plan_task(tasks[0])]
    if start == "fork":
        # A forked child's collections would walk every object it inherits, and write to the pages
        # they sit on (copy-on-write): frozen, they are skipped (measured: docs/planning.md).
        gc.freeze()
    try:
        return _run_children(tasks, workers, keep_errors, multiprocessing.get_context(start))
    finally:
        if start == "fork":
            gc.unfreeze()


def _run_children(tasks: list[tuple], workers: int, keep_errors: bool, context: Any) -> list[Any]:
    """_run_tasks' processes, `workers` at once."""
    results: list[Any] = [None] * len(tasks)
    pending = list(enumerate(tasks))
    running: list[tuple[int, object, Connection]] = []
    while pending or running:
        while pending and len(running) < max(1, workers):
            index, task = pending.pop(0)
            parent, child = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(task, child), daemon=True)
            process.start()
            child.close()
            running.append((index, process, parent))
        ready = wait([parent for _, _, parent in running])  # whichever ends first: plans differ in length
        index, process, parent = running.pop(next(i for i, r in enumerate(running) if r[2] in ready))
        try:
            status, value = parent.recv()
        except EOFError:
            status, value = "error", RuntimeError(f"planning rank {tasks[index][2]} died (exit code "
                                                  f"{process.exitcode})")
        process.join()
        if status == "error" and not keep_errors:
            raise value
        results[index] = value
    return results


def _numerics(options: ParallelOptions, fsdp: bool) -> str:
    """What computes and reduces in which dtype, as the layout does it."""
    if options.param_dtype == "float32":
        return "float32"
    return f"bfloat16 compute (FSDP casts), {options.reduce_dtype} reduce" if fsdp else "bfloat16 (autocast)"


def count_parameters(spec: ModelSpec, args: Any) -> int:
    """Parameters of the whole model, counted on the meta device (a tied weight once)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    return sum(p.numel() for p in model.parameters())


def suggest_changes(cfg: JobConfig, world_size: int, plan: Plan, *, device_type: str = "cuda",
                    workers: int | None = None) -> list[Suggestion]:
    """For a plan that does not fit: a few single changes — more ranks, a larger TP or PP degree
    taken from FSDP's ranks, HSDP's replicas as FSDP shards, stronger activation checkpointing,
    a smaller batch per rank — each planned as the trainer would run it (the AC modes' peaks are
    reused from the plan when it has them), all side by side. Changes the layout checks refuse
    are left out; those that fit come first, smallest peak first. Only the planned mode and the
    default ranks are planned per change, which bounds the time to one plan's worth per core."""
    start = time.perf_counter()
    device, out, pending = plan.device, [], []
    spec, args = load_model_family(cfg)
    options = ParallelOptions.from_config(cfg, device_type)
    dims, _ = build_layout(cfg, spec, args, world_size, options, device_type)
    for flags, why, changed, world in _candidates(cfg, world_size, dims, plan, spec.pipeline_fn is not None):
        try:
            pending.append((flags, why, _prepare(changed, world, device, device_type=device_type, ranks=None,
                                                 mfu=plan.mfu, ac_modes=False)))
        except (KilnError, ValueError):
            continue  # a layout the trainer would refuse is no suggestion
    tasks = [task for _, _, p in pending for task in p.tasks]
    results = _run_tasks(tasks, workers or os.cpu_count() or 1, keep_errors=True) if tasks else []
    for flags, why, p in pending:
        done, results = results[:len(p.tasks)], results[len(p.tasks):]
        if any(isinstance(r, BaseException) for r in done):
            continue  # it failed to plan (e.g. a model check at build time): not suggested
        finished = _finish(p, list(done))
        out.append(_suggestion(flags, why, max(r.peak for r in done), device,
                               finished.tokens_per_second_per_device))
    if plan.has_ac_peaks:  # reused: planned with the plan itself
        for mode in AC_MODES[AC_MODES.index(plan.ac_mode) + 1:]:
            peak = max(r.ac_peaks[mode] for r in plan.ranks)
            recomputing = dataclasses.replace(plan, facts=dataclasses.replace(plan.facts, ac_mode=mode))
            out.append(_suggestion(f"--activation_checkpoint.mode {mode}",
                                   f"recompute {'every block' if mode == 'full' else 'part of each block'}"
                                   " in backward instead of keeping its activations", peak, device,
                                   recomputing.tokens_per_second_per_device))
    # those that fit, fastest first; then the rest, closest to fitting first
    plan.suggestions = sorted(out, key=lambda g: (not g.fits,
                                                  -g.tokens_per_second_per_device if g.fits else g.peak))
    plan.suggestions_seconds = time.perf_counter() - start
    return plan.suggestions


def _suggestion(flags: str, why: str, peak: int, device: Device, speed: float) -> Suggestion:
    spare = device.memory_gib - device.reserve_gib - peak / 2**30
    return Suggestion(flags, why, peak, spare >= 0, spare, speed)


def _candidates(cfg: JobConfig, world_size: int, dims: Any, plan: Plan, can_pipeline: bool
                ) -> list[tuple[str, str, JobConfig, int]]:
    """(flags, what they change, the changed config, its world size) for each single change worth
    planning; stronger AC is not among them (suggest_changes reuses the plan's AC peaks) unless the
    plan has none."""
    p, t = cfg.parallelism, cfg.training
    out = []

    def add(changes: dict[str, Any], why: str, world: int = world_size, dp: int = dims.dp) -> None:
        changes = changes | _batch_for(cfg, dp, changes)
        local = changes.get("training.local_batch_size", t.local_batch_size)
        if changes.get("training.global_batch_size", t.global_batch_size) == -1 and dp != dims.dp:
            why += f" (global batch_size -1: {local} × {dp} = {local * dp} rows per step)"
        changed = copy.deepcopy(cfg)
        for key, value in changes.items():
            section, name = key.split(".")
            setattr(getattr(changed, section), name, value)
        flags = " ".join([f"--world-size {world}"] * (world != world_size)
                         + [f"--{key} {value}" for key, value in changes.items()])
        out.append((flags, why, changed, world))

    # More ranks, the next power of two: FSDP shards over the new ones.
    bigger = 1 << world_size.bit_length()
    others = dims.dp_replicate * dims.cp * dims.tp * dims.pp
    if bigger % others == 0:
        shard = bigger // others
        add({} if p.data_parallel_shard_degree == -1 else {"parallelism.data_parallel_shard_degree": -1},
            f"{bigger} ranks: FSDP over {shard} instead of {dims.dp_shard}", bigger,
            dims.dp_replicate * shard)
    # A larger TP or PP degree, its ranks taken from FSDP's (the model's heads and layers permitting).
    if dims.dp_shard % 2 == 0:
        for key, degree, word in (("tensor_parallel_degree", dims.tp, "TP"),
                                  ("pipeline_parallel_degree", dims.pp, "PP")):
            if key == "pipeline_parallel_degree" and not can_pipeline:
                continue
            changes: dict[str, Any] = {f"parallelism.{key}": 2 * degree}
            if p.data_parallel_shard_degree != -1:
                changes["parallelism.data_parallel_shard_degree"] = dims.dp_shard // 2
            add(changes, f"{word} {2 * degree} instead of {degree}, FSDP over {dims.dp_shard // 2}",
                dp=dims.dp // 2)
    # HSDP's replicas as FSDP shards: every data-parallel rank holds a shard.
    if dims.dp_replicate > 1:
        add({"parallelism.data_parallel_replicate_degree": 1,
             "parallelism.data_parallel_shard_degree": dims.dp_replicate * dims.dp_shard},
            f"FSDP over all {dims.dp} data-parallel ranks instead of {dims.dp_replicate} replicas")
    # Fewer rows at once per rank, the same global batch: more microbatches per step.
    if dims.pp == 1 and t.local_batch_size > 1:
        rows = plan.global_batch // dims.dp
        local = max(d for d in range(1, t.local_batch_size // 2 + 1) if rows % d == 0)
        add({"training.local_batch_size": local, "training.global_batch_size": plan.global_batch},
            f"{local} rows per microbatch instead of {t.local_batch_size}, the same global batch")
    elif dims.pp > 1 and p.pipeline_parallel_microbatch_size > 1:
        size = p.pipeline_parallel_microbatch_size // 2
        add({"parallelism.pipeline_parallel_microbatch_size": size},
            f"pipeline microbatches of {size} rows instead of {p.pipeline_parallel_microbatch_size}")
    if not plan.has_ac_peaks and plan.ac_mode != "full":
        add({"activation_checkpoint.mode": "full"}, "recompute every block in backward instead of keeping "
            "its activations")
    return out


def _batch_for(cfg: JobConfig, dp: int, changes: dict[str, Any]) -> dict[str, Any]:
    """Batch sizes that let a fixed global batch split over `dp` data-parallel ranks: a smaller local
    batch when the rows per rank allow, else a global batch of local × dp ({} when nothing changes)."""
    t = cfg.training
    glob = changes.get("training.global_batch_size", t.global_batch_size)
    local = changes.get("training.local_batch_size", t.local_batch_size)
    if glob <= 0 or glob % (local * dp) == 0:
        return {}
    if glob % dp == 0:
        rows = glob // dp
        return {"training.local_batch_size": max(d for d in range(1, min(local, rows) + 1) if rows % d == 0)}
    return {"training.global_batch_size": local * dp}
