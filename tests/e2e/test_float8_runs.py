"""float8 through torchao (`--model.converters float8`) in real runs.

Layout parity: with the tensorwise recipe a weight's scale is the amax of the whole weight (FSDP
all-reduces the shards' amax before it casts for the float8 all-gather) and an activation's scale
is the amax of its microbatch, which holds the same rows in one process (2 microbatches of 8) and
in FSDP 2 (8 rows per rank): both layouts cast the same numbers to float8, and only float32
reduction order differs, as in fp32 parity. Measured over 10 steps of the tiny model: loss within
6e-8 relative, grad norm equal; the bounds are the fp32 parity tests' (1e-5 at step 1, 1e-4 after),
since a reduction-order difference that lands on a float8 rounding boundary can move a value by
one float8 step (2^-3 relative) in a few elements. A converter that silently did nothing would
pass parity, so the conversion itself is checked module by module (tests/unit/test_float8.py),
and FSDP's float8 all-gather by the bytes it puts on the wire.
"""

import json
import shutil

import pytest

from tests.helpers.runs import (
    TINY,
    check_ok,
    dump_args,
    fails_with,
    read_metrics,
    run_train,
    run_trains_side_by_side,
    train_rows,
)

FLOAT8 = ["--model.converters", "float8"]
BATCH16 = ["--training.global_batch_size", "16", "--training.local_batch_size", "8"]
WIRE = "tests/helpers/fsdp_wire.py"


def test_float8_missing_torchao_run_fails_with_one_line(tmp_path, data_cache) -> None:
    """The trainer's own line when torchao cannot be imported (a stand-in package that fails to
    import shadows the installed one), before any data is read."""
    fake = tmp_path / "shadow" / "torchao"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named torchao (simulated)')\n")
    proc = run_train([*TINY, *FLOAT8, *dump_args(tmp_path / "run", data_cache)],
                     extra_env={"PYTHONPATH": str(tmp_path / "shadow")})
    fails_with(proc, "model.converters float8 needs torchao", "simulated", "pip install 'kiln[float8]'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _close(rows: list[dict], ref: list[dict], bound: float, keys=("loss", "grad_norm")) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for got, want in zip(rows, ref, strict=True):
        for key in keys:
            tol = 1e-5 if got["step"] == 1 and bound < 1e-3 else bound
            assert abs(got[key] - want[key]) <= tol * abs(want[key]), (key, got["step"], got[key], want[key])


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory, data_cache) -> dict:
    """float8 in one process and under FSDP 2 (saving step-5), 10 steps of the tiny model."""
    root = tmp_path_factory.mktemp("float8")
    common = [*TINY, *FLOAT8, *BATCH16, "--training.data_cache_dir", str(data_cache)]
    one = run_train([*common, *dump_args(root / "one")])
    fsdp = run_train([*common, *dump_args(root / "fsdp2"), "--checkpoint.enable",
                      "--checkpoint.interval", "5"], nproc=2)
    for proc in (one, fsdp):
        check_ok(proc)
    assert "float8 block linears (tensorwise, all-gathered in float8)" in fsdp.stdout
    return {"root": root, "one": train_rows(root / "one"), "fsdp2": train_rows(root / "fsdp2")}


def test_float8_fsdp2_matches_one_process(float8_runs) -> None:
    _close(float8_runs["fsdp2"], float8_runs["one"], 1e-4)


