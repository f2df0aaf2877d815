"""Fault-tolerant replica groups (torchft) as users run them: a lighthouse and two replica groups of
two processes each (FSDP 2 inside), each group its own job of train.py.

(a) nothing fails: the two groups train exactly as one HSDP 2 × 2 job (losses, grad norms), and
    their weights and optimizer states stay bitwise equal;
(b) kill -9 of a whole group: the other commits its next step within the heartbeat timeout plus a
    step or two, and (c) the killed group, started again, heals from the live one and both end
    bitwise equal;
(d) a hung group (SIGSTOP) is dropped after the timeout and heals when it wakes (SIGCONT);
(e) DiLoCo: the loss falls and the groups agree after every outer step;
and the bad inputs refused in one line before any training.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from components.fault_tolerance.lighthouse import lighthouse as serve_lighthouse
from tests.helpers.runs import (
    ONE_THREAD_UNBUFFERED,
    REPO,
    TINY,
    WARM,
    check_ok,
    fails_with,
    read_metrics,
    relative,
    run_train,
    train_rows,
)

HEARTBEAT_MS = 1000
FT_TIMEOUT = "5"  # seconds a cross-group collective waits for a silent group


def lighthouse(min_replicas: int):
    """torchft's lighthouse in this process, as scripts/ft_launch.py serves it."""
    return serve_lighthouse(min_replicas, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=500)


def group_args(group: int, address: str, dump: Path, *extra: str, steps: int = 6, min_replicas: int = 1,
               groups: int = 2) -> list[str]:
    return [*TINY, "--training.steps", str(steps), "--job.dump_folder", str(dump),
            "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
            "--fault_tolerance.group_size", str(groups), "--fault_tolerance.min_replicas", str(min_replicas),
            "--fault_tolerance.lighthouse", address, "--fault_tolerance.timeout_seconds", FT_TIMEOUT,
            "--fault_tolerance.weights_digest_freq", "1", *extra]


class Group:
    """One replica group's job, run by the warm launcher in a thread; `pgid` kills or stops all of it."""

    def __init__(self, args: list[str], nproc: int = 2, timeout: int = 240) -> None:
        self.result = None
        before = WARM.last_pgid
        self.thread = threading.Thread(target=self._run, args=(args, nproc, timeout), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while WARM.last_pgid == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert WARM.last_pgid != before, "the group's job did not start"
        self.pgid = WARM.last_pgid

    def _run(self, args, nproc, timeout):
        try:
            self.result = run_train(args, nproc=nproc, timeout=timeout)
        except ValueError:  # killed with its launcher, which then answers nothing
            self.result = subprocess.CompletedProcess(args, -signal.SIGKILL, "", "")

    def signal(self, sig: int) -> None:
        os.killpg(self.pgid, sig)

    def wait(self):
        self.thread.join()
        return self.result


def rows(dump: Path, group: int) -> list[dict]:
    path = dump / f"replica_{group}" / "metrics.jsonl"
    return [r for r in read_metrics(path.parent) if "loss" in r] if path.exists() else []


def wait_for(condition, what: str, seconds: float = 90, poll: float = 0.05):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def kill_inside_a_step(victim: Group, dump: Path) -> None:
    """SIGKILL the victim halfway through a step, between two of the survivor's rows (the groups step
    together). A kill just after a row can land between the victim's steps: the next quorum then
    leaves it out and no step is discarded, which is right but not what (b) tests."""
    seen = rows(dump, 0)[-1]["step"]
    wait_for(lambda: rows(dump, 0)[-1]["step"] > seen, "a fresh step of the survivor", poll=0.005)
    recent = rows(dump, 0)
    step_seconds = (recent[-1]["time"] - recent[-4]["time"]) / 3
    time.sleep(step_seconds / 2)
    victim.signal(signal.SIGKILL)


def agree_where_both_logged(dump: Path) -> int:
    """Both groups' rows of every step they both logged have one loss, grad norm and digest; returns
    how many steps that was."""
    first, second = ({r["step"]: r for r in rows(dump, g)} for g in (0, 1))
    shared = sorted(set(first) & set(second))
    for step in shared:
        a, b = first[step], second[step]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), step
        for key in ("weights_digest", "optimizer_digest"):
            assert a[key] == b[key], (key, step)
    return len(shared)


MOE = ["--model.name", "moe", "--training.global_batch_size", "8", "--training.local_batch_size", "4",
       "--parallelism.expert_parallel_degree", "2"]
TP2, PP2 = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"]
SHARD2 = ["--parallelism.data_parallel_shard_degree", "2"]
# Inside each group -> the 4-process job whose data-parallel ranks read the same rows. FSDP takes
# FSDP's all-reduce hook across groups; TP and PP alone take the average after the backward.
LAYOUTS = {
    "fsdp2": ([], ["--parallelism.data_parallel_replicate_degree", "2", *SHARD2]),
    "tp2": (TP2, [*TP2, *SHARD2]),
    "pp2": (PP2, [*PP2, *SHARD2]),
    "moe_fsdp2_ep2": (MOE, [*MOE, "--training.global_batch_size", "16"]),
}


