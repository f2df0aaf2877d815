"""torch.profiler traces every `profile_freq` steps, one Chrome trace per rank."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def maybe_profile(enabled: bool, trace_dir: Path, freq: int, rank: int, warmup: int = 1, active: int = 1,
                  snapshot_dir: Path | None = None) -> Iterator[object | None]:
    """Yield a profiler whose step() is called once per training step, or None when disabled.

    Each cycle waits, warms up for `warmup` steps and records `active` steps ending at a multiple
    of `freq`, written to trace_dir/iteration_N/rank{rank}_trace.json. With snapshot_dir (CUDA
    only) the allocator's history is dumped at the same steps to
    snapshot_dir/iteration_N/rank{rank}_memory_snapshot.pickle (open it in pytorch.org/memory_viz).
    """
    if snapshot_dir is not None and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if not enabled:
        yield None
        return
    wait = max(0, freq - warmup - active)

    def on_ready(prof: torch.profiler.profile) -> None:
        out = trace_dir / f"iteration_{prof.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        if snapshot_dir is not None and torch.cuda.is_available():
            snap = snapshot_dir / f"iteration_{prof.step_num}"
            snap.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snap / f"rank{rank}_memory_snapshot.pickle"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=on_ready, record_shapes=True) as prof:
        yield prof
