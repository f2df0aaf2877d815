"""Preemption: SIGTERM or SIGUSR1 asks every rank to finish its step, save a checkpoint and exit 0."""

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
