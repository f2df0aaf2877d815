"""This group's place in a fault-tolerant job: torchft's Manager, the per-step quorum, the gradient
average across the live groups and the commit gate (docs/fault_tolerance.md).

Every replica group is its own torchrun job with one layout inside it; the data-parallel replicate
dimension across groups is the one that may shrink and grow. Each step:

1. `start_step`: a quorum of the live groups through the lighthouse, synchronous, so that a group
   that is behind (restarted, or back from a hang) heals from a live one before its forward;
2. `exchange`: one all-reduce across the groups of [tokens, layout fingerprint, heal seconds,
   one-hot replica id] tells every group the live token count (the loss stays a mean over the live
   groups' tokens), who is live, and refuses a twin replica_id or another layout;
3. the gradients are averaged across the live groups (FSDP's all-reduce hook, or after the backward
   for layouts without FSDP);
4. `commit`: the optimizer steps only if every live group got through the step.
"""

import hashlib
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from components.config.sections import FaultTolerance
from components.fault_tolerance.heal_state import heal_state_fns
from components.runtime.errors import KilnError

_HEADER = 3  # tokens, fingerprint, heal seconds; then one slot per replica id


def check_fault_tolerance(ft: FaultTolerance) -> None:
    """The [fault_tolerance] section's own rules, before anything is built (one line each)."""
    if not ft.enable:
        return
    if ft.replica_id >= ft.group_size:
        raise KilnError(f"fault_tolerance.replica_id = {ft.replica_id} but group_size = {ft.group_size}: "
                        f"replica ids run from 0 to group_size - 1")
    if ft.group_size < ft.min_replicas:
        raise KilnError(f"fault_tolerance.group_size = {ft.group_size} is below min_replicas = "
                        f"{ft.min_replicas}: no step could ever commit")


def lighthouse_address(ft: FaultTolerance) -> str:
    """The lighthouse's address, checked to accept connections (else one line saying so)."""
    address = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise KilnError("fault_tolerance.enable needs the lighthouse's address: --fault_tolerance.lighthouse "
                        "http://HOST:PORT (or TORCHFT_LIGHTHOUSE); start one with torchft_lighthouse "
                        "or scripts/ft_launch.py")
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname or "localhost", url.port or 29510), timeout=5):
            pass
    except OSError as e:
        raise KilnError(f"no torchft lighthouse answers at {address} ({e.strerror or e}): start it first "
                        "(torchft_lighthouse --min_replicas N, or scripts/ft_launch.py)") from None
    return address if "://" in address else f"http://{address}"


def layout_fingerprint(description: str) -> float:
    """A number every group of one job computes alike (40 bits, so sums of them stay exact in float64)."""
    return float(int.from_bytes(hashlib.sha256(description.encode()).digest()[:5], "big"))


@dataclass
class ReplicaEvents:
    """What the groups did during the run, for its console lines and end summary."""

    live: list[int] = field(default_factory=list)  # replica ids in the last exchange
    committed: int = 0  # steps this group committed with others (not those it healed past)
    steps_short: int = 0  # steps committed with fewer than group_size groups
    discarded: int = 0  # steps a group failed during, run again
    heals: list[float] = field(default_factory=list)  # this group's heal times (seconds)
    pending: list[str] = field(default_factory=list)  # console lines not yet said


