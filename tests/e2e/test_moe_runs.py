"""Mixture of Experts training in every layout (expert parallel included) against the single process,
its load metrics, checkpoints across layouts, bad layouts, and the expert bias balancing a longer
run. The layer itself is tests/unit/test_moe.py."""

import shutil

import pytest

from tests.helpers.runs import (
    TINY,
    check_ok,
    dump_args,
    fails_with,
    read_metrics,
    run_train,
    run_trains_side_by_side,
    train_rows,
    unigram_entropy,
)

MOE = [*TINY, "--model.name", "moe", "--training.global_batch_size", "8"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
VARIANT = ["--job.custom_import", "tests.helpers.variant_models", "--model.name", "moe_variant"]


LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "ep2": (2, ["--training.local_batch_size", "4", *EP2]),
    "ep4": (4, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4"]),
    "fsdp4_ep2": (4, ["--training.local_batch_size", "2", *EP2]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp2_tp2_ep2": (4, ["--training.local_batch_size", "4", *TP2, *EP2]),
    "pp2_ep2": (4, ["--training.local_batch_size", "4", *PP2, *EP2]),
    "cp2_ep2": (2, ["--parallelism.context_parallel_degree", "2", *EP2]),
    "accum": (1, ["--training.local_batch_size", "4"]),
    "tp2_compile": (2, [*TP2, "--compile.enable"]),
    "ep2_compile": (2, ["--training.local_batch_size", "4", *EP2, "--compile.enable"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    dump = tmp_path_factory.mktemp("moe_ref")
    check_ok(run_train([*MOE, *dump_args(dump, data_cache)]))
    return read_metrics(dump)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path, data_cache):
    """Dropless routing and a bias moved by the global load: the same losses, grad norms and expert
    loads in every layout."""
    nproc, args = LAYOUTS[layout]
    check_ok(run_train([*MOE, *args, *dump_args(tmp_path, data_cache)], nproc=nproc))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert abs(got["loss"] - ref["loss"]) <= tol * ref["loss"], (layout, ref["step"])
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= tol * ref["grad_norm"], (layout, ref["step"])
        assert got["moe_load"] == ref["moe_load"], (layout, ref["step"])


def test_load_metrics(reference):
    """Every step logs tokens per expert for each MoE layer (all k choices of every token) and max/mean."""
    tokens = 8 * 64
    for row in reference:
        assert set(row["moe_load"]) == {"0", "1"}
        for layer, load in row["moe_load"].items():
            assert len(load) == 8 and sum(load) == tokens * 2
            assert row["moe_imbalance"][layer] == pytest.approx(max(load) / (sum(load) / 8), abs=1e-4)


def test_variant_with_aux_loss_accumulation_matches_fsdp(tmp_path, data_cache):
    """Dense first block, sigmoid routing and the auxiliary loss: the aux loss is computed per
    microbatch, so 2 microbatches of 4 rows on one process equal 2 ranks of 4 rows."""
    runs = {}
    for nproc in (1, 2):
        dump = tmp_path / f"n{nproc}"
        check_ok(run_train([*MOE, *VARIANT, "--training.local_batch_size", "4", *dump_args(dump, data_cache)],
                           nproc=nproc))
        runs[nproc] = train_rows(dump)
    for a, b in zip(runs[1], runs[2], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
        assert set(a["moe_load"]) == {"1", "2"}  # block 0 is dense


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory, data_cache):
    """10 EP 2 steps with checkpoints at 5 and 10."""
    dump = tmp_path_factory.mktemp("ep2_ckpt")
    args = [*MOE, "--checkpoint.enable", "--checkpoint.interval", "5", "--training.local_batch_size", "4",
            *EP2]
    check_ok(run_train([*args, *dump_args(dump, data_cache)],
                       nproc=2))
    return dump


@pytest.mark.parametrize("nproc,args", [
    (1, []),
    (4, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4"]),
], ids=["to_single", "to_ep4"])
def test_ep2_checkpoint_resumes_in_another_layout(ep2_checkpoint, nproc, args, tmp_path, data_cache):
    """Expert weights sharded over EP ranks and the expert bias come back exactly in another layout."""
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(ep2_checkpoint / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    check_ok(run_train([*MOE, "--checkpoint.enable", "--checkpoint.interval", "5", *args,
                        *dump_args(tmp_path, data_cache)],
                       nproc=nproc))
    ref = {r["step"]: r for r in read_metrics(ep2_checkpoint)}
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(6, 11))
    for row in rows:
        assert abs(row["loss"] - ref[row["step"]]["loss"]) <= 1e-5 * row["loss"]
        assert abs(row["grad_norm"] - ref[row["step"]]["grad_norm"]) <= 1e-4 * row["grad_norm"]
        assert row["moe_load"] == ref[row["step"]]["moe_load"]


@pytest.mark.parametrize("nproc,args,fragment", [
    (2, [*EP2, "--model.name", "llama3", "--training.local_batch_size", "4"], "Mixture-of-Experts"),
    (2, ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"], "divide dp_shard"),
    (3, ["--parallelism.expert_parallel_degree", "3", "--training.local_batch_size", "2",
         "--training.global_batch_size", "6"], "must divide num_experts 8"),
    (1, [*VARIANT, "--model.name", "moe_top9"], "top_k = 9 of only 8 experts"),
], ids=["ep_on_dense_model", "ep_not_dividing_dp_shard_cp", "ep_not_dividing_experts", "top_k_over_experts"])
def test_bad_expert_layouts(nproc, args, fragment, tmp_path):
    fails_with(run_train([*MOE, *dump_args(tmp_path), *args], nproc=nproc), fragment,
               torchrun=True)


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory, data_cache):
    """100 steps of moe_debug (seq 64, batch 8), with the expert bias and without it (measured:
    last-10 loss 5.87 both; mean max/mean load over steps 51-100: 1.47 with the bias, 2.87 without)."""
    names = ("moe", "moe_nobias")
    dumps = [tmp_path_factory.mktemp(name) for name in names]
    procs = run_trains_side_by_side(
        [["--config", "moe_debug", "--training.seq_len", "64",
          "--training.local_batch_size", "8", "--training.global_batch_size", "8",
          "--job.custom_import", "tests.helpers.variant_models", "--model.name", name,
          *dump_args(dump, data_cache)]
         for name, dump in zip(names, dumps, strict=True)], timeout=900)
    for proc in procs:
        check_ok(proc)
    return {name: train_rows(dump) for name, dump in zip(names, dumps, strict=True)}


def test_moe_debug_learns_and_the_bias_balances_the_load(debug_runs, data_cache):
    floor = unigram_entropy(next(data_cache.glob("train-*.bin")))
    rows = debug_runs["moe"]
    assert len(rows) == 100
    last = sum(r["loss"] for r in rows[-10:]) / 10
    assert last < floor - 0.2, (last, floor)

    def mean_imbalance(run: list[dict]) -> float:
        """max/mean expert load, averaged over layers and the last 50 steps."""
        values = [v for r in run[50:] for v in r["moe_imbalance"].values()]
        return sum(values) / len(values)

    assert mean_imbalance(rows) < mean_imbalance(debug_runs["moe_nobias"])
