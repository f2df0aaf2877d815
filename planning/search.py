"""Search the layouts of a world: enumerate those that make sense, keep those the trainer accepts,
plan each distinct one on fake tensors — cut to one and two blocks per pipeline stage and scaled to
the model's depth — and rank those that fit by the step-time model's tokens/s per device.

A layout here is the degrees (TP within a node, PP and its schedule, CP for long sequences, EP for
MoE, FSDP or HSDP over the rest), the activation-checkpoint mode and the rows per microbatch.
What is planned per layout: its ranks that differ (the first of the first and of the last pipeline
stage) in every activation-checkpoint mode with its optimizer step, at one and two blocks per stage
and one and two rows per microbatch. State, collectives and calls are linear in the blocks per
stage; the peak is linear in the blocks and in the rows (a block's and a row's share are the
differences); FSDP's gathers and reduce-scatters repeat per microbatch; a step of one microbatch
holds no accumulated gradients through its backward. HSDP's replicas change only how the state is
sharded and add the replicas' all-reduce, so every split of the data-parallel ranks is derived
from the plan of FSDP over all of them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.runtime.errors import KilnError
from planning.devices import Device
from planning.plan import AC_MODES, _run_tasks, count_parameters, default_ranks
from planning.rank_plan import RankPlan
from planning.step_time import LayoutFacts, StepTime, predict
from training.assembly import build_layout, load_model_family

SCHEDULES = {1: "1F1B", 2: "Interleaved1F1B"}  # stages per rank → the schedule searched
LONG_SEQUENCE = 16384  # context parallel is searched from this sequence length on


@dataclass
class Layout:
    """One searched layout: its config changes, degrees and what the model predicts for it."""

    flags: dict[str, Any]
    degrees: dict[str, int]
    ac_mode: str
    rows: int  # per microbatch (pipeline: per pipeline microbatch)
    peak: int = 0  # bytes on the fullest planned rank
    fits: bool = False
    spare_gib: float = 0.0
    step: StepTime | None = None

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.step.tokens_per_second_per_device if self.step is not None else 0.0

    def describe(self) -> str:
        d = self.degrees
        parts = [f"{k.upper() if k != 'dp_shard' else 'FSDP'} {d[k]}"
                 for k in ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard") if d[k] > 1]
        text = " × ".join(parts).replace("DP_REPLICATE", "HSDP replicas") or "one rank"
        if d["pp"] > 1:
            text += f", {self.flags['parallelism.pipeline_parallel_schedule']}"
        return f"{text}, AC {self.ac_mode}, {self.rows} row(s) per microbatch"


@dataclass
class SearchResult:
    """The ranked layouts, those that do not fit, and what the search took."""

    model: str
    world_size: int
    device: Device
    global_batch: int
    seq_len: int
    ranked: list[Layout] = field(default_factory=list)  # fit, fastest first
    too_big: list[Layout] = field(default_factory=list)
    considered: int = 0  # layouts enumerated
    refused: int = 0  # of them the trainer's checks refuse
    planned: int = 0  # fake plans run
    seconds: float = 0.0


def _powers(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def enumerate_layouts(cfg: JobConfig, world: int, per_node: int, args: Any, can_pipeline: bool
                      ) -> list[dict[str, Any]]:
    """Config changes for every layout worth considering: TP within a node, PP over the layers, CP
    for long sequences, EP over the experts, FSDP over the rest (HSDP: replicas of one node's
    shards), and one row per microbatch (rows are sized later); AC modes are added by the search."""
    n_layers, seq = args.n_layers, cfg.training.seq_len
    experts = getattr(getattr(args, "moe", None), "num_experts", 0)
    out = []
    for tp in _powers(min(per_node, world)):
        for pp in (_powers(min(world // tp, n_layers)) if can_pipeline else [1]):
            for cp in (_powers(min(world // (tp * pp), 16)) if seq >= LONG_SEQUENCE else [1]):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                eps = [e for e in _powers(min(experts, dp * cp)) if experts % e == 0] if experts else [1]
                for ep in eps:
                    for replicas in sorted({1, max(1, (dp * cp * tp) // per_node)}):
                        if dp % replicas:
                            continue
                        for stages in ([1, 2] if pp > 1 else [1]):
                            out.append(_flags(tp, pp, cp, ep, replicas, dp // replicas, stages))
    return out


def _flags(tp: int, pp: int, cp: int, ep: int, replicas: int, shard: int, stages: int) -> dict[str, Any]:
    p = "parallelism."
    flags = {p + "tensor_parallel_degree": tp, p + "pipeline_parallel_degree": pp,
             p + "context_parallel_degree": cp, p + "expert_parallel_degree": ep,
             p + "data_parallel_replicate_degree": replicas, p + "data_parallel_shard_degree": shard}
    if pp > 1:
        flags[p + "pipeline_parallel_schedule"] = SCHEDULES[stages]
        flags[p + "pipeline_parallel_microbatch_size"] = 1
    return flags


def configured(cfg: JobConfig, flags: dict[str, Any]) -> JobConfig:
    changed = copy.deepcopy(cfg)
    for key, value in flags.items():
        section, name = key.split(".")
        setattr(getattr(changed, section), name, value)
    return changed


def _rows_options(per_rank: int) -> list[int]:
    """Rows per microbatch to consider: the powers of two that divide a rank's rows (up to 8)."""
    return [r for r in _powers(min(per_rank, 8)) if per_rank % r == 0]


