"""FSDP's communication floor (planning/comm_floor.py) and a step's bytes against it."""

from planning.comm_floor import against_floor, fsdp_floor


def degrees(**d):
    return {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1, **d}


def test_fsdp_gathers_twice_in_the_compute_dtype_and_reduces_once():
    # 1,000 fp32 elements stored per rank, sharded over 4: 4,000 elements in all
    floor = fsdp_floor({"float32": 4000}, degrees(dp_shard=4), "bfloat16", "float32")
    assert floor == {"fsdp": {"all-gather": 2 * 4000 * 2, "reduce-scatter": 4000 * 4}}
    hsdp = fsdp_floor({"float32": 4000}, degrees(dp_shard=4, dp_replicate=2), "float32", "float32")
    assert hsdp["dp_replicate"] == {"all-reduce": 4000}  # the shard, once
    assert fsdp_floor({"float32": 4000}, degrees(), "float32", "float32") == {}  # nothing sharded
    assert fsdp_floor({"float32": 4000}, degrees(dp_shard=4, ep=2), "float32", "float32") == {}


def test_a_step_that_gathers_per_microbatch_sends_more_than_the_floor():
    floor = {"fsdp": {"all-gather": 100, "reduce-scatter": 50}}
    sent = {"dp_shard": {"all-gather": 400, "reduce-scatter": 200}, "tp": {"all-reduce": 7}}
    assert sorted(against_floor(sent, floor)) == [("dp_shard", "all-gather", 4.0),
                                                   ("dp_shard", "reduce-scatter", 4.0)]
