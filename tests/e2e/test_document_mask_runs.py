"""Document masking: a packed window trains as if its documents were separate, in every layout (the
window itself on one process: tests/unit/test_document_mask.py)."""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, run_train, train_rows


def test_document_mask_matches_across_layouts(tmp_path, data_cache):
    """The masked run (positions restarting) is layout-invariant like any other, and differs from
    the unmasked one."""
    # 256-token windows: most steps' batches hold a document boundary (scenes are ~2k tokens).
    base = [*TINY, "--training.steps", "5", "--training.global_batch_size", "8", "--training.seq_len", "256",
            "--training.data_cache_dir", str(data_cache)]
    masked = ["--training.document_mask", "--training.document_positions_restart"]
    runs = {}
    for name, nproc, extra in (("plain", 1, []), ("single", 1, masked),
                               ("fsdp2", 2, [*masked, "--training.local_batch_size", "4"]),
                               ("tp2", 2, [*masked, "--parallelism.tensor_parallel_degree", "2"])):
        check_ok(run_train([*base, *extra, *dump_args(tmp_path / name)], nproc=nproc))
        runs[name] = train_rows(tmp_path / name)
    for name in ("fsdp2", "tp2"):
        for ref, got in zip(runs["single"], runs[name], strict=True):
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (name, ref["step"])
            assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (name, ref["step"])
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["plain"], runs["single"], strict=True)) > 1e-4


@pytest.mark.parametrize("nproc,args,fragment", [
    (1, ["--training.document_positions_restart"], "needs training.document_mask"),
    (2, ["--training.document_mask", "--parallelism.context_parallel_degree", "2"], "pipeline or context"),
], ids=["restart_without_mask", "with_cp"])
def test_bad_document_mask_input(nproc, args, fragment, tmp_path):
    fails_with(run_train([*TINY, *dump_args(tmp_path), *args], nproc=nproc), fragment,
               torchrun=nproc > 1)
