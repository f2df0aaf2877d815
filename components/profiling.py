"""torch.profiler traces every `profile_freq` steps, one Chrome trace per rank."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def maybe_profile(enabled: bool, trace_dir: Path, freq: int, rank: int) -> Iterator[object | None]:
    """Yield a profiler whose step() is called once per training step, or None when disabled.

    Each cycle waits, warms up for a step and records the step that ends at a multiple of
    `freq`, written to trace_dir/iteration_N/rank{rank}_trace.json.
    """
    if not enabled:
        yield None
        return
    warmup, active = 1, 1
    wait = max(0, freq - warmup - active)

    def on_ready(prof: torch.profiler.profile) -> None:
        out = trace_dir / f"iteration_{prof.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=on_ready, record_shapes=True) as prof:
        yield prof
