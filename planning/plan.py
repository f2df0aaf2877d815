"""A whole plan: the layout checked as the trainer checks it, then the ranks that differ planned on
fake tensors, each against a device's memory, with the step time a given peak and MFU imply."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from models import ModelSpec
from planning.rank_plan import RankPlan, plan_rank
from training.assembly import build_layout, load_model_family

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Device:
    """What a plan is checked against."""

    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (or what --peak-tflops says)
    reserve_gib: float = 2.0  # kept free: CUDA context, NCCL buffers, allocator fragmentation


# Memory (GiB as the driver reports it) and dense bf16 TFLOP/s from the vendors' data sheets.
DEVICES = {
    "h100": Device("H100 SXM 80GB", 79.2, 989.0), "h200": Device("H200 141GB", 139.8, 989.0),
    "a100": Device("A100 80GB", 79.1, 312.0), "a100-40": Device("A100 40GB", 39.4, 312.0),
    "b200": Device("B200 180GB", 178.4, 2250.0), "mi300x": Device("MI300X 192GB", 191.5, 1307.0),
    "l40s": Device("L40S 48GB", 44.4, 362.0),
}


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
    mfu: float
    flops_per_token: int
    ranks: list[RankPlan] = field(default_factory=list)
    seconds: float = 0.0  # wall time of planning

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def bubble(self) -> float:
        return max((r.bubble or 0.0) for r in self.ranks) if self.ranks else 0.0

    @property
    def step_seconds(self) -> float:
        """Compute per device at the assumed MFU, stretched by the pipeline bubble (communication is
        assumed hidden behind compute)."""
        flops = self.flops_per_token * self.tokens_per_step / self.world_size
        return flops / (self.device.peak_tflops * 1e12 * self.mfu) / (1.0 - self.bubble)

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step / self.world_size / self.step_seconds

    def verdict(self, rank: RankPlan) -> tuple[bool, float]:
        """(fits, GiB to spare — negative when short) of a rank's peak on the device."""
        spare = self.device.memory_gib - self.device.reserve_gib - rank.peak / 2**30
        return spare >= 0, spare


def default_ranks(world_size: int, pp: int) -> list[int]:
    """The ranks that differ: the first of the first pipeline stage and of the last one (EP and the
    data-parallel ranks hold the same sizes under balanced routing)."""
    return sorted({0, (pp - 1) * (world_size // pp)})


def make_plan(cfg: JobConfig, world_size: int, device: Device, *, device_type: str = "cuda",
              ranks: list[int] | None = None, mfu: float = 0.4, ac_modes: bool = True,
              workers: int | None = None) -> Plan:
    """Check the layout (every problem in one KilnError, as the trainer raises it), then plan each
    rank — with ac_modes, in the other activation-checkpoint modes too — `workers` processes at a
    time (default: one per core)."""
    workers = workers or os.cpu_count() or 1
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
                device=device, mfu=mfu, flops_per_token=0)
    ranks = ranks if ranks is not None else default_ranks(world_size, dims.pp)
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"rank {bad[0]} is not in a world of {world_size}")
    # One task per (rank, AC mode); the planned mode's with the optimizer, the others without.
    modes = [options.ac_mode] + ([m for m in AC_MODES if m != options.ac_mode] if ac_modes else [])
    tasks = [(cfg, world_size, rank, device_type, mode, mode == options.ac_mode) for rank in ranks
             for mode in modes]
    results = dict(zip([(t[2], t[4]) for t in tasks], _run_tasks(tasks, workers), strict=True))
    for rank in ranks:
        planned = results[(rank, options.ac_mode)]
        if ac_modes:  # other modes: their forward/backward peak, plus the state a steady step holds
            state = sum(planned.optimizer.values())
            planned.ac_peaks = {m: planned.peak if m == options.ac_mode else
                                max(results[(rank, m)].peak + state, planned.optimizer_step_peak)
                                for m in AC_MODES}
        plan.ranks.append(planned)
    num_stages = max(len(r.stages) for r in plan.ranks) * dims.pp
    plan.layout = dims.describe(options, num_stages, microbatches if dims.pp > 1 else 0)
    plan.num_params = count_parameters(spec, args)
    plan.flops_per_token = spec.flops_per_token_fn(args, plan.num_params, t.seq_len)
    plan.seconds = time.perf_counter() - start
    return plan


def _plan_task(task: tuple) -> RankPlan:
    """One rank in one activation-checkpoint mode, in a process of its own."""
    cfg, world_size, rank, device_type, mode, with_optimizer = task
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # its notes about fake groups
    warnings.filterwarnings("ignore")
    spec, args = load_model_family(cfg)
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


def _run_tasks(tasks: list[tuple], workers: int) -> list[RankPlan]:
    """The tasks side by side, `workers` at once, each in a fresh process: torch keeps process groups
    and DTensor's sharding caches per process, so a second fake world in one process finds stale
    groups of the first ("Could not resolve the process group")."""
    if len(tasks) == 1:
        return [_plan_task(tasks[0])]
    context = multiprocessing.get_context("spawn")
    results: list[RankPlan | None] = [None] * len(tasks)
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
        index, process, parent = running.pop(0)
        try:
            status, value = parent.recv()
        except EOFError:
            raise RuntimeError(f"planning rank {tasks[index][2]} died (exit code {process.exitcode})"
                               ) from None
        process.join()
        if status == "error":
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