class ReplicaGroups:
    """torchft's Manager for this group, and what the trainer asks of it each step."""

    def __init__(self, ft: FaultTolerance, rank: int, world_size: int, device: torch.device,
                 fingerprint: float) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
        try:
            import torchft
        except ImportError:
            raise KilnError("fault_tolerance.enable needs torchft: pip install -e '.[ft]'") from None
        self.ft, self.group_size, self.fingerprint, self.device = ft, ft.group_size, fingerprint, device
        self.events = ReplicaEvents()
        self._heal_started: float | None = None
        self._healed_seconds = 0.0
        # Gradients averaged every step; DiLoCo instead runs its own quorums at its sync points.
        self.per_step = ft.semi_sync == "none"
        self.reduce_after_backward = False
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = (torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda"
              else torchft.ProcessGroupGloo(timeout=timeout))
        host, port = self._group_store(world_size)
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replicas,
            use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds), connect_timeout=timeout,
            rank=rank, world_size=world_size, store_addr=host, store_port=port,
            lighthouse_addr=lighthouse_address(ft), replica_id=f"kiln_{ft.replica_id}",
            init_sync=False)  # every group initialises the same weights from the seed

    def _group_store(self, world_size: int) -> tuple[str, int]:
        """The group's TCPStore, where its Manager finds rank 0's server: torchrun's (MASTER_ADDR and
        MASTER_PORT), or one hosted here for a group of one process (then the host's name, which the
        other groups must reach)."""
        if world_size > 1 or "MASTER_PORT" in os.environ:
            host = os.environ["MASTER_ADDR"]
            # The first live group's store also hosts the groups' own rendezvous: other groups must
            # reach it, which a loopback address (torchrun --standalone's) does not say how.
            if host in ("localhost", "127.0.0.1", "::1"):
                host = socket.gethostname()
            return host, int(os.environ["MASTER_PORT"])
        self._own_store = dist.TCPStore(socket.gethostname(), 0, 1, is_master=True, wait_for_workers=False)
        return socket.gethostname(), self._own_store.port

    # ------------------------------------------------------------------ set-up

    def register_state(self, states: dict[str, Stateful]) -> None:
        """What a joining group fetches from a live one: model, optimizer, LR schedule, train state and
        (unless streaming) the data position."""
        load, save = heal_state_fns(states, self._healed)
        self.manager.register_state_dict_fn("kiln", load, save)

    def attach(self, parts: list[nn.Module]) -> None:
        """Average gradients across the live groups inside FSDP's backward (its all-reduce hook, after
        the group's own reduce-scatter), or after the backward for parts without FSDP; under DiLoCo
        not at all (its outer step averages the groups' progress)."""
        fsdp = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
        self.reduce_after_backward = self.per_step and not fsdp
        if self.per_step:
            for module in fsdp:
                module.set_all_reduce_hook(self.average)

    def set_step(self, step: int) -> None:
        """Align torchft's step with the run's (after a resume from a checkpoint): groups at a lower
        step heal from one at the highest."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    # ------------------------------------------------------------------ each step

    def start_step(self) -> None:
        """Join this step's quorum; a group that is behind heals here, before its forward."""
        self._heal_started, self._healed_seconds = time.perf_counter(), 0.0
        try:
            self.manager.start_quorum()
        except Exception as e:  # torchft's quorum RPC: the lighthouse gone, or too few groups in time
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            ft = self.ft
            raise KilnError(f"replica group {ft.replica_id}: no quorum of {ft.min_replicas}+ live group(s) "
                            f"within fault_tolerance.quorum_timeout_seconds = "
                            f"{ft.quorum_timeout_seconds:g} s, or the lighthouse is gone ({first})") from None
        self._heal_started = None

    def _healed(self) -> None:
        if self._heal_started is not None:
            self._healed_seconds = time.perf_counter() - self._heal_started
            self.events.heals.append(self._healed_seconds)

    def exchange(self, group_tokens: float) -> tuple[float, int]:
        """(tokens of all live groups, live groups) for this step; says who joined or left."""
        slots = torch.zeros(_HEADER + self.group_size, dtype=torch.float64, device=self.device)
        slots[0], slots[1], slots[2] = group_tokens, self.fingerprint, self._healed_seconds
        slots[_HEADER + self.ft.replica_id] = 1.0
        self.manager.allreduce(slots, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:  # a group failed: this step will not commit
            return group_tokens, 1
        counts = slots[_HEADER:].tolist()
        if max(counts) > 1.5:
            twin = counts.index(max(counts))
            raise KilnError(f"two replica groups run with fault_tolerance.replica_id = {twin}: give each "
                            f"group its own id, 0 .. group_size - 1")
        live = [i for i, c in enumerate(counts) if c > 0.5]
        if slots[1].item() != len(live) * self.fingerprint:
            raise KilnError("the replica groups run different models or layouts (their start-up layout "
                            "lines differ): every group of a fault-tolerant job must run the same config")
        self._note_change(live, slots[2].item())
        return slots[0].item(), len(live)

    def _note_change(self, live: list[int], heal_seconds: float) -> None:
        before = self.events.live
        self.events.live = live
        if not before or before == live:
            return
        joined = [i for i in live if i not in before]
        left = [i for i in before if i not in live]
        words = []
        if left:
            words.append(f"group {', '.join(map(str, left))} left")
        if joined:
            healed = f" (healed in {heal_seconds:.2f} s)" if heal_seconds > 0 else ""
            words.append(f"group {', '.join(map(str, joined))} joined{healed}")
        skipped = ("; the missing groups' rows of each step are skipped" if len(live) < self.group_size
                   else "")
        self.events.pending.append(f"replicas: {' and '.join(words)}: {len(live)} of {self.group_size} "
                                   f"groups live{skipped}")

    def average(self, tensor: torch.Tensor) -> None:
        """Average a gradient (shard) over the live groups, in place."""
        self.manager.allreduce(tensor).wait()

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Average every gradient over the live groups (layouts without FSDP's hook)."""
        works = []
        for p in params:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                works.append(self.manager.allreduce(grad))
        for work in works:
            work.wait()

    def sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor (a logged loss and its token count) over the live groups."""
        self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
        return tensor

    def commit(self) -> bool:
        """Whether every live group got through this step (then the optimizer steps)."""
        committed = self.manager.should_commit()
        if not committed:
            self.events.discarded += 1
            return False
        self.events.committed += 1
        if len(self.events.live) < self.group_size:
            self.events.steps_short += 1
        return True

    def writes_checkpoints(self) -> bool:
        """The first live group alone writes the job's checkpoints (every group could load them)."""
        return self.manager.participating_rank() == 0

    def take_lines(self) -> list[str]:
        """Console lines about the groups since the last call."""
        lines, self.events.pending = self.events.pending, []
        return lines

    def summary(self) -> str:
        """The end-of-run line about the groups (steps this group committed with the others)."""
        e, steps = self.events, self.events.committed
        times = ", ".join(f"{s:.2f}" for s in e.heals)
        heals = f"; healed {len(e.heals)} time(s) from a live group ({times} s)" if e.heals else ""
        return (f"replicas: {steps - e.steps_short} of {steps} steps committed with all {self.group_size} "
                f"groups, {e.steps_short} with fewer; {e.discarded} step(s) discarded and run again{heals}")

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
