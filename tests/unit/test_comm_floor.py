"""The communication floors of FSDP, TP and EP (planning/comm_floor.py) and a step's bytes against
them. That a planned step sends at least its floors: tests/e2e/test_plan_search_bounds.py."""

from planning.comm_floor import (
    against_floor,
    all_reduces_as_reductions,
    expert_parallel_floor,
    fsdp_floor,
    fsdp_gathers,
    rank_floor_groups,
    sharded_floor,
    tensor_parallel_floor,
)


def degrees(**d):
    return {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1, **d}


def test_fsdp_gathers_twice_in_the_compute_dtype_and_reduces_once():
    # 1,000 fp32 elements stored per rank, sharded over 4: 4,000 elements in all
    floor = fsdp_floor({"float32": 4000}, 4, 1, "bfloat16", "float32")
    assert floor == {"fsdp": {"all-gather": 2 * 4000 * 2, "reduce-scatter": 4000 * 4}}
    hsdp = fsdp_floor({"float32": 4000}, 4, 2, "float32", "float32")
    assert hsdp["dp_replicate"] == {"all-reduce": 4000}  # the shard, once
    assert fsdp_floor({"float32": 4000}, 1, 1, "float32", "float32") == {}  # nothing sharded


def test_fsdp_floor_of_several_passes_and_ddps_all_reduce():
    # four microbatches that reshard after forward: 8 gathers and 4 reduce-scatters; HSDP's all-reduce
    # per reduce-scatter
    floor = fsdp_floor({"float32": 4000}, 4, 2, "bfloat16", "float32", 8, 4)
    assert floor == {"fsdp": {"all-gather": 8 * 4000 * 2, "reduce-scatter": 4 * 4000 * 4},
                     "dp_replicate": {"all-reduce": 4 * 1000 * 4}}
    assert fsdp_floor({"float32": 4000}, 1, 2, "float32", "float32") == {
        "dp_replicate": {"all-reduce": 4000}}  # DDP: the whole gradient, once


def test_weights_kept_gathered_for_backward_are_gathered_once():
    assert fsdp_gathers(1, "default") == 2 and fsdp_gathers(1, "always") == 2
    assert fsdp_gathers(2, "default") == 1 and fsdp_gathers(1, "never") == 1  # a pipeline's stages keep them
    assert fsdp_gathers(2, "always") == 2


def test_a_ranks_groups_blocks_twice_the_rest_once_experts_over_what_ep_leaves():
    # 1,000 bytes stored: 600 in blocks, of them 400 routed experts; FSDP 4 × EP 2, HSDP 2 replicas
    d = degrees(dp_shard=4, ep=2, dp_replicate=2)
    groups = rank_floor_groups({"float32": 1000}, {"float32": 600}, {"float32": 400}, d, 2)
    assert groups == [("fsdp", {"float32": 200}, 4, 2), ("fsdp", {"float32": 400}, 4, 1),
                      ("dp_shard_mod_ep", {"float32": 400}, 2, 2)]
    floor = sharded_floor(groups, 2, "float32", "float32")
    assert floor == {"fsdp": {"all-gather": (2 * 200 + 400) * 4, "reduce-scatter": 600 * 4},
                     "dp_shard_mod_ep": {"all-gather": 2 * 400 * 2, "reduce-scatter": 400 * 2},
                     "dp_replicate": {"all-reduce": 1000}}  # every shard once, both groups
    # without EP the experts are blocks like the others
    plain = rank_floor_groups({"float32": 1000}, {"float32": 600}, {"float32": 400}, degrees(dp_shard=4), 2)
    assert plain == [("fsdp", {"float32": 600}, 4, 2), ("fsdp", {"float32": 400}, 4, 1)]


def test_tp_and_ep_floors_move_every_token_forward_and_back():
    # 100 tokens of dim 16 in bf16: 14 rows gathered and 12 reduced (model_shape.tensor_parallel_rows
    # counts them), and loss parallel's three float32 sums per token through the head twice; every
    # (token, choice) of top 2 through 3 MoE layers sent and returned, forward and backward
    row = 100 * 16 * 2
    assert tensor_parallel_floor(14, 12, 100, 16, "bfloat16") == {"tp": {"all-gather": 14 * row,
                                                                         "reduce-scatter": 12 * row}}
    assert tensor_parallel_floor(14, 12, 100, 16, "bfloat16", loss_passes=2) == {
        "tp": {"all-gather": 14 * row, "reduce-scatter": 12 * row + 2 * 100 * 3 * 4}}
    assert expert_parallel_floor(3, 100, 2, 16, "bfloat16") == {"ep": {"all-to-all": 4 * 2 * 3 * row}}


def test_tp_all_reduces_count_as_reductions():
    sent = {"tp": {"all-gather": 10, "reduce-scatter": 6, "all-reduce": 3}, "dp_shard": {"all-reduce": 5}}
    assert all_reduces_as_reductions(sent) == {"tp": {"all-gather": 10, "reduce-scatter": 9},
                                               "dp_shard": {"all-reduce": 5}}
    assert sent["tp"]["all-reduce"] == 3  # the step's own numbers are left as they are


def test_a_step_that_gathers_per_microbatch_sends_more_than_the_floor():
    floor = {"fsdp": {"all-gather": 100, "reduce-scatter": 50}}
    sent = {"dp_shard": {"all-gather": 400, "reduce-scatter": 200}, "tp": {"all-reduce": 7}}
    assert sorted(against_floor(sent, floor)) == [("dp_shard", "all-gather", 4.0),
                                                   ("dp_shard", "reduce-scatter", 4.0)]
    # a group that is two dimensions' carries both floors
    both = {"fsdp": {"all-gather": 100}, "dp_shard_mod_ep": {"all-gather": 60}}
    assert against_floor({"dp_shard = dp_shard_mod_ep": {"all-gather": 320}}, both) == [
        ("dp_shard = dp_shard_mod_ep", "all-gather", 2.0)]