def _linear(one: float, two: float, blocks: float, depths: tuple[int, int] = (1, 2)) -> float:
    """A value measured at `depths` blocks per stage (one, two), at `blocks` per stage."""
    return one + (two - one) * (blocks - depths[0]) / (depths[1] - depths[0])


def _scaled(one: RankPlan, two: RankPlan, blocks: float) -> RankPlan:
    """A rank planned at one and two blocks per stage, at `blocks` per stage: its state, buffers,
    collectives and calls (the peak is the caller's)."""
    def dim_map(a: dict, b: dict) -> dict:
        return {dim: {kind: int(_linear(a.get(dim, {}).get(kind, 0), b.get(dim, {}).get(kind, 0), blocks))
                      for kind in set(a.get(dim, {})) | set(b.get(dim, {}))} for dim in set(a) | set(b)}

    def sizes(a: dict, b: dict) -> dict:
        return {k: int(_linear(a.get(k, 0), b.get(k, 0), blocks)) for k in set(a) | set(b)}

    return dataclasses.replace(one, parameters=sizes(one.parameters, two.parameters),
                               gradients=sizes(one.gradients, two.gradients),
                               optimizer=sizes(one.optimizer, two.optimizer),
                               buffers=int(_linear(one.buffers, two.buffers, blocks)), peak_breakdown={},
                               communication=dim_map(one.communication, two.communication),
                               calls=dim_map(one.calls, two.calls))


def _held(plan: RankPlan) -> int:
    """The state a rank holds through the step: parameters, gradients, optimizer state, buffers."""
    state = (plan.parameters, plan.gradients, plan.optimizer)
    return sum(sum(part.values()) for part in state) + plan.buffers


