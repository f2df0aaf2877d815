"""Section 16.4 walkthroughs: gradient averaging from scratch against DDP, and DDP + DistributedSampler on
MNIST (read by torchvision from a small fixture in MNIST's own file format)."""

import json
import os
import re
import subprocess
import sys
import zlib
from collections import Counter
from itertools import accumulate

import numpy as np
import pytest

from tests.helpers.mnist_fixture import write_mnist_fixture
from tests.helpers.runs import REPO, check_ok

DP = REPO / "scripts" / "tutorial" / "dp_from_scratch.py"
MNIST = REPO / "scripts" / "tutorial" / "ddp_mnist.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
NUM = r"[-+]?\d+\.?\d*(?:e[-+]?\d+)?"


def run(args: list[str], nproc: int = 0, timeout: int = 120) -> subprocess.CompletedProcess:
    """Launch a tutorial script as a user would: plain python (it spawns its world) or torchrun (nproc)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc else [sys.executable])
    proc = subprocess.run([*launcher, *map(str, args)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    check_ok(proc)
    return proc


# ---------------------------------------------------------------- dp_from_scratch.py

def param_bytes(width: int = 16, classes: int = 4, layers: int = 6) -> list[int]:
    """Bytes of the script's parameters in model order (weight, bias per Linear), float32."""
    sizes = []
    for i in range(layers):
        out = classes if i == layers - 1 else width
        sizes += [4 * width * out, 4 * out]
    return sizes


