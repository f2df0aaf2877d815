"""Search the layouts of a world and rank those that fit by the step-time model's tokens/s per device.

Every layout planning/layout_space.py enumerates is checked as the trainer checks it. Each distinct
one (its degrees: HSDP splits, AC modes and microbatch sizes are derived from it) is timed from fake
plans without activation checkpointing, cut to one and two blocks per pipeline stage (the second
depth on the first stage's rank only: a block adds the same on every stage) and to two short counts
of microbatches per step (a pipeline's run by GPipe or LoopedBFS, which take fewer microbatches than
ranks and send what the layout's schedule sends), and scaled to the model's depth and the run's
microbatches (planning/depth_scaling.py). That gives every layout's collectives, so its predicted
step, which does not depend on its memory.

Branch and bound: the distinct layouts are timed in the order of the most their layouts could be
predicted at (planning/layout_bounds.py: their compute over their least bubble with only the
communication floors of FSDP, TP and EP, among the HSDP splits and AC modes whose least peak fits —
once a layout of the same TP, CP and EP degrees is timed, with what each forward in flight keeps
as its plans show: _learn_keeps), and a timed
layout faster than any untimed one could be is checked at once — fastest first, its peak planned
(its AC mode at one and two rows per microbatch; a pipeline deeper than four stages at four, grown
to its depth: planning/shallow_pipeline.py) until `top` of them fit. The layouts still untimed
then could not have been among them: the ranking is the one timing every layout would give. Not
planned at all: a layout whose peak has a lower bound above the device (its model's shape's least
peak; its state; under a pipeline, what two short plans in its AC mode show — each end rank's last
backward, and the first rank's first backwards with every forward the layout's schedule has in
flight then; and once planned, each rank's peak at the fewest blocks, before the deeper plans), and
one whose fewer rows per microbatch were already too big.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.runtime.errors import KilnError
from parallelisms.layout_checks import stage_layers
from parallelisms.pipeline import stage_ids
from planning.depth_scaling import Key, held, linear, one_microbatch_fewer, rank_peak, rank_state, state_floor
from planning.devices import Device
from planning.layout_bounds import least_peak, speed_bound
from planning.layout_space import (
    SCHEDULES,
    closed_form_bubble,
    configured,
    enumerate_layouts,
    layout_degrees,
    rows_options,
)
from planning.model_shape import block_parameters, block_tensor_parallel_rows, moe_flops_per_token
from planning.pipeline_bubble import forwards_before_first_backward
from planning.plan import AC_MODES, _run_tasks, count_parameters, default_ranks
from planning.rank_plan import RankPlan
from planning.shallow_pipeline import ShallowPipeline, shallow_pipeline
from planning.shallow_pipeline import fill as pipeline_fill
from planning.step_time import LayoutFacts, StepTime, predict, rank_flops
from training.assembly import build_layout, load_model_family

PlanKey = tuple[Key, bool]  # a plan and whether it times the collectives (a pipeline's timing schedule)


@dataclass
class Layout:
    """One searched layout: its config changes, degrees and what the model predicts for it."""

    flags: dict[str, Any]
    degrees: dict[str, int]
    ac_mode: str
    rows: int  # per microbatch (pipeline: per pipeline microbatch)
    peak: int = 0  # bytes on the fullest planned rank (at least _Sized.floor)
    fits: bool = False
    spare_gib: float = 0.0
    step: StepTime | None = None
    peak_is_lower_bound: bool = False  # not planned: a lower bound on it (_Sized.floor) exceeds the device

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
    """The layouts that fit (fastest first, `top` of them), those found too big, and what it took."""

    model: str
    world_size: int
    device: Device
    global_batch: int
    seq_len: int
    top: int
    ranked: list[Layout] = field(default_factory=list)  # fit, fastest first
    too_big: list[Layout] = field(default_factory=list)  # smallest peak first
    considered: int = 0  # layouts enumerated
    refused: int = 0  # of them the trainer's checks refuse
    distinct: int = 0  # distinct layouts the trainer accepts (their degrees), each timed once
    untimed: int = 0  # of them never timed: slower, even at their floors, than `top` that fit
    sized: int = 0  # layouts sized and ranked by predicted speed
    checked: int = 0  # of them checked against the device's memory
    too_big_by_rows: int = 0  # of them too big because fewer rows per microbatch were (not planned)
    floored: int = 0  # of them whose peak's lower bound exceeds the device (not planned)
    planned: int = 0  # fake plans run
    failed: list[str] = field(default_factory=list)  # layouts whose plans raised, with the error
    seconds: float = 0.0


@dataclass
class _Piece:
    """A layout's degrees, planned once (FSDP over every data-parallel rank) for every AC mode, HSDP
    split and microbatch size derived from it."""

    flags: dict[str, Any]
    cfg: JobConfig  # at one row per microbatch
    dims: Any
    global_batch: int
    blocks: float  # blocks per pipeline stage in the real model
    ranks: list[int]
    stages: int  # pipeline stages per rank
    spec: Any
    args: Any
    device_type: str
    depths: dict[str, tuple[int, int]]  # AC mode → blocks per stage planned
    index: int = 0  # its place among the enumerated layouts (the ranking's tie-break)
    rank_blocks: dict[int, float] = field(default_factory=dict)  # rank → blocks per stage it is scaled to
    middle: int | None = None  # a middle pipeline rank, whose peak alone is planned (at the fewest blocks)
    timing_microbatches: tuple[int, ...] = (1,)  # microbatches per step the collectives are planned at
    peak_microbatches: dict[int, int] = field(default_factory=dict)  # rows per microbatch → microbatches
    # a deep pipeline's peaks planned at a shallower one, at those rows per microbatch (the others at
    # fewer microbatches than fill the pipeline, planned as they are)
    shallow: ShallowPipeline | None = None
    shallow_rows: tuple[int, ...] = ()
    replicas: set[int] = field(default_factory=lambda: {1})  # HSDP replica counts derived from it
    block_parameters: tuple[int, int] = (0, 0)  # what a block adds: all parameters, the routed experts'
    # what a block gathers and reduces per token under TP, without EP and with it (model_shape;
    # None: a block whose TP plan is the model's own, no floor claimed)
    tensor_parallel_rows: tuple[tuple[float, float], tuple[float, float]] | None = None
    # per pipeline stage (the model without one), whether each of its blocks is of the kind planned
    stage_kinds: list[list[bool]] = field(default_factory=list)
    moe_flops_per_token: float = 0.0  # the MoE layers' (planning/model_shape.py)
    results: dict[PlanKey, RankPlan] = field(default_factory=dict)
    errors: dict[PlanKey, BaseException] = field(default_factory=dict)  # plans that raised

    @property
    def schedule(self) -> str:
        return self.flags.get("parallelism.pipeline_parallel_schedule", "")

    @property
    def timing_schedule(self) -> str | None:
        """The schedule the collectives are planned with: the layout's stages per rank, every forward
        then every backward (GPipe, LoopedBFS), which runs any count of microbatches — fewer than
        ranks, unlike 1F1B — and sends and gathers what the layout's schedule does (the order
        differs, and so the peak, which is planned with the layout's own)."""
        if self.dims.pp == 1:
            return None
        return "GPipe" if self.stages == 1 else "LoopedBFS"

    @functools.cached_property
    def options(self) -> ParallelOptions:
        """The layout's options as the trainer reads them (its dtypes)."""
        return ParallelOptions.from_config(self.cfg, self.device_type)

    @property
    def first_rank_blocks(self) -> float:
        """Blocks on the first planned rank, all its stages, as its plans are scaled."""
        return self.rank_blocks[self.ranks[0]] * self.stages

    def plan_key(self, key: Key, timing: bool) -> PlanKey:
        """A plan's key; without a pipeline, a timing plan is the plain plan of the same key."""
        return key, timing and self.timing_schedule is not None

    @property
    def timing_counts(self) -> tuple[int, ...]:
        """The microbatches per step the timing plans run at: of (1, 2) only 2, which tells what one
        more microbatch sends (RankPlan.microbatch_communication), so what one fewer does."""
        return (2,) if self.timing_microbatches == (1, 2) else self.timing_microbatches

    def lookup(self, timing: bool) -> Callable[[Key], RankPlan]:
        """The finished timing (or peak) plans by depth_scaling's keys."""
        def plan_of(key: Key) -> RankPlan:
            rank, mode, blocks, rows, microbatches = key
            if timing and microbatches not in self.timing_counts:
                return one_microbatch_fewer(self.results[self.plan_key((rank, mode, blocks, rows, 2), True)])
            return self.results[self.plan_key(key, timing)]
        return plan_of

    @property
    def in_flight(self) -> int:
        """The forwards the first rank's schedule holds as its first backward begins, at the
        microbatches its peak is planned at."""
        return forwards_before_first_backward(self.schedule, self.dims.pp, self.stages,
                                              self.peak_microbatches[1])

    def rows_kept(self, plan: RankPlan, planned: int = 0) -> int:
        """What the step's rows keep to its end (receive buffers, the rows) beyond the `planned`
        microbatches of one row `plan` holds already: every row's share, whatever the rows per
        microbatch."""
        return plan.microbatch_bytes * (self.per_rank - planned)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dims.dp

    def config(self, rows: int, microbatches: int, timing: bool = False) -> JobConfig:
        """The layout at `rows` per microbatch and `microbatches` per step (a plan's batch, not the
        run's), with the timing schedule for a timing plan."""
        changes = {_rows_key(self.dims.pp): rows,
                   "training.global_batch_size": rows * microbatches * self.dims.dp}
        if timing and self.timing_schedule is not None:
            changes["parallelism.pipeline_parallel_schedule"] = self.timing_schedule
        return configured(self.cfg, changes)

    def accepts(self, rows: int, microbatches: int, timing: bool = False) -> bool:
        return _checked(self.config(rows, microbatches, timing), self.spec, self.args, self.dims.world_size,
                        self.device_type) is not None

    def keeps_keys(self, mode: str) -> list[PlanKey]:
        """The plans that bound a pipeline's peak in AC `mode` (_Sized._rank_keeps_bounds): each
        planned rank timed at two microbatches (without AC, the base plans and the last rank at two
        blocks per stage)."""
        if self.timing_schedule is None or self.timing_microbatches != (1, 2):
            return []
        return [self.plan_key((rank, mode, k, 1, 2), True) for rank in self.ranks for k in self.depths[mode]]

    def peak_ranks(self) -> list[int]:
        """The ranks whose peaks are planned: the timed ones and a middle pipeline rank."""
        return self.ranks + ([self.middle] if self.middle is not None else [])

    def first_peaks(self, mode: str) -> list[PlanKey]:
        """Under a pipeline, every planned rank's peak plan in AC `mode` at its fewest blocks, one row."""
        if self.dims.pp == 1:
            return []
        return [self.plan_key((rank, mode, self.depths[mode][0], 1, self.peak_microbatches[1]), False)
                for rank in self.peak_ranks()]

    def base(self) -> list[PlanKey]:
        """The plans every layout of the piece is timed from: no AC, one row, each planned count; at
        two blocks per stage the first rank only (what a block adds is the same on every stage)."""
        return [self.plan_key((rank, "none", k, 1, m), True) for m in self.timing_counts
                for k in self.depths["none"] for rank in self.ranks if k == 1 or rank == self.ranks[0]]

    def keys(self, mode: str, rows: int) -> list[PlanKey]:
        """The plans a layout of this piece in `mode` at `rows` per microbatch is sized from."""
        counts = [r for r in self.peak_microbatches if r == 1 or rows > 1]
        return [self.plan_key((rank, mode, k, r, self.peak_microbatches[r]), False) for r in counts
                for k in self.depths[mode] for rank in self.peak_ranks()
                if rank != self.middle or k == self.depths[mode][0]]

    def unplanned(self, keys: list[PlanKey]) -> list[PlanKey]:
        """Those of `keys` neither planned nor failed."""
        return [k for k in keys if k not in self.results and k not in self.errors]

    def missing(self, mode: str, rows: int) -> list[PlanKey]:
        return self.unplanned(self.keys(mode, rows))

    def failed(self, mode: str, rows: int) -> bool:
        return any(k in self.errors for k in self.keys(mode, rows))

    def planned_shallow(self, key: PlanKey) -> bool:
        """Whether a plan runs at the shallow pipeline (a peak plan at rows it takes)."""
        (_, _, _, rows, _), timing = key
        return self.shallow is not None and not timing and rows in self.shallow_rows

    def task(self, key: PlanKey) -> tuple:
        (rank, mode, k, rows, microbatches), timing = key
        if self.planned_shallow(key):
            shallow = self.shallow
            return (self.shallow_config(rows), shallow.shallow_world, shallow.rank(rank), self.device_type,
                    mode, True, shallow.degree * self.stages * k)
        return (self.config(rows, microbatches, timing), self.dims.world_size, rank, self.device_type, mode,
                True, self.dims.pp * self.stages * k)

    def shallow_config(self, rows: int) -> JobConfig:
        """The layout on the shallow pipeline at `rows` per microbatch and the microbatches that fill it."""
        return configured(self.config(rows, self.shallow.microbatches),
                          {"parallelism.pipeline_parallel_degree": self.shallow.degree})

    def finished(self, key: PlanKey, plan: RankPlan) -> RankPlan:
        """A plan as its key asks for it: a shallow one grown to the layout's pipeline."""
        return self.shallow.deepened(plan, key[0][0]) if self.planned_shallow(key) else plan


