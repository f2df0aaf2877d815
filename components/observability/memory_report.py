"""What a rank really holds, measured in a run, to set beside what scripts/plan.py planned.

With profiling.memory_report, after step 2 every rank writes <dump>/memory_rank<R>.json: the bytes
of its parameters, gradients (as the optimizer sees them) and optimizer state by dtype, counted
from the tensors' storages (FSDP padding included), and the allocator's peak during step 2 — on
CUDA torch.cuda.max_memory_allocated, on CPU the most bytes the c10 CPU allocator held at any of
its events of step 2, counted from before the model exists (every tensor byte, none of the
interpreter's; the corpus, read before, is left out as host memory).

The CPU figure is the c10 allocator's own running total, which it keeps over every thread when
FLAGS_caffe2_report_cpu_memory_usage is set (the report sets it while it records) and which the
profiler stores with each event. Summing the profiler's allocation and free events would not do:
it sees only the threads it profiles, and gloo frees blocks on its own worker threads (an
all-gather's output, a reduce-scatter's copy of its input), so the peak would follow scheduling.

Given the run's ParallelDims, the report also holds "communication": the bytes and calls of every
c10d collective the rank issues in step 2, by mesh dimension and kind, counted by the planner's own
rule (planning/step_tracker.py) with its own names for the process groups (planning/fake_world.py),
so that a plan's communication and a run's are the same figure.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from components.runtime.tensor_utils import local_tensor

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims


MEASURED_STEP = 2  # the first step with the optimizer state already made: the steady state


FLAG = "FLAGS_caffe2_report_cpu_memory_usage"  # c10's: count every thread's CPU blocks (AllocatorTotals)


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
    """Records one rank's memory (and, given its dims, its collectives) through step MEASURED_STEP
    and writes them as JSON."""

    def __init__(self, device: torch.device, path: Path, dims: ParallelDims | None = None) -> None:
        self.device, self.path, self.dims = device, path, dims
        self.gradients: dict[str, int] = {}
        self.step_start_ns = 0
        self.collectives: CollectiveCounter | None = None
        self.profiler = None
        self.every_thread: AllocatorTotals | None = None
        if device.type == "cuda":
            return
        self.every_thread = AllocatorTotals()
        self.every_thread.start()
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
        if step != MEASURED_STEP:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.dims is not None:
            # Named now: every process group of the layout exists by step 2.
            self.collectives = CollectiveCounter(self.dims)
            self.collectives.__enter__()
        self.step_start_ns = time.time_ns()

    def step_ends(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """After MEASURED_STEP: stop recording and write the report."""
        if step != MEASURED_STEP:
            return
        end_ns = time.time_ns()
        communication = None
        if self.collectives is not None:
            self.collectives.__exit__(None, None, None)
            communication = self.collectives.by_dim()
        if self.profiler is None:
            peak, how = torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        else:
            peak, how = self._cpu_peak(end_ns), "c10 CPU allocator's total over every thread (torch.profiler)"
        sizes = state_bytes(parts, optimizers)
        report = {"parameters": sizes["parameters"], "gradients": self.gradients,
                  "optimizer": sizes["optimizer"], "peak": peak, "step": MEASURED_STEP, "how": how}
        if communication is not None:
            report["communication"] = communication
        self.path.write_text(json.dumps(report, indent=1))

    def _cpu_peak(self, end_ns: int) -> int:
        """The most bytes the CPU allocator held between the step's start and end."""
        self.profiler.stop()
        self.every_thread.stop()
        events = cpu_allocator_totals(self.profiler.profiler.kineto_results.experimental_event_tree())
        self.profiler = None
        return window_peak(events, self.step_start_ns, end_ns)


class AllocatorTotals:
    """c10's FLAGS_caffe2_report_cpu_memory_usage, set while the report records: the CPU allocator
    then counts the blocks of every thread in one running total (which the profiler stores with each
    event), not only those of the threads the profiler follows. The flag has no Python binding;
    libc10 exports it."""

    def __init__(self) -> None:
        import ctypes  # only here: an opt-in measurement reads a flag of torch's own libc10

        libraries = sorted(Path(torch.__file__).parent.joinpath("lib").glob("*c10.*"))  # libc10.so, c10.dll
        self.flag = None
        for library in libraries:
            try:
                self.library = ctypes.CDLL(str(library))  # already loaded by torch: the same copy
                self.flag = ctypes.c_bool.in_dll(self.library, FLAG)
                break
            except (OSError, ValueError):
                continue
        if self.flag is None:
            raise RuntimeError(f"the memory report needs c10's {FLAG}, found in none of {libraries}")
        self.before = bool(self.flag.value)

    def start(self) -> None:
        self.flag.value = True

    def stop(self) -> None:
        self.flag.value = self.before


class CollectiveCounter(TorchDispatchMode):
    """Bytes and calls of every c10d collective this process issues while active, by (mesh
    dimension, kind): the planner's StepTracker counting (its `_count_collective`, the same code) on
    real tensors, with the planner's names for the layout's process groups."""

    def __init__(self, dims: ParallelDims) -> None:
        super().__init__()
        # Imported here: torch.distributed._tools is slow to import and needed only by a report.
        from torch.distributed._tools.fake_collectives import collective_ops, sync_ops

        from planning.fake_world import mesh_group_names
        from planning.step_tracker import StepTracker

        self._counted = collective_ops - sync_ops
        self._count = StepTracker._count_collective
        self.group_names = mesh_group_names(dims)
        self.comm_bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.comm_calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor turns itself into local ops first; those are counted
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._counted:
            self._count(self, func, out, args, kwargs)
        return out

    def by_dim(self) -> dict[str, dict[str, dict[str, int]]]:
        """mesh dimension → kind → {"bytes", "calls"}."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (dim, kind), nbytes in sorted(self.comm_bytes.items()):
            out.setdefault(dim, {})[kind] = {"bytes": nbytes, "calls": self.comm_calls[(dim, kind)]}
        return out


def cpu_allocator_totals(roots: list[Any]) -> list[tuple[int, int, int]]:
    """(time ns, bytes: + allocated, - freed, bytes the CPU allocator holds after it) of every CPU
    allocator event in a profile's event tree, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(roots)
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                out.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
            continue
        stack.extend(event.children)
    return sorted(out)


def window_peak(events: list[tuple[int, int, int]], start_ns: int, end_ns: int) -> int:
    """The most bytes held between start_ns and end_ns: after any event inside, or just before the
    first (what was held as the window opened, frees on unprofiled threads included)."""
    inside = [(delta, total) for at, delta, total in events if start_ns <= at <= end_ns]
    if not inside:
        return max([total for at, _, total in events if at < start_ns][-1:], default=0)
    first_delta, first_total = inside[0]
    return max(first_total - first_delta, *(total for _, total in inside))
