"""The DeviceMesh and fully_shard walkthroughs: groups, averaged replicas, shards and the one-process step."""

import ast
import itertools
import math
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO, check_ok

TUTORIAL = REPO / "scripts" / "tutorial"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_script(name: str, *args: str) -> str:
    """Run a walkthrough as a user would; its stdout, after checking it exited 0."""
    proc = subprocess.run([sys.executable, str(TUTORIAL / name), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=240)
    check_ok(proc)
    return proc.stdout


def section(out: str, header: str) -> str:
    """The text from the `== <header>` line up to the next `==` header."""
    start = out.index(f"== {header}")
    end = out.find("\n== ", start + 1)
    return out[start:] if end < 0 else out[start:end]


def expected_groups(shape: tuple[int, ...]) -> tuple[dict, dict]:
    """From the mesh shape alone (row-major: rank = sum of coordinate x stride), every rank's coordinate
    and, per dim, its group: the ranks reached by moving along that dim only."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    coords = {}
    for coord in itertools.product(*(range(n) for n in shape)):
        coords[sum(c * s for c, s in zip(coord, strides, strict=True))] = coord
    groups = {}
    for rank, coord in coords.items():
        for d in range(len(shape)):
            base = rank - coord[d] * strides[d]
            groups[rank, d] = [base + i * strides[d] for i in range(shape[d])]
    return coords, groups


def check_mesh_table(text: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """The per-rank table and the list of distinct groups match the groups derived from the shape."""
    coords, groups = expected_groups(shape)
    rows = re.findall(r"^\s+(\d+)\s+\(([\d, ]+)\)\s+(.*)$", text, flags=re.M)
    assert [int(r) for r, _, _ in rows] == list(range(math.prod(shape))), text
    for rank, coord, cells in rows:
        rank = int(rank)
        assert tuple(int(c) for c in coord.split(",")) == coords[rank]
        printed = [ast.literal_eval(cell) for cell in re.findall(r"\[[\d, ]*\]", cells)]
        assert printed == [groups[rank, d] for d in range(len(shape))], (rank, printed)
    listed = re.findall(r"^  dim (\w+): group \d+: ranks (\[[\d, ]*\])$", text, flags=re.M)
    expected = {(names[d], tuple(groups[r, d])) for r in coords for d in range(len(shape))}
    assert len(listed) == len(expected)
    assert {(name, tuple(ast.literal_eval(ranks))) for name, ranks in listed} == expected
    assert f"\n{len(expected)} process groups in all\n" in text


@pytest.fixture(scope="module", params=[("2,4", "2,2,2"), ("2,2", "1,2,2")], ids=["8ranks", "4ranks"])
def mesh_run(request) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """device_mesh.py's output, with the two mesh shapes it was given."""
    shape_2d, shape_3d = request.param
    out = run_script("device_mesh.py", "--mesh-2d", shape_2d, "--mesh-3d", shape_3d)
    return out, ast.literal_eval(shape_2d + ","), ast.literal_eval(shape_3d + ",")


def test_mesh_groups(mesh_run):
    out, shape_2d, shape_3d = mesh_run
    check_mesh_table(section(out, "2-D mesh"), shape_2d, ("replicate", "model_parallel"))
    check_mesh_table(section(out, "exercise: 3-D mesh"), shape_3d, ("dp", "pp", "tp"))
    if shape_2d == (2, 4):  # the chapter's six groups, spelled out
        text = section(out, "2-D mesh")
        for ranks in ("[0, 1, 2, 3]", "[4, 5, 6, 7]", "[0, 4]", "[1, 5]", "[2, 6]", "[3, 7]"):
            assert re.search(rf"group \d+: ranks {re.escape(ranks)}$", text, flags=re.M), ranks
    n2, n3 = sum(shape_2d), sum(math.prod(shape_3d) // n for n in shape_3d)
    assert f"check: 2-D mesh: each of the {n2} groups" in out
    assert f"check: 3-D mesh: each of the {n3} groups" in out


def test_mesh_replicas_averaged(mesh_run):
    out, (n_replicas, n_parts), _ = mesh_run
    text = section(out, "average the replicas")
    lines = re.findall(r"^rank (\d+) \(replica (\d+), part (\d+), weight \((\d+), (\d+)\)\): "
                       r"row 0 before (\[.*?\]) after (\[.*?\])$", text, flags=re.M)
    assert [int(x[0]) for x in lines] == list(range(n_replicas * n_parts))  # printed in rank order
    before, after, widths = {}, {}, {}
    for rank, replica, part, w_out, w_in, b, a in lines:
        rank, replica, part = int(rank), int(replica), int(part)
        assert (replica, part) == divmod(rank, n_parts)
        before[replica, part], after[replica, part] = ast.literal_eval(b), ast.literal_eval(a)
        widths.setdefault(part, set()).add((int(w_in), int(w_out)))
    for part in range(n_parts):
        copies = [before[r, part] for r in range(n_replicas)]
        assert all(c != copies[0] for c in copies[1:])  # the replicas really did start different
        mean = [sum(col) / n_replicas for col in zip(*copies, strict=True)]
        for r in range(n_replicas):
            assert after[r, part] == pytest.approx(mean, abs=2e-6)  # 6 printed decimals
    check = re.search(r"^check: averaged over replicate, every part equals the mean its rank computed itself "
                      r"\(max abs diff ([\d.e+-]+)\) and its replicas agree \(max abs diff ([\d.e+-]+)\)$",
                      text, flags=re.M)
    assert check and float(check[1]) <= 1e-6 and float(check[2]) == 0.0

    # The model-parallel all_gather: one line per replica (from its first part), the parts' shapes chaining.
    gathered = re.findall(r"^replica (\d+) \(rank (\d+)\) all_gathered over model_parallel: (.*)$",
                          section(out, "a collective inside each replica"), flags=re.M)
    assert [(int(r), int(k)) for r, k, _ in gathered] == [(r, r * n_parts) for r in range(n_replicas)]
    for _, _, chain in gathered:
        parts = re.findall(r"part (\d+): \[(\d+), (\d+)\] -> \[(\d+), (\d+)\]", chain)
        assert [int(p[0]) for p in parts] == list(range(n_parts))
        for part, b_in, w_in, b_out, w_out in parts:
            assert b_in == b_out and widths[int(part)] == {(int(w_in), int(w_out))}
        assert all(p[4] == q[2] for p, q in itertools.pairwise(parts))


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def fsdp_run(request) -> tuple[str, int]:
    """fully_shard_demo.py's output and its world size."""
    return run_script("fully_shard_demo.py", "--world", str(request.param)), request.param


def test_fully_shard_shards(fsdp_run):
    out, world = fsdp_run
    tables = re.split(r"^rank (\d+):$", section(out, "fully_shard over a 1-D mesh"), flags=re.M)
    assert [int(r) for r in tables[1::2]] == list(range(world))  # printed in rank order
    first = None
    for table in tables[2::2]:
        params = re.findall(r"^  (\S+)\s+global (\([\d, ]+\))\s+\(Shard\(dim=0\),\)\s+local (\([\d, ]+\))$",
                            table, flags=re.M)
        shapes = {name: (ast.literal_eval(g), ast.literal_eval(loc)) for name, g, loc in params}
        assert len(shapes) == len(params) >= 2
        for glob, local in shapes.values():
            assert local[0] * world == glob[0] and local[1:] == glob[1:]  # first dim split world ways
        weights = [shapes[n][0] for n in shapes if n.endswith(".weight")]
        assert all(a[0] == b[1] for a, b in itertools.pairwise(weights))  # an MLP: the layers chain
        kept, full = map(int, re.search(r"memory: keeps (\d+) B of the full model's (\d+) B", table).groups())
        assert kept == 4 * sum(math.prod(loc) for _, loc in shapes.values())  # float32
        assert full == 4 * sum(math.prod(g) for g, _ in shapes.values()) == kept * world
        assert first in (None, shapes)  # every rank holds same-shaped shards
        first = shapes

    # Inside each layer's forward the weight is the all-gathered full tensor; right after, a shard again.
    step = section(out, "one training step")
    layers = [n[: -len(".weight")] for n in first if n.endswith(".weight")]
    for name in layers:
        glob, local = first[f"{name}.weight"]
        assert f"  {name} forward starts: weight is plain tensor {glob}" in step
        assert f"  {name} forward done:   weight is DTensor {glob}, local shard {local}" in step
    counts = re.search(r"forward (\d+) all-gathers, (\d+) reduce-scatters; backward (\d+) all-gathers, "
                       r"(\d+) reduce-scatters", step)
    # One all-gather per layer in forward; each was resharded after forward, so backward gathers again and
    # reduce-scatters one gradient per layer.
    assert tuple(map(int, counts.groups())) == (len(layers), 0, len(layers), len(layers))
    grads = dict(re.findall(r"(\S+) (\([\d, ]+\))", step.split("gradient shards kept on rank 0: ")[1]))
    assert {n: ast.literal_eval(s) for n, s in grads.items()} == {n: loc for n, (_, loc) in first.items()}


def test_fully_shard_matches_one_process(fsdp_run):
    out, _ = fsdp_run
    text = section(out, "compare with one process")
    losses = re.search(r"loss: FSDP \(mean over ranks\) ([\d.]+), one process ([\d.]+)", text)
    fsdp_loss, one_loss = map(float, losses.groups())
    assert fsdp_loss == one_loss
    per_param = [float(d) for d in re.findall(r"^  \S+\s+max abs diff ([\d.e+-]+)$", text, flags=re.M)]
    assert len(per_param) >= 2 and max(per_param) <= 1e-6
    check = re.search(r"^check: parameters after one FSDP step \(full_tensor\) equal one process trained on "
                      r"the whole batch \(max abs diff ([\d.e+-]+)\)$", text, flags=re.M)
    assert check and float(check[1]) == max(per_param)
    grad = re.search(r"^check: gradient shards equal the row blocks of the whole-batch gradient "
                     r"\(max abs diff ([\d.e+-]+) over all ranks\)$", text, flags=re.M)
    assert grad and float(grad[1]) <= 1e-6
