"""Validation: the same val_loss (and its perplexity) in every layout, and another file on request."""

import math

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, read_metrics, run_train

VAL = [*TINY, "--training.steps", "4", "--training.global_batch_size", "8", "--validation.enable",
       "--validation.freq", "2", "--validation.steps", "2"]


def val_rows(dump) -> list[dict]:
    return [r for r in read_metrics(dump) if "val_loss" in r]


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    dump = tmp_path_factory.mktemp("val1")
    check_ok(run_train([*VAL, *dump_args(dump, data_cache)]))
    return val_rows(dump)


def test_rows_carry_loss_perplexity_and_tokens(single):
    assert [r["step"] for r in single] == [2, 4]
    for r in single:
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-9)
        assert r["val_tokens"] == 2 * 8 * 64  # 2 rounds of one global batch of 64-token windows


@pytest.mark.parametrize("nproc,args", [
    (2, ["--training.local_batch_size", "4"]),
    (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    (2, ["--parallelism.context_parallel_degree", "2"]),
    (2, ["--parallelism.tensor_parallel_degree", "2"]),
], ids=["fsdp2", "pp2", "cp2", "tp2"])
def test_same_validation_in_every_layout(single, nproc, args, tmp_path, data_cache):
    check_ok(run_train([*VAL, *args, *dump_args(tmp_path, data_cache)], nproc=nproc))
    rows = val_rows(tmp_path)
    assert [r["step"] for r in rows] == [2, 4]
    for ref, got in zip(single, rows, strict=True):
        assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"]
        assert got["val_tokens"] == ref["val_tokens"]


def test_validation_under_expert_parallel(tmp_path, data_cache):
    """The MoE model's validation under EP 2 (tokens routed to other ranks' experts) equals one process."""
    moe = [*VAL, "--model.name", "moe"]
    runs = {}
    for name, nproc, extra in (("single", 1, []), ("ep2", 2, ["--training.local_batch_size", "4",
                                                              "--parallelism.expert_parallel_degree", "2"])):
        check_ok(run_train([*moe, *extra, *dump_args(tmp_path / name, data_cache)], nproc=nproc))
        runs[name] = val_rows(tmp_path / name)
    assert [r["step"] for r in runs["ep2"]] == [2, 4]
    for ref, got in zip(runs["single"], runs["ep2"], strict=True):
        assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"]


def test_validation_dataset(single, tmp_path, data_cache):
    text = tmp_path / "sonnets.txt"
    text.write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 60)
    dump = tmp_path / "run"
    check_ok(run_train([*VAL, "--validation.dataset", str(text), *dump_args(dump, data_cache)]))
    rows = val_rows(dump)
    assert [r["step"] for r in rows] == [2, 4]
    assert abs(rows[0]["val_loss"] - single[0]["val_loss"]) > 1e-3  # another text, another loss
    fails_with(run_train([*VAL, "--validation.dataset", str(tmp_path / "none.txt"),
                          *dump_args(tmp_path / "bad")]), "validation.dataset", "none.txt")
    # A one-file training set has no val split: the message says what to do.
    fails_with(run_train([*VAL, "--training.dataset_path", str(text),
                          *dump_args(tmp_path / "one")]),
               "no validation split", "--validation.dataset FILE")
