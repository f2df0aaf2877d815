"""Pipeline parallel: every schedule trains like the single process; PP composes with FSDP and TP.

The tiny model gets 4 layers here so that two-stages-per-rank schedules have a layer per stage.
Same config, seed and global batch as the reference; loss and grad norm within 1e-5 relative at
step 1 and 1e-4 through step 10. The layer split itself is tests/unit/test_pipeline.py.
"""

import pytest

from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, relative, run_train, train_rows

PP = [*TINY, "--training.global_batch_size", "8", "--job.custom_import", "tests.helpers.variant_models",
      "--model.name", "llama3_4l"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    dump = tmp_path_factory.mktemp("ref")
    check_ok(run_train([*PP, *dump_args(dump, data_cache)]))
    return train_rows(dump)


def _compare(reference, rows) -> None:
    assert [r["step"] for r in rows] == list(range(1, 11))
    for ref, got in zip(reference, rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (ref["step"], got["loss"], ref["loss"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (ref["step"], got, ref)


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_single_process(schedule, reference, tmp_path, data_cache):
    proc = run_train([*PP, "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_schedule", schedule,
                      "--parallelism.pipeline_parallel_microbatch_size", "2",
                      *dump_args(tmp_path, data_cache)],
                     nproc=2)
    check_ok(proc)
    assert f"PP 2 ({schedule}" in proc.stdout
    _compare(reference, train_rows(tmp_path))


@pytest.mark.parametrize("schedule", ["GPipe", "LoopedBFS"])
def test_schedule_with_fewer_microbatches_than_ranks(schedule, reference, tmp_path, data_cache):
    """Every forward, then every backward: one microbatch of all 8 rows on PP 2 (the planner times
    pipelines so, docs/planning.md)."""
    proc = run_train([*PP, "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_schedule", schedule,
                      "--parallelism.pipeline_parallel_microbatch_size", "8",
                      *dump_args(tmp_path, data_cache)],
                     nproc=2)
    check_ok(proc)
    _compare(reference, train_rows(tmp_path))


@pytest.mark.parametrize("nproc,extra", [
    (4, ["--training.local_batch_size", "4"]),  # PP 2 × FSDP 2
    (4, ["--parallelism.tensor_parallel_degree", "2"]),  # PP 2 × TP 2
    (2, ["--training.local_batch_size", "4"]),  # PP 2 with gradient accumulation (2 × 4 rows)
    (2, ["--parallelism.pipeline_parallel_stage_layers", "0,1-3"]),  # uneven stages by hand
    (2, ["--activation_checkpoint.mode", "full"]),  # each stage through the same AC path
    (2, ["--compile.enable"]),  # ... and the same compile path
], ids=["pp2_fsdp2", "pp2_tp2", "pp2_accumulation", "pp2_explicit_layers", "pp2_ac", "pp2_compile"])
def test_pipeline_composes(nproc, extra, reference, tmp_path, data_cache):
    check_ok(run_train([*PP, "--parallelism.pipeline_parallel_degree", "2", *extra,
                        *dump_args(tmp_path, data_cache)],
                       nproc=nproc, timeout=600))
    _compare(reference, train_rows(tmp_path))


def test_3d_pp_fsdp_tp_on_8_processes(reference, tmp_path, data_cache):
    check_ok(run_train([*PP, "--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                        *dump_args(tmp_path, data_cache)],
                       nproc=8, timeout=900))
    _compare(reference, train_rows(tmp_path))


@pytest.mark.parametrize("args,fragment", [
    (["--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size",
      "8"], "at least as many microbatches"),
    (["--parallelism.pipeline_parallel_microbatch_size", "3"], "not divisible"),
    (["--parallelism.pipeline_parallel_schedule", "Zigzag"], "Interleaved1F1B"),
    (["--model.name", "llama3", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "more than the model's 2 layers"),
], ids=["too_few_microbatches", "microbatch_size", "unknown_schedule", "stages_over_layers"])
def test_bad_pipeline_input(args, fragment, tmp_path):
    fails_with(run_train([*PP, "--parallelism.pipeline_parallel_degree", "2", *args,
                          *dump_args(tmp_path)], nproc=2), fragment, torchrun=True)


def test_checkpoints_cross_between_pp_and_fsdp(tmp_path, data_cache):
    """Save with PP 2 × FSDP 2, resume with FSDP 2 × TP 2, and the other way round (TP → PP)."""
    import shutil

    layouts = {"pp": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
               "tp": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]}
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5", "--training.data_cache_dir", str(data_cache)]
    straight = {}
    for name, extra in layouts.items():
        dump = tmp_path / f"straight_{name}"
        check_ok(run_train([*PP, *ckpt, *extra, *dump_args(dump)], nproc=4))
        straight[name] = {r["step"]: r["loss"] for r in train_rows(dump)}
    for saver, loader in (("pp", "tp"), ("tp", "pp")):
        dump = tmp_path / f"{saver}_to_{loader}"
        shutil.copytree(tmp_path / f"straight_{saver}" / "checkpoint" / "step-5",
                        dump / "checkpoint" / "step-5")
        proc = run_train([*PP, *ckpt, *layouts[loader], *dump_args(dump)], nproc=4)
        check_ok(proc)
        assert "resumed from" in proc.stdout
        rows = {r["step"]: r["loss"] for r in train_rows(dump)}
        assert sorted(rows) == list(range(6, 11))
        for step in range(6, 11):
            assert relative(rows[step], straight[saver][step]) <= 1e-5, (saver, loader, step)


TIED = [*TINY, "--training.global_batch_size", "8", "--job.custom_import", "tests.helpers.variant_models",
        "--model.name", "llama3_tied_4l"]


TIED_CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory, data_cache):
    """The one-process tied run (with its step-5 checkpoint): (rows, dump folder)."""
    dump = tmp_path_factory.mktemp("tied_ref")
    check_ok(run_train([*TIED, *TIED_CKPT, *dump_args(dump, data_cache)]))
    return train_rows(dump), dump


@pytest.fixture(scope="module")
def tied_reference(tied_run):
    return tied_run[0]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_tied_embeddings_stay_one_weight_across_stages(schedule, tied_reference, tmp_path, data_cache):
    """The first stage's embedding and the last stage's head are one weight: gradients summed across
    the two ranks (1F1B, Interleaved1F1B) or within one ("v" layout: ZBV), the norm counting it once."""
    check_ok(run_train([*TIED, "--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_schedule", schedule,
                        *dump_args(tmp_path, data_cache)],
                       nproc=2))
    _compare(tied_reference, train_rows(tmp_path))


def test_tied_checkpoints_cross_between_one_process_and_pp(tied_run, tmp_path, data_cache):
    """One process keeps a tied weight once (and its optimizer state under the first name); PP keeps
    a copy per stage: step-5 of either resumes in the other exactly."""
    import shutil

    tied_reference, single_dump = tied_run
    layouts = {"single": (1, []), "pp": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])}
    ckpt = [*TIED_CKPT, "--training.data_cache_dir", str(data_cache)]
    check_ok(run_train([*TIED, *ckpt, *layouts["pp"][1], *dump_args(tmp_path / "pp")], nproc=2))
    savers = {"single": single_dump, "pp": tmp_path / "pp"}
    for saver, loader in (("single", "pp"), ("pp", "single")):
        dump = tmp_path / f"{saver}_to_{loader}"
        shutil.copytree(savers[saver] / "checkpoint" / "step-5", dump / "checkpoint" / "step-5")
        nproc, extra = layouts[loader]
        proc = run_train([*TIED, *ckpt, *extra, *dump_args(dump)], nproc=nproc)
        check_ok(proc)
        rows = train_rows(dump)
        assert [r["step"] for r in rows] == list(range(6, 11))
        for got, ref in zip(rows, tied_reference[5:], strict=True):
            assert relative(got["loss"], ref["loss"]) <= 1e-4, (saver, loader, got, ref)
            assert relative(got["grad_norm"], ref["grad_norm"]) <= 1e-4, (saver, loader, got, ref)
