"""The planner's step-time model against published runs: TorchTitan's Llama 3.1 tables on H100s
(benchmarks/llama3_h100_202412_torchtitan.md in TorchTitan's repository, measured 2024-12 on
Grand Teton hosts: 8 H100s per host over NVLink, 400 Gb/s RDMA per GPU, 500 W).

    python benchmarks/step_time_published.py [--rows t1,t3,...]

Each row is planned as Kiln would run it (scripts/plan.py's make_plan, every layer on fake
tensors; float8 as the efficiency table's speed-up, since the planner measures unconverted
linears). Three constants are fitted, each on one row of Table 1 (8B on 8 GPUs): the compute
efficiency on FSDP, compile's speed-up on FSDP + compile, float8's on FSDP + compile + float8;
every other row is a prediction, and its error is reported.
"""

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config.loading import load_config  # noqa: E402
from planning.devices import DEVICES  # noqa: E402
from planning.plan import Plan, make_plan  # noqa: E402
from planning.step_time import Efficiency  # noqa: E402

# The real-size configs compile their blocks: the eager rows turn it off.
B8 = ["--config", "llama3_8b", "--training.seq_len", "8192", "--compile.enable", "false"]
COMPILE, FLOAT8 = ["--compile.enable", "true"], ["--model.converters", "float8"]
SELECTIVE = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
FULL = ["--activation_checkpoint.mode", "full"]


def t1(local: int = 2, world: int = 8) -> list[str]:
    return [*B8, "--training.local_batch_size", str(local), "--training.global_batch_size",
            str(local * world), *SELECTIVE]


def cp(cp_degree: int, seq: int) -> list[str]:
    return ["--config", "llama3_8b", "--training.seq_len", str(seq), "--training.local_batch_size", "1",
            "--training.global_batch_size", str(8 // cp_degree), "--parallelism.context_parallel_degree",
            str(cp_degree), *COMPILE, *FLOAT8, *FULL]


B70 = ["--config", "llama3_70b", "--training.seq_len", "8192", "--training.local_batch_size", "16",
       "--training.global_batch_size", "512", "--parallelism.tensor_parallel_degree", "8", *COMPILE, *FLOAT8,
       *FULL]
B405 = ["--config", "llama3_405b", "--training.seq_len", "8192", "--training.global_batch_size", "256",
        "--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "8",
        "--parallelism.pipeline_parallel_microbatch_size", "1", *COMPILE, *FLOAT8, *FULL]

# name → (what, world, arguments, published tokens/s per GPU); fit_* rows set the constants.
ROWS = {
    "fit_eager": ("T1 8B FSDP 8", 8, t1(), 5762),
    "fit_compile": ("T1 8B FSDP 8 + compile", 8, [*t1(), *COMPILE], 6667),
    "fit_float8": ("T1 8B FSDP 8 + compile + float8", 8, [*t1(), *COMPILE, *FLOAT8], 8532),
    "t3": ("T3 8B FSDP 128", 128, t1(world=128), 5605),
    "t3_compile": ("T3 8B FSDP 128 + compile", 128, [*t1(world=128), *COMPILE], 6514),
    "t3_float8": ("T3 8B FSDP 128 + compile + float8", 128, [*t1(world=128), *COMPILE, *FLOAT8], 8380),
    "t2_cp1": ("T2 8B FSDP 8, seq 32K", 8, cp(1, 32768), 3890),
    "t2_cp2": ("T2 8B FSDP 4 × CP 2, seq 64K", 8, cp(2, 65536), 2540),
    "t2_cp4": ("T2 8B FSDP 2 × CP 4, seq 128K", 8, cp(4, 131072), 1071),
    "t4": ("T4 70B TP 8 × FSDP 32", 256, B70, 829),
    "t5_1f1b": ("T5 405B TP 8 × PP 8 × FSDP 8, 1F1B", 512, [*B405, "--parallelism.pipeline_parallel_schedule",
                                                            "1F1B"], 100),
    "t5_interleaved": ("T5 405B TP 8 × PP 8 × FSDP 8, interleaved", 512,
                       [*B405, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 128),
}


def planned(row: tuple) -> Plan:
    """A row planned as Kiln would run it (float8: the model's linears unconverted, its speed-up
    applied by the step-time model)."""
    _, world, args, _ = row
    cfg = load_config([a for a in args if a not in FLOAT8])
    plan = make_plan(cfg, world, DEVICES["h100"], ac_modes=False)
    plan.facts = dataclasses.replace(plan.facts, float8="float8" in args)
    return plan


def speed(plan: Plan, eff: Efficiency) -> float:
    """tokens/s per GPU the model predicts for a planned row with these constants."""
    return dataclasses.replace(plan, device=dataclasses.replace(plan.device, efficiency=eff)
                               ).tokens_per_second_per_device


def fit(plan: Plan, published: float, eff: Efficiency, name: str) -> Efficiency:
    """The constant `name` set so that the row's predicted step equals the published one: the
    compute that leaves room for the exposed communication and the bubble (a few rounds, since
    what FSDP hides depends on the compute)."""
    for _ in range(5):
        t = dataclasses.replace(plan, device=dataclasses.replace(plan.device, efficiency=eff)).estimate
        target = t.tokens_per_second_per_device / published * t.seconds
        compute = (target - sum(t.exposed.values())) * (1 - t.bubble)
        eff = dataclasses.replace(eff, **{name: getattr(eff, name) * t.compute / compute})
    return eff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    names = p.parse_args().rows.split(",")
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    plans = {}
    for name in dict.fromkeys(["fit_eager", "fit_compile", "fit_float8", *names]):
        plans[name] = planned(ROWS[name])
        print(f"planned {ROWS[name][0]} in {plans[name].seconds:.0f} s", file=sys.stderr, flush=True)
    eff = Efficiency(compute=1.0, compile=1.0, float8=1.0, comm=DEVICES["h100"].efficiency.comm)
    for row, constant in (("fit_eager", "compute"), ("fit_compile", "compile"), ("fit_float8", "float8")):
        eff = fit(plans[row], ROWS[row][3], eff, constant)
    print(f"fitted: compute efficiency {eff.compute:.3f}, compile × {eff.compile:.3f}, float8 × "
          f"{eff.float8:.3f}; links {DEVICES['h100'].links}, comm efficiency {eff.comm}\n")
    print("| row | GPUs | published tokens/s/GPU | predicted | error |\n|---|---:|---:|---:|---:|")
    for name in names:
        row = ROWS[name]
        got = speed(plans[name], eff)
        tag = " (fitted)" if name.startswith("fit_") else ""
        error = (got - row[3]) / row[3]
        print(f"| {row[0]}{tag} | {row[1]} | {row[3]:,} | {got:,.0f} | {error:+.0%} |", flush=True)


if __name__ == "__main__":
    main()
