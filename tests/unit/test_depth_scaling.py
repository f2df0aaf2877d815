"""planning/depth_scaling.py: plans of a cut model and a short step, at the model's depth and the
run's microbatches — FSDP's traffic counted per microbatch, the activations' per row, the peak per
block and per row, HSDP derived."""

from planning.depth_scaling import rank_peak, rank_state, state_floor
from planning.rank_plan import RankPlan

MiB = 2**20


def plan(blocks: int, microbatches: int, peak: int = 0) -> RankPlan:
    """A rank whose every number is a known function of its blocks and microbatches (one row each):
    FSDP gathers 100 bytes per block and microbatch plus 10 per block and step; TP all-reduces 7
    bytes per block and row, in two calls per block and microbatch."""
    k, m = blocks, microbatches
    return RankPlan(rank=0, coordinates={}, stages=[0], parameters={"float32": 40 * k},
                    gradients={"float32": 40 * k}, optimizer={"float32": 80 * k}, buffers=4, peak=peak,
                    peak_breakdown={}, optimizer_step_peak=0,
                    communication={"dp_shard": {"all-gather": k * (100 * m + 10)},
                                   "tp": {"all-reduce": 7 * k * m}},
                    calls={"dp_shard": {"all-gather": k * m}, "tp": {"all-reduce": 2 * k * m}})


def test_state_and_collectives_at_the_models_depth_and_the_runs_microbatches():
    planned = {(0, "none", k, 1, m): plan(k, m) for k in (1, 2) for m in (2, 3)}
    # 4 blocks per stage, a rank's 8 rows as 4 microbatches of 2
    state = rank_state(planned.__getitem__, 0, 4, (2, 3), 4, 8, replicas=1)
    assert state.parameters == {"float32": 160} and state.optimizer == {"float32": 320}
    assert state.communication["dp_shard"]["all-gather"] == 4 * (100 * 4 + 10)  # per microbatch
    assert state.communication["tp"]["all-reduce"] == 7 * 4 * 8  # per row
    assert state.calls == {"dp_shard": {"all-gather": 16}, "tp": {"all-reduce": 32}}
    hsdp = rank_state(planned.__getitem__, 0, 4, (2, 3), 4, 8, replicas=2)
    assert hsdp.communication["dp_replicate"] == {"all-reduce": 160 * 2}
    assert state_floor(hsdp, 2) == (160 + 320) * 2 + 4


def test_one_planned_count_scales_fsdp_per_microbatch():
    planned = {(0, "none", k, 1, 2): plan(k, 2) for k in (1, 2)}
    state = rank_state(planned.__getitem__, 0, 3, (2,), 1, 2, replicas=1)  # 2 rows in one microbatch
    # FSDP's bytes halve with the microbatches, their per-step share too: 315 where exact is 330
    assert state.communication["dp_shard"]["all-gather"] == 3 * (100 * 2 + 10) // 2
    assert state.communication["tp"]["all-reduce"] == 7 * 3 * 2  # the same rows
    assert state.calls == {"dp_shard": {"all-gather": 3}, "tp": {"all-reduce": 6}}


def test_peak_per_block_and_per_row_and_what_one_microbatch_and_hsdp_change():
    def peak(k: int, r: int) -> int:
        return MiB + 50 * k + 20 * k * r

    planned = {(0, "full", k, r, 2): plan(k, 2, peak(k, r)) for k in (1, 2) for r in (1, 2)}
    planned |= {(0, "none", k, 1, m): plan(k, m) for k in (1, 2) for m in (2, 3)}
    state = rank_state(planned.__getitem__, 0, 4, (2, 3), 2, 8, replicas=1)
    rows = {1: 2, 2: 2}  # rows per microbatch → microbatches its peaks were planned at
    assert rank_peak(planned.__getitem__, state, 0, "full", (1, 2), rows, 4, 4, 1, False) == peak(4, 4)
    one = rank_peak(planned.__getitem__, state, 0, "full", (1, 2), rows, 4, 8, 1, True)
    assert one == peak(4, 8) - 160  # no accumulated gradients before its own backward
    hsdp = rank_peak(planned.__getitem__, state, 0, "full", (1, 2), rows, 4, 4, 2, False)
    assert hsdp == peak(4, 4) + (160 + 160 + 320)  # the state sharded over half the ranks


def test_a_later_stage_grows_by_what_a_block_adds_to_the_first():
    # the last stage's rank, planned at one block only, has its own ends (an output layer: 1000
    # more parameter bytes, a loss all-reduce) and the blocks of the first stage's rank
    import dataclasses

    def last(k: int, m: int) -> RankPlan:
        p = plan(k, m)
        return dataclasses.replace(p, rank=1, parameters={"float32": 40 * k + 1000},
                                   communication=p.communication | {"tp": {"all-reduce": 7 * k * m + 3 * m}})

    planned = {(0, "none", k, 1, m): plan(k, m) for k in (1, 2) for m in (2, 3)}
    planned |= {(1, "none", 1, 1, m): last(1, m) for m in (2, 3)}
    state = rank_state(planned.__getitem__, 1, 4, (2, 3), 4, 8, replicas=1, first=0)
    assert state.rank == 1 and state.parameters == {"float32": 160 + 1000}
    assert state.communication["tp"]["all-reduce"] == 7 * 4 * 8 + 3 * 8
    assert state.communication["dp_shard"]["all-gather"] == 4 * (100 * 4 + 10)
    assert state.calls == {"dp_shard": {"all-gather": 16}, "tp": {"all-reduce": 32}}
