"""Expert weights scale with the shard when there are fewer local experts than FSDP ranks.

FSDP shards a parameter's first dimension; expert weights are stacked [experts, ...] and already
split over EP, so with fewer local experts than FSDP ranks each rank would keep a whole (padded)
expert — Mixtral 8x7B over EP 8 × FSDP 8 held 21 GiB of weights per rank instead of 2.7 (found
by scripts/plan.py). The experts' rows are sharded then instead. That such a layout trains like one
process is tests/e2e/test_expert_sharding_runs.py.
"""

import dataclasses
import logging
import warnings

import pytest


@pytest.mark.parametrize("flavor,world,ep,local_rows", [("mixtral_8x7b", 64, 8, 14336 // 8)])
def test_expert_rows_are_sharded_when_experts_run_out(flavor, world, ep, local_rows):
    """Built in a fake world of `world` ranks: each rank keeps 1/world of the experts, not one each."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    from components.config.loading import load_config
    from components.config.parallel_options import ParallelOptions
    from planning.fake_world import fake_world
    from training.assembly import build_layout, build_model_parts, load_model_family

    cfg = load_config(["--config", "moe_debug", "--model.flavor", flavor, "--training.seq_len", "64",
                       "--training.local_batch_size", "1", "--training.global_batch_size", "-1",
                       "--parallelism.expert_parallel_degree", str(ep)])
    spec, args = load_model_family(cfg)
    options = dataclasses.replace(ParallelOptions.from_config(cfg, "cuda"), device_type="cpu")
    dims, _ = build_layout(cfg, spec, args, world, options, "cuda")
    with fake_world(world, 0):
        dims.build_mesh("cpu")
        part = build_model_parts(spec, args, dims, options).parts[0]
        w1 = part.layers["0"].moe.experts.w1
        assert tuple(w1._local_tensor.shape) == (args.moe.num_experts // ep, local_rows, args.dim)
        dims.release()


@pytest.mark.parametrize("counts", [[[3, 0, 2], [1, 4, 0]], [[0, 0], [0, 0]], [[5]],
                                    [[0, 2, 1, 0], [2, 0, 0, 3], [1, 1, 1, 1]]])
def test_received_rows_are_reordered_expert_major(counts):
    """EP's received rows come grouped by source rank, then expert; the permutation lists, expert by
    expert and source by source, the positions of that block's rows."""
    from parallelisms.expert_parallel import _source_major_to_expert_major

    starts, at = {}, 0
    for s, row in enumerate(counts):
        for e, n in enumerate(row):
            starts[s, e] = at
            at += n
    expected = [starts[s, e] + i for e in range(len(counts[0])) for s in range(len(counts))
                for i in range(counts[s][e])]
    assert _source_major_to_expert_major(counts).tolist() == expected