@dataclass
class _Sized:
    """A layout sized and timed from its piece's plans; its peak waits for its AC mode's plans."""

    layout: Layout
    piece: _Piece
    replicas: int
    states: dict[int, RankPlan]  # rank → its state and collectives at the model's depth
    one_microbatch: bool  # several rows per rank in one microbatch, without a pipeline
    least_peak: int  # what the model's shape alone says its first rank holds (planning/layout_bounds.py)
    _floor: int | None = None  # the lower bound on the peak, once its keeps plans are done
    _from_none: int | None = None  # selective AC's bound before them, once the base plans are done

    @property
    def floor(self) -> int:
        """A lower bound on the peak: the model's shape's, the state, then under a pipeline what its
        short plans show (_keeps_floor) and, once its ranks' peaks at the fewest blocks are planned,
        those."""
        return max(self.least_peak, self._keeps_floor(), self._first_peaks_floor())

    def _first_peaks_floor(self) -> int:
        """Under a pipeline, the most any rank's peak plan at its AC mode's fewest blocks per stage
        and one row reached (with what HSDP's fewer shards add): a rank of at least those blocks at
        this layout's rows holds at least that. 0 until one is planned."""
        p, mode, out = self.piece, self.layout.ac_mode, 0
        for key in p.first_peaks(mode):
            (rank, _, blocks, _, planned), _ = key
            if key in p.results and p.rank_blocks[rank] >= blocks:
                state, plan = self.states.get(rank, self.states[p.ranks[0]]), p.results[key]
                more_rows = p.rows_kept(plan, planned)
                out = max(out, plan.peak + more_rows + (held(state) - state.buffers) * (self.replicas - 1))
        return out

    def _keeps_floor(self) -> int:
        """The state; and under a pipeline, once its keeps plans are done (_Piece.keeps_keys), what
        each planned rank holds at least at its last backward and, the first rank, as its first and
        second backwards begin (_rank_keeps_bounds)."""
        if self._floor is not None:
            return self._floor
        bound = max(state_floor(s, self.replicas) for s in self.states.values())
        p = self.piece
        keys = p.keeps_keys(self.layout.ac_mode)
        if not keys or not all(key in p.results for key in keys):
            return max(bound, self._selective_floor_from_none())
        bounds = [bound]
        for rank in p.ranks:
            plans = [p.results[key] for key in keys if key[0][0] == rank]
            bounds += self._rank_keeps_bounds(rank, plans, keys[0][0][4])
        self._floor = int(max(bounds))
        return self._floor

    def _selective_floor_from_none(self) -> int:
        """Under a pipeline, before its own keeps plans, selective AC of every N-th block: its other
        blocks keep what they keep without AC, so what each forward in flight keeps is at least the
        base plans' second forward's with a block's share for every N-th block taken out — the
        first rank's state, with as many forwards as its schedule has in flight at the first
        backward and the receive buffers of all the step's rows. 0 for other modes."""
        if self._from_none is not None:
            return self._from_none
        p = self.piece
        option = p.cfg.activation_checkpoint.selective_ac_option
        first = p.ranks[0]
        keys = [key for key in p.keeps_keys("none") if key[0][0] == first]
        if self.layout.ac_mode != "selective" or not option.isdigit() or not keys \
                or not all(key in p.results for key in keys):
            return 0
        one, two = (p.results[key] for key in keys)
        per_block, blocks = two.forward_keeps - one.forward_keeps, p.rank_blocks[first]
        keeps = one.forward_keeps - per_block + per_block * blocks * (1 - 1 / int(option))
        state = self._short_state(first)
        self._from_none = int(state_floor(state, self.replicas) + p.in_flight * keeps + p.rows_kept(one))
        return self._from_none

    def _short_state(self, rank: int) -> RankPlan:
        """A rank's state at the blocks its peak is scaled to, as its short plans hold it (one
        microbatch of one row): what the lower bounds start from."""
        p = self.piece
        return rank_state(p.lookup(True), rank, p.rank_blocks[rank], p.timing_microbatches, 1, 1,
                          self.replicas, p.ranks[0])

    def _rank_keeps_bounds(self, rank: int, plans: list[RankPlan], planned: int) -> list[float]:
        """Lower bounds on a rank's peak from its keeps plans (one and two blocks, `planned`
        microbatches by the timing schedule), at the blocks its peak is scaled to, with the receive
        buffers of all the step's rows: its last backward, which holds what that of every schedule
        does (its own forward alone in flight, the step's gradients accumulated); and on the first
        rank its first and second backwards' starts — the keeps plans' state, gathered parameters,
        gradients accumulated so far and forwards in flight, with as many more forwards as the
        layout's schedule has in flight then, each holding at least what the second forward of those
        plans kept in this layout's AC mode."""
        p, mode = self.piece, self.layout.ac_mode
        blocks, depths = p.rank_blocks[rank], p.depths[mode]  # those its peak is scaled to
        state = self._short_state(rank)
        more_shards = state_floor(state, self.replicas) - state_floor(state, 1)  # HSDP: planned at 1
        more_rows = p.rows_kept(plans[0], planned)  # their own rows are in what they found alive
        last_backward = linear(*(plan.last_backward_peak for plan in plans), blocks, depths)
        bounds = [last_backward + more_shards + more_rows]
        if rank != p.ranks[0]:
            return bounds
        keeps = linear(*(plan.forward_keeps for plan in plans), blocks, depths)
        # counted at one row per microbatch: more rows per microbatch keep more in each forward
        in_flight = p.in_flight
        bounds.append(state_floor(state, self.replicas) + in_flight * keeps
                      + p.rows_kept(plans[0]))
        for k in range(min(len(plan.backward_starts) for plan in plans)):
            # the most alive in the first backward, which runs as the schedule's first does (its
            # second is the plan's last of a stage, which reduces the gradients; the schedule's not)
            alive = linear(*(plan.backward_starts[k][2 if k == 0 else 0] for plan in plans), blocks, depths)
            more = in_flight - k - plans[0].backward_starts[k][1]  # one backward done: one fewer
            if more >= 0:
                bounds.append(alive + more_shards + more * keeps + more_rows)
        return bounds

    def keeps_missing(self) -> list[PlanKey]:
        """The keeps plans of this layout's AC mode not yet run (none without a pipeline)."""
        return self.piece.unplanned(self.piece.keeps_keys(self.layout.ac_mode))

    def first_peaks_missing(self) -> list[PlanKey]:
        """The peak plans at the fewest blocks not yet run (none without a pipeline): planned before
        the deeper ones, which a rank's shallow peak alone may show unneeded (_first_peaks_floor)."""
        return self.piece.unplanned(self.piece.first_peaks(self.layout.ac_mode))

    @property
    def group(self) -> tuple:
        return id(self.piece), self.replicas, self.layout.ac_mode

    def needs(self) -> list[PlanKey]:
        return self.piece.missing(self.layout.ac_mode, self.layout.rows)

    def peak(self, rows: int) -> int:
        """The fullest rank's peak in this layout's AC mode and HSDP split at `rows` per microbatch."""
        p, mode = self.piece, self.layout.ac_mode
        one = self.one_microbatch and rows == self.layout.rows
        microbatches = p.per_rank // rows
        peaks = [rank_peak(p.lookup(False), self.states[rank], rank, mode, p.depths[mode],
                           p.peak_microbatches, p.rank_blocks[rank], rows, self.replicas, one, microbatches)
                 for rank in p.ranks]
        if p.middle is not None:  # grown as the first rank: the blocks are alike, the ends differ
            first = p.ranks[0]
            peaks.append(rank_peak(p.lookup(False), self.states[first], first, mode, p.depths[mode],
                                   p.peak_microbatches, p.rank_blocks[p.middle], rows, self.replicas, one,
                                   microbatches, own=p.middle))
        return max(peaks)


