"""What the loop does between steps besides training: a stop request (SIGTERM / SIGUSR1) that every
rank agrees on, and garbage collection at fixed steps."""

import gc
import signal

import torch
import torch.distributed as dist


class StopRequest:
    """Records a stop signal; `agreed()` tells all ranks together whether any rank received one.

    Ranks can get the signal a step apart, so they vote once per step (one tiny all-reduce) and
    stop at the same step.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.received: int | None = None
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame) -> None:
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor(1.0 if self.received is not None else 0.0, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class GarbageCollection:
    """Disable automatic GC and collect the young generations every `freq` steps instead."""

    def __init__(self, freq: int) -> None:
        self.freq = freq
        if freq > 0:
            gc.disable()
            gc.collect(1)

    def maybe_collect(self, step: int) -> None:
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(1)
