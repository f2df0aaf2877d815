"""CheckpointManager: atomic, resharding, optionally asynchronous checkpoints over DCP.

A checkpoint is one DCP folder `<dump>/<folder>/step-N/` holding every Stateful part of a run
(model, optimizer, lr_scheduler, dataloader, train_state) under layout-free names: FSDP/DDP/TP
shards are saved by parameter name and global shape, so any layout can load any checkpoint.
Each is written as `step-N.tmp` and renamed once DCP's coordinator has written the metadata,
which it does only after every rank finished: a crash mid-save leaves the previous checkpoint
as the latest. Before the rename the main rank writes a manifest of the files, their sizes and
CRC-32s (checkpoint_integrity); a resume skips a damaged checkpoint for the newest intact one.
"""

import contextlib
import os
import re
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.integrity import SafeFileSystemReader, checkpoint_problem, write_manifest
from components.checkpoint.states import SafeLoadPlanner
from components.runtime.errors import KilnError
from components.runtime.filesystem import require_shared, require_writable

_STEP_DIR = re.compile(r"^step-(\d+)$")


PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def one_process_quiet():
    """Without a process group DCP warns that it is "assuming the intent is to load (save) in a single
    process" — which is the intent of a one-process run or tool, so the warning is dropped there."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")
        yield


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step → folder of every complete checkpoint (a step-N folder with DCP's .metadata)."""
    found = {}
    if not folder.is_dir():
        return found
    for child in folder.iterdir():
        m = _STEP_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        if (child / ".metadata").exists():
            found[int(m.group(1))] = child
        else:
            warnings.warn(f"ignoring incomplete checkpoint {child} (no DCP .metadata)", stacklevel=2)
    return dict(sorted(found.items()))


