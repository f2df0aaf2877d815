"""What a searched layout could at best be, from its model's shape alone, before any plan: the most
tokens/s per device the step-time model could predict for it (its compute and the communication
floors of FSDP, TP and EP, planning/comm_floor.py) and the least its peak could be — from its state,
and once another layout's plans show what a block's forward keeps, from its forwards in flight.
planning/search.py times and plans a layout only where these say it could be among the best that
fit; tests/e2e/test_plan_search_bounds.py checks that they stay below what its plans give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallelisms.pipeline import stage_ids
from planning.comm_floor import (
    expert_parallel_floor,
    fsdp_gathers,
    rank_floor_groups,
    sharded_floor,
    tensor_parallel_floor,
)
from planning.devices import Device
from planning.layout_space import closed_form_bubble, layout_degrees, rows_options
from planning.pipeline_bubble import forwards_in_flight
from planning.plan import AC_MODES
from planning.step_time import LayoutFacts, predict, rank_flops

if TYPE_CHECKING:
    from planning.search import _Piece


def speed_bound(piece: _Piece, device: Device, flops_per_token: float, seq_len: int,
                speedups: dict[str, bool], keeps: dict[str, float] | None = None) -> float:
    """The most tokens/s per device any layout of the piece could be predicted at: its compute (with
    its AC mode's recompute) over the smallest bubble (one row per microbatch), with no
    communication but the floors of FSDP, TP and EP, at the HSDP split and AC mode that hide the
    most of those whose least peak fits the device (0 where none does) — what the step-time model
    adds is never negative. `keeps`: what one block's forward keeps at one row, by AC mode, where
    known (least_in_flight_peak)."""
    d = piece.dims
    tokens = piece.global_batch * seq_len
    bubble = closed_form_bubble(d.pp, piece.stages, piece.per_rank)
    capacity = (device.memory_gib - device.reserve_gib) * 2**30
    option = piece.cfg.activation_checkpoint.selective_ac_option
    best = 0.0
    # the HSDP splits EP can borrow its ranks from (the trainer refuses the others)
    for replicas in (r for r in piece.replicas if d.dp % r == 0 and d.dp // r * d.cp % d.ep == 0):
        if least_peak(piece, replicas) > capacity:
            continue
        degrees = layout_degrees(d, replicas)
        floor = communication_floor(piece, tokens, replicas)  # without latencies, which only add
        flops = rank_flops(flops_per_token, piece.moe_flops_per_token, tokens, d.world_size, degrees)
        for mode in AC_MODES:  # fastest first: each recomputes more than the one before
            if least_in_flight_peak(piece, replicas, mode, keeps or {}) > capacity:
                continue
            facts = LayoutFacts(degrees, max(int(round(piece.blocks * piece.stages)), 1), mode, option,
                                **speedups)
            step = predict(flops, bubble, floor, {}, tokens / d.world_size, facts, device.peak_tflops,
                           device.links, device.efficiency)
            best = max(best, step.tokens_per_second_per_device)
            break
    return best


def least_in_flight_peak(piece: _Piece, replicas: int, mode: str, keeps: dict[str, float]) -> float:
    """Bytes some rank holds at least as its first backward begins in AC `mode`, given `keeps`: what
    one block's forward keeps for its backward at one row per microbatch, by AC mode, where known
    (measured on another piece of the same TP, CP and EP degrees by planning/search.py: it depends
    on neither the pipeline nor the data-parallel split). The rank's blocks' share of the model's
    state (least_peak's), the weights its pipeline stages keep gathered from their first forward,
    and each forward in flight's keeps — the most of any place on the pipeline, at the rows per
    microbatch that give the least (one forward of every block without a pipeline). Only blocks of
    the kind the search plans count (an MoE model's dense blocks keep less); under selective AC of
    every N-th block, those it does not checkpoint, at what they keep without AC."""
    d = piece.dims
    every, experts = piece.block_parameters
    shard = d.dp // replicas * d.cp
    per_held = 12 * every / (d.tp * shard)
    if d.pp > 1 and shard > 1 and fsdp_gathers(d.pp, piece.cfg.parallelism.fsdp_reshard_after_forward) == 1:
        itemsize = getattr(torch, piece.options.param_dtype).itemsize
        per_held += itemsize * (every - experts + experts / d.ep) / d.tp
    per_block, counted = _counted_blocks(piece, mode, keeps)
    most = 0.0
    for place in range(d.pp):
        stages = stage_ids(place, d.pp, piece.schedule) if d.pp > 1 else [0]
        held = sum(sum(piece.stage_kinds[s]) for s in stages) * per_held
        kept = min(_kept_rows(piece, place, [counted[s] for s in stages], rows)
                   for rows in rows_options(piece.per_rank))
        most = max(most, held + per_block * kept)
    return most


def _counted_blocks(piece: _Piece, mode: str, keeps: dict[str, float]) -> tuple[float, list[int]]:
    """(bytes one counted block's forward keeps at one row, the counted blocks of every stage) in AC
    `mode`: selective AC of every N-th block checkpoints a stage's local blocks 0, N, 2N, ...
    (parallelisms/activation_checkpoint.py), and the others keep what they keep without AC."""
    option = piece.cfg.activation_checkpoint.selective_ac_option
    if mode == "selective" and option.isdigit():
        every = int(option)
        return keeps.get("none", 0.0), [sum(kind for i, kind in enumerate(stage) if i % every)
                                        for stage in piece.stage_kinds]
    return keeps.get(mode, 0.0), [sum(stage) for stage in piece.stage_kinds]


def _kept_rows(piece: _Piece, place: int, blocks: list[int], rows: int) -> int:
    """Block-rows of forwards a pipeline place holds as its first backward begins, at `rows` per
    microbatch, given its stages' counted blocks (1F1B: min(microbatches, pp − place) forwards)."""
    if piece.dims.pp == 1:
        return rows * sum(blocks)
    flights = forwards_in_flight(piece.schedule, piece.dims.pp, piece.stages, piece.per_rank // rows, place)
    return rows * sum(f * b for f, b in zip(flights, blocks, strict=True))


def least_peak(piece: _Piece, replicas: int) -> float:
    """Bytes the first planned rank's peak holds at least: its blocks' fp32 master weights and AdamW's
    two fp32 moments (components/config/sections.py) split over TP and the FSDP shard (EP's experts
    over as many ranks: ep × what it leaves of dp_shard × cp); and under a pipeline with FSDP, the
    weights gathered and their gradients accumulated unsharded, which torch's pipeline stages keep
    until the step's last backward (set_reshard_after_backward(False)). What TP does not split, the
    embedding and the head only add."""
    d, blocks = piece.dims, piece.first_rank_blocks
    every, experts = piece.block_parameters
    shard = d.dp // replicas * d.cp
    least = 12 * every * blocks / (d.tp * shard)
    if d.pp > 1 and shard > 1:
        dtype = getattr(torch, piece.options.param_dtype)
        least += 2 * dtype.itemsize * blocks * (every - experts + experts / d.ep) / d.tp
    return least


def communication_floor(piece: _Piece, tokens: int, replicas: int) -> dict[str, dict[str, float]]:
    """The floors of FSDP, TP and EP (planning/comm_floor.py) on the first planned rank as the search
    scales it: its stages' blocks, each an MoE layer where the model has them (a timing plan's model
    is cut to blocks of one kind), split over TP ranks; every token of its data-parallel × CP rank
    routed (each TP rank routes the whole sequence, models/moe/parallelize.py). The embedding and
    the head only add."""
    d, options, blocks = piece.dims, piece.options, piece.first_rank_blocks
    moe = getattr(piece.args, "moe", None)
    every, experts = piece.block_parameters

    def stored(parameters: float) -> dict[str, int]:  # fp32 master bytes a rank holds of its blocks'
        return {"float32": int(parameters * blocks / (d.tp * (d.dp // replicas) * d.cp)) * 4}

    gathers, reductions = fsdp_passes(piece)
    groups = rank_floor_groups(stored(every), stored(every), stored(experts), layout_degrees(d, replicas),
                               gathers)
    floor = sharded_floor(groups, replicas, options.param_dtype, options.reduce_dtype, reductions)
    if "fsdp" in floor:  # named as the plans name its group
        floor["dp_shard_cp" if d.cp > 1 else "dp_shard"] = floor.pop("fsdp")
    routed = tokens / (d.dp * d.cp)
    if d.tp > 1 and piece.tensor_parallel_rows is not None:
        gathered, reduced = piece.tensor_parallel_rows[d.ep > 1]
        floor |= tensor_parallel_floor(blocks * gathered, blocks * reduced, routed, piece.args.dim,
                                       options.param_dtype)
    if d.ep > 1 and moe is not None:
        floor |= expert_parallel_floor(blocks, routed, moe.top_k, piece.args.dim, options.param_dtype)
    return floor


def fsdp_passes(piece: _Piece) -> tuple[int, int]:
    """The fewest gathers and reduce-scatters of a block's weights per step in any layout of the piece
    (parallelisms/fsdp.py): without a pipeline, per microbatch — at the most rows per microbatch — a
    reduce-scatter and a gather for the forward, and one for the backward where the forward
    reshards; with one, once (torch's stages reduce the gradients after the last backward)."""
    if piece.dims.pp > 1:
        return 1, 1
    microbatches = piece.per_rank // max(rows_options(piece.per_rank))
    return microbatches * fsdp_gathers(1, piece.cfg.parallelism.fsdp_reshard_after_forward), microbatches
