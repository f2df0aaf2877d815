"""A three-source mixture (training.sources) trained as a user trains it: the same losses, grad norms
and per-source losses in one process, FSDP 2 and PP 2; each source's share of every step's rows as its
weight asks; a resume from a checkpoint reproduces the uninterrupted run exactly, and a resume with new
weights continues each source where it stood. The loader itself is tests/unit/test_mixture.py."""

import json
import random
import shutil

import pytest

from tests.helpers.runs import TINY, check_ok, fails_with, read_metrics, relative, run_train, train_rows

WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}
STEPS = 8
BATCH = ["--training.global_batch_size", "10", "--training.local_batch_size", "10"]  # 5 : 3 : 2 rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three jsonl sources of different sizes (books, under 16 windows, runs out within the run)."""
    root = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)
    words = {"web": "the quick brown fox jumps over a lazy dog".split(),
             "code": "def return if else for while import class self".split(),
             "books": "thou art king and queen of the realm my lord".split()}
    sizes = {"web": 400, "code": 300, "books": 8}
    for name, n in sizes.items():
        lines = [json.dumps({"text": " ".join(rng.choice(words[name]) for _ in range(rng.randint(30, 60)))})
                 for _ in range(n)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def sources(corpus, weights=WEIGHTS) -> list[str]:
    return ["--training.sources", ",".join(f"{corpus / name}.jsonl={w}" for name, w in weights.items())]


def mixture_run(corpus, dump, *extra, nproc=1, weights=WEIGHTS, steps=STEPS):
    args = [*TINY, *BATCH, "--training.steps", str(steps), *sources(corpus, weights),
            "--job.dump_folder", str(dump), "--training.data_cache_dir", str(corpus / "cache"), *extra]
    return run_train(args, nproc=nproc)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("mixture_ref")
    proc = mixture_run(corpus, dump, "--checkpoint.enable", "--checkpoint.interval", "4")
    check_ok(proc)
    assert "data    mixture of 3: web 50%" in proc.stdout
    assert "source books ran out at step" in proc.stdout
    return dump, train_rows(dump)


def test_each_step_takes_each_source_by_its_weight(reference):
    _, rows = reference
    for r in rows:
        assert r["source_tokens"] == {"web": 5 * 64, "code": 3 * 64, "books": 2 * 64}
        assert sum(r["source_tokens"].values()) == r["loss_tokens"]
        # the step's loss is the token-weighted mean of the sources' losses
        mean = sum(r["source_loss"][n] * r["source_tokens"][n] for n in WEIGHTS) / r["loss_tokens"]
        assert relative(mean, r["loss"]) < 1e-6


@pytest.mark.parametrize("layout", ["fsdp2", "pp2"])
def test_layouts_match_one_process(layout, corpus, reference, tmp_path):
    extra = {"fsdp2": ["--training.local_batch_size", "5"],
             "pp2": ["--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_microbatch_size", "2"]}[layout]
    check_ok(mixture_run(corpus, tmp_path, *extra, nproc=2))
    rows = train_rows(tmp_path)
    for ref, got in zip(reference[1], rows, strict=True):
        tol = 1e-5 if ref["step"] == 1 else 1e-4
        assert relative(got["loss"], ref["loss"]) <= tol, (layout, ref["step"])
        assert relative(got["grad_norm"], ref["grad_norm"]) <= tol, (layout, ref["step"])
        assert got["source_tokens"] == ref["source_tokens"]
        for name in WEIGHTS:
            assert relative(got["source_loss"][name], ref["source_loss"][name]) <= tol, (layout, name)


def resumed_at(reference, step: int, dump):
    """A copy of the reference run's checkpoint of `step` alone, in a fresh folder."""
    shutil.copytree(reference[0] / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")


def test_resume_reproduces_the_run_exactly(corpus, reference, tmp_path):
    resumed_at(reference, 4, tmp_path)
    proc = mixture_run(corpus, tmp_path, "--checkpoint.enable", "--checkpoint.interval", "4")
    check_ok(proc)
    assert "resumed from" in proc.stdout
    got = {r["step"]: r for r in train_rows(tmp_path)}
    for ref in reference[1][4:]:
        row = got[ref["step"]]
        assert row["loss"] == ref["loss"] and row["source_loss"] == ref["source_loss"]


def test_new_weights_on_resume_continue_each_source(corpus, reference, tmp_path):
    resumed_at(reference, 4, tmp_path)
    weights = {"web": 0.2, "code": 0.3, "books": 0.5}
    proc = mixture_run(corpus, tmp_path, "--checkpoint.enable", "--checkpoint.interval", "4", weights=weights)
    check_ok(proc)
    assert ("new mixture weights from step 5 (web 0.5→0.2, code 0.3→0.3, books 0.2→0.5): each source "
            "continues where it stood") in proc.stdout
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [5, 6, 7, 8]
    assert all(r["source_tokens"] == {"web": 2 * 64, "code": 3 * 64, "books": 5 * 64} for r in rows)
    saved = json.loads(json.dumps(rows[0]))  # the per-source loss of the continued phase is logged too
    assert set(saved["source_loss"]) == set(WEIGHTS)


def test_bad_mixtures_are_one_line(corpus, tmp_path):
    bad = ["--training.sources", f"{corpus / 'web.jsonl'}=0,{corpus / 'code.jsonl'}=1"]
    fails_with(run_train([*TINY, *bad, "--job.dump_folder", str(tmp_path)]),
               "web.jsonl has weight 0.0; a weight must be above 0")
    missing = ["--training.sources", f"{corpus / 'nope.jsonl'}=1"]
    fails_with(run_train([*TINY, *missing, "--job.dump_folder", str(tmp_path)]),
               "training.sources:", "nope.jsonl")
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[[training.sources]]\npath = "{corpus / "web.jsonl"}"\nwieght = 2\n')
    fails_with(run_train(["--config", str(toml), "--job.dump_folder", str(tmp_path)]),
               "training.sources[0]: unknown key 'wieght'")


def test_validation_per_source(corpus, tmp_path):
    """Sources that are folders with train.* and val.* files are validated one by one; val_loss is the
    mean over all their tokens."""
    for name in ("web", "code"):
        folder = tmp_path / name
        folder.mkdir()
        lines = (corpus / f"{name}.jsonl").read_text().splitlines()
        (folder / "train.jsonl").write_text("\n".join(lines[40:]) + "\n")
        (folder / "val.jsonl").write_text("\n".join(lines[:40]) + "\n")
    args = [*TINY, *BATCH, "--training.steps", "2", "--training.sources",
            f"{tmp_path / 'web'}=0.5,{tmp_path / 'code'}=0.5", "--validation.enable",
            "--validation.freq", "2", "--validation.steps", "2", "--job.dump_folder", str(tmp_path / "run")]
    proc = run_train(args)
    check_ok(proc)
    assert "validated per source (web, code)" in proc.stdout
    rows = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert len(rows) == 1 and set(rows[0]["val_source_loss"]) == {"web", "code"}
    losses = rows[0]["val_source_loss"]
    assert min(losses.values()) <= rows[0]["val_loss"] <= max(losses.values())
    assert losses["web"] != losses["code"]


def test_toml_tables_and_val_share(corpus, tmp_path):
    """[[training.sources]] tables with a name, a text field and a held-out share, validated per source."""
    (tmp_path / "code.jsonl").write_text("".join(
        json.dumps({"content": json.loads(line)["text"]}) + "\n"
        for line in (corpus / "code.jsonl").read_text().splitlines()))
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[[training.sources]]\npath = "{corpus / "web.jsonl"}"\nweight = 3\nname = "crawl"\n'
                    f'val_share = 0.05\n\n[[training.sources]]\npath = "{tmp_path / "code.jsonl"}"\n'
                    'weight = 2\ntext_field = "content"\nval_share = 0.05\n')
    args = ["--config", str(toml), *TINY[2:], *BATCH, "--training.steps", "2", "--validation.enable",
            "--validation.freq", "2", "--validation.steps", "1", "--job.dump_folder", str(tmp_path / "run")]
    proc = run_train(args)
    check_ok(proc)
    assert "data    mixture of 2: crawl 60%" in proc.stdout
    rows = read_metrics(tmp_path / "run")
    assert all(r["source_tokens"] == {"crawl": 6 * 64, "code": 4 * 64} for r in rows if "loss" in r)
    (val,) = [r for r in rows if "val_loss" in r]
    assert set(val["val_source_loss"]) == {"crawl", "code"}


def test_document_masking_on_mixed_windows(corpus, tmp_path):
    """Masking keeps attention inside each document of a mixed window: it changes the loss (the
    windows hold several documents), and the run learns as well."""
    check_ok(mixture_run(corpus, tmp_path / "mask", "--training.document_mask", steps=3))
    masked, plain = train_rows(tmp_path / "mask"), None
    check_ok(mixture_run(corpus, tmp_path / "plain", steps=3))
    plain = train_rows(tmp_path / "plain")
    assert masked[0]["loss"] != plain[0]["loss"] and relative(masked[0]["loss"], plain[0]["loss"]) < 1e-2
    assert masked[0]["source_tokens"] == plain[0]["source_tokens"]
