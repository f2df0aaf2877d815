"""Same seed ⇒ the same full initial weights in every layout (gathered full state dicts compared)."""

import pytest
import torch

from tests.helpers.runs import TINY, check_ok, dump_args, run_train

PROBE = "tests/helpers/dump_init_weights.py"


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("init") / "single.pt"
    check_ok(run_train([str(out), *TINY, *dump_args(out.parent, data_cache)], script=PROBE))
    return torch.load(out)


@pytest.mark.parametrize("nproc,args", [
    (2, []),  # FSDP 2
    (4, ["--parallelism.data_parallel_replicate_degree", "2"]),  # HSDP 2×2
    (2, ["--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"]),  # DDP 2
    (2, ["--parallelism.tensor_parallel_degree", "2"]),  # TP 2
    (4, ["--parallelism.tensor_parallel_degree", "2"]),  # FSDP 2 × TP 2
], ids=["fsdp2", "hsdp2x2", "ddp2", "tp2", "fsdp2_tp2"])
def test_initial_weights_do_not_depend_on_layout(single, nproc, args, tmp_path, data_cache):
    out = tmp_path / "w.pt"
    check_ok(run_train([str(out), *TINY, *args, *dump_args(tmp_path, data_cache)], nproc=nproc, script=PROBE))
    weights = torch.load(out)
    assert weights.keys() == single.keys()
    for name, value in single.items():
        assert torch.equal(weights[name], value), name


def test_seed_changes_weights(single, tmp_path, data_cache):
    out = tmp_path / "w.pt"
    check_ok(run_train([str(out), *TINY, "--training.seed", "7", *dump_args(tmp_path, data_cache)],
                       script=PROBE))
    weights = torch.load(out)
    assert not torch.equal(weights["layers.0.attention.wq.weight"], single["layers.0.attention.wq.weight"])
    # The reference is not degenerate (the CPU DTensor RNG trap repeats one shard's values).
    wq = single["layers.0.attention.wq.weight"]
    assert not torch.equal(wq[: wq.shape[0] // 2], wq[wq.shape[0] // 2 :])
