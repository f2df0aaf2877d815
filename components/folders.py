"""Folders a run writes into: checked at start-up, so a bad path fails before any work is done."""

import os
import time
from pathlib import Path

from components.errors import KilnError


def require_writable(folder: Path, what: str) -> None:
    """Create `folder` if needed and prove a file can be written there, else one clear KilnError
    naming `what` (the option) and the path."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}-{time.time_ns()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise KilnError(f"{what} {folder} is not writable: {e}") from None
