"""bf16 in every layout (the GPU numerics, run on CPU/gloo): each layout against one process in bf16,
and measurably away from float32 on the same batches; gradients reduced in bf16; bf16 learning like
fp32.

Where FSDP shards the parameters it casts them to bf16 for compute; every other layout runs the
forward under autocast over fp32 parameters. bf16 keeps 8 significant bits (rounding up to 2^-9 ≈
2e-3 relative per operation), so layouts that sum in another order agree to that rounding, not to
fp32's. Measured on the tiny model over 10 steps against one process in bf16 (autocast):
- autocast layouts (TP 2, PP 2): loss within 2.1e-5, grad norm within 2.3e-4 relative (4.3e-4
  when DDP was torch's replicate and autocast too);
- parameter-casting layouts (FSDP 2, CP 2 folded into FSDP, EP 2 with FSDP): loss within 2.7e-4 and
  grad norm within 1.8e-3, since norms and residual adds also run in bf16 there.
The tolerances below are 3-6× those; a layout that scales gradients wrongly or drops a reduction is
off by tens of percent within a few steps.

That bound alone would pass a layout computing in float32: one process in bf16 is only 3.6e-5
(loss) and 5.2e-4 (grad norm) from one process in fp32. So every bf16 run must also be away from
the fp32 run of the same batches: the largest relative gap over the 10 steps, measured on every
bf16 run here (one process, each layout, the MoE in one process and EP 2), is at least 2.9e-5 in
loss and 5.1e-4 in grad norm, while fp32 layouts agree with one fp32 process to 1.1e-7 and 1.8e-7.
The floors (FROM_FP32) are 5× under the smallest bf16 gap and 50× (loss) and 500× (grad norm) over
the fp32 agreement, so one fp32 process serves as the fp32 side of every dense layout.
"""

import json
from collections.abc import Callable

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, run_train, train_rows

BF16 = ["--training.mixed_precision_param", "bfloat16"]
SAME_BATCHES = ["--training.global_batch_size", "8"]
AUTOCAST = {"loss": 1e-4, "grad_norm": 1.5e-3}
CAST = {"loss": 1e-3, "grad_norm": 6e-3}
FROM_FP32 = {"loss": 6e-6, "grad_norm": 1e-4}  # least max-over-steps gap of a bf16 run from fp32
LAYOUTS = {
    "tp2": (["--parallelism.tensor_parallel_degree", "2"], AUTOCAST),
    "pp2_1f1b": (["--parallelism.pipeline_parallel_degree", "2"], AUTOCAST),
    "fsdp2": (["--training.local_batch_size", "4"], CAST),
    "cp2": (["--parallelism.context_parallel_degree", "2"], CAST),
}
MOE = ["--model.name", "moe"]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
REDUCE_BF16 = ["--training.mixed_precision_reduce", "bfloat16"]


def _args(args: list[str], dump, data_cache, bf16: bool = True) -> list[str]:
    """train.py's arguments: the tiny model on the same 8-row batches in every layout, in bf16 or fp32."""
    return [*TINY, *SAME_BATCHES, *(BF16 if bf16 else []), *args, *dump_args(dump, data_cache)]


def _bf16_run(args: list[str], dump, data_cache, nproc: int = 1) -> list[dict]:
    """The training rows of one bf16 run."""
    check_ok(run_train(_args(args, dump, data_cache), nproc=nproc))
    return train_rows(dump)


def _one_process(args: list[str], root, data_cache) -> dict[str, list[dict]]:
    """One process in bf16 and in fp32 on the same batches; the bf16 one away from fp32."""
    check_ok(run_train(_args(args, root / "fp32", data_cache, bf16=False)))
    rows = {"bf16": _bf16_run(args, root / "bf16", data_cache), "fp32": train_rows(root / "fp32")}
    _away_from(rows["bf16"], rows["fp32"], FROM_FP32)
    return rows


