"""Garbage collection at fixed steps: Python's automatic GC pauses ranks at different moments,
which makes the fast ranks wait for the slow ones at every collective."""

import gc


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
