"""Document masking: a packed window trains as if its documents were separate, in every layout."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, check_ok, fails_with, run_train, tiny_llama, train_rows

BOS = 1


def tiny_model() -> torch.nn.Module:
    model = tiny_llama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wq.weight", "wk.weight")):
                p.normal_(0.0, 0.3)  # sharp attention: a leak across documents shows
    return model.eval()


def test_packed_window_equals_its_documents_run_separately():
    """With the mask and positions restarting, the logits (and so the summed loss) of a window
    holding a document's tail and two whole documents are those of the three pieces run alone."""
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randint(10, 4000, (n,), generator=gen) for n in (5, 9, 7)]
    pieces[1][0] = pieces[2][0] = BOS  # whole documents start with BOS; the first is a tail
    window = torch.cat(pieces).unsqueeze(0)
    model = tiny_model()
    with torch.no_grad():
        separate = torch.cat([model(p.unsqueeze(0)) for p in pieces], dim=1)
        model.document_bos_id, model.restart_positions = BOS, True
        packed = model(window)
        model.restart_positions = False
        masked_only = model(window)
        model.document_bos_id = None
        plain = model(window)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    labels = torch.randint(0, 4096, window.shape, generator=gen)
    loss = F.cross_entropy(packed.flatten(0, 1), labels.flatten(), reduction="sum")
    parts = sum(F.cross_entropy(p, labels[0, i:j], reduction="sum") for p, i, j in
                zip(separate[0].split([5, 9, 7]), (0, 5, 14), (5, 14, 21), strict=True))
    torch.testing.assert_close(loss, parts, atol=1e-3, rtol=1e-5)
    assert (plain[:, 5:] - separate[:, 5:]).abs().max() > 1e-3  # without the mask, documents mix
    # RoPE scores depend on position differences only, so without the restart the result is the
    # same up to rounding (the restart keeps positions small; it does not change the maths).
    torch.testing.assert_close(masked_only, separate, atol=1e-4, rtol=1e-4)


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
        check_ok(run_train([*base, *extra, "--job.dump_folder", str(tmp_path / name)], nproc=nproc))
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
    fails_with(run_train([*TINY, "--job.dump_folder", str(tmp_path), *args], nproc=nproc), fragment,
               torchrun=nproc > 1)
