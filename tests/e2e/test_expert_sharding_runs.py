"""Row-sharded experts (fewer local experts than FSDP ranks: each expert's rows are sharded, see
tests/unit/test_expert_sharding.py) train like one process."""

from tests.helpers.runs import TINY, check_ok, dump_args, read_metrics, run_train

MOE2 = [*TINY, "--job.custom_import", "tests.helpers.variant_models", "--model.name", "moe_2experts",
        "--training.global_batch_size", "8"]


def test_row_sharded_experts_match_one_process(tmp_path, data_cache):
    """EP 2 over 4 ranks with 2 experts (one per EP rank, rows over 2 FSDP ranks) trains like one
    process: loss and grad norm to float32 rounding, the same expert loads."""
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("ep2", 4, ["--training.local_batch_size", "2",
                                                            "--parallelism.expert_parallel_degree", "2"])):
        dump = tmp_path / name
        check_ok(run_train([*MOE2, *extra, *dump_args(dump, data_cache)], nproc=nproc))
        runs[name] = read_metrics(dump)
    for ref, got in zip(runs["one"], runs["ep2"], strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert abs(got["loss"] - ref["loss"]) <= tol * ref["loss"], ref["step"]
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= tol * ref["grad_norm"], ref["step"]
        assert got["moe_load"] == ref["moe_load"], ref["step"]
