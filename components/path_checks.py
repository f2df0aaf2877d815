"""Every path of a run's config checked before any work: one line naming the option and the path.

Without it a dump folder that is a file fails as a NotADirectoryError deep in the data cache, and a
missing initial_load_path as a DCP trace. Checks only look (no folder is created here), so every
rank may run them.
"""

import os
from pathlib import Path

from components.config import JobConfig, resolve_path
from components.errors import KilnError
from components.hub import is_hub_id


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
    # says itself what is missing (components/hub.py).
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
