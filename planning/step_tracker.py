"""StepTracker: the live tensor bytes and the collectives of a fake training step, as they happen.

A TorchDispatchMode entered inside the planner's FakeTensorMode. Every tensor an op returns is
counted once per storage until that storage dies (a weak reference's callback), and FSDP's
`storage.resize_` (how it frees and re-allocates unsharded parameters, invisible to dispatch) is
followed too, so `peak` is the most tensor memory alive at once on the planned rank. Every c10d
collective is counted in bytes per op kind and mesh dimension, with torch's own helpers for
which tensor a collective moves (torch.distributed._tools.fake_collectives).

torch's MemTracker (torch.distributed._tools.mem_tracker) does the memory part, but refuses a
module that runs forward more than once per step (microbatches, pipeline schedules), so Kiln
keeps this smaller tracker that counts storages only.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The kind of traffic each collective is, as the planner reports it.
_KINDS = {
    "allgather": "all-gather", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
    "allreduce": "all-reduce", "all_reduce": "all-reduce", "alltoall": "all-to-all",
    "all_to_all": "all-to-all", "send": "send/recv", "recv": "send/recv", "isend": "send/recv",
    "irecv": "send/recv", "batch_p2p": "send/recv", "broadcast": "broadcast",
}


_DEVICE_QUERY = torch.ops.prim.device.default
# Reductions that take a dtype and cast their whole input to it first.
_CASTING_REDUCTIONS = {torch.ops.aten.linalg_vector_norm, torch.ops.aten.sum, torch.ops.aten.mean,
                       torch.ops.aten.nansum, torch.ops.aten.prod}


def collective_kind(op: torch._ops.OpOverload) -> str:
    """all-gather, reduce-scatter, all-reduce, all-to-all, send/recv or broadcast."""
    name = op.__name__ if hasattr(op, "__name__") else str(op)
    for key, kind in _KINDS.items():
        if key in name:
            return kind
    return "other"


class StepTracker(TorchDispatchMode):
    """Counts live bytes (now, peak) and collective bytes while active.

    group_names maps a process group's name to the mesh dimension it belongs to (unknown groups
    are reported as "other"). `category` is the label new storages get (the planner sets
    "optimizer" around optimizer.step, so the peak can be broken down).
    """

    def __init__(self, fake_mode: FakeTensorMode, group_names: dict[str, str],
                 device_type: str = "cuda") -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.device_type = device_type  # the planned device's (the fake tensors are on "cpu")
        self.group_names = group_names
        self.live: dict[str, int] = defaultdict(int)  # bytes alive now, by category
        self.peak = 0
        self.window_peak = 0  # the most alive since a caller last set it (to `now`)
        self.peak_by_category: dict[str, int] = {}
        self.phase_peak: dict[str, int] = defaultdict(int)  # the peak while each label was current
        self.category = "activations and temporaries"
        self.comm_bytes: dict[tuple[str, str], int] = defaultdict(int)  # (mesh dim, kind) → bytes
        self.comm_calls: dict[tuple[str, str], int] = defaultdict(int)
        # Storages that are gradients right now (the breakdown of the peak moves them there).
        self.gradient_storages: Callable[[], list[torch.UntypedStorage]] = list
        self._peak_pending = False
        self._sizes: dict[int, tuple[str, int, weakref.ref]] = {}  # id(storage) → (category, bytes, ref)
        self.born = 0  # storages counted so far (a mark for alive_since)
        self._birth: dict[int, int] = {}  # id(storage) → `born` when it was counted
        self._original_resize: Callable | None = None
        self._original_propagate: Callable | None = None
        self._propagating = 0  # inside DTensor's shape propagation (not the rank's memory)

    # ----------------------------------------------------------------- memory

    @property
    def now(self) -> int:
        return sum(self.live.values())

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Count a tensor's storage (once) under `category` (default: the current one)."""
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        label = category or self.category
        self._sizes[key] = (label, nbytes, weakref.ref(storage, lambda _, k=key: self._forget(k)))
        self._birth[key] = self.born
        self.born += 1
        self.live[label] += nbytes
        self._update_peak()

    def relabel(self, tensor: torch.Tensor, category: str) -> None:
        """Move an already counted tensor's bytes to another category (e.g. parameters)."""
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        key = id(tensor.untyped_storage())
        if key not in self._sizes:
            self.track(tensor, category)
            return
        old, nbytes, ref = self._sizes[key]
        self.live[old] -= nbytes
        self.live[category] += nbytes
        self._sizes[key] = (category, nbytes, ref)

    def _forget(self, key: int) -> None:
        entry = self._sizes.get(key)
        if entry is None:
            return
        self._snapshot_peak()
        del self._sizes[key]
        del self._birth[key]
        self.live[entry[0]] -= entry[1]

    def alive_since(self, mark: int) -> int:
        """Bytes of the storages counted since `mark` (a value of `born`) that are still alive."""
        return sum(nbytes for key, (_, nbytes, _) in self._sizes.items() if self._birth[key] >= mark)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._sizes.get(id(storage))
        if entry is None:
            return
        label, old, ref = entry
        new = storage.nbytes()
        if new < old:
            self._snapshot_peak()
        self.live[label] += new - old
        self._sizes[id(storage)] = (label, new, ref)
        self._update_peak()

    def transient(self, nbytes: int) -> None:
        """Memory that lives only inside one op (a kernel's own buffer): counted at its moment."""
        self.live[self.category] += nbytes
        self._update_peak()
        self._snapshot_peak()
        self.live[self.category] -= nbytes

    def _update_peak(self) -> None:
        now = self.now
        self.window_peak = max(self.window_peak, now)
        if now > self.phase_peak[self.category]:
            self.phase_peak[self.category] = now
        if now > self.peak:
            self.peak = now
            self._peak_pending = True

    def _snapshot_peak(self) -> None:
        """The breakdown of the peak, taken when memory first falls after it (the peak's state)."""
        if not self._peak_pending:
            return
        self._peak_pending = False
        breakdown = {k: v for k, v in self.live.items() if v}
        for key in {id(storage) for storage in self.gradient_storages()}:
            entry = self._sizes.get(key)
            if entry is not None and entry[0] != "gradients":
                breakdown[entry[0]] -= entry[1]
                breakdown["gradients"] = breakdown.get("gradients", 0) + entry[1]
        self.peak_by_category = {k: v for k, v in breakdown.items() if v}

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now, and new collective counts."""
        self._snapshot_peak()
        self.peak = 0
        self.phase_peak.clear()
        self.comm_bytes.clear()
        self.comm_calls.clear()
        self._update_peak()

    def finish(self) -> None:
        """Take the breakdown of a peak that memory never fell from."""
        self._snapshot_peak()

    @contextlib.contextmanager
    def collectives_during(self) -> Iterator[tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]]:
        """(mesh dim, kind) → bytes, and → calls, of the collectives issued inside the block (filled
        in when it ends)."""
        before = dict(self.comm_bytes), dict(self.comm_calls)
        added: tuple[dict, dict] = ({}, {})
        yield added
        for table, now, old in zip(added, (self.comm_bytes, self.comm_calls), before, strict=True):
            table.update({key: n - old.get(key, 0) for key, n in now.items() if n != old.get(key, 0)})

    # ----------------------------------------------------------------- mode

    def __enter__(self) -> StepTracker:
        self._original_resize = original = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        # DTensor derives output shapes by running each op on global-shape fake tensors, in the
        # active fake mode when there is one (ours): those tensors are not the rank's memory.
        self._original_propagate = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        @wraps(propagate)
        def propagate_outside(prop: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
            self._propagating += 1
            try:
                return propagate(prop, *args, **kwargs)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_outside
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is _DEVICE_QUERY:  # asked of every fake tensor over and over; it allocates nothing
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn itself into local ops first; those are counted
        kwargs = kwargs or {}
        ours = not self._propagating and active_fake_mode() is self.fake_mode
        if func is torch.ops._c10d_functional.wait_tensor.default:
            out = args[0]  # eager waits in place; the meta kernel would return a new tensor
        else:
            out = func(*args, **kwargs)
        # DTensor's shape propagation (in a fake mode of its own, or in ours): not the rank's memory.
        if not ours:
            return out
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        if self.device_type == "cpu" and func.overloadpacket in _CASTING_REDUCTIONS:
            self._reduction_cast(func, args, kwargs)  # alive with the output, as in the kernel
        if func in collective_ops and func not in sync_ops:
            self._count_collective(func, out, args, kwargs)
        return out

    def _reduction_cast(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """A reduction asked for another dtype than its input's first copies the whole input to it
        (ATen's make_reduction: `self.to(dtype)`), a buffer inside the kernel that neither dispatch
        nor fake tensors see (a float64 norm of a vocabulary-sized gradient can make a step's peak).
        Counted for CPU plans only: CUDA reduces half/bfloat16 into float32 without a copy."""
        names = [a.name for a in func._schema.arguments]
        dtype = kwargs.get("dtype")
        if dtype is None and "dtype" in names and names.index("dtype") < len(args):
            dtype = args[names.index("dtype")]
        source = args[0] if args else None
        if isinstance(dtype, torch.dtype) and isinstance(source, torch.Tensor) and dtype != source.dtype:
            self.transient(source.numel() * dtype.itemsize)

    def _count_collective(self, func: torch._ops.OpOverload, out: Any, args: tuple, kwargs: dict) -> None:
        group = CollectiveOp.get_process_group(func, args)
        dim = self.group_names.get(group.group_name, "other")
        kind = collective_kind(func)
        if kind == "all-to-all":  # what this rank sends (torch's helper adds what it receives)
            c10d = torch.ops.c10d
            sent = args[1] if func in (c10d.alltoall_.default, c10d.alltoall_base_.default) else args[0]
            nbytes = CollectiveOp.sum_tensors(sent)
        else:
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
        self.comm_bytes[(dim, kind)] += nbytes
        self.comm_calls[(dim, kind)] += 1
