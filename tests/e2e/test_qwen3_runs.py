"""Qwen3 in the parallel layouts: the tiny dense model under FSDP 2, TP 2 (the QK-norms on each
rank's heads; also compiled, and with selective activation checkpointing), PP 2 and CP 2, and the
tiny MoE model under EP 2, FSDP 2 and TP 2, each against one process — loss and grad norm within
1e-5 relative at step 1 and 1e-4 through step 10, as tests/e2e/test_parity.py holds Llama.
Agreement with transformers' own Qwen3 is tests/unit/test_qwen3_hf.py.

The MoE model's auxiliary loss is computed per microbatch (per rank's rows), so its reference takes
the global batch of 8 as two microbatches of 4: the rows each rank of a 2-way layout holds.
"""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, relative, run_train, train_rows

QWEN3 = [*TINY, "--model.name", "qwen3", "--training.global_batch_size", "8"]
DENSE = [*QWEN3, "--model.flavor", "tiny"]
MOE = [*QWEN3, "--model.flavor", "moe_tiny"]
HALF = ["--training.local_batch_size", "4"]

DENSE_LAYOUTS = {
    "fsdp2": HALF,
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    # The QK-norms' DTensors inside compiled attention, and recomputed under activation checkpointing.
    "tp2_compile": ["--parallelism.tensor_parallel_degree", "2", "--compile.enable"],
    "tp2_ac_selective": ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode",
                         "selective", "--activation_checkpoint.selective_ac_option", "op"],
}
MOE_LAYOUTS = {
    "ep2": [*HALF, "--parallelism.expert_parallel_degree", "2"],
    "fsdp2": HALF,
    "tp2": [*HALF, "--parallelism.tensor_parallel_degree", "2"],
}


def _reference(args, tmp_path_factory, data_cache, name):
    dump = tmp_path_factory.mktemp(name)
    check_ok(run_train([*args, *dump_args(dump, data_cache)]))
    rows = train_rows(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, "the reference run did not learn"
    return rows


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory, data_cache):
    """One process, the whole global batch at once."""
    return _reference(DENSE, tmp_path_factory, data_cache, "qwen3_ref")


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, data_cache):
    """One process, the global batch as two microbatches of 4 (see the module docstring)."""
    return _reference([*MOE, *HALF], tmp_path_factory, data_cache, "qwen3_moe_ref")


def _assert_parity(reference, rows, layout):
    assert [r["step"] for r in rows] == list(range(1, 11))
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (layout, ref["step"], got["loss"], ref["loss"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (
            layout, ref["step"], got["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_dense_layout_matches_single_process(layout, dense_reference, tmp_path, data_cache):
    check_ok(run_train([*DENSE, *DENSE_LAYOUTS[layout], *dump_args(tmp_path, data_cache)], nproc=2))
    _assert_parity(dense_reference, train_rows(tmp_path), layout)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_layout_matches_single_process(layout, moe_reference, tmp_path, data_cache):
    check_ok(run_train([*MOE, *MOE_LAYOUTS[layout], *dump_args(tmp_path, data_cache)], nproc=2))
    rows = train_rows(tmp_path)
    _assert_parity(moe_reference, rows, layout)
    for ref, got in zip(moe_reference, rows, strict=True):
        assert got["moe_load"] == ref["moe_load"], (layout, ref["step"])