def _reason(error: BaseException) -> str:
    """One line saying why a DCP call failed: under DCP's CheckpointException, the first failing
    rank's own error; a weights-only refusal's line naming the global it blocked, if any."""
    if isinstance(error, CheckpointException) and error.failures:
        first = next(iter(error.failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = lines[0] if lines else ""
    blocked = next((line for line in lines if "GLOBAL " in line and line != head), "")
    return f"{type(error).__name__}: {head}" + (f" ({blocked})" if blocked else "")


def checkpoint_keys(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every key stored in a DCP checkpoint: the global shape of a tensor, None for other values."""
    try:
        meta = SafeFileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated, foreign or crafted file: say which folder, not a pickle trace
        raise KilnError(f"cannot read checkpoint metadata in {path}: {e}") from None
    return {k: tuple(v.size) if hasattr(v, "size") else None for k, v in meta.state_dict_metadata.items()}


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor stored in a DCP checkpoint, by its flattened key."""
    return {k: v for k, v in checkpoint_keys(path).items() if v is not None}


def is_full_checkpoint(path: Path) -> bool:
    """Whether a checkpoint holds a whole training state (not only the model)."""
    return any(k.startswith("train_state.") for k in checkpoint_keys(path))


def check_model_matches(model_state: dict[str, Any], stored: dict[str, tuple[int, ...]], path: Path,
                        partial: bool = False) -> None:
    """Refuse a checkpoint of another model shape, naming the first parameter that differs.

    partial: the model is one pipeline stage, so the checkpoint may hold parameters it lacks.
    """
    for name, tensor in model_state.items():
        key = f"model.{name}"
        if key not in stored:
            raise KilnError(f"checkpoint {path} has no parameter {name!r}: it is of another model")
        if tuple(tensor.shape) != stored[key]:
            raise KilnError(
                f"checkpoint {path} does not fit the model: parameter {name!r} is "
                f"{list(stored[key])} in the checkpoint but {list(tensor.shape)} in the model"
            )
    model_keys = {f"model.{n}" for n in model_state}
    extra = sorted(k for k in stored if k.startswith("model.") and k not in model_keys)
    if extra and not partial:
        raise KilnError(f"checkpoint {path} has parameter {extra[0][6:]!r} that the model lacks: "
                        f"it is of another model")


class CheckpointManager:
    """Saves the run's Stateful parts every `interval` steps and loads the latest (or a chosen) one."""

    def __init__(self, folder: Path, states: dict[str, Stateful], *, enable: bool, interval: int,
                 keep_latest_k: int = 0, load_step: int = -1, async_mode: str = "disabled",
                 last_save_model_only: bool = False, export_dtype: str = "float32",
                 exclude_from_loading: str = "", is_main: bool = True, partial_model: bool = False,
                 shared_folder_wait_seconds: float = 10.0) -> None:
        self.folder = Path(folder)
        self.states = states
        self.enable = enable
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.load_step = load_step
        self.async_mode = async_mode
        self.last_save_model_only = last_save_model_only
        self.export_dtype = EXPORT_DTYPES[export_dtype]
        self.exclude = {p.strip() for p in exclude_from_loading.split(",") if p.strip()}
        unknown = self.exclude - set(PARTS)
        if unknown:
            raise KilnError(f"checkpoint.exclude_from_loading names unknown parts {sorted(unknown)}; "
                            f"parts: {', '.join(PARTS)}")
        self.is_main = is_main
        self.partial_model = partial_model
        self._pending: tuple[Any, int, Path, Path] | None = None  # (future, step, tmp, final)
        self._pg = None
        self.last_save_seconds = {"blocked": 0.0}
        if enable and async_mode == "async" and dist.is_initialized():
            # Its own group: async writes on the default group collide with training collectives.
            self._pg = dist.new_group(backend="gloo")
        if enable and is_main:
            require_writable(self.folder, "checkpoint folder")
        if enable:
            require_shared(self.folder, "checkpoint folder", shared_folder_wait_seconds)

    # ---------------------------------------------------------------- loading

    def load(self) -> int | None:
        """Load the checkpoint chosen by load_step (-1 = latest); returns its step, or None if none.

        Rank 0 chooses and tells the others, so every rank loads the same step even when their
        views of the folder differ for a moment (network file systems).
        """
        if not self.enable:
            return None
        decision = [self._choose() if self.is_main else None]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
        step, error = decision[0]
        if error:
            raise KilnError(error)
        if step is None:
            return None
        self.load_from(self.folder / f"step-{step}", parts=[p for p in PARTS if p not in self.exclude])
        return step

    def require_intact(self, path: Path, what: str) -> None:
        """Refuse a damaged checkpoint (the main rank reads it once and tells the others)."""
        problem = [checkpoint_problem(path) if self.is_main else None]
        if dist.is_initialized():
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise KilnError(f"{what} {path} is damaged: {problem[0]}")

    def _choose(self) -> tuple[int | None, str | None]:
        """(step to resume from or None, error message or None), from the main rank's view."""
        found = complete_checkpoints(self.folder)
        if self.load_step < 0:
            return self._choose_latest(found)
        if self.load_step not in found:
            have = ", ".join(map(str, found)) or "none"
            return None, (f"checkpoint.load_step {self.load_step} not found in {self.folder}; "
                          f"complete checkpoints: {have}")
        problem = checkpoint_problem(found[self.load_step])
        if problem:
            return None, (f"checkpoint.load_step {self.load_step}: {found[self.load_step]} is damaged: "
                          f"{problem}")
        newer = [s for s, path in found.items() if s > self.load_step and
                 checkpoint_problem(path, checksums=False) is None and is_full_checkpoint(path)]
        if newer:
            return None, (
                f"checkpoint.load_step {self.load_step} is older than step-{max(newer)} in {self.folder}: "
                f"resuming there would mix two runs' checkpoints. Start a new job.dump_folder with "
                f"--checkpoint.initial_load_path {self.folder}/step-{self.load_step} "
                f"--checkpoint.initial_load_model_only false")
        return self.load_step, None

    def _choose_latest(self, found: dict[int, Path]) -> tuple[int | None, str | None]:
        """The newest intact whole training state; a damaged newer one is skipped with one warning.
        A model-only checkpoint (a seed, or a last_save_model_only export) is no resume point unless
        it is all there is, like the seed checkpoint step-0. Only damaged ones: an error, never a
        silent fresh start over them."""
        damaged, model_only = [], None
        for step in sorted(found, reverse=True):
            problem = checkpoint_problem(found[step])
            if problem:
                damaged.append(f"{found[step]} ({problem})")
                warnings.warn(f"skipping damaged checkpoint {found[step]}: {problem}", stacklevel=2)
            elif is_full_checkpoint(found[step]):
                return step, None
            elif model_only is None:
                model_only = step
        if model_only is None and damaged:
            return None, f"no intact checkpoint in {self.folder}: " + "; ".join(damaged)
        return model_only, None

    def load_from(self, path: Path, parts: list[str]) -> list[str]:
        """Load the named parts that the checkpoint at `path` holds; returns the parts loaded."""
        keys = checkpoint_keys(path)
        if "model" in parts:
            stored = {k: v for k, v in keys.items() if v is not None}
            check_model_matches(self.states["model"].state_dict(), stored, path, self.partial_model)
        present = {key.split(".", 1)[0] for key in keys}
        loading = {p: self.states[p] for p in parts if p in present and p in self.states}
        start = time.perf_counter()
        try:
            with one_process_quiet():
                dcp.load(loading, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
        except KilnError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            raise KilnError(f"cannot load checkpoint {path}: {_reason(e)}") from None
        self.last_load_seconds = time.perf_counter() - start
        return list(loading)

    # ---------------------------------------------------------------- saving

    def should_save(self, step: int, last: bool) -> bool:
        return self.enable and (step % self.interval == 0 or last)

    def save(self, step: int, *, last: bool = False, model_only: bool = False) -> None:
        """Write step-N (model only at the last step if configured); never overwrite a complete one."""
        final = self.folder / f"step-{step}"
        start = time.perf_counter()  # waiting for the previous async save blocks training too
        self.wait()
        if (final / ".metadata").exists() and checkpoint_problem(final, checksums=False) is None:
            raise KilnError(f"refusing to overwrite the complete checkpoint {final}")
        model_only = model_only or (last and self.last_save_model_only)
        tmp = self.folder / f"step-{step}.tmp"
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)  # the remains of a crashed save
        if dist.is_initialized():
            dist.barrier()
        state = {"model": self._export_model()} if model_only else dict(self.states)
        if self.async_mode == "async" and not last:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
            self._pending = (future, step, tmp, final)
            self.last_save_seconds = {"blocked": time.perf_counter() - start}
            return
        try:
            with one_process_quiet():
                dcp.save(state, checkpoint_id=str(tmp))
        except CheckpointException as e:  # a BaseException: it would pass every `except Exception`
            raise KilnError(f"cannot save checkpoint {final}: {_reason(e)}") from None
        if os.environ.get("KILN_TEST_CRASH_DURING_SAVE") == str(step) and self.is_main:
            # Fault injection for the crash-consistency test: die after writing, before publishing.
            os.kill(os.getpid(), signal.SIGKILL)
        self._finish(step, tmp, final)
        self.last_save_seconds = {"blocked": time.perf_counter() - start}

    def _export_model(self) -> dict[str, torch.Tensor]:
        """The model's state dict in export_dtype (a model-only checkpoint for inference or a seed)."""
        return {k: v.to(self.export_dtype) if v.is_floating_point() else v
                for k, v in self.states["model"].state_dict().items()}

    @property
    def pending(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._pending is not None

    def poll(self) -> None:
        """Publish a finished asynchronous save now (called every step), not only at the next save."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk, then publish it."""
        if self._pending is None:
            return
        future, step, tmp, final = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            raise KilnError(f"asynchronous save of {final} failed: {_reason(e)}") from None
        self._finish(step, tmp, final)

    def _finish(self, step: int, tmp: Path, final: Path) -> None:
        """Write the manifest, rename step-N.tmp to step-N (main rank; all ranks' files are in) and
        prune old ones."""
        if self.is_main:
            start = time.perf_counter()
            write_manifest(tmp)
            self.last_manifest_seconds = time.perf_counter() - start
            if final.exists():  # an incomplete step-N (ignored) or a damaged one (set aside) is in the way
                _set_aside(final)
            tmp.rename(final)
            if self.keep_latest_k > 0:
                prune(self.folder, self.keep_latest_k)

    def close(self) -> None:
        """Finish any pending save (called at exit)."""
        self.wait()


def _set_aside(folder: Path) -> None:
    """Keep a damaged or incomplete step-N as step-N.damaged (evidence; no longer a checkpoint)."""
    if not (folder / ".metadata").exists():
        shutil.rmtree(folder)
        return
    aside = folder.with_name(folder.name + ".damaged")
    if aside.exists():
        shutil.rmtree(aside)
    folder.rename(aside)


def prune(folder: Path, keep: int) -> None:
    """Keep the newest `keep` intact whole training states and delete the whole states older than
    them; model-only exports stay. Only intact ones count, so a damaged checkpoint never pushes out
    the intact one a resume would need."""
    intact, older = 0, []
    for path in reversed(list(complete_checkpoints(folder).values())):
        if intact >= keep:
            older.append(path)
        elif checkpoint_problem(path, checksums=False) is None and is_full_checkpoint(path):
            intact += 1
    for path in older:
        if checkpoint_problem(path, checksums=False) is not None or is_full_checkpoint(path):
            shutil.rmtree(path, ignore_errors=True)


def load_model_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    """Fill a plain (one-process) model with the weights of a DCP step folder saved in any layout."""
    from components.checkpoint.states import ModelState

    checkpoint = Path(checkpoint)
    if not (checkpoint / ".metadata").is_file():
        raise KilnError(f"{checkpoint} is not a complete DCP checkpoint (no .metadata)")
    problem = checkpoint_problem(checkpoint)
    if problem:
        raise KilnError(f"checkpoint {checkpoint} is damaged: {problem}")
    state = ModelState([model])
    check_model_matches(state.state_dict(), checkpoint_shapes(checkpoint), checkpoint)
    try:
        with one_process_quiet():
            dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(checkpoint)),
                     planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # a damaged file: name the folder, not DCP's internals
        raise KilnError(f"cannot load checkpoint {checkpoint}: {_reason(e)}") from None
