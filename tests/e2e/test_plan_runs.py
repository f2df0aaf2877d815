"""The planner (scripts/plan.py): its numbers against a real run, its refusals, a 1024-rank plan, --json.

Planned parameter, gradient and optimizer bytes must equal what the real run's tensors hold
(FSDP padding and uneven pipeline stages included), the planned peak must be within 10% of the
allocator's measured peak of the same step, and the planned collectives must be the ones the step
issued: calls and bytes per mesh dimension and kind (components/observability/memory_report.py).
"""

import json
import subprocess
import sys

import pytest

from benchmarks.plan_check import measured, planned
from tests.helpers.runs import REPO, TINY, fails_with

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
    # TP 3 needs a feed-forward 3 divides (264): sequence parallel, loss parallel, FSDP of 1.
    "tp3": (3, [*ODD, "--model.name", "llama3_odd_tp", "--parallelism.tensor_parallel_degree", "3",
                "--parallelism.data_parallel_shard_degree", "1"]),
    # CP 2 (head-tail halves of 60 positions) with FSDP over the cp ranks.
    "cp2": (2, [*ODD, "--parallelism.context_parallel_degree", "2"]),
    # EP 2 borrows dp_shard 2: each rank holds 4 of the 8 experts and all-to-alls its tokens.
    "ep2": (2, [*TINY, "--model.name", "moe", "--training.global_batch_size", "8",
                "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
    # HSDP: 2 replicas of FSDP 2, reduce-scatter within a replica and all-reduce across.
    "hsdp2x2": (4, [*ODD, "--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "3"]),
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
    check_communication(plan, real)


def check_communication(plan: dict[int, dict], real: dict[int, dict]) -> None:
    """Every rank issued the planned collectives: the same calls per (mesh dim, kind), and the same
    bytes, except that all-to-all bytes are compared summed over the ranks. An all-to-all is expert
    parallel's token exchange: what a rank sends back (its experts' outputs, and the gradients of
    the rows it received) is what the router sent it, which the planner takes as balanced; the rows
    each rank sends out (tokens × top k) are fixed, so the sum over the ranks is exact."""
    def table(rank: dict, field: str) -> dict[tuple[str, str], int]:
        return {(dim, kind): n for dim, kinds in rank[field].items() for kind, n in kinds.items()}

    sums: dict[tuple[str, str], list[int]] = {}
    for r in sorted(real):
        assert "communication" in real[r], "the memory report has no communication: train.py passes no dims"
        measured_calls = {key: v["calls"] for key, v in table(real[r], "communication").items()}
        measured_bytes = {key: v["bytes"] for key, v in table(real[r], "communication").items()}
        planned_bytes = table(plan[r], "communication")
        assert planned_bytes, r  # every layout here communicates
        assert table(plan[r], "calls") == measured_calls, (r, table(plan[r], "calls"), measured_calls)
        for key, nbytes in planned_bytes.items():
            if key[1] == "all-to-all":
                total = sums.setdefault(key, [0, 0])
                total[0] += nbytes
                total[1] += measured_bytes[key]
            else:
                assert nbytes == measured_bytes[key], (r, key, nbytes, measured_bytes[key])
    for key, (planned_total, measured_total) in sums.items():
        assert planned_total == measured_total, (key, planned_total, measured_total)


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


def test_deepseek_v3_671b_on_1024_ranks():
    """The shipped config as it stands (compile on, which the planner runs eager): PP 16 × EP 64 ×
    FSDP 64, the multi-token prediction module and a tied copy of the embedding on the last stage;
    a middle stage's rank planned too (receive buffers both ways, neither embedding nor head)."""
    proc = plan_cli("--config", "deepseek_v3_671b", "--world-size", "1024", "--no-ac-modes",
                    "--no-suggestions", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["model"] == "deepseek_v3/671B" and plan["world_size"] == 1024
    # 671.0B in the main model (as published) and 11.6B in the MTP module (the release's 14B counts its
    # copies of the embedding and head, which Kiln shares).
    assert round(plan["num_params"] / 1e9, 1) == 682.6
    first, middle, last = plan["ranks"]  # the first rank of the first, second and last stage
    assert (first["rank"], middle["rank"], last["rank"]) == (0, 64, 960)
    for rank in (first, middle, last):
        assert rank["fits"] is True, rank
        assert rank["communication"]["ep"]["all-to-all"] > 0 and "tp" not in rank["communication"]
    # The last stage holds the MTP block, the head and an embedding copy on top of its share of blocks.
    assert sum(last["parameters"].values()) > 1.5 * sum(first["parameters"].values())


def floor_ratios(stdout: str) -> dict[str, float]:
    """The plan's `floor` line: "group kind" → bytes sent over the least the layout needs."""
    line = next(line for line in stdout.splitlines() if line.startswith("floor "))
    cells = line.split(": ", 1)[1].split("; above it")[0].split(", ")
    return {cell.rsplit(" ", 1)[0]: float(cell.rsplit(" ", 1)[1].rstrip("×")) for cell in cells}


MOE4 = ["--config", "moe_debug", "--model.flavor", "tiny", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.global_batch_size", "8",
        "--parallelism.expert_parallel_degree", "2"]


DEEPSEEK4 = ["--config", "deepseek_v3_debug", "--model.flavor", "tiny", "--training.seq_len", "64",
             "--training.local_batch_size", "4", "--training.global_batch_size", "8",
             "--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize("world,args,groups", [  # FSDP alone: test_what_sends_more_than_its_floor_is_named
    (4, [*TINY, "--parallelism.pipeline_parallel_degree", "2"], {"dp_shard"}),
    (4, MOE4, {"dp_shard", "dp_shard_mod_ep", "ep"}),
    (4, [*MOE4, "--parallelism.data_parallel_replicate_degree", "2"], {"dp_replicate", "dp_shard_cp", "ep"}),
    (4, [*TINY, "--parallelism.tensor_parallel_degree", "2"], {"dp_shard", "tp"}),
    (4, [*DEEPSEEK4, "--parallelism.expert_parallel_degree", "2"], {"dp_shard", "ep", "tp"}),
], ids=["pp2_fsdp2", "fsdp4_ep2", "hsdp2x2_ep2", "fsdp2_tp2", "deepseek_tp2_ep2"])
def test_a_step_of_one_microbatch_sends_its_floors_exactly(world, args, groups):
    """FSDP's floor: the blocks gathered for forward and again for backward (once under a pipeline,
    whose stages keep them), the embedding and head once (parallelisms/fsdp.py), every gradient
    reduce-scattered once, HSDP's shards all-reduced once — under EP the experts over dp_shard_mod_ep,
    their replicas' all-reduce dp_replicate's; EP's: each routed token there and back; TP's: each
    block's inputs gathered and outputs reduced, forward and backward, the embedding's and the head's
    once each way (DeepSeek-V3's MLA: its latents' gradients all-reduced instead of its input's; an
    MoE layer under EP: nothing reduced). A step of one microbatch without AC sends just that (EP: and
    the counts per expert; TP: and the norms' weight gradients), every group named."""
    proc = plan_cli(*args, "--world-size", str(world), "--activation_checkpoint.mode", "none",
                    "--no-ac-modes", "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = floor_ratios(proc.stdout)
    assert {group for key in ratios for group in key.rsplit(" ", 1)[0].split(" = ")} == groups, proc.stdout
    assert all(ratio == pytest.approx(1.0, abs=0.005) for ratio in ratios.values()), ratios
    assert "above it" not in proc.stdout


def test_what_sends_more_than_its_floor_is_named():
    """Two microbatches of FSDP gather and reduce-scatter twice what one needs (exactly 2.00×: the
    blocks twice each, the embedding and head once); full AC recomputes each forward, whose dispatch
    and combine send again — 6 all-to-alls of the 4 (1.50×)."""
    proc = plan_cli(*TINY, "--world-size", "2", "--training.local_batch_size", "2",
                    "--training.global_batch_size", "8", "--no-ac-modes", "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert floor_ratios(proc.stdout) == {"dp_shard all-gather": 2.0, "dp_shard reduce-scatter": 2.0}
    assert "FSDP's collectives once per microbatch" in proc.stdout
    world, args = LAYOUTS["ep2"]
    proc = plan_cli(*args, "--world-size", str(world), "--activation_checkpoint.mode", "full",
                    "--no-ac-modes", "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert floor_ratios(proc.stdout)["dp_shard = ep all-to-all"] == pytest.approx(1.5, abs=0.01)
    assert "recomputes forwards, whose collectives send again" in proc.stdout


def test_what_tp_sends_above_its_floor_is_named():
    """TP without FSDP runs under autocast, which keeps the norms' and the embedding's outputs in
    float32: of the tiny model's 10 rows each way (4 per block, the embedding's and the head's), 6 go
    in float32 — exactly 1.60×. An MoE layer without EP sums its input's gradient by all-reduces
    (its routed and shared experts' each) where one reduce-scatter would do."""
    proc = plan_cli(*TINY, "--world-size", "2", "--parallelism.tensor_parallel_degree", "2",
                    "--no-ac-modes", "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert floor_ratios(proc.stdout) == {"tp all-gather": 1.6, "tp reduce-scatter": 1.6}
    assert "autocast keeps the norms' and the embedding's outputs in float32" in proc.stdout
    proc = plan_cli(*DEEPSEEK4, "--world-size", "4", "--no-ac-modes", "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = floor_ratios(proc.stdout)
    assert ratios["tp all-gather"] == pytest.approx(1.0, abs=0.005) and ratios["tp reduce-scatter"] > 1.2
    assert "an MoE layer without EP sums its input's gradient by all-reduces" in proc.stdout
    assert "autocast" not in proc.stdout
    # a model with its own TP plan (the GPT-2 example, Megatron's without sequence parallel) is planned,
    # its FSDP held to its floor, its TP to none claimed
    proc = plan_cli("--config", "llama_debug", "--job.custom_import", "examples/gpt2_model.py",
                    "--model.name", "gpt2", "--model.flavor", "tiny", "--training.seq_len", "64",
                    "--world-size", "4", "--parallelism.tensor_parallel_degree", "2", "--no-ac-modes",
                    "--no-suggestions")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(floor_ratios(proc.stdout)) == {"dp_shard all-gather", "dp_shard reduce-scatter"}, proc.stdout


def test_json_shape():
    """The --json plan of PP 2 over 4 ranks. Its peaks per AC mode strictly fall from none to
    selective to full: planned 6,067,764 / 5,869,108 / 5,471,796 bytes on the first stage and
    19,834,204 / 19,471,708 / 19,107,164 on the last. Hence seq 256 and per-op selective AC: at seq
    64 the first stage's peak is its optimizer step's in every mode, and selective option 2
    checkpoints a one-block stage's only block, as full does."""
    proc = plan_cli("--config", "llama_debug", "--model.flavor", "tiny", "--training.seq_len", "256",
                    "--activation_checkpoint.selective_ac_option", "op",
                    "--world-size", "4", "--parallelism.pipeline_parallel_degree", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    for key in ("model", "layout", "world_size", "global_batch", "device", "ranks", "step_seconds",
                "tokens_per_second_per_device", "bubble", "flops_per_token"):
        assert key in plan, key
    assert [r["rank"] for r in plan["ranks"]] == [0, 2]  # first rank of the first and the last stage
    for r in plan["ranks"]:
        assert set(r["ac_peaks"]) == {"none", "selective", "full"}
        assert r["ac_peaks"]["full"] < r["ac_peaks"]["selective"] < r["ac_peaks"]["none"], r["ac_peaks"]
        assert 0 < r["bubble"] < 1 and r["peak"] >= sum(r["parameters"].values())
    # 1F1B over 2 stages, 16 rows / dp 2 = 8 microbatches of 1: (p - 1) / (m + p - 1) = 1/9
    assert plan["bubble"] == pytest.approx(1 / 9)
