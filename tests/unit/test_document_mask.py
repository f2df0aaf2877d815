"""Document masking on one process: a packed window computes as if its documents were separate.
That it trains the same in every layout is tests/e2e/test_document_mask_runs.py."""

import torch
import torch.nn.functional as F

from tests.helpers.runs import tiny_llama

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
