"""Checkpoints: exact resume, resume in another layout, atomic saves, async, seed, export, bad input.

A run of 20 steps saves every 5; a resumed run starts from a copy of one of its step folders and
must reproduce the uninterrupted run's losses for the steps after it.
"""

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from components.checkpoint.integrity import MANIFEST, checkpoint_problem
from components.checkpoint.manager import prune
from tests.helpers.runs import TINY, check_ok, dump_args, fails_with, read_metrics, run_train, train_rows

# Every checkpoint kept (the default keeps the latest 3): the tests resume from each of them.
CKPT = ["--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "5",
        "--checkpoint.keep_latest_k", "0"]


def args_for(dump: Path, cache: Path, *extra: str) -> list[str]:
    return [*TINY, *CKPT, *dump_args(dump, cache), *extra]


def resume_from(source: Path, step: int, dump: Path) -> None:
    """Start a new dump folder that holds only source's step-N checkpoint."""
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")


def losses(dump: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train_rows(dump)}


def assert_same(got: dict, ref: dict, steps: range, rel: float) -> None:
    for s in steps:
        for a, b in zip(got[s], ref[s], strict=True):
            assert abs(a - b) <= rel * abs(b), (s, got[s], ref[s])


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    """20 uninterrupted single-process steps, checkpoints at 5, 10, 15, 20."""
    dump = tmp_path_factory.mktemp("single")
    check_ok(run_train(args_for(dump, data_cache)))
    return dump


@pytest.fixture(scope="module")
def hsdp4(tmp_path_factory, data_cache):
    """20 uninterrupted HSDP 2 × 2 steps (same global batch), checkpoints every 5."""
    dump = tmp_path_factory.mktemp("hsdp4")
    check_ok(run_train(args_for(dump, data_cache, "--training.local_batch_size", "2",
                                "--parallelism.data_parallel_replicate_degree", "2"), nproc=4))
    return dump


def test_saves_every_interval_atomically(single):
    folder = single / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]
    assert all((p / ".metadata").exists() and (p / MANIFEST).exists() for p in folder.iterdir())


def test_exact_resume_single_process_twice(single, tmp_path, data_cache):
    first = tmp_path / "first"
    resume_from(single, 10, first)
    proc = run_train(args_for(first, data_cache))
    check_ok(proc)
    assert "resumed from" in proc.stdout and "step-10" in proc.stdout
    got = losses(first)
    assert sorted(got) == list(range(11, 21))
    assert_same(got, losses(single), range(11, 21), rel=0.0)  # bitwise
    # A second resume, from a checkpoint that a resumed run wrote.
    second = tmp_path / "second"
    resume_from(first, 15, second)
    check_ok(run_train(args_for(second, data_cache)))
    assert sorted(losses(second)) == list(range(16, 21))
    assert_same(losses(second), losses(single), range(16, 21), rel=0.0)


def test_finished_run_resumed_new_run_kept(single, tmp_path, data_cache):
    """A finished run has nothing to do; trained further, its clock continues and it ends with a
    summary; a new run (nothing to resume) in its folder moves its records aside rather than over."""
    dump = tmp_path / "run"
    shutil.copytree(single, dump)
    before = (dump / "metrics.jsonl").read_text()
    proc = run_train(args_for(dump, data_cache))
    check_ok(proc)
    assert "nothing to do: the run already reached step 20" in proc.stdout
    assert (dump / "metrics.jsonl").read_text() == before and not (dump / "earlier_runs").exists()
    proc = run_train(args_for(dump, data_cache, "--training.steps", "22"))
    check_ok(proc)
    assert "assuming the intent" not in proc.stderr  # one-process load and save without DCP's warning
    rows = train_rows(dump)
    assert [r["step"] for r in rows] == list(range(1, 23))
    assert all(b["time"] > a["time"] for a, b in zip(rows, rows[1:], strict=False))  # across the resume
    assert "done    steps 21–22 of 22" in proc.stdout and "(the run so far: " in proc.stdout
    assert f"checkpoint {dump / 'checkpoint' / 'step-22'}" in proc.stdout
    kept = (dump / "metrics.jsonl").read_text()
    proc = run_train(args_for(dump, data_cache, "--checkpoint.enable", "false", "--training.steps", "2"))
    check_ok(proc)
    assert f"were moved to {dump / 'earlier_runs' / '1'}" in proc.stdout
    assert (dump / "earlier_runs" / "1" / "metrics.jsonl").read_text() == kept
    assert (dump / "earlier_runs" / "1" / "config.toml").exists()
    assert [r["step"] for r in train_rows(dump)] == [1, 2]


