"""torch.profiler traces and CUDA memory snapshots every few steps, one file of each per rank."""

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


class SnapshotSteps:
    """Memory snapshots without traces: step() once per training step, dump(step) every `cycle` steps
    (the steps at which the profiler would write its traces)."""

    def __init__(self, cycle: int, dump: Callable[[int], None]) -> None:
        self.cycle, self.dump, self.step_num = cycle, dump, 0

    def step(self) -> None:
        """Count a finished training step; dump at the end of each cycle."""
        self.step_num += 1
        if self.step_num % self.cycle == 0:
            self.dump(self.step_num)


@contextlib.contextmanager
def maybe_profile(traces: bool, trace_dir: Path, freq: int, rank: int, warmup: int = 1, active: int = 1,
                  snapshot_dir: Path | None = None) -> Iterator[object | None]:
    """Yield an object whose step() is called once per training step, or None when neither traces nor
    snapshots are asked for.

    Each cycle waits, warms up for `warmup` steps and records `active` steps ending at a multiple
    of `freq`: with `traces`, written to trace_dir/iteration_N/rank{rank}_trace.json. With
    snapshot_dir (CUDA only) the allocator's history is recorded while the context lasts and dumped
    at the same steps to snapshot_dir/iteration_N/rank{rank}_memory_snapshot.pickle (open it in
    pytorch.org/memory_viz).
    """
    snapshots = snapshot_dir is not None and torch.cuda.is_available()
    if not traces and not snapshots:
        yield None
        return
    wait = max(0, freq - warmup - active)

    def dump_snapshot(step: int) -> None:
        if snapshots:
            file = _window_file(snapshot_dir, step, f"rank{rank}_memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(str(file))

    with memory_history(snapshots):
        if traces:
            with _trace_profiler(trace_dir, rank, wait, warmup, active, dump_snapshot) as prof:
                yield prof
        else:
            yield SnapshotSteps(wait + warmup + active, dump_snapshot)


@contextlib.contextmanager
def memory_history(record: bool) -> Iterator[None]:
    """Record the CUDA allocator's history inside the context (when `record`), and stop after it:
    recording costs time and memory on every allocation."""
    if not record:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _trace_profiler(trace_dir: Path, rank: int, wait: int, warmup: int, active: int,
                    after_trace: Callable[[int], None]) -> torch.profiler.profile:
    """A profiler on that schedule writing one Chrome trace per window, then calling after_trace(step)."""
    def on_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(_window_file(trace_dir, prof.step_num, f"rank{rank}_trace.json")))
        after_trace(prof.step_num)

    # No activities given: torch traces the CPU and every device it can trace here (CUDA on a GPU).
    return torch.profiler.profile(schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
                                  on_trace_ready=on_ready, record_shapes=True)


def _window_file(folder: Path, step: int, name: str) -> Path:
    """folder/iteration_{step}/name, its folder created."""
    out = folder / f"iteration_{step}"
    out.mkdir(parents=True, exist_ok=True)
    return out / name
