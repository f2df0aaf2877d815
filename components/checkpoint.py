"""CheckpointManager: atomic, resharding, optionally asynchronous checkpoints over DCP.

A checkpoint is one DCP folder `<dump>/<folder>/step-N/` holding every Stateful part of a run
(model, optimizer, lr_scheduler, dataloader, train_state) under layout-free names: FSDP/DDP/TP
shards are saved by parameter name and global shape, so any layout can load any checkpoint.
Each is written as `step-N.tmp` and renamed once DCP's coordinator has written the metadata,
which it does only after every rank finished: a crash mid-save leaves the previous checkpoint
as the latest.
"""

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
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint_states import SafeLoadPlanner
from components.errors import KilnError

_STEP_DIR = re.compile(r"^step-(\d+)$")
PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor stored in a DCP checkpoint, by its flattened key."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign file: say which folder, not a pickle trace
        raise KilnError(f"cannot read checkpoint metadata in {path}: {e}") from None
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}


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
                 exclude_from_loading: str = "", is_main: bool = True, partial_model: bool = False) -> None:
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
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                probe = self.folder / f".write-test-{time.time_ns()}"
                probe.touch()
                probe.unlink()
            except OSError as e:
                raise KilnError(f"checkpoint folder {self.folder} is not writable: {e}") from None

    # ---------------------------------------------------------------- loading

    def load(self) -> int | None:
        """Load the checkpoint chosen by load_step (-1 = latest); returns its step, or None if none."""
        if not self.enable:
            return None
        found = complete_checkpoints(self.folder)
        if self.load_step >= 0:
            if self.load_step not in found:
                have = ", ".join(map(str, found)) or "none"
                raise KilnError(f"checkpoint.load_step {self.load_step} not found in {self.folder}; "
                                f"complete checkpoints: {have}")
            step = self.load_step
        elif found:
            step = max(found)
        else:
            return None
        self.load_from(found[step], parts=[p for p in PARTS if p not in self.exclude])
        return step

    def load_from(self, path: Path, parts: list[str]) -> list[str]:
        """Load the named parts that the checkpoint at `path` holds; returns the parts loaded."""
        stored = checkpoint_shapes(path)
        if "model" in parts:
            check_model_matches(self.states["model"].state_dict(), stored, path, self.partial_model)
        present = {key.split(".", 1)[0] for key in stored} | {
            key.split(".", 1)[0] for key in self._non_tensor_keys(path)}
        loading = {p: self.states[p] for p in parts if p in present and p in self.states}
        start = time.perf_counter()
        try:
            dcp.load(loading, checkpoint_id=str(path), planner=SafeLoadPlanner())
        except KilnError:
            raise
        except Exception as e:
            raise KilnError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from None
        self.last_load_seconds = time.perf_counter() - start
        return list(loading)

    @staticmethod
    def _non_tensor_keys(path: Path) -> list[str]:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        return [k for k, v in meta.state_dict_metadata.items() if not hasattr(v, "size")]

    # ---------------------------------------------------------------- saving

    def should_save(self, step: int, last: bool) -> bool:
        return self.enable and (step % self.interval == 0 or last)

    def save(self, step: int, *, last: bool = False, model_only: bool = False) -> None:
        """Write step-N (model only at the last step if configured); never overwrite a complete one."""
        final = self.folder / f"step-{step}"
        start = time.perf_counter()  # waiting for the previous async save blocks training too
        self.wait()
        if (final / ".metadata").exists():
            self.last_save_seconds = {"blocked": time.perf_counter() - start}
            return  # never overwrite a complete checkpoint (e.g. the step a run resumed from)
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
        dcp.save(state, checkpoint_id=str(tmp))
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

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk, then publish it."""
        if self._pending is None:
            return
        future, step, tmp, final = self._pending
        self._pending = None
        future.result()
        self._finish(step, tmp, final)

    def _finish(self, step: int, tmp: Path, final: Path) -> None:
        """Rename step-N.tmp to step-N (main rank; all ranks' files are in) and prune old ones."""
        if self.is_main:
            tmp.rename(final)
            if self.keep_latest_k > 0:
                complete = list(complete_checkpoints(self.folder).values())
                for old in complete[: -self.keep_latest_k]:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Finish any pending save (called at exit)."""
        self.wait()