def test_float8_checkpoints_resume_with_float8_on_or_off(float8_runs, data_cache) -> None:
    """FSDP 2 float8's step-5 resumes in one plain process, whose step-6 checkpoint resumes with
    float8 again. float8 and float32 steps differ by float8 rounding — measured at most 1.4e-4
    relative in loss over steps 6-10 — so a resumed run lies within 2e-3 of the float8 run, while
    a run that ignored the checkpoint would restart from the initial loss (3% higher at step 6)."""
    root, fsdp2, one = float8_runs["root"], float8_runs["fsdp2"], float8_runs["one"]
    common = [*TINY, *BATCH16, "--training.data_cache_dir", str(data_cache), "--checkpoint.enable",
              "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]  # step-6 is copied below
    shutil.copytree(root / "fsdp2" / "checkpoint" / "step-5", root / "plain" / "checkpoint" / "step-5")
    plain = run_train([*common, *dump_args(root / "plain")])
    check_ok(plain)
    assert "resumed from" in plain.stdout and "step-5" in plain.stdout
    shutil.copytree(root / "plain" / "checkpoint" / "step-6", root / "again" / "checkpoint" / "step-6")
    again = run_train([*common, *FLOAT8, *dump_args(root / "again")])
    check_ok(again)
    assert "step-6" in again.stdout
    _close(train_rows(root / "plain"), fsdp2[5:], 2e-3, keys=("loss",))
    _close(train_rows(root / "again"), one[6:], 2e-3, keys=("loss",))
    assert fsdp2[0]["loss"] - fsdp2[5]["loss"] > 0.02 * fsdp2[5]["loss"]
    assert read_metrics(root / "again")[0]["step"] == 7


def test_float8_learns_like_bf16(tmp_path, data_cache) -> None:
    """100 steps of the debug model, float8 against bf16 (the comparison float8 is made for), one
    process each, side by side, on small batches (4 × 32 tokens: both see the same batches, so the
    gap is float8's alone). Measured: both fall from 8.76 to about 6.16 (mean of the last 10 steps),
    the largest gap at any step is 0.011 nats (0.18%), the last-10 means 4e-5 apart. Bounds: 1% at
    any step, 0.5% for the last-10 means; and float8 must differ from bf16 somewhere by > 1e-3."""
    args = [*TINY[:2], "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--training.steps", "100", "--metrics.log_freq", "1",
            "--training.mixed_precision_param", "bfloat16", "--training.data_cache_dir", str(data_cache)]
    runs = [[*args, *FLOAT8, *dump_args(tmp_path / "float8")],
            [*args, *dump_args(tmp_path / "bf16")]]
    float8, bf16 = run_trains_side_by_side(runs, timeout=600)
    check_ok(float8)
    check_ok(bf16)
    assert "float8 block linears (tensorwise)" in float8.stdout
    f8, ref = train_rows(tmp_path / "float8"), train_rows(tmp_path / "bf16")
    assert len(f8) == len(ref) == 100
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(f8, ref, strict=True)]
    assert max(gaps) <= 0.01, max(gaps)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(f8, ref, strict=True)) > 1e-3
    tail = [sum(r["loss"] for r in rows[-10:]) / 10 for rows in (f8, ref)]
    assert abs(tail[0] - tail[1]) <= 0.005 * tail[1]
    assert ref[0]["loss"] - tail[1] > 2.0 and f8[0]["loss"] - tail[0] > 2.0


def _on_the_wire(dump, data_cache, *args: str) -> dict:
    """What FSDP 2 hands its collectives in 2 float8 steps of the tiny model (tests/helpers/fsdp_wire.py)."""
    out = dump / "wire.json"
    check_ok(run_train([str(out), *TINY, *FLOAT8, *BATCH16, *args, *dump_args(dump, data_cache)],
                       nproc=2, script=WIRE))
    return json.loads(out.read_text())


def test_fsdp_float8_all_gather_sends_float8_bytes(tmp_path, data_cache) -> None:
    """FSDP 2's all-gathers as recorded on the wire, torch's own collectives carrying them. With
    float8 all-gather (the default) each block's buffer holds its float8 linears' weight shards at
    one byte an element beside its norms' float32 at four, packed by FSDP as raw bytes (uint8);
    with float8.enable_fsdp_float8_all_gather false the block travels as float32, four bytes an
    element. The embeddings and the head (norm + output) are float32 either way. Each block is
    gathered twice a step (forward, and again for backward). Both send the same numbers: a
    tensorwise scale is the whole weight's amax, cast before or after the gather alike, so the
    losses agree (measured: equal to the last digit)."""
    on = _on_the_wire(tmp_path / "on", data_cache)
    off = _on_the_wire(tmp_path / "off", data_cache, "--float8.enable_fsdp_float8_all_gather", "false")
    blocks = [name for name in on["modules"] if name.startswith("layers.")]
    assert blocks == ["layers.0", "layers.1"]
    for name in blocks:
        block_on, block_off = on["modules"][name], off["modules"][name]
        float8, other = block_on["float8_elements"], block_on["other_elements"]
        assert float8 > 0 and other > 0, name  # 7 float8 linears, 2 float32 norms
        assert block_on["all_gather"] == [["uint8", float8 * 1 + other * 4]] * 4, (name, block_on)
        assert block_off["all_gather"] == [["float32", (float8 + other) * 4]] * 4, (name, block_off)
    for wire in (on, off):
        for name in ("tok_embeddings", "norm+output"):
            gathered = wire["modules"][name]
            assert gathered["float8_elements"] == 0 and gathered["all_gather"], name
            assert all(sent == ["float32", gathered["other_elements"] * 4] for sent in gathered["all_gather"])
    for a, b in zip(on["losses"], off["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * b, (on["losses"], off["losses"])
