"""The folders a run reads and writes: every configured path checked before any work (one line naming
the option and the path), output folders proven writable, a folder proven shared by every node (DCP
checkpoints and a shared data cache need it), and an earlier run's records kept, never overwritten."""

import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from components.config.loading import resolve_path
from components.config.sections import JobConfig
from components.runtime.errors import KilnError
from components.runtime.hub import is_hub_id


def check_paths(cfg: JobConfig) -> None:
    """Raise one KilnError naming every bad path option of the config; nothing when all are usable."""
    problems = path_problems(cfg)
    if problems:
        raise KilnError("; ".join(problems))


def path_problems(cfg: JobConfig) -> list[str]:
    """One sentence per unusable path: output folders that cannot be made, inputs that are missing."""
    dump = Path(cfg.job.dump_folder)
    c = cfg.checkpoint
    out = [_output_problem(dump, "job.dump_folder")]
    if cfg.training.data_cache_dir:
        out.append(_output_problem(Path(cfg.training.data_cache_dir), "training.data_cache_dir"))
    if c.enable or c.create_seed_checkpoint:
        out.append(_output_problem(dump / c.folder, "checkpoint.folder"))
    # A hub id (owner/name, not a local path) is resolved through the Hugging Face cache, which
    # says itself what is missing (components/runtime/hub.py).
    if not is_hub_id(cfg.model.tokenizer_path):
        out.append(_tokenizer_problem(cfg.model.tokenizer_path))
    if c.initial_load_path and not is_hub_id(c.initial_load_path):
        out.append(_initial_load_problem(c.initial_load_path, c.initial_load_in_hf))
    return [p for p in out if p]


def _output_problem(folder: Path, option: str) -> str | None:
    """A folder that exists or can be made and written: no file in its place or above it."""
    if folder.exists() and not folder.is_dir():
        return f"{option} {folder} is a file, not a folder"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{option} {folder}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {folder}: {existing} is not writable"
    return None


def _tokenizer_problem(path: str) -> str | None:
    p = resolve_path(path)
    if not p.exists():
        return f"model.tokenizer_path {path} does not exist"
    if p.is_dir() and not (p / "tokenizer.json").is_file():
        return f"model.tokenizer_path {path} is a folder without tokenizer.json"
    return None


def _initial_load_problem(path: str, hf: bool) -> str | None:
    p = resolve_path(path)
    if not p.exists():
        return f"checkpoint.initial_load_path {path} does not exist"
    if not p.is_dir():
        return f"checkpoint.initial_load_path {path} is a file, not a folder"
    if hf and not (p / "config.json").is_file():
        return (f"checkpoint.initial_load_path {path} is not a Hugging Face folder (no config.json; "
                "checkpoint.initial_load_in_hf is set)")
    if not hf and not (p / ".metadata").is_file():
        return (f"checkpoint.initial_load_path {path} is not a checkpoint step folder (no DCP .metadata; "
                "--checkpoint.initial_load_in_hf for a Hugging Face folder)")
    return None


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


def unseen_by(folder: Path, wait_seconds: float) -> list[tuple[int, str]]:
    """(rank, host) of every rank that cannot see a file rank 0 writes into `folder`.

    Collective: every rank calls it. Rank 0 writes a probe file with a fresh name; the others
    list the folder until it shows up (a network file system may take a moment) or wait_seconds
    pass. Listing the folder, rather than stat-ing the name, revalidates NFS's directory cache.
    """
    name = [f".kiln-shared-probe-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    probe = folder / name[0]
    if dist.get_rank() == 0:
        probe.touch()
    dist.barrier()
    deadline = time.monotonic() + wait_seconds
    seen = False
    while True:
        try:
            seen = name[0] in os.listdir(folder)
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    answers: list = [None] * dist.get_world_size()
    dist.all_gather_object(answers, (seen, socket.gethostname()))
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    return [(rank, host) for rank, (ok, host) in enumerate(answers) if not ok]


def require_shared(folder: Path, what: str, wait_seconds: float) -> None:
    """Raise on every rank when some rank does not share `folder` with rank 0 (seen within wait_seconds)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    missing = unseen_by(folder, wait_seconds)
    if missing:
        ranks = ", ".join(str(r) for r, _ in missing)
        hosts = ", ".join(sorted({h for _, h in missing}))
        raise KilnError(
            f"{what} {folder} is not shared: rank(s) {ranks} (host {hosts}) cannot see the files rank 0 "
            f"writes there. Every rank writes its own shards of a checkpoint and reads others' when "
            f"resuming in another layout, so the folder must be on storage all nodes mount at the same "
            f"path (NFS, Lustre, a cluster file system), or run with --checkpoint.enable false")


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
