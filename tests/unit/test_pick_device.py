"""Each process of a node gets a GPU of its own: more local ranks than GPUs is a one-line error."""

import pytest
import torch

from components.runtime.distributed import init_distributed, pick_device
from components.runtime.errors import KilnError


@pytest.fixture
def two_gpus(monkeypatch):
    """A node with two visible GPUs, as torch.cuda reports them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_each_local_rank_gets_its_own_gpu(two_gpus):
    assert [pick_device(r, 2) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize("local_rank", [0, 1, 2])
def test_more_processes_than_gpus_is_an_error_on_every_rank(two_gpus, local_rank):
    with pytest.raises(KilnError) as error:
        pick_device(local_rank, 3)
    message = str(error.value)
    assert "\n" not in message
    assert "3 processes on this node" in message and "2 visible GPU(s) (cuda:0..1)" in message
    assert "--nproc-per-node=2" in message


def test_a_local_rank_past_the_gpus_is_an_error_without_local_world_size(two_gpus):
    with pytest.raises(KilnError, match="3 processes on this node"):
        pick_device(2)


def test_one_gpu_is_named_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(KilnError, match=r"\(cuda:0\): launch at most 1 per node"):
        pick_device(1, 2)


def test_without_cuda_every_rank_runs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(5, 8) == torch.device("cpu")


def test_init_distributed_checks_torchruns_local_world_size(two_gpus, monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE reaches the check, so rank 0 of 3 on 2 GPUs fails too."""
    for var, value in {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3",
                       "RAYON_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(KilnError, match="--nproc-per-node=2"):
        init_distributed(timeout_seconds=10)