def _piece(cfg: JobConfig, flags: dict[str, Any], world: int, spec: Any, args: Any, device_type: str
           ) -> _Piece | None:
    """The layout checked as the trainer checks it at one row per microbatch (None when refused), and
    the microbatches per step it is planned at."""
    changed = configured(cfg, flags | {"training.local_batch_size": 1, "activation_checkpoint.mode": "none"})
    checked = _checked(changed, spec, args, world, device_type)
    if checked is None:
        return None
    dims, batch = checked
    stages = 2 if flags.get("parallelism.pipeline_parallel_schedule") == SCHEDULES[2] else 1
    option = changed.activation_checkpoint.selective_ac_option
    piece = _Piece(flags, changed, dims, batch, args.n_layers / (dims.pp * stages),
                   _timed_ranks(world, dims.pp), stages, spec, args, device_type,
                   {mode: _depths(mode, option) for mode in AC_MODES})
    piece.rank_blocks = dict.fromkeys(piece.ranks, piece.blocks)
    dense = getattr(args, "n_dense_layers", 0)  # the plans' models are cut to the other blocks
    piece.stage_kinds = [[i >= dense for i in range(args.n_layers)]]
    if dims.pp > 1:  # a split can be uneven: the first and last stages take a block fewer
        layers = stage_layers(args.n_layers, dims.pp, ParallelOptions.from_config(changed, device_type))
        piece.stage_kinds = [[i >= dense for i in stage] for stage in layers]
        schedule = changed.parallelism.pipeline_parallel_schedule
        blocks = [sum(len(layers[i]) for i in stage_ids(r, dims.pp, schedule)) / stages
                  for r in range(dims.pp)]
        # the first rank's collectives stand for every rank's but the last, at the most blocks of
        # any; a middle rank (pp coordinate 1: the most forwards in flight of them) has receive
        # buffers both ways and neither the embedding nor the head: its peak is planned too
        piece.rank_blocks = {piece.ranks[0]: max(blocks[:-1]), piece.ranks[-1]: blocks[-1]}
        if dims.pp > 2:
            piece.middle = world // dims.pp
            piece.rank_blocks[piece.middle] = max(blocks[1:-1])
    piece.timing_microbatches, piece.peak_microbatches = _microbatches(piece)
    piece.shallow = shallow_pipeline(piece.schedule, dims.pp, world, stages)
    if piece.shallow is not None:  # the rows planned at the pipeline's fill, where the trainer takes them
        deep_fill = pipeline_fill(piece.schedule, dims.pp, stages)
        piece.shallow_rows = tuple(
            rows for rows, microbatches in piece.peak_microbatches.items() if microbatches == deep_fill
            and _checked(piece.shallow_config(rows), spec, args, piece.shallow.shallow_world, device_type))
    return piece