def _gap(rows: list[dict], reference: list[dict], key: str) -> float:
    """The largest relative difference of `key` over the steps."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    return max(abs(got[key] - ref[key]) / abs(ref[key]) for got, ref in zip(rows, reference, strict=True))


def _compare(rows: list[dict], reference: list[dict], tol: dict[str, float]) -> None:
    """Every step within the relative tolerance of the reference, in each key."""
    for key, bound in tol.items():
        gap = _gap(rows, reference, key)
        assert gap <= bound, (key, gap, bound)


def _away_from(rows: list[dict], reference: list[dict], floor: dict[str, float]) -> None:
    """Some step differs from the reference by more than the floor, in each key."""
    for key, least in floor.items():
        gap = _gap(rows, reference, key)
        assert gap > least, (key, gap, least)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_cache) -> dict[str, list[dict]]:
    """The dense tiny model in one process: bf16 (every layout's reference) and fp32."""
    return _one_process([], tmp_path_factory.mktemp("bf16_one"), data_cache)


@pytest.fixture(scope="module")
def layout_rows(tmp_path_factory, data_cache) -> Callable[[str], list[dict]]:
    """The bf16 rows of a layout of LAYOUTS, each run once per module (the reduce test reuses FSDP 2)."""
    done: dict[str, list[dict]] = {}

    def rows(layout: str) -> list[dict]:
        if layout not in done:
            dump = tmp_path_factory.mktemp(f"bf16_{layout}")
            done[layout] = _bf16_run(LAYOUTS[layout][0], dump, data_cache, nproc=2)
        return done[layout]

    return rows


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_layout_matches_one_process_bf16(layout, one_process, layout_rows):
    rows = layout_rows(layout)
    _compare(rows, one_process["bf16"], LAYOUTS[layout][1])
    _away_from(rows, one_process["fp32"], FROM_FP32)


def test_bf16_expert_parallel_matches_one_process_bf16(tmp_path, data_cache):
    one = _one_process(MOE, tmp_path / "one", data_cache)
    ep2 = _bf16_run([*MOE, *EP2], tmp_path / "ep2", data_cache, nproc=2)
    _compare(ep2, one["bf16"], CAST)
    _away_from(ep2, one["fp32"], FROM_FP32)


def test_bf16_gradients_reduced_in_bf16(one_process, layout_rows, tmp_path, data_cache):
    """FSDP 2 in bf16 with training.mixed_precision_reduce bfloat16 trains like one process in bf16,
    and really reduces in bf16, seen twice:
    - on the wire (tests/helpers/fsdp_wire.py records what FSDP hands its collectives): every
      reduce-scatter input is bfloat16, 2 bytes a gradient element, as every all-gather is;
    - in the numbers, against the same run reducing in fp32 (LAYOUTS' fsdp2): step 1's loss is the
      same (the forward runs before any reduction), and the grad norms differ by the bf16 rounding
      of the gradient sums. Measured over 10 steps: grad norms at most 2.6e-4 apart (7.8e-5 at step
      1), losses 1.2e-5; the floor 5e-5 is 5× under the former (an fp32 reduction gives 0: the same
      computation), the ceilings 1e-3 and 5e-5 about 4× over.
    """
    out = tmp_path / "wire.json"
    check_ok(run_train([str(out), *_args(["--training.local_batch_size", "4", *REDUCE_BF16],
                                         tmp_path / "wire", data_cache)],
                       nproc=2, script="tests/helpers/fsdp_wire.py"))
    modules = json.loads(out.read_text())["modules"]
    for name, wire in modules.items():  # 2 ranks: a reduce-scatter sends both ranks' shards
        elements = wire["float8_elements"] + wire["other_elements"]
        assert wire["reduce_scatter"], name
        assert all(sent == ["bfloat16", 2 * 2 * elements] for sent in wire["reduce_scatter"]), (name, wire)
        assert all(sent == ["bfloat16", 2 * elements] for sent in wire["all_gather"]), (name, wire)
    rows = _bf16_run(["--training.local_batch_size", "4", *REDUCE_BF16], tmp_path / "run", data_cache,
                     nproc=2)
    fp32_reduce = layout_rows("fsdp2")
    _compare(rows, one_process["bf16"], CAST)
    assert abs(rows[0]["loss"] - fp32_reduce[0]["loss"]) <= 1e-7 * fp32_reduce[0]["loss"]
    _compare(rows, fp32_reduce, {"loss": 5e-5, "grad_norm": 1e-3})
    _away_from(rows, fp32_reduce, {"grad_norm": 5e-5})


def test_bf16_learns_like_fp32(tmp_path, data_cache):
    """30 steps of FSDP 2 in bf16 (the GPU path: parameters cast) against one process in fp32: the
    loss falls by more than 1.5 nats in both and ends within 0.5% (measured over 40 steps: at most
    1.2e-4 apart)."""
    steps = ["--training.steps", "30", "--lr_scheduler.warmup_steps", "4"]
    bf16 = _bf16_run([*steps, "--training.local_batch_size", "4"], tmp_path / "bf16", data_cache, nproc=2)
    check_ok(run_train(_args(steps, tmp_path / "fp32", data_cache, bf16=False)))
    fp32 = train_rows(tmp_path / "fp32")
    for rows in (bf16, fp32):
        assert rows[0]["loss"] - rows[-1]["loss"] > 1.5
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) <= 0.005 * fp32[-1]["loss"]
