"""Tests ParallelDims: -1 resolution, impossible layouts named, derived flags, no mesh at 1."""

import dataclasses

import pytest

from components.config.parallel_options import ParallelOptions
from components.runtime.errors import KilnError
from parallelisms.layout_checks import ModelShape
from parallelisms.parallel_dims import ParallelDims


def dims(world: int, *, rep: int = 1, shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1,
         ep: int = 1) -> ParallelDims:
    """ParallelDims with keyword degrees defaulting to a plain FSDP layout."""
    return ParallelDims(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep,
                        world_size=world)


def check(d: ParallelDims, *, heads: int = 16, kv: int = 8, layers: int = 8,
          seq: int = 256) -> None:
    """check_model with a Llama-like default shape."""
    d.check_model(n_heads=heads, n_kv_heads=kv, n_layers=layers, seq_len=seq)


@pytest.mark.parametrize("world,kw,shard", [
    (8, {}, 8), (8, {"tp": 2}, 4), (16, {"rep": 2, "tp": 2, "pp": 2}, 2), (6, {"cp": 3}, 2),
])
def test_minus_one_fills_the_rest(world: int, kw: dict, shard: int) -> None:
    assert dims(world, **kw).dp_shard == shard


def test_minus_one_must_divide() -> None:
    with pytest.raises(KilnError, match="world size 6") as e:
        dims(6, tp=4)
    assert "4" in str(e.value)


def test_product_must_equal_world_size() -> None:
    with pytest.raises(KilnError) as e:
        dims(8, rep=2, shard=2, tp=3)
    msg = str(e.value)
    assert "multiply to 12" in msg and "world size is 8" in msg
    assert "tp 3" in msg and "dp_replicate 2" in msg


@pytest.mark.parametrize("kw", [{"tp": 0}, {"pp": -1}, {"shard": 0}, {"shard": -2}])
def test_degrees_must_be_positive(kw: dict) -> None:
    with pytest.raises(KilnError):
        dims(4, **kw)


def test_tp_must_divide_heads() -> None:
    with pytest.raises(KilnError, match="tensor_parallel_degree 8 .*12 attention heads"):
        check(dims(8, tp=8), heads=12, kv=12)
    check(dims(4, tp=4), heads=12, kv=12)


def test_tp_must_divide_kv_heads() -> None:
    with pytest.raises(KilnError, match="2 key/value heads"):
        check(dims(4, tp=4), heads=16, kv=2)
    check(dims(4, tp=2), heads=16, kv=2)  # a multiple is fine


def test_seq_len_divisibility() -> None:
    with pytest.raises(KilnError, match="seq_len 254 .*tensor_parallel_degree 4"):
        check(dims(4, tp=4), seq=254)
    with pytest.raises(KilnError, match=r"seq_len 20 .*2 × context_parallel_degree = 8"):
        check(dims(4, cp=4), seq=20)  # 20 is divisible by cp=4 but not by 2·cp
    check(dims(4, cp=4), seq=24)


def test_pp_at_most_layers() -> None:
    with pytest.raises(KilnError, match="pipeline_parallel_degree 4 .*2 layers"):
        check(dims(4, pp=4), layers=2)
    check(dims(4, pp=4), layers=4)


def test_ep_must_divide_shard_times_cp() -> None:
    with pytest.raises(KilnError, match="expert_parallel_degree 3 .*dp_shard × cp = 4"):
        dims(4, ep=3)
    d = dims(8, shard=2, cp=2, tp=2, ep=4)  # EP borrows dp_shard × cp = 4 ranks: no extra world
    assert d.ep == 4 and d.dp == 2


@pytest.mark.parametrize("world,kw,dp,fsdp,ddp,hsdp", [
    (1, {"shard": 1}, 1, False, False, False),
    (4, {}, 4, True, False, False),
    (4, {"rep": 4, "shard": 1}, 4, False, True, False),
    (8, {"rep": 2}, 8, True, False, True),
    (4, {"shard": 1, "tp": 4}, 1, False, False, False),
    (4, {"shard": 1, "cp": 4}, 1, True, False, False),  # FSDP shards over cp alone
    (8, {"rep": 2, "shard": 1, "cp": 2, "tp": 2}, 2, True, False, True),
])
def test_derived_flags(world: int, kw: dict, dp: int, fsdp: bool, ddp: bool, hsdp: bool) -> None:
    d = dims(world, **kw)
    assert (d.dp, d.fsdp_enabled, d.ddp_enabled, d.hsdp_enabled) == (dp, fsdp, ddp, hsdp)
    assert d.data_parallel_enabled == (fsdp or ddp)  # all three go through fully_shard