def buckets_at_most(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices, last first, in buckets never over cap (the rule the script implements)."""
    buckets, total = [[]], 0
    for i in reversed(range(len(sizes))):
        if buckets[-1] and total + sizes[i] > cap:
            buckets, total = [*buckets, []], 0
        buckets[-1].append(i)
        total += sizes[i]
    return buckets


def buckets_closing_at_cap(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices, last first, a bucket closing as soon as it reaches cap (DDP's rule)."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets, current, total = [*buckets, current], [], 0
    return buckets + ([current] if current else [])


def parse_layout(line: str) -> list[tuple[list[int], int]]:
    """`[11 10 9] 1360 B | [8] 1024 B` -> [([11, 10, 9], 1360), ([8], 1024)]."""
    found = re.findall(r"\[([\d ]+)\] (\d+) B", line)
    return [([int(i) for i in ids.split()], int(size)) for ids, size in found]


def line_after(out: str, prefix: str) -> str:
    """The rest of the single output line starting with prefix."""
    found = [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, out)
    return found[0]


@pytest.mark.parametrize("world,cap_kb,steps", [(2, 2, 3), (3, 4, 2)])
def test_dp_from_scratch_agrees_with_ddp(world, cap_kb, steps):
    out = run([DP, "--world-size", world, "--bucket-cap-kb", cap_kb, "--steps", steps]).stdout
    sizes = param_bytes()
    ours = buckets_at_most(sizes, cap_kb * 1024)
    ddps = buckets_closing_at_cap(sizes, cap_kb * 1024)
    assert len(ours) > 1 and len(ddps) > 1  # several buckets each way

    # The local gradients differ per rank; after averaging every rank holds their mean.
    blocks = re.findall(r"^rank (\d+): last bias grad, local\s+\[(.*)\]\n\s+averaged by \(a\)\s+\[(.*)\]$",
                        out, flags=re.M)
    assert [int(r) for r, _, _ in blocks] == list(range(world))  # printed in rank order
    local = np.array([[float(v) for v in loc.split(",")] for _, loc, _ in blocks])
    averaged = np.array([[float(v) for v in avg.split(",")] for _, _, avg in blocks])
    assert np.abs(local - local[0]).max() > 1e-3  # the ranks really saw different data
    assert np.abs(averaged - local.mean(axis=0)).max() < 2e-6

    # Bucket layouts, recomputed here from the parameter sizes.
    assert parse_layout(line_after(out, "our buckets")) == [(b, sum(sizes[i] for i in b)) for b in ours]
    assert parse_layout(line_after(out, "DDP's buckets, first backward:")) == [
        (list(range(len(sizes))), sum(sizes))]
    assert parse_layout(line_after(out, "DDP's buckets, rebuilt")) == [
        (b, sum(sizes[i] for i in b)) for b in ddps]
    # (c) launches bucket k once its gradients (and every earlier bucket's) have arrived, mostly mid-backward.
    launched = re.search(r"launched its buckets after \[([\d, ]+)\] of (\d+)", out)
    assert [int(v) for v in launched.group(1).split(",")] == list(accumulate(len(b) for b in ours))
    assert int(launched.group(2)) == len(sizes)

    rows = {m: (int(c), int(s), float(d)) for m, c, s, d in re.findall(
        rf"^\(([abc])\) [^\n]*?\s(\d+)\s+(\d+)\s+({NUM})$", out, flags=re.M)}
    assert rows.keys() == {"a", "b", "c"}
    assert rows["a"][:2] == (len(sizes), len(sizes))
    assert rows["b"][:2] == rows["c"][:2] == (len(ours), len(ours))
    assert all(d <= 1e-6 for _, _, d in rows.values())
    ddp_rows = re.findall(r"^DDP, (first backward|buckets rebuilt)\s+-\s+(\d+)\s+reference$", out, flags=re.M)
    assert ddp_rows == [("first backward", "1"), ("buckets rebuilt", str(len(ddps)))]

    train = re.findall(rf"^\s+(\d+)\s+({NUM})\s+(\d+)\s+(.*?)\s+({NUM})$", out, flags=re.M)
    assert [int(s) for s, *_ in train] == list(range(1, steps + 1))
    assert all(int(calls) == len(ours) and float(diff) <= 1e-6 for _, _, calls, _, diff in train)
    ddp_ops = [ops for *_, ops, _ in train]
    assert ddp_ops[0] == "1 allreduce_"  # one bucket before DDP has seen a backward
    assert ddp_ops[1] == f"{len(ddps)} allreduce_, 2 broadcast_"  # rank 0 shares the rebuilt layout
    assert all(ops == f"{len(ddps)} allreduce_" for ops in ddp_ops[2:])

    checks = re.findall(rf"^check: .* matches \(max abs diff ({NUM})\)$", out, flags=re.M)
    assert len(checks) == 6 and all(float(d) <= 1e-6 for d in checks)


# ---------------------------------------------------------------- ddp_mnist.py

def crc_of(indices: list[int]) -> str:
    """The CRC32 of the sorted indices as little-endian int64, as the script describes its checksum."""
    return f"{zlib.crc32(np.array(sorted(indices), dtype='<i8').tobytes()):08x}"


def rank_lines(out: str) -> list[tuple[int, int, int, str, list[int]]]:
    """(rank, samples, index sum, crc32, first five) of every per-rank epoch line, in printed order."""
    pattern = r"^rank (\d+): (\d+) samples, indices sum=(\d+) crc32=([0-9a-f]{8}), first five \[(.*)\]$"
    found = re.findall(pattern, out, flags=re.M)
    return [(int(r), int(n), int(s), c, [int(v) for v in first.split(",")]) for r, n, s, c, first in found]


def test_ddp_mnist_trains_on_disjoint_shares(tmp_path):
    write_mnist_fixture(tmp_path, n_train=512, n_test=128)
    dump = tmp_path / "indices.json"
    out = run([MNIST, "--data-dir", tmp_path, "--world-size", 2, "--epochs", 3, "--batch-size", 32,
               "--lr", 0.05, "--dump-indices", dump]).stdout
    log = json.loads(dump.read_text())
    assert log["world_size"] == 2 and len(log["epochs"]) == 3
    for per_rank in log["epochs"]:
        assert [len(indices) for indices in per_rank] == [256, 256]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert set(per_rank[0]) | set(per_rank[1]) == set(range(512))
    # set_epoch reshuffles: rank 0 gets a different share every epoch.
    assert len({frozenset(epoch[0]) for epoch in log["epochs"]}) == 3

    # What each rank printed, in rank order, describes exactly the indices it trained on.
    printed = rank_lines(out)
    assert [r for r, *_ in printed] == [0, 1] * 3
    for (rank, n, total, crc, first), (epoch, r) in zip(printed, [(e, r) for e in range(3) for r in range(2)],
                                                        strict=True):
        indices = log["epochs"][epoch][r]
        assert (rank, n, total, crc, first) == (r, len(indices), sum(indices), crc_of(indices), indices[:5])

    epochs = re.findall(rf"^epoch (\d+): train loss ({NUM}), test accuracy ({NUM})% \((\d+)/(\d+)\)$",
                        out, flags=re.M)
    assert [int(e) for e, *_ in epochs] == [1, 2, 3]
    losses = [float(loss) for _, loss, *_ in epochs]
    assert losses[0] > 1.0 and losses[-1] < 0.5 * losses[0]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False))
    _, _, accuracy, correct, total = epochs[-1]
    assert int(total) == 128 and int(correct) / 128 == pytest.approx(float(accuracy) / 100, abs=1e-4)
    assert int(correct) >= 0.8 * 128  # chance would be about 13 of 128
    assert out.count("check: ranks' indices cover all 512 samples (512 with padding), disjoint\n") == 3
    assert "check: every rank holds the same parameters as rank 0 (max abs diff 0.0e+00)" in out


def test_ddp_mnist_under_torchrun_pads_the_last_round(tmp_path):
    write_mnist_fixture(tmp_path, n_train=320, n_test=32)
    dump = tmp_path / "indices.json"
    out = run([MNIST, "--data-dir", tmp_path, "--limit", 301, "--epochs", 1, "--batch-size", 32,
               "--dump-indices", dump], nproc=3).stdout
    per_rank = json.loads(dump.read_text())["epochs"][0]
    assert [len(indices) for indices in per_rank] == [101, 101, 101]  # ceil(301 / 3), padded to 303
    counts = Counter(i for indices in per_rank for i in indices)
    assert set(counts) == set(range(301))  # --limit keeps the first 301 images, all of them seen
    assert sorted(counts.values(), reverse=True)[:3] == [2, 2, 1]  # exactly two padding repeats
    assert [r for r, *_ in rank_lines(out)] == [0, 1, 2]
    assert "check: ranks' indices cover all 301 samples (303 with padding), disjoint apart from 2 padding " \
           "repeat(s)" in out
