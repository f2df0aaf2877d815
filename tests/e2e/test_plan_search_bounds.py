"""The search's bounds hold: a layout is never timed or planned where a bound says it cannot be among
the best that fit, so each bound must stay below what timing and planning it would give. Every layout
of a DeepSeek-V3 debug model on 4 ranks (two per node: TP, PP, EP, HSDP, DDP; dense and MoE blocks)
is timed, and its pipelined layouts' peaks planned (tests/helpers/search_bounds.py)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO

MODEL = ["--config", "deepseek_v3_debug", "--training.seq_len", "64", "--training.global_batch_size", "8"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.search_bounds", "4", "2", *MODEL], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def by_dimension(communication: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Bytes by mesh dimension and kind; a group the planner names twice ("dp_shard = ep") counts
    for both."""
    out: dict[str, dict[str, int]] = {}
    for label, kinds in communication.items():
        for dim in label.split(" = "):
            for kind, nbytes in kinds.items():
                out.setdefault(dim, {})[kind] = out.get(dim, {}).get(kind, 0) + nbytes
    return out


def test_no_layout_is_predicted_faster_than_its_speed_bound(rows):
    assert len(rows) > 50
    faster = [r["layout"] for r in rows if r["predicted"] > r["bound"] * (1 + 1e-9)]
    assert not faster


def test_the_least_peak_is_below_the_planned_state_and_peak(rows):
    flat = [r for r in rows if r["pp"] == 1]
    assert flat and all(r["least_peak"] <= r["state"] for r in flat)
    # a pipeline keeps its stage's weights gathered and gradients unsharded until the last backward
    piped = [r for r in rows if "peak" in r and r["pp"] > 1]
    assert len(piped) >= 5 and all(r["least_peak"] <= r["peak"] for r in piped)


def test_what_forwards_in_flight_keep_bounds_the_peak_from_another_layouts_plans(rows):
    """The search learns what one block's forward keeps from the first layout of each TP, CP and EP
    degrees it times, and bounds the peak of every other before timing it: the state of its blocks,
    the weights a pipeline keeps gathered, and its forwards in flight at the first backward (dense
    blocks, which keep less than the MoE blocks planned, not counted). Below every planned peak,
    and above the state alone without AC, where a forward's keeps are known."""
    peaked = [r for r in rows if "peak" in r]
    assert len(peaked) > 15 and {r["ac_mode"] for r in peaked} == {"none", "full"}
    assert {r["pp"] > 1 for r in peaked} == {True, False}
    low = [r["layout"] for r in peaked if not r["state_only"] <= r["in_flight_peak"] <= r["peak"]]
    assert not low
    assert all(r["in_flight_peak"] > r["state_only"] for r in peaked if r["ac_mode"] == "none")


def test_every_step_sends_at_least_its_floors_and_eps_is_what_it_sends(rows):
    seen = set()
    for r in (r for r in rows if r["ac_mode"] == "none"):
        planned = by_dimension(r["planned"])
        for dim, kinds in r["floor"].items():
            sent = planned.get(dim, {})
            for kind, least in kinds.items():
                seen.add(dim)
                # an all-reduce does a reduce-scatter's and an all-gather's work (TP without sequence
                # parallel)
                assert sent.get(kind, 0) + sent.get("all-reduce", 0) >= least, (r["layout"], dim, kind)
            if dim == "ep":  # exact but for the exchange of the counts per expert
                assert sent["all-to-all"] <= 1.01 * kinds["all-to-all"], r["layout"]
    assert seen == {"tp", "ep", "dp_shard", "dp_shard_mod_ep", "dp_replicate"}
