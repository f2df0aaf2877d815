"""What a rank really holds, measured in a run, to set beside what scripts/plan.py planned.

With profiling.memory_report, after step 2 every rank writes <dump>/memory_rank<R>.json: the bytes
of its parameters, gradients (as the optimizer sees them) and optimizer state by dtype, counted
from the tensors' storages (FSDP padding included), and the allocator's peak during step 2 — on
CUDA torch.cuda.max_memory_allocated, on CPU the c10 CPU allocator's allocation and free events
recorded by torch.profiler from before the model exists (every tensor byte, none of the
interpreter's; the corpus, read before, is left out as host memory), paired by address into live
bytes.

Why by address: the profiler records an allocator event only on a thread it profiles, and gloo
frees some blocks on its own worker threads (the copy of its input a reduce-scatter works in,
all-gather outputs whose last reference the finished work drops), so their frees never appear.
Summed, the events would let those blocks live forever. An address the allocator hands out again
was free by then, so a new block at a live address ends the old one; and a block a collective of
step 1 made that no tensor holds when step 2 begins was freed too (every collective of a step has
finished by its end). With both, what is live as step 2 begins is what the planner has alive then.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from components.local_tensor import local_tensor

MEASURED_STEP = 2  # the first step with the optimizer state already made: the steady state


def bytes_by_dtype(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of the distinct storages behind the tensors (a DTensor's local piece), by dtype."""
    seen, out = set(), {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()  # one Python object per storage while it lives
        if id(storage) not in seen:
            seen.add(id(storage))
            dtype = str(t.dtype).removeprefix("torch.")
            out[dtype] = out.get(dtype, 0) + storage.nbytes()
    return out


def state_bytes(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict[str, int]]:
    """Parameter, gradient and optimizer-state bytes by dtype of real or fake model parts (the same
    counting for a plan and for the run it is checked against)."""
    params = [p for part in parts for p in part.parameters()]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"parameters": bytes_by_dtype(params),
            "gradients": bytes_by_dtype([p.grad for p in params if p.grad is not None]),
            "optimizer": bytes_by_dtype(state)}


class MemoryReport:
    """Records one rank's memory through step MEASURED_STEP and writes it as JSON."""

    def __init__(self, device: torch.device, path: Path) -> None:
        self.device, self.path = device, path
        self.gradients: dict[str, int] = {}
        self.step_start_ns = 0
        self.held_at_start: set[int] = set()  # addresses of the storages Python holds as the step begins
        self.profiler = None
        if device.type == "cuda":
            return
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               profile_memory=True)
        self.profiler.start()

    def watch(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Record the gradients each optimizer step sees."""
        def before(*_: Any) -> None:
            self.gradients = state_bytes(parts, [])["gradients"]

        for opt in optimizers:
            opt.register_step_pre_hook(before)

    def step_begins(self, step: int) -> None:
        if step == MEASURED_STEP:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            else:
                self.held_at_start = held_storages()
            self.step_start_ns = time.time_ns()

    def step_ends(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """After MEASURED_STEP: stop recording and write the report."""
        if step != MEASURED_STEP:
            return
        if self.profiler is None:
            peak, how = torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        else:
            peak, how = self._cpu_peak(time.time_ns()), "c10 CPU allocator events (torch.profiler) by address"
        sizes = state_bytes(parts, optimizers)
        report = {"parameters": sizes["parameters"], "gradients": self.gradients,
                  "optimizer": sizes["optimizer"], "peak": peak, "step": MEASURED_STEP, "how": how}
        self.path.write_text(json.dumps(report, indent=1))

    def _cpu_peak(self, end_ns: int) -> int:
        """The most live allocator bytes between the step's start and end."""
        self.profiler.stop()
        events = cpu_allocator_events(self.profiler.profiler.kineto_results.experimental_event_tree())
        self.profiler = None
        return live_peak(events, self.step_start_ns, end_ns, self.held_at_start)


def held_storages() -> set[int]:
    """The addresses of the CPU storages behind every tensor the garbage collector can see."""
    out = set()
    for obj in gc.get_objects():
        # plain tensors and parameters (a DTensor's local piece is one)
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu":
            try:
                out.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # sparse, nested: no storage of their own
                pass
    return out


def cpu_allocator_events(roots: list[Any]) -> list[tuple[int, int, int, bool]]:
    """(time ns, address, bytes: + allocated, - freed, made inside a c10d collective) of every CPU
    allocator event in a profile's event tree, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], [(root, False) for root in roots]
    while stack:
        event, in_collective = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                out.append((event.start_time_ns, fields.ptr, fields.alloc_size, in_collective))
            continue
        in_collective = in_collective or event.name.startswith(("c10d::", "_c10d_functional::"))
        stack.extend((child, in_collective) for child in event.children)
    return sorted(out)


def live_peak(events: list[tuple[int, int, int, bool]], start_ns: int, end_ns: int,
              held_at_start: set[int] | None = None) -> int:
    """The most bytes live at once between start_ns and end_ns, blocks paired by address: a free
    ends the block at its address, and so does a new block there (its free went unrecorded). With
    held_at_start (the addresses Python holds at start_ns), a block a collective made before start_ns
    that backs none of them is gone by then: every collective of the step before has finished."""
    blocks: dict[int, tuple[int, bool]] = {}
    live, peak, started = 0, 0, False
    for at, address, delta, in_collective in events:
        if not started and at >= start_ns:
            started = True
            if held_at_start is not None:
                for gone in [a for a, (_, c) in blocks.items() if c and a not in held_at_start]:
                    live -= blocks.pop(gone)[0]
                peak = live
        if delta > 0:
            live += delta - blocks.get(address, (0, False))[0]
            blocks[address] = (delta, in_collective)
        else:
            live -= blocks.pop(address, (0, False))[0]
        if start_ns <= at <= end_ns:
            peak = max(peak, live)
    return peak
