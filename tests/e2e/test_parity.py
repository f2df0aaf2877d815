"""Layout invariance: every data-parallel layout trains like the single process (docs/architecture.md).

Same config, seed and global batch; per-step loss and grad norm must agree to float32 rounding:
relative difference <= 1e-5 at step 1 and <= 1e-4 through step 10.
"""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, relative, run_train, train_rows

GLOBAL_BATCH = ["--training.global_batch_size", "8"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
DDP2 = ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1"]
RING = ["--parallelism.context_parallel_rotate_method", "ring"]

LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "fsdp4": (4, ["--training.local_batch_size", "2"]),
    "hsdp2x2": (4, ["--training.local_batch_size", "2",
                    "--parallelism.data_parallel_replicate_degree", "2"]),
    "ddp2": (2, DDP2),
    # Gradient accumulation: global 8 as 2 microbatches of 4 on one process, and FSDP 2 × 2 × 2.
    "accum1": (1, ["--training.local_batch_size", "4"]),
    "fsdp2_accum": (2, ["--training.local_batch_size", "2"]),
    # DDP (HSDP with shard degree 1) composed with TP, PP and CP.
    "ddp2_tp2": (4, [*DDP2, "--parallelism.tensor_parallel_degree", "2"]),
    "ddp2_pp2": (4, [*DDP2, "--parallelism.pipeline_parallel_degree", "2"]),
    "ddp2_cp2": (4, [*DDP2, *CP2]),
    "ddp2_accum": (2, ["--training.local_batch_size", "2",
                       "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "1"]),
    # Tensor parallel (sequence + loss parallel), alone and composed.
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp2_no_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2",
                                 "--parallelism.disable_loss_parallel"]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "tp2_ac_full": (2, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
    "tp2_ac_selective": (2, ["--parallelism.tensor_parallel_degree", "2",
                             "--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"]),
    # Context parallel (head-tail sharded sequence), both rotate methods, alone and composed.
    "cp2_allgather": (2, [*CP2]),
    "cp2_ring": (2, [*CP2, *RING]),
    "cp4_ring": (4, ["--parallelism.context_parallel_degree", "4", *RING]),
    "fsdp2_cp2": (4, [*CP2, "--training.local_batch_size", "4"]),
    "tp2_cp2_ring": (4, [*CP2, "--parallelism.tensor_parallel_degree", "2", *RING]),
    "pp2_cp2": (4, [*CP2, "--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable"]),
    "tp2_compile": (2, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable"]),
    "fsdp2_tp2_compile": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                              "--compile.enable"]),
}
# The gloo accelerations (parallelisms/gloo_accelerations.py): every row above runs torch's own
# collectives, the GPU users' path; these run the opt-in gloo ones, and must say so at start-up.
GLOO_ACC = ["--comm.gloo_accelerations"]
ACCELERATED = {
    "fsdp2_gloo_acc": (LAYOUTS["fsdp2"], "FSDP broadcast all-gather"),
    "hsdp2x2_gloo_acc": (LAYOUTS["hsdp2x2"], "FSDP broadcast all-gather"),
    "tp2_gloo_acc": (LAYOUTS["tp2"], "none apply"),
    "cp2_allgather_gloo_acc": (LAYOUTS["cp2_allgather"], "CP overlapped K/V gather"),
    "fsdp2_tp2_gloo_acc": (LAYOUTS["fsdp2_tp2"], "FSDP broadcast all-gather"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The single-process run all layouts are compared with."""
    dump = tmp_path_factory.mktemp("ref")
    check_ok(run_train([*TINY, *GLOBAL_BATCH, *dump_args(dump, data_cache)]))
    return train_rows(dump)


@pytest.mark.parametrize("layout", [*LAYOUTS, *ACCELERATED])
def test_layout_matches_single_process(layout, reference, tmp_path, data_cache):
    (nproc, args), said = (ACCELERATED[layout][0], ACCELERATED[layout][1]) if layout in ACCELERATED else (
        LAYOUTS[layout], None)
    proc = run_train([*TINY, *GLOBAL_BATCH, *args, *(GLOO_ACC if said else []),
                      *dump_args(tmp_path, data_cache)], nproc=nproc)
    check_ok(proc)
    comm = [line for line in proc.stdout.splitlines() if line.startswith("comm    gloo accelerations:")]
    assert (comm and said in comm[0]) if said else not comm, comm
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.2, "the reference run did not learn"
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (layout, ref["step"], got["loss"], ref["loss"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (
            layout, ref["step"], got["grad_norm"], ref["grad_norm"])
        # Measured, not a formula: the labels the loss averaged over, summed over every rank
        # (a layout that drops or repeats rows or sequence chunks counts another number).
        assert got["loss_tokens"] == ref["loss_tokens"] == 8 * 64, (layout, ref["step"], got["loss_tokens"])


def test_tied_embeddings_fsdp_matches_single_process(tmp_path, data_cache):
    """Tied weights (Llama 3.2 1B/3B style) stay tied through meta → FSDP → to_empty."""
    tied = ["--job.custom_import", "tests.helpers.variant_models", "--model.name", "llama3_tied"]
    runs = {}
    for nproc in (1, 2):
        dump = tmp_path / f"n{nproc}"
        proc = run_train([*TINY, *GLOBAL_BATCH, *tied, "--training.local_batch_size", str(8 // nproc),
                          *dump_args(dump, data_cache)],
                         nproc=nproc)
        check_ok(proc)
        # One shared matrix: 4096 × 64 fewer parameters than the untied tiny model (0.62M).
        assert "0.36M parameters" in proc.stdout
        runs[nproc] = train_rows(dump)
    for ref, got in zip(runs[1], runs[2], strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.2


def test_fsdp_accumulation_holds_only_sharded_gradients(tmp_path, data_cache):
    """Between microbatches FSDP 2 holds only its half of the gradients (reduce-scatter on every
    microbatch): the live tensors grow by half the full fp32 gradient size over the first
    microbatch. FSDP2's no-sync mode, measured the same way, holds the full size."""
    proc = run_train([*TINY, "--training.local_batch_size", "2", *GLOBAL_BATCH,
                      *dump_args(tmp_path, data_cache)],
                     nproc=2, script="tests/helpers/accumulation_memory.py")
    check_ok(proc)
    grown = {line.split()[0]: (int(line.split()[2]), int(line.split()[4]))
             for line in proc.stdout.splitlines() if " grown " in line}
    kiln, full = grown["kiln"]
    assert 0.45 * full <= kiln <= 0.55 * full, grown
    assert grown["no_sync"][0] >= 0.95 * full, grown


# An odd shape (dim 96, 3 heads, 5 layers, vocabulary 4098, seq 60): FSDP shards that need padding
# (a 256-unit feed-forward over 3 ranks), 5 layers in 3 uneven pipeline stages, and TP over 3 ranks
# (with a 264-unit feed-forward, which 3 divides) — none of which a power-of-two shape tests.
ODD = [*TINY, "--job.custom_import", "tests.helpers.variant_models", "--training.seq_len", "60",
       "--training.global_batch_size", "12", "--training.local_batch_size", "4"]
ODD_LAYOUTS = {
    "fsdp3": (3, "llama3_odd", []),
    "tp3": (3, "llama3_odd_tp", ["--parallelism.tensor_parallel_degree", "3"]),
    "pp3": (3, "llama3_odd", ["--parallelism.pipeline_parallel_degree", "3",
                              "--parallelism.pipeline_parallel_microbatch_size", "4"]),
}


@pytest.fixture(scope="module")
def odd_reference(tmp_path_factory, data_cache):
    """model name → its single-process rows (run once per model of the module)."""
    runs: dict[str, list[dict]] = {}

    def rows(model: str) -> list[dict]:
        if model not in runs:
            dump = tmp_path_factory.mktemp(f"ref_{model}")
            check_ok(run_train([*ODD, "--model.name", model, *dump_args(dump, data_cache)]))
            runs[model] = train_rows(dump)
        return runs[model]
    return rows


@pytest.mark.parametrize("layout", list(ODD_LAYOUTS))
def test_odd_shape_matches_single_process(layout, odd_reference, tmp_path, data_cache):
    nproc, model, args = ODD_LAYOUTS[layout]
    check_ok(run_train([*ODD, "--model.name", model, *args, *dump_args(tmp_path, data_cache)], nproc=nproc))
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    for ref, got in zip(odd_reference(model), rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (layout, ref["step"], got["loss"], ref["loss"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (layout, ref["step"])
