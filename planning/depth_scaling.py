"""A rank planned on a model cut to one and two blocks per pipeline stage, at the model's real depth,
rows per microbatch and HSDP split — what lets the layout search plan small models for large ones.

State, collectives and calls are linear in the blocks per stage; the peak is linear in the blocks
and in the rows (a block's and a row's share are the differences); FSDP's gathers and
reduce-scatters repeat per microbatch; a step of one microbatch holds no accumulated gradients
through its backward; HSDP's replicas shard the state over fewer ranks and add their all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from planning.rank_plan import RankPlan

Key = tuple[int, str, int, int]  # rank, AC mode, blocks per stage, rows per microbatch
Lookup = Callable[[Key], RankPlan]


def linear(one: float, two: float, blocks: float, depths: tuple[int, int] = (1, 2)) -> float:
    """A value measured at `depths` blocks per stage (one, two), at `blocks` per stage."""
    return one + (two - one) * (blocks - depths[0]) / (depths[1] - depths[0])


def scaled(one: RankPlan, two: RankPlan, blocks: float) -> RankPlan:
    """A rank planned at one and two blocks per stage, at `blocks` per stage: its state, buffers,
    collectives and calls (the peak is rank_peak's)."""
    def dim_map(a: dict, b: dict) -> dict:
        return {dim: {kind: int(linear(a.get(dim, {}).get(kind, 0), b.get(dim, {}).get(kind, 0), blocks))
                      for kind in set(a.get(dim, {})) | set(b.get(dim, {}))} for dim in set(a) | set(b)}

    def sizes(a: dict, b: dict) -> dict:
        return {k: int(linear(a.get(k, 0), b.get(k, 0), blocks)) for k in set(a) | set(b)}

    return dataclasses.replace(one, parameters=sizes(one.parameters, two.parameters),
                               gradients=sizes(one.gradients, two.gradients),
                               optimizer=sizes(one.optimizer, two.optimizer),
                               buffers=int(linear(one.buffers, two.buffers, blocks)), peak_breakdown={},
                               communication=dim_map(one.communication, two.communication),
                               calls=dim_map(one.calls, two.calls))


def held(plan: RankPlan) -> int:
    """The state a rank holds through the step: parameters, gradients, optimizer state, buffers."""
    state = (plan.parameters, plan.gradients, plan.optimizer)
    return sum(sum(part.values()) for part in state) + plan.buffers


def rank_state(plan_of: Lookup, rank: int, blocks: float, pp: int, replicas: int, microbatches: int,
               per_rank: int) -> RankPlan:
    """One rank at `blocks` per stage, `microbatches` per step of `per_rank` rows, `replicas` HSDP
    replicas: its state, collectives and calls, from its plans without activation checkpointing at
    one row per microbatch (whose `microbatches` were `per_rank`). Its peak is not set."""
    plan = scaled(plan_of((rank, "none", 1, 1)), plan_of((rank, "none", 2, 1)), blocks)
    comm, calls = plan.communication, plan.calls
    if pp > 1 and microbatches != per_rank:  # the same activations, in fewer sends
        calls["pp"] = {k: max(1, int(v * microbatches / per_rank)) for k, v in calls.get("pp", {}).items()}
    if pp == 1 and microbatches != per_rank:  # FSDP gathers and reduces every microbatch
        for table in (comm, calls):
            for dim in list(table):
                if dim.split(" = ")[0] in ("dp_shard", "dp_shard_cp"):
                    table[dim] = {k: int(v * microbatches / per_rank) if k in ("all-gather", "reduce-scatter")
                                  else v for k, v in table[dim].items()}
    if replicas > 1:  # the replicas all-reduce the gradients each of them reduce-scattered
        rs_calls = sum(v.get("reduce-scatter", 0) for k, v in calls.items() if k.startswith("dp_shard"))
        comm["dp_replicate"] = {"all-reduce": sum(plan.gradients.values()) * replicas}
        calls["dp_replicate"] = {"all-reduce": max(rs_calls, 1)}
    return plan


def state_floor(state: RankPlan, replicas: int) -> int:
    """Bytes every activation-checkpoint mode and microbatch size hold at their peak at least: the
    parameters, optimizer state and buffers (HSDP: sharded over `replicas` times fewer ranks)."""
    kept = sum(state.parameters.values()) + sum(state.optimizer.values())
    return kept * replicas + state.buffers


def rank_peak(plan_of: Lookup, state: RankPlan, rank: int, mode: str, depths: tuple[int, int],
              row_counts: list[int], blocks: float, rows: int, replicas: int, one_microbatch: bool) -> int:
    """The rank's peak in AC `mode` (planned at `depths` blocks per stage and `row_counts` rows) at
    `blocks` per stage and `rows` per microbatch; `one_microbatch` when a step of several rows per
    rank runs them as one microbatch without pipelining."""
    def peak_at(r: int) -> float:
        return linear(plan_of((rank, mode, depths[0], r)).peak, plan_of((rank, mode, depths[1], r)).peak,
                      blocks, depths)

    at_one_row = peak = peak_at(1)
    if rows > 1 and 2 in row_counts:  # the peak's growth per row, itself linear in the blocks
        two_rows = peak_at(2)
        peak += (two_rows - at_one_row) * (rows - 1)
    elif rows > 1:  # one row planned only: everything above the state grows with the rows
        peak += (at_one_row - held(state)) * (rows - 1)
    if one_microbatch:
        # planned with gradient accumulation, whose gradients are alive through each later backward;
        # one microbatch per step has none before its own backward makes them
        peak -= sum(state.gradients.values())
    if replicas > 1:  # the state sharded over `replicas` times fewer ranks
        peak += (held(state) - state.buffers) * (replicas - 1)
    return int(peak)
