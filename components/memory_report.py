"""What a rank really holds, measured in a run, to set beside what scripts/plan.py planned.

With profiling.memory_report, after step 2 every rank writes <dump>/memory_rank<R>.json: the bytes
of its parameters, gradients (as the optimizer sees them) and optimizer state by dtype, counted
from the tensors' storages (FSDP padding included), and the allocator's peak during step 2 — on
CUDA torch.cuda.max_memory_allocated, on CPU the c10 CPU allocator's allocation and free events
recorded by torch.profiler from before the model exists (every tensor byte, none of the
interpreter's; the corpus, read before, is left out as host memory), summed into live bytes.
"""

from __future__ import annotations

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
            self.step_start_ns = time.time_ns()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)

    def step_ends(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """After MEASURED_STEP: stop recording and write the report."""
        if step != MEASURED_STEP:
            return
        if self.profiler is None:
            peak, how = torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        else:
            peak, how = self._cpu_peak(time.time_ns()), "c10 CPU allocator events (torch.profiler)"
        sizes = state_bytes(parts, optimizers)
        report = {"parameters": sizes["parameters"], "gradients": self.gradients,
                  "optimizer": sizes["optimizer"], "peak": peak, "step": MEASURED_STEP, "how": how}
        self.path.write_text(json.dumps(report, indent=1))

    def _cpu_peak(self, end_ns: int) -> int:
        """The most live allocator bytes between the step's start and end."""
        self.profiler.stop()
        events = sorted((e.start_ns(), e.nbytes()) for e in self.profiler.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        self.profiler = None
        live, peak = 0, 0
        for at, delta in events:
            live += delta
            if self.step_start_ns <= at <= end_ns:
                peak = max(peak, live)
        return peak