def pipeline_bubble(pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle share of a pipelined step: (pp − 1) warm-up and cool-down slots against v × n slots of
    work ((pp − 1) / (v·n + pp − 1), 1F1B and its interleaved form alike)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@dataclass
class _Piece:
    """A layout's degrees planned once (FSDP over every data-parallel rank), for every AC mode,
    HSDP split and microbatch size derived from it."""

    flags: dict[str, Any]
    cfg: JobConfig
    dims: Any
    global_batch: int
    blocks: float  # blocks per pipeline stage in the real model
    ranks: list[int]
    stages: int  # pipeline stages per rank
    spec: Any
    args: Any
    device_type: str
    tasks: list[tuple] = field(default_factory=list)
    keys: list[tuple[int, str, int, int]] = field(default_factory=list)  # rank, AC mode, blocks, rows
    row_counts: list[int] = field(default_factory=lambda: [1])  # rows per microbatch planned
    depths: dict[str, tuple[int, int]] = field(default_factory=dict)  # AC mode → blocks per stage planned
    replicas: set[int] = field(default_factory=lambda: {1})  # HSDP replica counts derived from it
    results: dict[tuple[int, str, int, int], RankPlan] = field(default_factory=dict)


def _piece(cfg: JobConfig, flags: dict[str, Any], world: int, spec: Any, args: Any, device_type: str
           ) -> _Piece | None:
    """The layout checked as the trainer checks it at one row per microbatch (None when refused), and
    its tasks: every differing rank × AC mode × one and two blocks per stage."""
    changed = configured(cfg, flags | {"training.local_batch_size": 1, "activation_checkpoint.mode": "none"})
    checked = _checked(changed, spec, args, world, device_type)
    if checked is None:
        return None
    dims, batch = checked
    stages = 2 if flags.get("parallelism.pipeline_parallel_schedule") == SCHEDULES[2] else 1
    piece = _Piece(flags, changed, dims, batch, args.n_layers / (dims.pp * stages),
                   default_ranks(world, dims.pp), stages, spec, args, device_type)
    # a second row per microbatch, where the trainer accepts it, gives the activations' growth
    doubled = configured(changed, {_rows_key(dims.pp): 2})
    piece.row_counts = [1, 2] if _checked(doubled, spec, args, world, device_type) else [1]
    option = changed.activation_checkpoint.selective_ac_option
    piece.depths = {mode: _depths(mode, option) for mode in AC_MODES}
    piece.keys = [(rank, mode, k, r) for r in piece.row_counts for mode in AC_MODES
                  for k in piece.depths[mode] for rank in piece.ranks]
    piece.tasks = [(changed if r == 1 else doubled, world, rank, device_type, mode, True,
                    dims.pp * stages * k) for rank, mode, k, r in piece.keys]
    return piece


def _checked(cfg: JobConfig, spec: Any, args: Any, world: int, device_type: str) -> tuple[Any, int] | None:
    """(degrees, global batch) of a layout the trainer accepts, None for one it refuses."""
    try:
        options = ParallelOptions.from_config(cfg, device_type)
        return build_layout(cfg, spec, args, world, options, device_type)
    except KilnError:
        return None


def _depths(mode: str, option: str) -> tuple[int, int]:
    """The blocks per stage a mode is planned at: one and two, or for selective AC of every N-th block
    N and 2N (so that the planned blocks are checkpointed in the model's proportion)."""
    period = int(option) if mode == "selective" and option.isdigit() else 1
    return period, 2 * period


def _rows_key(pp: int) -> str:
    return "parallelism.pipeline_parallel_microbatch_size" if pp > 1 else "training.local_batch_size"


def _layouts_of(piece: _Piece, device: Device, flops_per_token: float, seq_len: int, speedups: dict[str, bool]
                ) -> list[Layout]:
    """Every AC mode × HSDP split × microbatch size of a planned piece, with its peak and step."""
    d = piece.dims
    dp, stages = d.dp, piece.stages
    per_rank = piece.global_batch // dp
    out = []
    for replicas in sorted(piece.replicas):
        if dp % replicas:
            continue
        for mode in AC_MODES:
            for rows in _rows_options(per_rank):
                layout = _layout(piece, device, flops_per_token, seq_len, replicas, mode, rows, per_rank,
                                 stages, speedups)
                # as finally sized, e.g. a pipeline needs as many microbatches as stages
                if _checked(configured(piece.cfg, layout.flags), piece.spec, piece.args, d.world_size,
                            piece.device_type):
                    out.append(layout)
    return out


def _layout(piece: _Piece, device: Device, flops_per_token: float, seq_len: int, replicas: int, mode: str,
            rows: int, per_rank: int, stages: int, speedups: dict[str, bool]) -> Layout:
    d = piece.dims
    degrees = {"pp": d.pp, "dp_replicate": replicas, "dp_shard": d.dp // replicas, "cp": d.cp, "tp": d.tp,
               "ep": d.ep}
    flags = piece.flags | {"parallelism.data_parallel_replicate_degree": replicas,
                           "parallelism.data_parallel_shard_degree": d.dp // replicas,
                           "activation_checkpoint.mode": mode}
    microbatches = per_rank // rows
    if d.pp > 1:
        flags["parallelism.pipeline_parallel_microbatch_size"] = rows
    else:
        flags["training.local_batch_size"] = rows
    layout = Layout(flags, degrees, mode, rows)
    world = d.world_size
    facts = LayoutFacts(degrees, max(int(round(piece.blocks * stages)), 1), mode,
                        piece.cfg.activation_checkpoint.selective_ac_option, **speedups)
    tokens = piece.global_batch * seq_len
    peaks, steps = [], []
    for rank in piece.ranks:
        plan = _rank_at(piece, rank, mode, rows, replicas, microbatches, per_rank)
        peaks.append(plan.peak)
        bubble = pipeline_bubble(d.pp, stages, microbatches)
        steps.append(predict(flops_per_token * tokens / world, bubble, plan.communication, plan.calls,
                             tokens / world, facts, device.peak_tflops, device.links, device.efficiency))
    layout.peak = max(peaks)
    layout.spare_gib = device.memory_gib - device.reserve_gib - layout.peak / 2**30
    layout.fits = layout.spare_gib >= 0
    layout.step = max(steps, key=lambda t: t.seconds)
    return layout


def _rank_at(piece: _Piece, rank: int, mode: str, rows: int, replicas: int, microbatches: int,
             per_rank: int) -> RankPlan:
    """One rank of the piece at full depth, in AC `mode`, `rows` per microbatch, `replicas` HSDP
    replicas: scaled from its plans at one and two blocks per stage."""
    res = piece.results

    def peak_in_mode(k: int, r: int) -> int:  # every mode is planned with its optimizer step
        return res[(rank, mode, k, r)].peak

    plan = _scaled(res[(rank, "none", 1, 1)], res[(rank, "none", 2, 1)], piece.blocks)
    k1, k2 = piece.depths[mode]
    at_one_row = _linear(peak_in_mode(k1, 1), peak_in_mode(k2, 1), piece.blocks, (k1, k2))
    if 2 in piece.row_counts:  # the peak's growth per row, itself linear in the blocks
        per_row = _linear(peak_in_mode(k1, 2), peak_in_mode(k2, 2), piece.blocks, (k1, k2)) - at_one_row
    else:  # one row only: everything above the state grows with the rows
        per_row = at_one_row - _held(plan)
    peak = at_one_row + per_row * (rows - 1)
    if piece.dims.pp == 1 and microbatches == 1 < per_rank:
        # planned with gradient accumulation, whose gradients are alive through each later backward;
        # one microbatch per step has none before its own backward makes them
        peak -= sum(plan.gradients.values())
    plan = dataclasses.replace(plan, peak=int(peak))
    comm, calls = plan.communication, plan.calls
    if piece.dims.pp > 1 and microbatches != per_rank:  # the same activations, in fewer sends
        calls["pp"] = {k: max(1, int(v * microbatches / per_rank)) for k, v in calls.get("pp", {}).items()}
    if piece.dims.pp == 1 and microbatches != per_rank:  # FSDP gathers and reduces every microbatch
        for table in (comm, calls):
            for dim in list(table):
                if dim.split(" = ")[0] in ("dp_shard", "dp_shard_cp"):
                    table[dim] = {k: int(v * microbatches / per_rank) if k in ("all-gather", "reduce-scatter")
                                  else v for k, v in table[dim].items()}
    if replicas > 1:  # HSDP: state sharded over fewer ranks, plus the replicas' gradient all-reduce
        held = _held(plan) - plan.buffers
        grads = sum(plan.gradients.values()) * replicas
        plan = dataclasses.replace(plan, peak=plan.peak + held * (replicas - 1))
        rs_calls = sum(v.get("reduce-scatter", 0) for k, v in calls.items() if k.startswith("dp_shard"))
        comm["dp_replicate"] = {"all-reduce": grads}
        calls["dp_replicate"] = {"all-reduce": max(rs_calls, 1)}
    return plan


def search(cfg: JobConfig, world: int, device: Device, *, device_type: str = "cuda",
           workers: int | None = None) -> SearchResult:
    """Every sensible layout of `cfg`'s model on `world` devices, planned and ranked (fastest that
    fits first). The config's global batch and sequence length are kept; its layout is ignored."""
    start = time.perf_counter()
    if cfg.training.global_batch_size <= 0:
        raise KilnError("plan.py --search keeps the global batch: give --training.global_batch_size")
    if cfg.model.converters and cfg.model.converters != "float8":
        raise KilnError(f"the planner does not plan model.converters ({cfg.model.converters})")
    float8 = cfg.model.converters == "float8"
    base = configured(cfg, {"model.converters": ""})  # float8 is planned as its speed-up, see devices.py
    spec, args = load_model_family(base)
    flags = enumerate_layouts(base, world, device.links.per_node, args, spec.pipeline_fn is not None)
    # one plan per piece: FSDP over all data-parallel ranks (HSDP splits are derived)
    pieces: dict[tuple, _Piece] = {}
    refused = 0
    for f in flags:
        key = tuple(sorted((k, v) for k, v in f.items() if "data_parallel" not in k))
        if key not in pieces:
            fsdp_all = {"parallelism.data_parallel_replicate_degree": 1,
                        "parallelism.data_parallel_shard_degree": -1}
            piece = _piece(base, f | fsdp_all, world, spec, args, device_type)
            if piece is None:
                refused += 1
                continue
            pieces[key] = piece
        pieces[key].replicas.add(f["parallelism.data_parallel_replicate_degree"])
    tasks = [t for p in pieces.values() for t in p.tasks]
    done = _run_tasks(tasks, workers or os.cpu_count() or 1, keep_errors=True, start="fork") if tasks else []
    t = cfg.training
    result = SearchResult(f"{cfg.model.name}/{cfg.model.flavor}", world, device, t.global_batch_size,
                          t.seq_len, considered=len(flags), refused=refused, planned=len(tasks))
    num_params = count_parameters(spec, args)
    flops_per_token = spec.flops_per_token_fn(args, num_params, cfg.training.seq_len)
    for piece in pieces.values():
        outcome, done = done[:len(piece.tasks)], done[len(piece.tasks):]
        if any(isinstance(r, BaseException) for r in outcome):
            result.refused += 1
            continue
        piece.results = dict(zip(piece.keys, outcome, strict=True))
        speedups = {"compile": cfg.compile.enable, "float8": float8}
        for layout in _layouts_of(piece, device, flops_per_token, cfg.training.seq_len, speedups):
            if float8:
                layout.flags["model.converters"] = "float8"
            (result.ranked if layout.fits else result.too_big).append(layout)
    result.ranked.sort(key=lambda lay: -lay.tokens_per_second_per_device)
    result.too_big.sort(key=lambda lay: lay.peak)
    result.seconds = time.perf_counter() - start
    return result
