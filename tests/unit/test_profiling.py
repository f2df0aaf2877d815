"""Profiler traces and CUDA memory history only when the profiling options ask for them, and the
history recording stops with the run."""

import pytest
import torch

from components.observability.profiling import maybe_profile

pytestmark = pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")


@pytest.fixture
def cuda_memory(monkeypatch):
    """A CUDA that is available, whose memory-history calls are recorded instead of run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: calls.append(("record", enabled)))

    def dump(path: str) -> None:
        calls.append(("dump", path))
        open(path, "wb").close()

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def run_steps(steps: int, **options) -> object:
    """Run maybe_profile for `steps` training steps (freq 4, warm-up 1, 2 active); its object."""
    with maybe_profile(freq=4, rank=3, warmup=1, active=2, **options) as prof:
        for _ in range(steps):
            if prof is not None:
                prof.step()
    return prof


def test_nothing_asked_records_nothing(cuda_memory, tmp_path):
    assert run_steps(8, traces=False, trace_dir=tmp_path / "traces") is None
    assert cuda_memory == [] and not (tmp_path / "traces").exists()


def test_traces_without_snapshots_leave_memory_history_off(cuda_memory, tmp_path):
    run_steps(8, traces=True, trace_dir=tmp_path / "traces")
    assert cuda_memory == []
    assert sorted(p.parent.name for p in (tmp_path / "traces").glob("*/rank3_trace.json")) == [
        "iteration_4", "iteration_8"]


def test_snapshots_alone_record_dump_and_stop_without_traces(cuda_memory, tmp_path):
    run_steps(8, traces=False, trace_dir=tmp_path / "traces", snapshot_dir=tmp_path / "snaps")
    snaps = [f"{tmp_path}/snaps/iteration_{n}/rank3_memory_snapshot.pickle" for n in (4, 8)]
    assert cuda_memory == [("record", "all"), ("dump", snaps[0]), ("dump", snaps[1]), ("record", None)]
    assert not (tmp_path / "traces").exists()


def test_snapshots_with_traces_dump_at_the_trace_steps(cuda_memory, tmp_path):
    run_steps(4, traces=True, trace_dir=tmp_path / "traces", snapshot_dir=tmp_path / "snaps")
    snap = f"{tmp_path}/snaps/iteration_4/rank3_memory_snapshot.pickle"
    assert cuda_memory == [("record", "all"), ("dump", snap), ("record", None)]
    assert (tmp_path / "traces/iteration_4/rank3_trace.json").is_file()


def test_memory_history_stops_when_the_run_fails(cuda_memory, tmp_path):
    with pytest.raises(RuntimeError, match="step failed"):
        with maybe_profile(False, tmp_path, 4, 0, snapshot_dir=tmp_path / "snaps"):
            raise RuntimeError("step failed")
    assert cuda_memory == [("record", "all"), ("record", None)]


def test_without_cuda_snapshots_are_skipped(cuda_memory, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_steps(8, traces=False, trace_dir=tmp_path, snapshot_dir=tmp_path / "snaps") is None
    assert cuda_memory == []