def _timed_ranks(world: int, pp: int) -> list[int]:
    """The ranks a piece is timed from: the first and the last pipeline stage's. A middle one gathers
    and reduces as the first, scaled to the most blocks of any but the last; it also sends to both
    neighbours, which is not timed apart. Its peak is planned alone (_Piece.middle)."""
    ranks = default_ranks(world, pp)
    return [ranks[0], ranks[-1]] if len(ranks) > 2 else ranks


def _microbatches(piece: _Piece) -> tuple[tuple[int, ...], dict[int, int]]:
    """(the microbatches per step a piece's collectives are planned at, rows per microbatch → the
    microbatches its peaks are planned at). A step's collectives are linear in its microbatches, so
    two counts give them at any count: 1 and 2 (with a pipeline, by its timing schedule), the step
    of 1 known from the plan of 2 (_Piece.timing_counts). The peak needs enough to fill the pipeline
    or, without one, to accumulate gradients (2); past that, each microbatch adds only what it keeps
    to the step's end (depth_scaling.rank_peak); planning/shallow_pipeline.py says how many fill a
    pipeline. A rank's real count, where smaller, is used as it is; a cut batch the trainer refuses
    falls back to the real one."""
    pp, per_rank = piece.dims.pp, piece.per_rank
    fill = 2 if pp == 1 else pipeline_fill(piece.schedule, pp, piece.stages)
    micro = tuple(sorted({1, min(per_rank, 2)}))
    if not all(piece.accepts(1, m, timing=True) for m in micro):
        micro = (per_rank,)
    peak_microbatches = {1: min(per_rank, fill) if piece.accepts(1, min(per_rank, fill)) else per_rank}
    doubled = min(per_rank, 2) if pp == 1 else min(fill, per_rank // 2)
    # a second row per microbatch, where the trainer accepts it, gives the activations' growth
    if doubled >= 1 and piece.accepts(2, doubled):
        peak_microbatches[2] = doubled
    return micro, peak_microbatches


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


def _plan(jobs: list[tuple[_Piece, PlanKey]], workers: int) -> None:
    """Plan the keys side by side; a plan that raises marks its piece's AC mode failed."""
    done = _run_tasks([piece.task(key) for piece, key in jobs], workers, keep_errors=True, start="fork")
    for (piece, key), result in zip(jobs, done, strict=True):
        if isinstance(result, BaseException):
            piece.errors[key] = result
        else:
            piece.results[key] = piece.finished(key, result)


def _sized_layouts(piece: _Piece, device: Device, flops_per_token: float, seq_len: int,
                   speedups: dict[str, bool]) -> list[_Sized]:
    """Every HSDP split × AC mode × microbatch size of a piece the trainer accepts, timed."""
    d = piece.dims
    per_rank = piece.per_rank
    out = []
    for replicas in sorted(r for r in piece.replicas if d.dp % r == 0):
        for mode in AC_MODES:
            for rows in rows_options(per_rank):
                sized = _size(piece, device, flops_per_token, seq_len, replicas, mode, rows, speedups)
                # as finally sized, e.g. a pipeline needs as many microbatches as stages
                if _checked(configured(piece.cfg, sized.layout.flags), piece.spec, piece.args, d.world_size,
                            piece.device_type):
                    out.append(sized)
    return out


def _size(piece: _Piece, device: Device, flops_per_token: float, seq_len: int, replicas: int, mode: str,
          rows: int, speedups: dict[str, bool]) -> _Sized:
    """One layout of the piece, its step predicted from the collectives of its ranks' state."""
    d = piece.dims
    per_rank = piece.per_rank
    microbatches = per_rank // rows
    degrees = layout_degrees(d, replicas)
    flags = piece.flags | {"parallelism.data_parallel_replicate_degree": replicas,
                           "parallelism.data_parallel_shard_degree": d.dp // replicas,
                           "activation_checkpoint.mode": mode, _rows_key(d.pp): rows}
    layout = Layout(flags, degrees, mode, rows)
    facts = LayoutFacts(degrees, max(int(round(piece.blocks * piece.stages)), 1), mode,
                        piece.cfg.activation_checkpoint.selective_ac_option, **speedups)
    tokens = piece.global_batch * seq_len
    bubble = closed_form_bubble(d.pp, piece.stages, microbatches)
    states, steps = {}, []
    for rank in piece.ranks:
        state = rank_state(piece.lookup(True), rank, piece.rank_blocks[rank], piece.timing_microbatches,
                           microbatches, per_rank, replicas, first=piece.ranks[0])
        states[rank] = state
        flops = rank_flops(flops_per_token, piece.moe_flops_per_token, tokens, d.world_size, degrees)
        steps.append(predict(flops, bubble, state.communication,
                             state.calls, tokens / d.world_size, facts, device.peak_tflops, device.links,
                             device.efficiency))
    layout.step = max(steps, key=lambda t: t.seconds)
    return _Sized(layout, piece, replicas, states, d.pp == 1 and microbatches == 1 < per_rank,
                  int(least_peak(piece, replicas)))


def _set_peak(layout: Layout, peak: int, device: Device) -> None:
    layout.peak = peak
    layout.spare_gib = device.memory_gib - device.reserve_gib - peak / 2**30
    layout.fits = layout.spare_gib >= 0


def _check_fastest(sized: list[_Sized], device: Device, top: int, workers: int, result: SearchResult,
                   too_big_rows: dict[tuple, int]) -> None:
    """Fastest first, plan each layout's peak and keep those that fit, until `top` of them do. A peak
    grows with the rows per microbatch while gradients accumulate over several microbatches: where
    fewer rows were too big, more are too, and their plans are skipped (`too_big_rows`: (piece,
    replicas, AC mode) → the fewest rows found too big, kept from one call to the next)."""
    capacity = (device.memory_gib - device.reserve_gib) * 2**30

    def skipped(s: _Sized) -> bool:
        """Too big as fewer rows were, or — its one-row plans done — as one row is."""
        if s.one_microbatch:
            return False
        if s.layout.rows > 1 and s.group not in too_big_rows and not s.piece.missing(s.layout.ac_mode, 1) \
                and not s.piece.failed(s.layout.ac_mode, 1) and s.peak(1) > capacity:
            too_big_rows[s.group] = 1
        return s.layout.rows > too_big_rows.get(s.group, s.layout.rows)

    for i, s in enumerate(sized):
        if len(result.ranked) >= top:
            break
        lay, piece = s.layout, s.piece
        # what a forward keeps first (a few short plans), which may bound the peak above the device
        while (s.keeps_missing() or s.needs()) and s.floor <= capacity \
                and not piece.failed(lay.ac_mode, lay.rows) and not skipped(s):
            jobs = _next_jobs(sized[i:], capacity, workers, skipped)
            if not jobs:
                break
            _plan(jobs, workers)
            result.planned += len(jobs)
        if s.floor > capacity:  # no plan can change that
            _set_peak(lay, s.floor, device)
            lay.peak_is_lower_bound = True
            result.floored += 1
            result.too_big.append(lay)
            continue
        if piece.failed(lay.ac_mode, lay.rows):
            continue
        if s.needs():  # skipped
            result.too_big_by_rows += 1
            continue
        result.checked += 1
        # at least the lower bound: a peak scaled linearly from one and two blocks per stage misses
        # where a deeper stage's peak moves to the first backward (a maximum of lines is no line)
        _set_peak(lay, max(s.peak(lay.rows), s.floor), device)
        (result.ranked if lay.fits else result.too_big).append(lay)
        if not lay.fits and not s.one_microbatch and (lay.rows == 1 or s.peak(lay.rows) >= s.peak(1)):
            too_big_rows[s.group] = min(lay.rows, too_big_rows.get(s.group, lay.rows))


def _next_jobs(sized: list[_Sized], capacity: float, workers: int, skipped: Callable[[_Sized], bool]
               ) -> list[tuple[_Piece, PlanKey]]:
    """The plans the next layouts in line need — one row per microbatch first, which may show more
    rows too big — the first one's, and the following ones' until every worker has a plan."""
    jobs: dict[tuple[int, PlanKey], tuple[_Piece, PlanKey]] = {}
    for s in sized:
        if jobs and len(jobs) >= workers:
            break
        if s.piece.failed(s.layout.ac_mode, s.layout.rows) or s.floor > capacity or skipped(s):
            continue
        gate = s.piece.missing(s.layout.ac_mode, 1) if not s.one_microbatch else []
        for key in s.keeps_missing() or s.first_peaks_missing() or gate or s.needs():
            jobs.setdefault((id(s.piece), key), (s.piece, key))
    return list(jobs.values())


def search(cfg: JobConfig, world: int, device: Device, *, device_type: str = "cuda", top: int = 10,
           workers: int | None = None) -> SearchResult:
    """The `top` fastest layouts of `cfg`'s model on `world` devices that fit, ranked by predicted
    tokens/s per device. The config's global batch and sequence length are kept; its layout is not."""
    start = time.perf_counter()
    if cfg.training.global_batch_size <= 0:
        raise KilnError("plan.py --search keeps the global batch: give --training.global_batch_size")
    if cfg.model.converters and cfg.model.converters != "float8":
        raise KilnError(f"the planner does not plan model.converters ({cfg.model.converters})")
    float8 = cfg.model.converters == "float8"
    base = configured(cfg, {"model.converters": ""})  # float8 is planned as its speed-up, see devices.py
    spec, args = load_model_family(base)
    flags = enumerate_layouts(base, world, device.links.per_node, args, spec.pipeline_fn is not None)
    t = cfg.training
    result = SearchResult(f"{cfg.model.name}/{cfg.model.flavor}", world, device, t.global_batch_size,
                          t.seq_len, top, considered=len(flags))
    pieces = _pieces(base, flags, world, spec, args, device_type, result)
    result.distinct = len(pieces)
    workers = workers or os.cpu_count() or 1
    flops_per_token = spec.flops_per_token_fn(args, count_parameters(spec, args), t.seq_len)
    speedups = {"compile": cfg.compile.enable, "float8": float8}
    block, moe_flops = block_parameters(spec, args), moe_flops_per_token(spec, args)
    tp_rows = block_tensor_parallel_rows(spec, args)
    for piece in pieces:
        piece.block_parameters, piece.moe_flops_per_token = block, moe_flops
        piece.tensor_parallel_rows = tp_rows
    keeps: dict[tuple[int, int, int], dict[str, float]] = {}  # _learn_keeps
    bounds = {id(p): speed_bound(p, device, flops_per_token, t.seq_len, speedups) for p in pieces}
    untimed = sorted(pieces, key=lambda p: -bounds[id(p)])
    waiting: list[_Sized] = []  # timed, not yet checked against memory
    too_big_rows: dict[tuple, int] = {}
    while True:
        learned = _learn_keeps(pieces, keeps)
        for piece in (p for p in untimed if _keeps_key(p) in learned):  # their bounds may fall
            bounds[id(piece)] = speed_bound(piece, device, flops_per_token, t.seq_len, speedups,
                                            keeps[_keeps_key(piece)])
        untimed.sort(key=lambda p: -bounds[id(p)])
        # a layout faster than any untimed one could be is checked now: its place is final
        threshold = bounds[id(untimed[0])] if untimed else -1.0
        ready = [s for s in waiting if s.layout.tokens_per_second_per_device > threshold]
        waiting = waiting[len(ready):]
        _check_fastest(ready, device, top, workers, result, too_big_rows)
        if len(result.ranked) >= top or not untimed:
            break
        batch = _next_pieces(untimed, 2 * workers)
        jobs = [(piece, key) for piece in batch for key in piece.base()]
        _plan(jobs, workers)  # without AC at one row: the collectives of all the pieces' layouts
        result.planned += len(jobs)
        for piece in batch:
            if all(key in piece.results for key in piece.base()):
                layouts = _sized_layouts(piece, device, flops_per_token, t.seq_len, speedups)
                result.sized += len(layouts)
                waiting += layouts
        # ties in enumeration order, as a search timing every layout at once ranks them
        waiting.sort(key=lambda s: (-s.layout.tokens_per_second_per_device, s.piece.index))
    result.untimed = len(untimed)
    for piece in pieces:
        result.failed += _failures(piece)
    if float8:
        for lay in result.ranked + result.too_big:
            lay.flags["model.converters"] = "float8"
    result.too_big.sort(key=lambda lay: lay.peak)
    result.seconds = time.perf_counter() - start
    return result


def _keeps_key(piece: _Piece) -> tuple[int, int, int]:
    """What one block's forward keeps depends on (besides the model, rows and AC mode): TP, CP, EP."""
    return piece.dims.tp, piece.dims.cp, piece.dims.ep


def _learn_keeps(pieces: list[_Piece], keeps: dict[tuple[int, int, int], dict[str, float]]
                 ) -> set[tuple[int, int, int]]:
    """Fill `keeps` (_keeps_key → AC mode → bytes one block's forward keeps for its backward at one
    row, layout_bounds.least_in_flight_peak) from the first rank's plans at two microbatches and its
    mode's two depths, where a piece has run them (its last local stage's: the first of an
    interleaved rank holds the embedding too); the keys learned anew."""
    learned = set()
    for p in pieces:
        into = keeps.setdefault(_keeps_key(p), {})
        for mode in (m for m in AC_MODES if m not in into):
            low, high = p.depths[mode]
            plans = [p.results.get(p.plan_key((p.ranks[0], mode, k, 1, 2), True)) for k in (low, high)]
            if all(plan is not None and plan.stage_keeps for plan in plans):
                into[mode] = max(0.0, (plans[1].stage_keeps[-1] - plans[0].stage_keeps[-1]) / (high - low))
                learned.add(_keeps_key(p))
    return learned


def _next_pieces(untimed: list[_Piece], plans: int) -> list[_Piece]:
    """The next pieces to time (taken from `untimed`, highest bound first), about `plans` plans' worth."""
    batch: list[_Piece] = []
    while untimed and (not batch or sum(len(p.base()) for p in batch) < plans):
        batch.append(untimed.pop(0))
    return batch


def _pieces(base: JobConfig, flags: list[dict[str, Any]], world: int, spec: Any, args: Any, device_type: str,
            result: SearchResult) -> list[_Piece]:
    """One piece per distinct layout the trainer accepts (its HSDP splits noted on it)."""
    pieces: dict[tuple, _Piece] = {}
    refused: set[tuple] = set()
    for f in flags:
        key = tuple(sorted((k, v) for k, v in f.items() if "data_parallel" not in k))
        if key in refused:
            result.refused += 1
            continue
        if key not in pieces:
            fsdp_all = {"parallelism.data_parallel_replicate_degree": 1,
                        "parallelism.data_parallel_shard_degree": -1}
            piece = _piece(base, f | fsdp_all, world, spec, args, device_type)
            if piece is None:
                refused.add(key)
                result.refused += 1
                continue
            piece.index = len(pieces)
            pieces[key] = piece
        pieces[key].replicas.add(f["parallelism.data_parallel_replicate_degree"])
    return list(pieces.values())


def _failures(piece: _Piece) -> list[str]:
    """The first error of each AC mode's plans that raised (a timing plan's named by its schedule)."""
    first: dict[tuple[str, bool], BaseException] = {}
    for ((_, mode, *_), timing), error in piece.errors.items():
        first.setdefault((mode, timing), error)
    timed = f" (timed with {piece.timing_schedule})"
    return [f"{_describe_piece(piece)}{timed if timing else ''}, AC {mode}: {type(error).__name__}: {error}"
            for (mode, timing), error in first.items()]


def _describe_piece(piece: _Piece) -> str:
    d = piece.dims
    return Layout(piece.flags, layout_degrees(d, 1), "none", 1).describe().rsplit(", AC", 1)[0]
