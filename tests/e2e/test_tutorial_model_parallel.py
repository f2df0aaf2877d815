"""The model-parallel and pipeline-parallel walkthroughs: run as a user would, check what they computed."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch.nn.functional as F

from tests.helpers.runs import REPO, check_ok

TUTORIAL = REPO / "scripts" / "tutorial"
NUM = r"([-+\d.e]+)"


def load(name: str):
    """Import a tutorial script as a module (to rebuild its seeded model and data on one process)."""
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", TUTORIAL / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, *args: str) -> str:
    """Run scripts/tutorial/<name>.py with args; return its stdout after checking it exited 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(TUTORIAL / f"{name}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    check_ok(proc)
    return proc.stdout


@pytest.mark.parametrize("widths,batch_sizes", [([4, 16, 8, 3], [5, 3]), ([4, 16, 3], [2, 6])])
def test_model_parallel_matches_one_process(widths, batch_sizes):
    args = ["--batch-sizes", ",".join(map(str, batch_sizes))]
    if widths != [4, 16, 8, 3]:
        args += ["--widths", ",".join(map(str, widths))]
    out = run("model_parallel", *args)
    world = len(widths) - 1
    mp = load("model_parallel")

    for step, batch in enumerate(batch_sizes):
        section = out.split(f"-- batch {step}:")[1].split("-- ")[0]
        # Every rank reported, in rank order; each received the header for its own input shape.
        ranks = [int(r) for r in re.findall(r"^rank (\d+): ", section, flags=re.M)]
        assert ranks == list(range(world)), section
        for r in range(1, world):
            assert f"rank {r}: header from rank {r - 1}: ndim 2, shape [{batch}, {widths[r]}]" in section
        # The loss the last rank printed is the loss of the same model and batch computed here.
        model = mp.build_model(widths)
        x, labels = mp.make_batch(batch, widths, step)
        expected = F.cross_entropy(model(x), labels).item()
        (loss, ref, diff), = re.findall(rf"check: batch {step} loss {NUM} matches one process {NUM} "
                                        rf"\(max abs diff {NUM}\)", section)
        assert abs(float(loss) - expected) < 1e-5 and abs(float(ref) - expected) < 1e-5
        assert float(diff) <= 1e-6
        grads = re.findall(rf"check: batch {step} stage (\d+) gradients match one process "
                           rf"\(max abs diff {NUM}\)", section)
        assert [int(s) for s, _ in grads] == list(range(world))
        assert all(float(d) <= 1e-6 for _, d in grads)
        (logit_diff,) = re.findall(rf"check: batch {step} logits match one process \(max abs diff {NUM}\)",
                                   section)
        assert float(logit_diff) <= 1e-6

    # Forward goes up the ranks, backward comes down, one rank at a time.
    one_batch = [f"F{r}" for r in range(world)] + [f"B{r}" for r in reversed(range(world))]
    (timeline,) = re.findall(r"^timeline: (.*)$", out, flags=re.M)
    assert timeline.split() == one_batch * len(batch_sizes)
    assert "overlapping compute intervals: 0" in out


@pytest.mark.parametrize("nproc", [2, 4])
def test_pipeline_gpipe_by_hand_and_torch(nproc):
    n_mb, batch, hidden = 4, 8, 8
    out = run("pipeline_parallel", "--nproc", str(nproc))
    pp = load("pipeline_parallel")

    # (a) each stage ran GPipe: all forwards in order, then all backwards in reverse order.
    orders = re.findall(r"^stage (\d+) \(blocks? [\d-]+\) order: (.*)$", out, flags=re.M)
    assert [int(s) for s, _ in orders] == list(range(nproc))
    gpipe = [f"F{m}" for m in range(n_mb)] + [f"B{m}" for m in reversed(range(n_mb))]
    assert all(order.split() == gpipe for _, order in orders)

    # The timeline: stage s does forward m in slot s+m, the backwards mirror it; the idle share is the
    # GPipe bubble (N-1)/(M+N-1).
    rows = re.findall(r"^stage (\d+) +((?:\s+(?:[FB]\d+|\.))+)\s*$", out, flags=re.M)
    assert len(rows) == nproc
    slots = 2 * (n_mb + nproc - 1)
    for s, cells in rows:
        s, cells = int(s), cells.split()
        assert len(cells) == slots
        for m in range(n_mb):
            assert cells[int(s) + m] == f"F{m}"
            assert cells[slots - 1 - s - m] == f"B{m}"
        assert cells.count(".") == 2 * (nproc - 1)
    (measured, formula), = re.findall(
        rf"bubble fraction: measured {NUM}, \(N-1\)/\(M\+N-1\) = .* = {NUM};", out)
    bubble = (nproc - 1) / (n_mb + nproc - 1)
    assert abs(float(measured) - bubble) < 1e-4 and abs(float(formula) - bubble) < 1e-4

    # Both parts: the full-batch loss equals the one computed here, every stage's gradients match.
    model = pp.build_model(hidden)
    x, y = pp.make_data(batch, hidden)
    expected = F.mse_loss(model(x), y).item()
    for part in ("(a)", "(b)"):
        p = re.escape(part)
        (loss, ref, diff), = re.findall(rf"check: {p} loss {NUM} \(.*\) matches one process {NUM} "
                                        rf"\(max abs diff {NUM}\)", out)
        assert abs(float(loss) - expected) < 1e-6 * expected and abs(float(ref) - expected) < 1e-6 * expected
        assert float(diff) <= 1e-6 * expected
        grads = re.findall(rf"check: {p} stage (\d+) gradients \((\d+) tensors\) match one process "
                           rf"\(max abs diff {NUM}, max relative diff {NUM}\)", out)
        assert [int(s) for s, *_ in grads] == list(range(nproc))
        assert sum(int(n) for _, n, *_ in grads) == 2 * pp.N_BLOCKS  # a weight and a bias per block
        assert all(float(a) <= 1e-6 and float(r) <= 1e-5 for _, _, a, r in grads)

    # (b) pipeline() cut the model where asked: stage s holds exactly its blocks, under their own names.
    held = re.findall(r"^stage (\d+) holds \[(.*)\]$", out, flags=re.M)
    per = pp.N_BLOCKS // nproc
    for s, names in held:
        blocks = {int(b) for b in re.findall(r"'blocks\.(\d+)\.", names)}
        assert blocks == set(range(int(s) * per, (int(s) + 1) * per))
    assert len(held) == nproc
