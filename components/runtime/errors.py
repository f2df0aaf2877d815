"""KilnError, the one exception type for bad user input, and its report: one line, whichever rank
finds it.

A KilnError found by every rank (a bad config, a layout that cannot run) is printed once, by rank 0; one
found by some ranks only (a file only rank 3 cannot read) is printed once, by the first of them,
prefixed with its rank. The ranks meet in the job's key-value store, not in a collective: a failing rank
must not wait for ranks that are busy elsewhere. The other ranks, whose collectives then fail because a
peer left, see that the error was reported and leave without lines of their own.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the store's type: the data tools import this module without torch
    import torch.distributed as dist


class KilnError(Exception):
    """A problem with the user's config, data, checkpoint or layout, explained in its message."""


_RANK0 = "kiln/error/rank0"  # rank 0 has printed its KilnError line


_REPORTED = "kiln/error/reported"  # how many ranks have found one


_PRINTED = "kiln/error/printed"  # how many non-zero ranks claimed the line (the first prints)


RANK0_GRACE_SECONDS = 3.0  # how long another rank waits to hear whether rank 0 has the error too


# Before the process group a non-zero rank stays this long before it exits: the launcher stops every
# worker when the first one exits, so rank 0 (which prints the line) must be the first.
SILENT_RANK_LINGER_SECONDS = 20.0


def report_kiln_error(error: Exception, rank: int, store: dist.Store | None) -> None:
    """Print `kiln: error: …` for this rank's KilnError unless another rank prints it."""
    if store is None:  # before the process group every rank read the same config: rank 0 speaks
        if rank == 0:
            _print(f"kiln: error: {error}")
        else:
            time.sleep(SILENT_RANK_LINGER_SECONDS)  # normally ended sooner, by the launcher
        return
    try:
        store.add(_REPORTED, 1)
        if rank == 0:  # print first, then tell: a rank that leaves on the flag gets rank 0 killed
            _print(f"kiln: error: {error}")
            store.set(_RANK0, "1")
            return
        if _rank0_reports(store) or store.add(_PRINTED, 1) != 1:
            return
    except Exception:  # the store went with rank 0, which has printed its own line
        return
    _print(f"kiln: error: rank {rank}: {error}")


def reported_elsewhere(store: dist.Store | None) -> bool:
    """Whether some rank already reported a KilnError (so a failed collective here is its echo)."""
    if store is None:
        return False
    try:
        return store.check([_REPORTED])
    except Exception:
        return False


def _rank0_reports(store: dist.Store) -> bool:
    deadline = time.monotonic() + RANK0_GRACE_SECONDS
    while time.monotonic() < deadline:
        if store.check([_RANK0]):
            return True
        time.sleep(0.05)
    return False


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
