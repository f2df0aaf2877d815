"""A rank planned on a model cut to one and two blocks per pipeline stage and to a few microbatches
per step, at the model's real depth, microbatches, rows per microbatch and HSDP split — what lets
the layout search plan small models and short steps for large ones.

State, collectives and calls are linear in the blocks per stage and in the microbatches per step;
the peak is linear in the blocks and in the rows (a block's and a row's share are the differences)
and, once the microbatches fill the pipeline (without one: once gradients accumulate), grows with
them only by the receive buffers and rows each keeps to the step's end; a step of one microbatch
holds no accumulated gradients through its backward; HSDP's replicas shard the state over fewer
ranks and add their all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from planning.rank_plan import RankPlan

Key = tuple[int, str, int, int, int]  # rank, AC mode, blocks per stage, rows per microbatch, microbatches
Lookup = Callable[[Key], RankPlan]


def linear(one: float, two: float, at: float, points: tuple[float, float] = (1, 2)) -> float:
    """A value measured at `points` (one, two), at `at`."""
    return one + (two - one) * (at - points[0]) / (points[1] - points[0])


def at_blocks(one: RankPlan, two: RankPlan, blocks: float, own: RankPlan | None = None) -> RankPlan:
    """A rank planned at one and two blocks per stage, at `blocks` per stage: its state, buffers,
    collectives and calls (the peak is rank_peak's). With `own`, another rank's plan at one block:
    that rank at `blocks`, growing by what a block adds to the first (one block is like another,
    whichever stage holds it)."""
    own = own or one

    def grown(at: float, a: float, b: float) -> int:
        return int(at - a + linear(a, b, blocks))

    def dim_map(at: dict, a: dict, b: dict) -> dict:
        dims = set(at) | set(a) | set(b)
        return {dim: {kind: grown(at.get(dim, {}).get(kind, 0), a.get(dim, {}).get(kind, 0),
                                  b.get(dim, {}).get(kind, 0))
                      for kind in set(at.get(dim, {})) | set(a.get(dim, {})) | set(b.get(dim, {}))}
                for dim in dims}

    def sizes(at: dict, a: dict, b: dict) -> dict:
        return {k: grown(at.get(k, 0), a.get(k, 0), b.get(k, 0)) for k in set(at) | set(a) | set(b)}

    return dataclasses.replace(own, parameters=sizes(own.parameters, one.parameters, two.parameters),
                               gradients=sizes(own.gradients, one.gradients, two.gradients),
                               optimizer=sizes(own.optimizer, one.optimizer, two.optimizer),
                               buffers=grown(own.buffers, one.buffers, two.buffers), peak_breakdown={},
                               communication=dim_map(own.communication, one.communication, two.communication),
                               calls=dim_map(own.calls, one.calls, two.calls))


def held(plan: RankPlan) -> int:
    """The state a rank holds through the step: parameters, gradients, optimizer state, buffers."""
    state = (plan.parameters, plan.gradients, plan.optimizer)
    return sum(sum(part.values()) for part in state) + plan.buffers


def rank_state(plan_of: Lookup, rank: int, blocks: float, planned: tuple[int, ...], microbatches: int,
               per_rank: int, replicas: int, first: int | None = None) -> RankPlan:
    """One rank at `blocks` per stage, `microbatches` per step of `per_rank` rows, `replicas` HSDP
    replicas: its state, collectives and calls, from its plans without activation checkpointing at
    one row per microbatch and the `planned` microbatches per step (at two blocks per stage only
    rank `first`'s, when given: a block adds the same to every rank). No peak."""
    slope = rank if first is None else first
    at = [at_blocks(plan_of((slope, "none", 1, 1, m)), plan_of((slope, "none", 2, 1, m)), blocks,
                    plan_of((rank, "none", 1, 1, m))) for m in planned]
    if len(at) == 2:
        plan = _at_microbatches(at[0], at[1], planned, microbatches, per_rank)
    else:  # planned at one count: the collectives that repeat per microbatch scale with them
        plan = _per_microbatch(at[0], microbatches / planned[0])
    comm, calls = plan.communication, plan.calls
    if replicas > 1:  # the replicas all-reduce the gradients each of them reduce-scattered
        rs_calls = sum(v.get("reduce-scatter", 0) for k, v in calls.items() if k.startswith("dp_shard"))
        comm["dp_replicate"] = {"all-reduce": sum(plan.gradients.values()) * replicas}
        calls["dp_replicate"] = {"all-reduce": max(rs_calls, 1)}
    return plan


def _weights_traffic(dim: str, kind: str) -> bool:
    """FSDP's gathers and reductions (on a data-parallel group), which repeat per microbatch whatever
    its rows; the rest (TP, CP, EP, PP) moves activations, as many bytes as the step has rows."""
    return dim.startswith("dp") and kind in ("all-gather", "reduce-scatter", "all-reduce")


def _at_microbatches(one: RankPlan, two: RankPlan, planned: tuple[int, ...], microbatches: int,
                     per_rank: int) -> RankPlan:
    """A rank planned at one row per microbatch and two counts of them, at `microbatches` of
    `per_rank` rows in all: every collective's calls and FSDP's bytes at the microbatches, the
    activations' bytes at the rows (both linear: a part per step plus a part per microbatch or row)."""
    def table(a: dict, b: dict, at_dim_kind) -> dict:
        return {dim: {kind: int(linear(a.get(dim, {}).get(kind, 0), b.get(dim, {}).get(kind, 0),
                                       at_dim_kind(dim, kind), planned))
                      for kind in set(a.get(dim, {})) | set(b.get(dim, {}))} for dim in set(a) | set(b)}

    comm = table(one.communication, two.communication,
                 lambda dim, kind: microbatches if _weights_traffic(dim, kind) else per_rank)
    calls = table(one.calls, two.calls, lambda dim, kind: microbatches)
    return dataclasses.replace(one, communication=comm, calls=calls)


def one_microbatch_fewer(plan: RankPlan) -> RankPlan:
    """A rank planned at several microbatches per step, at one fewer: its collectives less what one
    microbatch adds (RankPlan.microbatch_communication). Not its peak, nor what its forwards keep."""
    def less(table: dict, first: dict) -> dict:
        return {dim: {kind: n - first.get(dim, {}).get(kind, 0) for kind, n in kinds.items()}
                for dim, kinds in table.items()}

    return dataclasses.replace(plan, communication=less(plan.communication, plan.microbatch_communication),
                               calls=less(plan.calls, plan.microbatch_calls))


def _per_microbatch(plan: RankPlan, ratio: float) -> RankPlan:
    """A rank planned at one count of microbatches, at `ratio` times as many (as many rows in all):
    every call and FSDP's bytes scale with the microbatches (their share per step too, a small
    overcount), the activations' bytes stay."""
    if ratio != 1:
        for dim, kinds in plan.communication.items():
            for kind in kinds:
                if _weights_traffic(dim, kind):
                    kinds[kind] = int(kinds[kind] * ratio)
        for kinds in plan.calls.values():
            for kind in kinds:
                kinds[kind] = max(1, int(kinds[kind] * ratio))
    return plan


def state_floor(state: RankPlan, replicas: int) -> int:
    """Bytes every activation-checkpoint mode and microbatch size hold at their peak at least: the
    parameters, optimizer state and buffers (HSDP: sharded over `replicas` times fewer ranks)."""
    kept = sum(state.parameters.values()) + sum(state.optimizer.values())
    return kept * replicas + state.buffers


def rank_peak(plan_of: Lookup, state: RankPlan, rank: int, mode: str, depths: tuple[int, int],
              peak_microbatches: dict[int, int], blocks: float, rows: int, replicas: int,
              one_microbatch: bool, microbatches: int = 0, own: int | None = None) -> int:
    """The rank's peak in AC `mode` (planned at `depths` blocks per stage, at the rows per microbatch
    `peak_microbatches` maps to the microbatches planned with them, enough to fill the pipeline or to
    accumulate gradients) at `blocks` per stage, `rows` per microbatch and, under a pipeline,
    `microbatches` per step: each keeps its receive buffers and rows to the step's end
    (RankPlan.microbatch_bytes), so a pipelined peak grows by them past the planned count.
    `one_microbatch` when a step of several rows per rank runs them as one microbatch without
    pipelining. With `own`, another rank planned at the fewest blocks only: that rank, growing by
    what a block adds to `rank`'s peak (a middle pipeline rank, by the first's, which holds a
    forward more in flight: a little more)."""
    def plans(r: int) -> tuple[RankPlan, RankPlan]:
        one, two = (plan_of((rank, mode, k, r, peak_microbatches[r])) for k in depths)
        return one, two

    def steady(plan: RankPlan, r: int) -> float:
        """Its peak without what its planned microbatches keep to the step's end."""
        return plan.peak - peak_microbatches[r] * plan.microbatch_bytes

    def own_plan(r: int) -> RankPlan:
        return plan_of((rank if own is None else own, mode, depths[0], r, peak_microbatches[r]))

    def peak_at(r: int) -> float:
        one, two = (steady(p, r) for p in plans(r))
        return steady(own_plan(r), r) + linear(one, two, blocks, depths) - one

    at_one_row = peak = peak_at(1)
    kept = own_plan(1).microbatch_bytes  # per microbatch of one row: buffers and rows, both as the rows
    planned = peak_microbatches[1]
    if rows > 1 and 2 in peak_microbatches:  # the peak's growth per row, itself linear in the blocks
        two_rows = peak_at(2)
        peak += (two_rows - at_one_row) * (rows - 1)
        kept += (own_plan(2).microbatch_bytes - kept) * (rows - 1)
        planned = peak_microbatches[2]
    elif rows > 1:  # one row planned only: everything above the state grows with the rows
        peak += (at_one_row - held(state)) * (rows - 1)
        kept *= rows
    peak += kept * max(microbatches, planned)
    if one_microbatch:
        # planned with gradient accumulation, whose gradients are alive through each later backward;
        # one microbatch per step has none before its own backward makes them
        peak -= sum(state.gradients.values())
    if replicas > 1:  # the state sharded over `replicas` times fewer ranks
        peak += (held(state) - state.buffers) * (replicas - 1)
    return int(peak)
