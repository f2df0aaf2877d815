"""DeepSeek-V3 in the parallel layouts it supports: the tiny model (multi-head latent attention with
low-rank queries, a dense block, then an MoE block with group-limited routing) under FSDP 2, EP 2,
TP 2 (MLA's plan), PP 2 and CP 2 (values padded to the keys' width), each against one process —
loss and grad norm within 1e-5 relative at step 1 and 1e-4 through step 10, as
tests/e2e/test_parity.py holds Llama, and the same expert loads. Agreement with transformers' own
DeepseekV3ForCausalLM is tests/unit/test_deepseek_v3_hf.py."""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, relative, run_train, train_rows

DEEPSEEK = [*TINY, "--model.name", "deepseek_v3", "--model.flavor", "tiny",
            "--training.global_batch_size", "8"]
HALF = ["--training.local_batch_size", "4"]
LAYOUTS = {
    "fsdp2": HALF,
    "ep2": [*HALF, "--parallelism.expert_parallel_degree", "2"],
    "tp2": [*HALF, "--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """One process, the whole global batch at once (no auxiliary loss: microbatching changes nothing)."""
    dump = tmp_path_factory.mktemp("deepseek_v3_ref")
    check_ok(run_train([*DEEPSEEK, *dump_args(dump, data_cache)]))
    rows = train_rows(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, "the reference run did not learn"
    return rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(layout, reference, tmp_path, data_cache):
    check_ok(run_train([*DEEPSEEK, *LAYOUTS[layout], *dump_args(tmp_path, data_cache)], nproc=2))
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    worst = max(max(relative(g["loss"], r["loss"]), relative(g["grad_norm"], r["grad_norm"]))
                for r, g in zip(reference, rows, strict=True))
    print(f"{layout}: worst relative difference over 10 steps {worst:.1e}")
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (layout, ref["step"], got["loss"], ref["loss"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (
            layout, ref["step"], got["grad_norm"], ref["grad_norm"])
        assert got["moe_load"] == ref["moe_load"], (layout, ref["step"])



# Multi-token prediction (one MTP module, an MoE block): 4 steps per layout, the MTP loss compared too.
MTP = [*DEEPSEEK, "--model.mtp_depth", "1", "--training.steps", "4"]
MTP_LAYOUTS = {name: LAYOUTS[name] for name in ("fsdp2", "ep2", "tp2", "pp2", "cp2")} | {
    # MLA's blocks compiled (with TP's DTensors), and recomputed under activation checkpointing.
    "tp2_compile": [*LAYOUTS["tp2"], "--compile.enable"],
    "fsdp2_ac_full": [*HALF, "--activation_checkpoint.mode", "full"],
}


@pytest.fixture(scope="module")
def mtp_reference(tmp_path_factory, data_cache, reference):
    dump = tmp_path_factory.mktemp("deepseek_v3_mtp_ref")
    proc = run_train([*MTP, *dump_args(dump, data_cache)])
    check_ok(proc)
    assert "multi-token prediction: 1 module, loss weight 0.3" in proc.stdout
    rows = train_rows(dump)
    # The main loss of step 1 is the model's without MTP (same weights); the gradient is not.
    assert rows[0]["loss"] == reference[0]["loss"]
    assert relative(rows[0]["grad_norm"], reference[0]["grad_norm"]) > 1e-3
    assert all(r["mtp_loss"] > 0 for r in rows) and rows[-1]["mtp_loss"] < rows[0]["mtp_loss"]
    return rows


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_mtp_layout_matches_single_process(layout, mtp_reference, tmp_path, data_cache):
    check_ok(run_train([*MTP, *MTP_LAYOUTS[layout], *dump_args(tmp_path, data_cache)], nproc=2))
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for ref, got in zip(mtp_reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert relative(got[key], ref[key]) <= tol, (layout, ref["step"], key, got[key], ref[key])
        assert got["moe_load"] == ref["moe_load"], (layout, ref["step"])
