"""The planner (scripts/plan.py): its numbers against a real run, its refusals, a 1024-rank plan, --json.

Planned parameter, gradient and optimizer bytes must equal what the real run's tensors hold
(FSDP padding and uneven pipeline stages included) and the planned peak must be within 10% of the
allocator's measured peak of the same step (components/memory_report.py).
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO, TINY, fails_with

from components.memory_report import live_peak
from scripts.plan_check import measured, planned

# Odd shapes on purpose: FSDP shards that need padding (256 rows over 3 ranks), 5 layers cut into
# 2 uneven pipeline stages.
ODD = [*TINY, "--job.custom_import", "tests.helpers.variant_models", "--model.name", "llama3_odd",
       "--training.seq_len", "60", "--training.global_batch_size", "12", "--training.local_batch_size", "4"]
LAYOUTS = {
    "fsdp3": (3, ODD),
    # DDP is fully_shard over (replicate 2, shard 1): the planner runs the real thing.
    "ddp2": (2, [*ODD, "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "2"]),
    "pp2": (2, [*ODD, "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_microbatch_size", "2"]),
}


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/plan.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_equals_a_real_run(layout, data_cache):
    nproc, args = LAYOUTS[layout]
    real = measured(nproc, args, data_cache)
    plan = planned(nproc, args, list(range(nproc)))
    for rank in range(nproc):
        for key in ("parameters", "gradients", "optimizer"):
            assert plan[rank][key] == real[rank][key], (rank, key, plan[rank][key], real[rank][key])
        assert sum(plan[rank]["parameters"].values()) > 0
        assert abs(plan[rank]["peak"] - real[rank]["peak"]) <= 0.10 * real[rank]["peak"], (
            rank, plan[rank]["peak"], real[rank]["peak"])


def test_the_measured_cpu_peak_pairs_blocks_by_address():
    # (ns, address, bytes, made inside a collective). The profiler misses frees made on threads it
    # does not profile (gloo's workers drop a reduce-scatter's input copy there): block 0xA is never
    # seen freed, and its address is handed out again at 30, so it was free by then.
    events = [(10, 0xA, 8, True), (20, 0xB, 4, False), (30, 0xA, 8, False), (40, 0xB, -4, False),
              (50, 0xC, 2, False), (60, 0xA, -8, False)]
    assert live_peak(events, 0, 100) == 12  # summed, the events would say 20
    assert live_peak(events, 45, 100) == 10  # within a window: what was live before it counts
    assert live_peak([(1, 0xD, -5, False), (2, 0xE, 3, False)], 0, 10) == 3  # freed, made before: nothing
    # A collective's block from before the window that no tensor holds at its start was freed unseen.
    events = [(10, 0xA, 8, True), (20, 0xB, 4, True), (30, 0xC, 2, False), (40, 0xD, 1, False)]
    assert live_peak(events, 25, 100) == 15
    assert live_peak(events, 25, 100, held_at_start={0xB}) == 7


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_reduction_into_another_dtype_counts_its_copy_of_the_input_on_cpu(device_type):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planning.step_tracker import StepTracker

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        grad = torch.empty(1 << 20)  # 4 MiB of float32
        tracker = StepTracker(fake, {}, device_type)
        with tracker:
            tracker.reset_peak()
            torch.linalg.vector_norm(grad, 2, dtype=torch.float64)  # the CPU grad-norm clip's
            torch.linalg.vector_norm(grad, 2)  # no cast: nothing beyond its output
    copy = (1 << 20) * 8 if device_type == "cpu" else 0
    assert tracker.peak == copy + 8


def test_refused_layout_lists_every_problem_as_the_trainer_does():
    bad = ["--config", "llama_debug", "--model.flavor", "tiny", "--training.seq_len", "62",
           "--parallelism.tensor_parallel_degree", "3", "--parallelism.context_parallel_degree", "2",
           "--parallelism.pipeline_parallel_degree", "4", "--training.global_batch_size", "7"]
    proc = plan_cli("--world-size", "48", *bad)
    fails_with(proc, "problems with this layout", "attention heads", "2 × context_parallel_degree",
               "more than the model's 2 layers", "global_batch_size 7")
    # The trainer refuses the same layout with the same line (one process: the world size differs,
    # so both are asked for a world of 1).
    trainer = subprocess.run([sys.executable, "train.py", *bad], cwd=REPO, capture_output=True, text=True)
    planner = plan_cli("--world-size", "1", *bad)
    ours = [line for line in trainer.stderr.splitlines() if line.startswith("kiln: error:")]
    assert ours and ours == [line for line in planner.stderr.splitlines() if line.startswith("kiln: error:")]


def test_a_1024_rank_plan_of_8b():
    proc = plan_cli("--config", "llama3_8b", "--world-size", "1024", "--parallelism.tensor_parallel_degree",
                    "8", "--training.seq_len", "2048", "--no-ac-modes", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["world_size"] == 1024 and plan["model"] == "llama3/8B"
    (rank,) = plan["ranks"]
    # 8.03B parameters over 128 FSDP × 8 TP ranks in fp32: about 31 MiB of weights per rank, as
    # stored (padding included), the same again as gradients, twice as AdamW state.
    params = sum(rank["parameters"].values())
    assert 8.03e9 * 4 / 1024 <= params <= 1.05 * 8.03e9 * 4 / 1024
    assert sum(rank["gradients"].values()) == params
    assert abs(sum(rank["optimizer"].values()) - 2 * params) < 1e4  # + the step counters
    assert set(rank["communication"]) == {"dp_shard", "tp"}
    assert rank["communication"]["dp_shard"]["reduce-scatter"] > 0 and rank["fits"] is True


def test_json_shape():
    proc = plan_cli("--config", "llama_debug", "--model.flavor", "tiny", "--training.seq_len", "64",
                    "--world-size", "4", "--parallelism.pipeline_parallel_degree", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    for key in ("model", "layout", "world_size", "global_batch", "device", "ranks", "step_seconds",
                "tokens_per_second_per_device", "bubble", "flops_per_token"):
        assert key in plan, key
    assert [r["rank"] for r in plan["ranks"]] == [0, 2]  # first rank of the first and the last stage
    for r in plan["ranks"]:
        assert set(r["ac_peaks"]) == {"none", "selective", "full"}
        assert r["ac_peaks"]["full"] <= r["ac_peaks"]["selective"] <= r["ac_peaks"]["none"]
        assert 0 < r["bubble"] < 1 and r["peak"] >= sum(r["parameters"].values())
    # 1F1B over 2 stages, 16 rows / dp 2 = 8 microbatches of 1: (p - 1) / (m + p - 1) = 1/9
    assert plan["bubble"] == pytest.approx(1 / 9)
