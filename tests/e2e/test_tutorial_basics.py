"""The first walkthrough scripts: threads vs. sequential, three ways to start a group, the collectives."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO, TORCHRUN, check_ok

TUTORIAL = REPO / "scripts" / "tutorial"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    """Launch a command from the repo root as a user would, and require exit 0."""
    proc = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    check_ok(proc)
    return proc


def test_motivation_threads_overlap_sleeping_tasks():
    sleep, tasks = 0.2, 5
    out = run([sys.executable, str(TUTORIAL / "motivation.py"), "--sleep", str(sleep), "--tasks", str(tasks)])
    seq = re.search(r"^sequential: result (\d+)\s+time ([\d.]+) s$", out.stdout, flags=re.M)
    thr = re.search(r"^threaded:\s+result (\d+)\s+time ([\d.]+) s$", out.stdout, flags=re.M)
    assert seq and thr, out.stdout
    assert int(seq[1]) == int(thr[1]) == sum(range(tasks))
    seq_time, thr_time = float(seq[2]), float(thr[2])
    assert seq_time >= tasks * sleep * 0.999  # printed to 3 decimals
    assert thr_time < seq_time
    assert re.search(r"^why: .*GIL.*processes", out.stdout, flags=re.M), out.stdout


@pytest.mark.parametrize("method", ["store", "env", "torchrun"])
def test_init_three_ways(method):
    script, world = str(TUTORIAL / "init_three_ways.py"), 3
    if method == "torchrun":
        cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={world}", script, "--method", method]
    else:
        cmd = [sys.executable, script, "--method", method, "--world-size", str(world)]
    out = run(cmd).stdout
    who = re.findall(r"^rank (\d+) of (\d+): local rank (\d+), backend (\w+), device (\S+)$", out, flags=re.M)
    assert [int(r) for r, *_ in who] == list(range(world)), out
    for rank, size, local, backend, device in who:
        assert int(size) == world and int(local) == int(rank)
        assert (backend, device.split(":")[0]) in {("gloo", "cpu"), ("nccl", "cuda")}
    sums = re.findall(r"^rank (\d+): all_reduce\(ones\) = ([\d.]+)$", out, flags=re.M)
    assert [int(r) for r, _ in sums] == list(range(world)), out
    assert all(float(s) == world for _, s in sums)
    assert out.index(f"rank {world - 1} of") < out.index("rank 0: all_reduce")  # whoami lines come first
    assert f"check: all_reduce of ones equals the world size {world} on every rank" in out
    assert f"== method {method}:" in out


def sections(out: str) -> dict[str, list[tuple[str, int, list]]]:
    """Each `== name:` section's tensor lines, in printed order, as (before/after, rank, values)."""
    found: dict[str, list] = {}
    name = None
    for line in out.splitlines():
        if head := re.match(r"^== (\S+): ", line):
            name = head[1]
            found[name] = []
        elif row := re.match(r"^rank (\d+) (before|after):\s+(.*)$", line):
            found[name].append((row[2], int(row[1]), ast.literal_eval(row[3])))
    return found


def test_collectives_results_match_hand_computation():
    w = 3
    out = run([sys.executable, str(TUTORIAL / "collectives.py"), "--world-size", str(w)]).stdout
    got = sections(out)
    names = ["broadcast", "all_reduce(sum)", "all_reduce(max)", "all_gather", "reduce_scatter", "all_to_all"]
    assert list(got) == names, out
    for name in names:
        # Every rank's input, then every rank's result, each in rank order.
        order = [(kind, rank) for kind, rank, _ in got[name]]
        assert order == [("before", r) for r in range(w)] + [("after", r) for r in range(w)], (name, order)
        assert re.search(rf"^check: {re.escape(name)} ok$", out, flags=re.M), name
    b = {name: [v for kind, _, v in rows if kind == "before"] for name, rows in got.items()}
    a = {name: [v for kind, _, v in rows if kind == "after"] for name, rows in got.items()}

    def labelled(rank: int, n: int) -> list[int]:
        return [10 * rank + i for i in range(n)]

    assert b["broadcast"] == [labelled(r, 3) for r in range(w)]
    assert a["broadcast"] == [labelled(0, 3)] * w

    digits = b["all_reduce(sum)"]
    assert b["all_reduce(max)"] == digits and len({tuple(d) for d in digits}) > 1  # ranks start different
    assert a["all_reduce(sum)"] == [[sum(col) for col in zip(*digits, strict=True)]] * w
    assert a["all_reduce(max)"] == [[max(col) for col in zip(*digits, strict=True)]] * w

    assert b["all_gather"] == [labelled(r, 2) for r in range(w)]
    assert a["all_gather"] == [[labelled(r, 2) for r in range(w)]] * w

    assert b["reduce_scatter"] == [labelled(r, 2 * w) for r in range(w)]
    total = [sum(10 * r + i for r in range(w)) for i in range(2 * w)]
    assert a["reduce_scatter"] == [total[2 * r:2 * r + 2] for r in range(w)]

    assert b["all_to_all"] == [labelled(r, w) for r in range(w)]
    assert a["all_to_all"] == [[10 * src + dst for src in range(w)] for dst in range(w)]
