"""Loading a checkpoint runs no code from it: the non-tensor values of a DCP checkpoint are read with
torch.load(weights_only=True) (components/checkpoint_states.SafeLoadPlanner), which takes plain
data and refuses any other pickled global, and its .metadata through an allow-list of DCP's own
metadata classes (components/checkpoint_integrity.SafeFileSystemReader)."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from components.checkpoint.integrity import write_manifest
from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, run_train, train_rows


class RunsCode:
    """A value whose unpickling calls os.mkdir(marker): what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def _non_tensor_keys(checkpoint: Path) -> list[str]:
    """The keys a checkpoint stores as pickled bytes (not tensors)."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    return [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]


def _with_value_that_runs_code(source: Path, target: Path, marker: Path, scratch: Path) -> str:
    """A copy of the checkpoint at `source`, rewritten by DCP with one of the optimizer's non-tensor
    values (a learning rate) replaced by RunsCode(marker), and a manifest that matches it, as a
    checkpoint from elsewhere would come; returns the replaced key."""
    dcp_to_torch_save(str(source), str(scratch))
    state = torch.load(scratch, weights_only=True)
    key = next(k for k in state["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr"))
    state["optimizer"][key] = RunsCode(marker)
    dcp.save(state, checkpoint_id=str(target), no_dist=True)
    write_manifest(target)
    return f"optimizer.{key}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in this one process
def test_checkpoint_value_that_would_run_code_is_refused(tmp_path, data_cache):
    """A 4-step run of the tiny model saves step-2, whose non-tensor values (the optimizer's param
    groups: floats, tuples, booleans, None) are read under weights_only when the run resumes from
    it, exactly. The same checkpoint with one learning rate replaced by a pickled object that would
    call os.mkdir, started from (checkpoint.initial_load_path), makes the run fail before step 1
    with one line naming the checkpoint and the global torch's refusal blocked; the folder is never
    made, while DCP's own planner, reading the same checkpoint, makes it (the payload is live)."""
    common = [*TINY, "--training.steps", "4", "--training.data_cache_dir", str(data_cache)]
    first = tmp_path / "first"
    saving = [*common, "--checkpoint.enable", "--checkpoint.interval", "2", *dump_args(first)]
    check_ok(run_train(saving))
    straight = train_rows(first)
    step2 = first / "checkpoint" / "step-2"
    assert any(".param_groups." in k for k in _non_tensor_keys(step2))
    marker = tmp_path / "code_ran"
    evil = tmp_path / "elsewhere" / "step-2"
    key = _with_value_that_runs_code(step2, evil, marker, tmp_path / "full.pt")
    assert key in _non_tensor_keys(evil)

    shutil.rmtree(first / "checkpoint" / "step-4")  # Kiln's own checkpoint resumes
    resumed = run_train(saving)
    check_ok(resumed)
    assert "resumed from" in resumed.stdout and "step-2" in resumed.stdout
    rows = {r["step"]: r for r in train_rows(first)}  # the resumed run's rows (steps 3, 4) come last
    for want in straight[2:]:
        assert abs(rows[want["step"]]["loss"] - want["loss"]) <= 1e-5 * want["loss"], (rows, want)

    started = tmp_path / "started"
    proc = run_train([*common, "--checkpoint.initial_load_path", str(evil),
                      "--checkpoint.initial_load_model_only", "false", *dump_args(started)])
    assert not marker.exists()  # the code never ran
    fails_with(proc, "cannot load checkpoint", "Weights only load failed", "GLOBAL posix.mkdir")
    assert not (started / "metrics.jsonl").exists()  # refused before the first step

    dcp_to_torch_save(str(evil), str(tmp_path / "unsafe.pt"))  # DCP's default planner unpickles freely
    assert marker.is_dir()


def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path, data_cache):
    """DCP unpickles a checkpoint's .metadata with plain pickle; Kiln reads it through an allow-list
    (components/checkpoint_integrity.SafeFileSystemReader). A saved checkpoint whose .metadata is
    replaced by a pickle that would call os.mkdir, with a manifest that matches: the run refuses it
    as damaged, names the blocked global in one line, and the code never runs."""
    import pickle

    common = [*TINY, "--training.steps", "2", "--training.data_cache_dir", str(data_cache)]
    first = tmp_path / "first"
    check_ok(run_train([*common, "--checkpoint.enable", "--checkpoint.interval", "2",
                        *dump_args(first)]))
    crafted = tmp_path / "elsewhere" / "step-2"
    shutil.copytree(first / "checkpoint" / "step-2", crafted)
    marker = tmp_path / "code_ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    (crafted / "kiln_manifest.json").unlink()
    write_manifest(crafted)
    proc = run_train([*common, "--checkpoint.initial_load_path", str(crafted),
                      *dump_args(tmp_path / "started")])
    assert not marker.exists()
    fails_with(proc, str(crafted), "refused posix.mkdir")
