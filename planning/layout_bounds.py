"""What a searched layout could at best be, from its model's shape alone, before any plan: the most
tokens/s per device the step-time model could predict for it (its compute and the communication
floors of FSDP, TP and EP, planning/comm_floor.py) and the least its first planned rank's peak could
be. planning/search.py times and plans a layout only where these say it could be among the best that
fit; tests/e2e/test_plan_search_bounds.py checks that they stay below what its plans give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from planning.comm_floor import expert_parallel_floor, fsdp_gathers, sharded_floor, tensor_parallel_floor
from planning.devices import Device
from planning.layout_space import closed_form_bubble, layout_degrees, rows_options
from planning.step_time import LayoutFacts, predict, rank_flops

if TYPE_CHECKING:
    from planning.search import _Piece


def speed_bound(piece: _Piece, device: Device, flops_per_token: float, seq_len: int,
                speedups: dict[str, bool]) -> float:
    """The most tokens/s per device any layout of the piece could be predicted at: its compute without
    recompute (AC adds more time than it can hide) over the smallest bubble (one row per microbatch),
    with no communication but the floors of FSDP, TP and EP, at the HSDP split that hides the most
    of those whose least peak fits the device (0 where none does) — what the step-time model adds
    is never negative."""
    d = piece.dims
    tokens = piece.global_batch * seq_len
    bubble = closed_form_bubble(d.pp, piece.stages, piece.per_rank)
    capacity = (device.memory_gib - device.reserve_gib) * 2**30
    best = 0.0
    # the HSDP splits EP can borrow its ranks from (the trainer refuses the others)
    for replicas in (r for r in piece.replicas if d.dp % r == 0 and d.dp // r * d.cp % d.ep == 0):
        if least_peak(piece, replicas) > capacity:
            continue
        degrees = layout_degrees(d, replicas)
        facts = LayoutFacts(degrees, max(int(round(piece.blocks * piece.stages)), 1), "none", **speedups)
        floor = communication_floor(piece, tokens, replicas)  # without latencies, which only add
        flops = rank_flops(flops_per_token, piece.moe_flops_per_token, tokens, d.world_size, degrees)
        step = predict(flops, bubble, floor, {}, tokens / d.world_size, facts, device.peak_tflops,
                       device.links, device.efficiency)
        best = max(best, step.tokens_per_second_per_device)
    return best


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
    shard = d.dp // replicas * d.cp
    every, experts = piece.block_parameters
    # EP's experts are FSDP-sharded over what it leaves of dp_shard × cp, the rest over all of it
    fsdp = "dp_shard_cp" if d.cp > 1 else "dp_shard"
    groups = [(fsdp, every, shard)]
    if d.ep > 1:
        groups = [(fsdp, every - experts, shard), ("dp_shard_mod_ep", experts / d.ep, shard // d.ep)]
    gathers, reductions = fsdp_passes(piece)
    stored = [(name, {"float32": int(parameters * blocks / (d.tp * ranks)) * 4}, ranks, gathers)
              for name, parameters, ranks in groups]
    floor = sharded_floor(stored, replicas, options.param_dtype, options.reduce_dtype, reductions)
    routed = tokens / (d.dp * d.cp)
    if d.tp > 1:
        floor |= tensor_parallel_floor(blocks, routed, piece.args.dim, options.param_dtype)
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
