"""bf16 in every layout (the GPU numerics, run on CPU/gloo): each layout against one process in bf16,
and bf16 learning like fp32.

Where FSDP shards the parameters it casts them to bf16 for compute; every other layout runs the
forward under autocast over fp32 parameters. bf16 keeps 8 significant bits (rounding up to 2^-9 ≈
2e-3 relative per operation), so layouts that sum in another order agree to that rounding, not to
fp32's. Measured on the tiny model over 10 steps against one process in bf16 (autocast):
- autocast layouts (TP 2, PP 2; DDP 2 too while it was torch's replicate — it now casts like FSDP):
  loss within 2e-5, grad norm within 4.3e-4 relative;
- parameter-casting layouts (FSDP 2, CP 2 folded into FSDP, EP 2 with FSDP): loss within 3e-4 and
  grad norm within 1.8e-3, since norms and residual adds also run in bf16 there.
The tolerances below are about 3× those; a layout that scales gradients wrongly or drops a
reduction is off by tens of percent within a few steps. One process in bf16 is 3.7e-5 (loss) and
1e-3 (grad norm) from fp32, so a "bf16" run equal to fp32 to 1e-7 would not be computing in bf16.
"""

import pytest
from conftest import TINY, check_ok, run_train, train_rows

BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "8"]
AUTOCAST = {"loss": 1e-4, "grad_norm": 1.5e-3}
CAST = {"loss": 1e-3, "grad_norm": 6e-3}
LAYOUTS = {
    "tp2": (["--parallelism.tensor_parallel_degree", "2"], AUTOCAST),
    "pp2_1f1b": (["--parallelism.pipeline_parallel_degree", "2"], AUTOCAST),
    "fsdp2": (["--training.local_batch_size", "4"], CAST),
    "cp2": (["--parallelism.context_parallel_degree", "2"], CAST),
}
MOE = ["--model.name", "moe"]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]


def _bf16_run(args: list[str], dump, data_cache, nproc: int = 1) -> list[dict]:
    proc = run_train([*TINY, *BF16, *args, "--job.dump_folder", str(dump),
                      "--training.data_cache_dir", str(data_cache)], nproc=nproc)
    check_ok(proc)
    assert "compute bfloat16" in proc.stdout  # the start-up summary says what really computes
    return train_rows(dump)


def _compare(rows: list[dict], reference: list[dict], tol: dict[str, float]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for got, ref in zip(rows, reference, strict=True):
        for key, bound in tol.items():
            assert abs(got[key] - ref[key]) <= bound * abs(ref[key]), (key, ref["step"], got[key], ref[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> list[dict]:
    return _bf16_run([], tmp_path_factory.mktemp("bf16_ref"), data_cache)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_layout_matches_one_process_bf16(layout, reference, tmp_path, data_cache):
    args, tol = LAYOUTS[layout]
    _compare(_bf16_run(args, tmp_path, data_cache, nproc=2), reference, tol)


def test_bf16_expert_parallel_matches_one_process_bf16(tmp_path, data_cache):
    ref = _bf16_run(MOE, tmp_path / "one", data_cache)
    _compare(_bf16_run([*MOE, *EP2], tmp_path / "ep2", data_cache, nproc=2), ref, CAST)


def test_bf16_learns_like_fp32(tmp_path, data_cache):
    """30 steps of FSDP 2 in bf16 (the GPU path: parameters cast) against one process in fp32: the
    loss falls by more than 1.5 nats in both and ends within 0.5% (measured over 40 steps: at most
    1.2e-4 apart)."""
    steps = ["--training.steps", "30", "--lr_scheduler.warmup_steps", "4"]
    bf16 = _bf16_run([*steps, "--training.local_batch_size", "4"], tmp_path / "bf16", data_cache, nproc=2)
    check_ok(run_train([*TINY, *steps, "--training.global_batch_size", "8", "--job.dump_folder",
                        str(tmp_path / "fp32"), "--training.data_cache_dir", str(data_cache)]))
    fp32 = train_rows(tmp_path / "fp32")
    for rows in (bf16, fp32):
        assert rows[0]["loss"] - rows[-1]["loss"] > 1.5
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) <= 0.005 * fp32[-1]["loss"]