def two_groups(dump: Path, extra: list[str], steps: int) -> list[subprocess.CompletedProcess]:
    with lighthouse(min_replicas=2) as address:
        groups = [Group(group_args(g, address, dump, *extra, steps=steps, min_replicas=2)) for g in (0, 1)]
        return [g.wait() for g in groups]


def assert_rows_match(reference: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for ref, row in zip(reference, got, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(row["loss"], ref["loss"]) <= tol, ref["step"]
        assert relative(row["grad_norm"], ref["grad_norm"]) <= tol, ref["step"]
        assert row["loss_tokens"] == ref["loss_tokens"] and row["replicas"] == 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_groups_train_as_one_job_of_both(layout, tmp_path):
    """(a) Group g's rank r reads data-parallel rank 2g + r of 4: the rows the 4-process job gives its
    data-parallel rank 2g + r, so the losses and grad norms are that job's. With FSDP, the first live
    group writes the checkpoints, and both groups started again resume from step 6 exactly."""
    inside, whole = LAYOUTS[layout]
    steps = 9 if layout == "fsdp2" else 5
    reference = tmp_path / "whole"
    check_ok(run_train([*TINY, "--training.steps", str(steps), "--job.dump_folder", str(reference), *whole],
                       nproc=4))
    dump = tmp_path / "ft"
    saving = ["--checkpoint.enable", "--checkpoint.interval", "3"] if layout == "fsdp2" else []
    for result in two_groups(dump, [*inside, *saving], steps):
        check_ok(result)
        assert "replicas group" in result.stdout and "replicas 2/2" in result.stdout
        assert (f"replicas: {steps} of {steps} steps committed with all 2 groups, 0 with fewer"
                in result.stdout)
    assert agree_where_both_logged(dump) == steps
    uninterrupted = rows(dump, 0)
    assert_rows_match(train_rows(reference), uninterrupted)
    if layout != "fsdp2":
        return
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-3", "step-6", "step-9"]
    shutil.rmtree(dump / "checkpoint" / "step-9")
    for result in two_groups(dump, saving, steps):
        check_ok(result)
        assert f"resumed from {dump / 'checkpoint' / 'step-6'}" in result.stdout
    exact = ("step", "loss", "grad_norm", "lr", "tokens", "weights_digest", "optimizer_digest")
    for group in (0, 1):  # the resumed rows follow each group's earlier ones
        assert [[r[k] for k in exact] for r in rows(dump, group)[-3:]] == \
               [[r[k] for k in exact] for r in uninterrupted[-3:]]


def test_a_killed_group_is_dropped_and_heals_when_started_again(tmp_path):
    """(b) and (c)."""
    dump, steps = tmp_path / "ft", 100
    with lighthouse(min_replicas=1) as address:
        args = [group_args(g, address, dump, steps=steps) for g in (0, 1)]
        survivor, victim = Group(args[0]), Group(args[1])
        wait_for(lambda: len([r for r in rows(dump, 0) if r["replicas"] == 2]) >= 5, "steps of both groups")
        kill_inside_a_step(victim, dump)
        killed, last = time.monotonic(), rows(dump, 0)[-1]["step"]
        # the survivor's next committed step (its rows are written as the steps end)
        wait_for(lambda: any(r["step"] > last + 1 for r in rows(dump, 0)), "the survivor's next steps")
        stall = time.monotonic() - killed
        before = rows(dump, 0)
        step_seconds = (before[last - 1]["time"] - before[last - 5]["time"]) / 4
        assert stall < HEARTBEAT_MS / 1000 + 2 * step_seconds + 2.0, (stall, step_seconds)
        print(f"kill -9: the survivor's next step after {stall:.2f} s (steps of {step_seconds:.3f} s)")
        assert victim.wait().returncode != 0
        restarted = Group(args[1])
        second, first = restarted.wait(), survivor.wait()
    check_ok(first)
    check_ok(second)
    assert "replicas: group 1 left: 1 of 2 groups live; the missing groups' rows of each step are skipped" \
        in first.stdout
    assert "group 1 joined (healed in" in first.stdout
    assert "discarded: a replica group failed during it" in first.stdout
    assert "healed from a live replica group in" in second.stdout
    survivor_rows = rows(dump, 0)
    assert survivor_rows[-1]["step"] == steps and rows(dump, 1)[-1]["step"] == steps
    assert any(r["replicas"] == 1 for r in survivor_rows)
    # no step lost or repeated (the group that started second may have healed past step 1 at once)
    assert [r["step"] for r in survivor_rows] == list(range(survivor_rows[0]["step"], steps + 1))
    assert agree_where_both_logged(dump) >= 3  # after the heal, to the last step


def test_a_hung_group_is_dropped_and_heals_when_it_wakes(tmp_path):
    """(d): SIGSTOP holds every process of group 1; after the timeout group 0 goes on alone; SIGCONT."""
    dump, steps = tmp_path / "ft", 100
    with lighthouse(min_replicas=1) as address:
        groups = [Group(group_args(g, address, dump, steps=steps)) for g in (0, 1)]
        wait_for(lambda: len([r for r in rows(dump, 0) if r["replicas"] == 2]) >= 5, "steps of both groups")
        groups[1].signal(signal.SIGSTOP)
        wait_for(lambda: len([r for r in rows(dump, 0) if r["replicas"] == 1]) >= 3, "steps of group 0 alone")
        groups[1].signal(signal.SIGCONT)
        results = [g.wait() for g in groups]
    for result in results:
        check_ok(result)
    assert "group 1 left" in results[0].stdout and "group 1 joined" in results[0].stdout
    assert "healed from a live replica group in" in results[1].stdout
    assert rows(dump, 0)[-1]["step"] == steps and rows(dump, 1)[-1]["step"] == steps
    assert agree_where_both_logged(dump) >= 3


def test_diloco_learns_and_its_groups_agree_after_every_outer_step(tmp_path):
    """(e) sync_every 4: each group steps alone, then both take the same outer step."""
    dump = tmp_path / "ft"
    extra = ["--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "4",
             "--fault_tolerance.weights_digest_freq", "4", "--optimizer.lr", "1e-2"]
    with lighthouse(min_replicas=2) as address:
        groups = [Group(group_args(g, address, dump, *extra, steps=16, min_replicas=2)) for g in (0, 1)]
        results = [g.wait() for g in groups]
    for result in results:
        check_ok(result)
        assert "DiLoCo: an outer step every 4 steps" in result.stdout
    first, second = rows(dump, 0), rows(dump, 1)
    assert first[-1]["loss"] < first[0]["loss"] - 0.3 and second[-1]["loss"] < second[0]["loss"] - 0.3
    synced = [(a, b) for a, b in zip(first, second, strict=True) if a["step"] % 4 == 0]
    assert len(synced) == 4
    for a, b in synced:
        assert a["weights_digest"] == b["weights_digest"], a["step"]
        assert a["replicas"] == 2
    between = [(a, b) for a, b in zip(first, second, strict=True) if a["step"] % 4 == 1]
    assert all(a["loss"] != b["loss"] for a, b in between)  # each group trains on its own rows


def test_bad_fault_tolerance_input_is_one_line_before_training(tmp_path):
    base = [*TINY, "--job.dump_folder", str(tmp_path), "--fault_tolerance.enable"]
    fails_with(run_train([*base, "--fault_tolerance.lighthouse", "http://localhost:1"]),
               "no torchft lighthouse answers at http://localhost:1")
    fails_with(run_train([*base, "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replicas", "3"]),
               "group_size = 2 is below min_replicas = 3")
    fails_with(run_train([*base, "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2"]),
               "replica_id = 2 but group_size = 2")
    with lighthouse(min_replicas=2) as address:  # the other group never comes
        alone = run_train([*group_args(0, address, tmp_path, min_replicas=2),
                           "--fault_tolerance.quorum_timeout_seconds", "2"])
    fails_with(alone, "replica group 0: no quorum of 2+ live group(s) within "
               "fault_tolerance.quorum_timeout_seconds = 2 s")


@pytest.mark.parametrize("case", ["twin replica_id", "other layout"])
def test_groups_that_cannot_train_together_are_refused_at_step_one(case, tmp_path):
    with lighthouse(min_replicas=2) as address:
        ids = (0, 0) if case == "twin replica_id" else (0, 1)
        other = ["--training.local_batch_size", "4"] if case == "other layout" else []
        groups = [Group(group_args(ids[0], address, tmp_path / "a", min_replicas=2), nproc=1),
                  Group(group_args(ids[1], address, tmp_path / "b", *other, min_replicas=2), nproc=1)]
        results = [g.wait() for g in groups]
    expected = ("two replica groups run with fault_tolerance.replica_id = 0" if case == "twin replica_id"
                else "the replica groups run different models or layouts")
    for result in results:
        fails_with(result, expected)
        assert "step 1/" not in result.stdout


def test_ft_launch_starts_a_lighthouse_and_the_groups(tmp_path):
    """scripts/ft_launch.py as the docs run it (real torchrun jobs, one process per group)."""
    proc = subprocess.run(
        [sys.executable, "scripts/ft_launch.py", "--groups", "2", "--nproc-per-group", "1", "--port", "0",
         "--min-replicas", "2", "--", *TINY, "--training.steps", "4", "--job.dump_folder", str(tmp_path)],
        cwd=REPO, env={**os.environ, **ONE_THREAD_UNBUFFERED}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ft_launch: lighthouse at http://" in proc.stdout
    for group in (0, 1):
        assert f"[group {group}] step 4/4" in proc.stdout
        assert f"[group {group}] replicas: 4 of 4 steps committed with all 2 groups" in proc.stdout
    assert "ft_launch: groups ended with 0: 0, 1: 0" in proc.stdout
    assert "torchft::" not in proc.stdout  # torchft's own per-quorum logging stays quiet