def test_exact_resume_fsdp2(tmp_path, data_cache):
    straight = tmp_path / "straight"
    fsdp2 = ["--training.local_batch_size", "4"]
    check_ok(run_train(args_for(straight, data_cache, *fsdp2), nproc=2))
    resumed = tmp_path / "resumed"
    resume_from(straight, 10, resumed)
    check_ok(run_train(args_for(resumed, data_cache, *fsdp2), nproc=2))
    assert_same(losses(resumed), losses(straight), range(11, 21), rel=1e-6)


@pytest.mark.parametrize("nproc,extra", [
    (2, ["--training.local_batch_size", "4"]),  # HSDP 2×2 → FSDP 2
    (1, []),  # HSDP 2×2 → one process
    (2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"]),  # HSDP 2×2 → DDP 2
    (2, ["--parallelism.tensor_parallel_degree", "2"]),  # HSDP 2×2 → TP 2
    (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),  # → FSDP 2 × TP 2
], ids=["to_fsdp2", "to_single", "to_ddp2", "to_tp2", "to_fsdp2_tp2"])
def test_resume_in_another_layout(hsdp4, nproc, extra, tmp_path, data_cache):
    resume_from(hsdp4, 10, tmp_path)
    check_ok(run_train(args_for(tmp_path, data_cache, *extra), nproc=nproc))
    assert_same(losses(tmp_path), losses(hsdp4), range(11, 21), rel=1e-5)


def test_ddp_checkpoint_resumes_with_fsdp(single, tmp_path, data_cache):
    ddp = tmp_path / "ddp"
    check_ok(run_train(args_for(ddp, data_cache, "--training.steps", "10", "--training.local_batch_size", "4",
                                "--parallelism.data_parallel_replicate_degree", "2",
                                "--parallelism.data_parallel_shard_degree", "1"), nproc=2))
    fsdp = tmp_path / "fsdp"
    resume_from(ddp, 10, fsdp)
    # steps=10 in the DDP run gives another LR schedule; compare against its own continuation.
    check_ok(run_train(args_for(fsdp, data_cache, "--training.steps", "12",
                                "--training.local_batch_size", "4"), nproc=2))
    single_cont = tmp_path / "single"
    resume_from(ddp, 10, single_cont)
    check_ok(run_train(args_for(single_cont, data_cache, "--training.steps", "12")))
    assert_same(losses(fsdp), losses(single_cont), range(11, 13), rel=1e-5)


def test_crash_during_save_keeps_previous_checkpoint(single, tmp_path, data_cache):
    proc = run_train(args_for(tmp_path, data_cache, "--training.local_batch_size", "4"), nproc=2,
                     extra_env={"KILN_TEST_CRASH_DURING_SAVE": "10"})
    assert proc.returncode != 0
    folder = tmp_path / "checkpoint"
    assert (folder / "step-10.tmp").exists() and not (folder / "step-10").exists()
    (folder / "step-15").mkdir()  # a half-written folder without DCP metadata: ignored
    resumed = run_train(args_for(tmp_path, data_cache, "--training.local_batch_size", "4"), nproc=2)
    check_ok(resumed)
    assert "step-5 " in resumed.stdout.split("resumed from")[1].splitlines()[0] + " "
    assert "ignoring incomplete checkpoint" in resumed.stderr
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert_same({r["step"]: (r["loss"], r["grad_norm"]) for r in rows[-15:]}, losses(single),
                range(6, 21), rel=1e-5)
    assert (folder / "step-10" / ".metadata").exists()


def test_keep_latest_and_load_step(single, tmp_path, data_cache):
    check_ok(run_train(args_for(tmp_path, data_cache, "--checkpoint.keep_latest_k", "2")))
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-15", "step-20"]
    # load_step behind newer checkpoints would fork the run inside one folder: refused...
    again = tmp_path / "again"
    shutil.copytree(single / "checkpoint", again / "checkpoint")
    fails_with(run_train(args_for(again, data_cache, "--checkpoint.load_step", "5")),
                "load_step 5", "older than step-20", "initial_load_path")
    # ...and done in a new folder, from that step's whole state: the original continuation.
    fork = tmp_path / "fork"
    check_ok(run_train(args_for(fork, data_cache, "--checkpoint.initial_load_path",
                                str(again / "checkpoint" / "step-5"),
                                "--checkpoint.initial_load_model_only", "false")))
    assert_same(losses(fork), losses(single), range(6, 21), rel=0.0)
    # load_step may also name the newest checkpoint itself.
    only = tmp_path / "only"
    resume_from(single, 5, only)
    shutil.copytree(single / "checkpoint" / "step-10", only / "checkpoint" / "step-10")
    check_ok(run_train(args_for(only, data_cache, "--checkpoint.load_step", "10")))
    assert sorted(losses(only)) == list(range(11, 21))


def test_async_save_resumes_exactly(single, tmp_path, data_cache):
    run = tmp_path / "async"
    proc = run_train(args_for(run, data_cache, "--checkpoint.async_mode", "async",
                              "--training.local_batch_size", "4"), nproc=2)
    check_ok(proc)
    assert "queued" in proc.stdout
    saved = sorted(p.name for p in (run / "checkpoint").iterdir())
    assert saved == ["step-10", "step-15", "step-20", "step-5"]
    resumed = tmp_path / "resumed"
    resume_from(run, 10, resumed)
    check_ok(run_train(args_for(resumed, data_cache)))
    assert_same(losses(resumed), losses(single), range(11, 21), rel=1e-5)


def test_seed_checkpoint_starts_any_layout(tmp_path, data_cache):
    """A seed checkpoint written shard by shard by 2 ranks starts one process and FSDP alike."""
    seed7 = tmp_path / "seed7"
    check_ok(run_train(args_for(seed7, data_cache, "--training.seed", "7", "--training.local_batch_size", "4",
                                "--checkpoint.create_seed_checkpoint"), nproc=2))
    assert [p.name for p in (seed7 / "checkpoint").iterdir()] == ["step-0"]
    # Seed-7 weights, seed-42 data order, in two layouts: equal to each other, unlike seed-42 weights.
    runs = {}
    for name, nproc, extra in (("single", 1, []), ("fsdp", 2, ["--training.local_batch_size", "4"]),
                               ("plain", 1, ["--checkpoint.enable", "false"])):
        dump = tmp_path / name
        if name != "plain":
            resume_from(seed7, 0, dump)
        proc = run_train(args_for(dump, data_cache, "--training.steps", "3", *extra), nproc=nproc)
        check_ok(proc)
        assert ("step-0" in proc.stdout) == (name != "plain")
        runs[name] = losses(dump)
    assert_same(runs["fsdp"], runs["single"], range(1, 4), rel=1e-5)
    assert abs(runs["plain"][1][0] - runs["single"][1][0]) > 1e-4


def test_model_only_export_dtype(tmp_path, data_cache):
    check_ok(run_train(args_for(tmp_path, data_cache, "--training.steps", "5",
                                "--checkpoint.last_save_model_only", "--checkpoint.export_dtype",
                                "bfloat16")))
    meta = dcp.FileSystemReader(str(tmp_path / "checkpoint" / "step-5")).read_metadata()
    keys = list(meta.state_dict_metadata)
    assert keys and all(k.startswith("model.") for k in keys)
    assert {str(m.properties.dtype) for m in meta.state_dict_metadata.values()} == {"torch.bfloat16"}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_bad_checkpoints_are_clear_errors_and_touch_nothing(single, tmp_path, data_cache):
    run = tmp_path / "run"
    shutil.copytree(single / "checkpoint", run / "checkpoint")
    before = _snapshot(run / "checkpoint")
    fails_with(run_train(args_for(run, data_cache, "--checkpoint.load_step", "7")),
                "load_step 7", "5, 10, 15, 20")
    fails_with(run_train(args_for(run, data_cache, "--model.flavor", "debug", "--training.seq_len", "64")),
                "tok_embeddings.weight", "[4096, 64]", "[4096, 256]")
    assert _snapshot(run / "checkpoint") == before
    corrupt = tmp_path / "corrupt"
    resume_from(single, 20, corrupt)
    (corrupt / "checkpoint" / "step-20" / ".metadata").write_bytes(b"not a checkpoint")
    fails_with(run_train(args_for(corrupt, data_cache)), "step-20")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoint").write_text("a file where the folder should be")
    fails_with(run_train(args_for(blocked, data_cache)), "checkpoint.folder", "a file, not a folder")


def test_initial_load_path_and_exclusions(single, tmp_path, data_cache):
    source = str(single / "checkpoint" / "step-10")
    fresh = losses(single)
    # Model only (the default): step numbering restarts, the weights are the trained ones.
    weights = tmp_path / "weights"
    proc = run_train(args_for(weights, data_cache, "--training.steps", "2",
                              "--checkpoint.initial_load_path", source))
    check_ok(proc)
    assert "started from" in proc.stdout
    assert sorted(losses(weights)) == [1, 2] and losses(weights)[1][0] < fresh[1][0] - 0.3
    # Everything: the run carries on at step 11 exactly as the source did.
    whole = tmp_path / "whole"
    check_ok(run_train(args_for(whole, data_cache, "--checkpoint.initial_load_path", source,
                                "--checkpoint.initial_load_model_only", "false")))
    assert_same(losses(whole), fresh, range(11, 21), rel=0.0)
    # Resume without the optimizer state: same step and data, fresh Adam moments → another path.
    no_opt = tmp_path / "no_opt"
    resume_from(single, 10, no_opt)
    check_ok(run_train(args_for(no_opt, data_cache, "--checkpoint.exclude_from_loading", "optimizer")))
    got = losses(no_opt)
    assert sorted(got) == list(range(11, 21)) and got[11] == fresh[11]
    assert abs(got[12][0] - fresh[12][0]) > 1e-4


def test_changed_data_order_is_refused_unless_excluded(single, tmp_path, data_cache):
    resume_from(single, 10, tmp_path)
    fails_with(run_train(args_for(tmp_path, data_cache, "--training.global_batch_size", "16")),
                "global_batch_size 8", "uses 16", "exclude_from_loading")
    proc = run_train(args_for(tmp_path, data_cache, "--training.global_batch_size", "16",
                              "--checkpoint.exclude_from_loading", "dataloader"))
    check_ok(proc)
    assert sorted(losses(tmp_path)) == list(range(11, 21))  # a fresh metrics file would start at 1


# ---------------------------------------------------------------- integrity (manifest, CRC-32)

def _damage(step: Path, kind: str) -> None:
    """One kind of damage to a checkpoint folder, as a full disk, a partial copy or bit rot leaves it."""
    shard = sorted(step.glob("*.distcp"))[0]
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    elif kind == "missing":
        shard.unlink()
    elif kind == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif kind == "metadata":
        meta = step / ".metadata"
        meta.write_bytes(b"\0" * meta.stat().st_size)  # same size: only the checksum or the parse can tell


DAMAGE = {"truncated": "truncated", "missing": "is missing", "flipped": "CRC-32", "metadata": "CRC-32"}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_integrity_check_names_each_damage(single, tmp_path, kind):
    step = tmp_path / "step-20"
    shutil.copytree(single / "checkpoint" / "step-20", step)
    assert (step / MANIFEST).is_file() and checkpoint_problem(step) is None
    _damage(step, kind)
    problem = checkpoint_problem(step)
    assert problem is not None and DAMAGE[kind] in problem, problem
    if kind == "flipped":  # same size: only the checksum sees it
        assert checkpoint_problem(step, checksums=False) is None
    # A folder from before manifests: its .metadata must still parse.
    (step / MANIFEST).unlink()
    if kind == "metadata":
        assert "does not parse" in checkpoint_problem(step)


def test_prune_counts_intact_checkpoints_only(single, tmp_path):
    folder = tmp_path / "checkpoint"
    shutil.copytree(single / "checkpoint", folder)
    _damage(folder / "step-20", "truncated")
    _damage(folder / "step-15", "missing")
    kept = _snapshot(folder / "step-10")
    prune(folder, keep=1)
    # step-10 is the newest intact one: it stays, byte for byte; only what is older goes.
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-15", "step-20"]
    assert _snapshot(folder / "step-10") == kept


def test_damaged_newest_checkpoint_is_skipped_and_load_step_of_it_refused(single, tmp_path, data_cache):
    run = tmp_path / "run"
    resume_from(single, 15, run)
    shutil.copytree(single / "checkpoint" / "step-20", run / "checkpoint" / "step-20")
    _damage(run / "checkpoint" / "step-20", "truncated")
    kept = _snapshot(run / "checkpoint" / "step-15")
    fails_with(run_train(args_for(run, data_cache, "--checkpoint.load_step", "20")),
               "load_step 20", "step-20 is damaged", "truncated")
    proc = run_train(args_for(run, data_cache))
    check_ok(proc)
    warned = [line for line in proc.stderr.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warned) == 1 and "step-20" in warned[0] and "truncated" in warned[0], proc.stderr[-2000:]
    assert "step-15" in proc.stdout.split("resumed from")[1].splitlines()[0]
    assert_same(losses(run), losses(single), range(16, 21), rel=0.0)
    assert _snapshot(run / "checkpoint" / "step-15") == kept
    # The new step-20 replaced the damaged one, which is kept aside, no longer a checkpoint.
    assert checkpoint_problem(run / "checkpoint" / "step-20") is None
    assert (run / "checkpoint" / "step-20.damaged").is_dir()


def test_damaged_initial_load_path_is_refused(single, tmp_path, data_cache):
    source = tmp_path / "source" / "step-10"
    shutil.copytree(single / "checkpoint" / "step-10", source)
    _damage(source, "flipped")
    run = args_for(tmp_path / "run", data_cache, "--checkpoint.initial_load_path", str(source))
    fails_with(run_train(run), "checkpoint.initial_load_path", "is damaged", "CRC-32")
