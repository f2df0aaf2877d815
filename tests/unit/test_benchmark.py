"""The speed benchmark's parts that can break without anyone timing anything: the independent
reference really has Kiln's debug shape (so `Kiln / reference` compares the same work), and the
table picks its layouts, alternates its trainers and divides the right numbers. That the reference
trains is tests/e2e/test_benchmark_runs.py."""

import sys

import pytest
import torch

from tests.helpers.runs import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import benchmark_speed  # noqa: E402
import reference_loop  # noqa: E402

from models import get_model_spec  # noqa: E402


def test_reference_has_the_debug_models_shape() -> None:
    spec = get_model_spec("llama3")
    args = spec.flavors["debug"]
    with torch.device("meta"):
        kiln = spec.model_cls(args)
        ref = reference_loop.Llama(args.vocab_size, args.dim, args.n_layers, args.n_heads, 768, 128)
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in kiln.parameters())
    assert ref.blocks[0].gate_up.out_features == 2 * kiln.layers["0"].feed_forward.w1.out_features


def test_layouts_without_a_trainers_run_bring_fsdp2() -> None:
    trainers = ["Kiln", "reference"]
    assert list(benchmark_speed.chosen_layouts(["1 process"], trainers)) == ["1 process"]
    assert list(benchmark_speed.chosen_layouts(["TP 2"], trainers)) == ["FSDP 2", "TP 2"]
    assert len(benchmark_speed.chosen_layouts(None, trainers)) == len(benchmark_speed.LAYOUTS)
    with pytest.raises(SystemExit, match="unknown layouts"):
        benchmark_speed.speed_table(1, 0, 1, REPO, only=["TP 9"])


def test_runs_alternate_and_ratios_divide_the_right_cells() -> None:
    calls = []

    def runner(who: str, rate: float):
        def run(nproc: int, options: list[str]) -> tuple[float, float]:
            calls.append(who)
            return rate * nproc, 0.5
        return run

    acc = benchmark_speed.ACCELERATED
    layouts = benchmark_speed.chosen_layouts(["1 process", "TP 2"], ["Kiln", acc, "reference"])
    runners = {"Kiln": runner("Kiln", 300.0), acc: runner(acc, 330.0),
               "reference": runner("reference", 200.0)}
    med = benchmark_speed.measure(layouts, runners, repeats=2)
    # 2 rounds × (FSDP 2: all, 1 process: all, TP 2: both Kilns only): the trainers alternate
    assert calls == ["Kiln", acc, "reference", "Kiln", acc, "reference", "Kiln", acc] * 2
    text = benchmark_speed.table(med, list(layouts), ["reference"]).splitlines()
    assert text[0].split(" | ")[1:6] == ["Kiln tok/s", f"{acc} tok/s", "reference tok/s", "Kiln / reference",
                                         f"{acc} / reference"]
    cells = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text[2:]}
    assert cells["1 process"][1:6] == ["300", "330", "200", "1.50", "1.65"]
    # 600 and 660 against the reference's FSDP 2 (400)
    assert cells["TP 2"][1:6] == ["600", "660", "—", "1.50 vs FSDP 2", "1.65 vs FSDP 2"]
