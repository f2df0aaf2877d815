"""A dump folder's records of an earlier run are kept, never overwritten by a new run in that folder.

A resumed run appends to its own metrics.jsonl; a new run (nothing resumed) that finds another
run's records moves them to `<dump>/earlier_runs/N/` first and says so in one line.
"""

import shutil
from pathlib import Path

EARLIER = "earlier_runs"


def records_of_a_run(dump: Path, tensorboard: str) -> list[Path]:
    """The files a run writes at the top of its dump folder that a new run would replace."""
    names = ["metrics.jsonl", "config.toml", tensorboard]
    found = [dump / name for name in names if (dump / name).exists()]
    return found + sorted(dump.glob("memory_rank*.json"))


def keep_earlier_run(dump: Path, tensorboard: str = "tb") -> Path | None:
    """Move an earlier run's records to <dump>/earlier_runs/N (N one past the highest there) and
    return that folder; None when there is nothing (or only an empty metrics file) to keep."""
    metrics = dump / "metrics.jsonl"
    if not metrics.exists() or metrics.stat().st_size == 0:
        return None
    taken = [int(p.name) for p in (dump / EARLIER).glob("*") if p.name.isdigit()]
    target = dump / EARLIER / str(max(taken, default=0) + 1)
    target.mkdir(parents=True)
    for path in records_of_a_run(dump, tensorboard):
        shutil.move(str(path), str(target / path.name))
    return target