def test_single_process_builds_no_mesh() -> None:
    d = dims(1)
    assert d.dp_shard == 1
    assert d.build_mesh("cpu") is None
    assert d.world_mesh is None and d.mesh("dp") is None and d.fsdp_mesh() is None


def test_tp_must_divide_vocab() -> None:
    with pytest.raises(KilnError, match="vocabulary size 1001"):
        dims(2, tp=2).check_model(n_heads=4, n_kv_heads=2, n_layers=2, seq_len=64, vocab_size=1001)
    dims(2, tp=2).check_model(n_heads=4, n_kv_heads=2, n_layers=2, seq_len=64, vocab_size=1000)


def test_every_problem_is_listed_at_once() -> None:
    """A layout with several faults names them all in one message, not the first one only."""
    model = ModelShape(n_heads=6, n_kv_heads=6, n_layers=2, vocab_size=1001, tied_embeddings=True)
    with pytest.raises(KilnError) as e:
        dims(4, pp=2, shard=1, tp=2).check_layout(
            model, ParallelOptions(seq_len=31, pp_schedule="Interleaved1F1B", pp_microbatch_size=3),
            global_batch=8)
    msg = str(e.value)
    assert msg.startswith("5 problems with this layout: "), msg
    for words in ("vocabulary size 1001", "seq_len 31", "tied embeddings", "4 pipeline stages are more than",
                  "not divisible by parallelism.pipeline_parallel_microbatch_size 3"):
        assert words in msg, (words, msg)


def test_model_family_check_joins_the_list() -> None:
    shape = ModelShape(n_heads=4, n_kv_heads=4, n_layers=2, num_experts=8)
    with pytest.raises(KilnError, match="must divide num_experts 8; top_k"):
        dims(6, ep=3).check_layout(shape, ParallelOptions(seq_len=64), extra=["top_k is too large"])
    with pytest.raises(KilnError, match="needs a Mixture-of-Experts model"):
        dims(2, ep=2).check_layout(ModelShape(n_heads=4, n_kv_heads=4, n_layers=2), ParallelOptions())


def test_summary_claims_sequence_parallel_only_for_a_plan_that_has_it() -> None:
    """Llama's plan shards the sequence between blocks, GPT-2's (examples/) does not: the start-up
    line says which, and nothing when it is not known (the planner)."""
    from components.runtime.custom_import import import_custom
    from models.llama3.parallelize import attention_plan, feed_forward_plan
    from parallelisms.tensor_parallel import shards_sequence, transformer_top_plan
    from tests.helpers.runs import REPO

    import_custom(str(REPO / "examples" / "gpt2_model.py"))
    import gpt2_model

    llama = [*transformer_top_plan(True).values(), *attention_plan().values(), *feed_forward_plan().values()]
    top, block = gpt2_model.gpt2_tp_plan(True)
    assert any(map(shards_sequence, llama))
    assert not any(map(shards_sequence, [*top.values(), *block.values()]))
    tp2 = dims(2, shard=1, tp=2)
    opts = ParallelOptions()
    assert "TP 2 (sequence parallel, loss parallel on)" in tp2.describe(opts, sequence_parallel=True)
    assert "TP 2 (no sequence parallel, loss parallel on)" in tp2.describe(opts, sequence_parallel=False)
    assert "TP 2 (loss parallel on)" in tp2.describe(opts)


def test_llama_tp_must_divide_the_feed_forward() -> None:
    """A 256-unit feed-forward cannot be split over 3 TP ranks (the row-wise projection would get
    uneven shards): refused with the numbers; 264 units can."""
    from models import get_model_spec

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["tiny"], dim=96, n_heads=3, n_kv_heads=3, vocab_size=4098)
    problems = spec.check_fn(args, dims(3, shard=1, tp=3))
    assert len(problems) == 1 and "feed-forward hidden size 256" in problems[0], problems
    assert spec.check_fn(dataclasses.replace(args, multiple_of=24), dims(3, shard=1, tp=3)) == []


def test_per_op_selective_ac_is_refused_with_expert_parallel_under_a_pipeline() -> None:
    shape = ModelShape(n_heads=4, n_kv_heads=4, n_layers=4, num_experts=8)
    per_op = ParallelOptions(seq_len=64, ac_mode="selective", ac_option="op")
    with pytest.raises(KilnError, match="selective_ac_option 'op'.* expert parallel under pipeline parallel"):
        dims(8, pp=2, ep=2).check_layout(shape, per_op)
    dims(8, pp=2, ep=2).check_layout(shape, ParallelOptions(seq_len=64, ac_mode="selective", ac_option="2"))
    dims(8, ep=2).check_layout(shape, per_op)  # without a pipeline it runs
