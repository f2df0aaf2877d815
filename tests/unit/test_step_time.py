"""The step-time model's arithmetic (planning/step_time.py): which link a mesh dimension crosses,
the wire share of each collective, what FSDP hides behind compute and what it cannot, the
recompute of activation checkpointing and the pipeline bubble. Its predictions against measured
and published steps: benchmarks/step_time_check.py and docs/planning.md."""

import pytest

from planning.step_time import (
    Efficiency,
    LayoutFacts,
    Links,
    collective_seconds,
    group_span,
    predict,
    rank_flops,
)

LINKS = Links(per_node=8, intra_gb_s=100.0, inter_gb_s=10.0, intra_us=0.0, inter_us=0.0)
EFF = Efficiency(compute=0.5, comm=1.0)


def degrees(**d):
    return {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1, **d}


@pytest.mark.parametrize(("dim", "d", "expected"), [
    ("tp", degrees(tp=8, dp_shard=4), (8, 8)),  # TP 8 fills a node
    ("dp_shard", degrees(tp=8, dp_shard=4), (4, 32)),  # FSDP across 4 nodes
    ("dp_shard", degrees(dp_shard=8), (8, 8)),
    ("dp_replicate", degrees(dp_replicate=2, dp_shard=8), (2, 16)),
    ("cp", degrees(cp=2, tp=4), (2, 8)),
    ("pp", degrees(pp=4, tp=8), (4, 32)),
    ("ep", degrees(dp_shard=8, ep=8), (8, 8)),
])
def test_a_dimension_spans_its_inner_dimensions(dim, d, expected):
    assert group_span(dim, d) == expected


def test_wire_shares_of_ring_collectives():
    gb = 1e9
    assert collective_seconds("all-gather", 8 * gb, 0, 8, True, LINKS, EFF) == pytest.approx(7 / 8 * 8 / 100)
    assert collective_seconds("all-reduce", 8 * gb, 0, 8, True, LINKS, EFF) == pytest.approx(14 / 8 * 8 / 100)
    assert collective_seconds("send/recv", 1 * gb, 0, 2, False, LINKS, EFF) == pytest.approx(1 / 10)
    latency = Links(8, 100.0, 10.0, intra_us=10.0, inter_us=10.0)
    assert collective_seconds("all-gather", 0, 3, 4, True, latency, EFF) == pytest.approx(3 * 3 * 10e-6)


def predicted(comm, facts, flops=1e12, bubble=0.0):
    return predict(flops, bubble, comm, {}, 1000.0, facts, 1.0, LINKS, EFF)  # 1 TFLOP/s at 50%: 2 s


def test_fsdp_hides_behind_compute_but_one_block():
    facts = LayoutFacts(degrees(dp_shard=8), layers_per_stage=4)
    small = predicted({"dp_shard": {"all-gather": int(8e9)}}, facts)  # 0.07 s on the wire
    assert small.compute == pytest.approx(2.0)
    assert small.exposed["dp_shard"] == pytest.approx(0.07 / 4)  # one block's share
    large = predicted({"dp_shard": {"all-gather": int(400e9)}}, facts)  # 3.5 s: more than compute hides
    assert large.exposed["dp_shard"] == pytest.approx(3.5 - 2.0 * 3 / 4)
    assert large.seconds == pytest.approx(2.0 + 3.5 - 1.5)


def test_eps_all_to_all_is_exposed_on_a_group_that_is_fsdps_too():
    """EP over every FSDP rank: the planner names the group "dp_shard = ep"; its gathers hide as FSDP's,
    its all-to-alls sit on the critical path as EP's do on a group of their own."""
    facts = LayoutFacts(degrees(dp_shard=8, ep=8), layers_per_stage=4)
    shared = predicted({"dp_shard = ep": {"all-gather": int(8e9), "all-to-all": int(8e9)}}, facts)
    alone = predicted({"dp_shard": {"all-gather": int(8e9)}, "ep": {"all-to-all": int(8e9)}}, facts)
    assert shared.comm["dp_shard = ep"] == pytest.approx(2 * 0.07)
    assert shared.exposed["dp_shard = ep"] == pytest.approx(0.07 + 0.07 / 4)
    assert shared.seconds == pytest.approx(alone.seconds)


def test_tp_is_exposed_and_the_bubble_stretches_compute():
    facts = LayoutFacts(degrees(tp=8), layers_per_stage=4)
    t = predicted({"tp": {"all-reduce": int(8e9)}}, facts, bubble=0.2)
    assert t.exposed["tp"] == pytest.approx(2 * 7 / 8 * 8 / 100)
    assert t.seconds == pytest.approx(2.0 / 0.8 + t.exposed["tp"])
    assert t.tokens_per_second_per_device == pytest.approx(1000.0 / t.seconds)


@pytest.mark.parametrize(("mode", "option", "factor"), [("none", "op", 1.0), ("selective", "op", 1.0),
                                                        ("selective", "2", 1 + 1 / 6), ("full", "op", 4 / 3)])
def test_activation_checkpointing_recomputes_forwards(mode, option, factor):
    t = predicted({}, LayoutFacts(degrees(), 4, ac_mode=mode, selective_ac_option=option))
    assert t.compute == pytest.approx(2.0 * factor)


def test_compile_and_float8_speed_compute_up():
    eff = Efficiency(compute=0.5, compile=1.25, float8=1.6)
    facts = LayoutFacts(degrees(), 4, compile=True, float8=True)
    assert predict(1e12, 0.0, {}, {}, 1.0, facts, 1.0, LINKS, eff).compute == pytest.approx(2.0 / 2.0)


def test_with_tp_and_ep_each_tp_rank_runs_the_moe_layers_whole():
    """Under EP the MoE layers are not split over TP ranks (models/moe/parallelize.py): each runs
    them on the whole sequence, so a rank computes their FLOPs tp times over; without EP, TP splits
    them like every layer."""
    every, moe, tokens = 100.0, 60.0, 1024.0
    assert rank_flops(every, moe, tokens, 8, degrees(tp=2, dp_shard=4)) == every * tokens / 8
    assert rank_flops(every, moe, tokens, 8, degrees(tp=2, dp_shard=4, ep=4)) == (every + moe) * tokens / 8
    tp4 = degrees(tp=4, dp_shard=2, ep=2)
    assert rank_flops(every, moe, tokens, 8, tp4) == (every + 3 * moe) * tokens / 8
    assert rank_flops(every, moe, tokens, 8, degrees(dp_shard=8, ep=8)) == every * tokens / 8
