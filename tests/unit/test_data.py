"""Tests components/data/token_cache.py: global batch order, layout-invariant loading, resume, token files."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from components.data.loader import BatchLoader, TokenWindows, global_batch_indices, validation_batches
from components.data.sources import EMBEDDED_DATASETS, REPO_ROOT, resolve_dataset
from components.data.token_cache import cached_token_file, token_file_for, write_token_file
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError

SEQ = 8
DOCS = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind",
        "to suffer"]


def counting_windows(tmp_path: Path, num_windows: int) -> TokenWindows:
    """A token file 0, 1, 2, ...: window i starts with token i·SEQ, so a row names its window."""
    path = tmp_path / "count.bin"
    np.arange(num_windows * SEQ + 1, dtype=np.uint16).tofile(path)
    return TokenWindows(path, SEQ, vocab_size=4096)


def window_ids(inputs: torch.Tensor) -> list[int]:
    """The window index of each row of a counting-file batch."""
    return (inputs[:, 0] // SEQ).tolist()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The shipped tokenizer, loaded once."""
    return Tokenizer(REPO_ROOT / "assets/tokenizer/tokenizer.json")


def write_jsonl(path: Path, docs: list[str]) -> Path:
    """A JSON-lines file with one {"text": ...} record per document."""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_global_batch_indices_deterministic_and_seeded() -> None:
    a = global_batch_indices(3, 16, 100, seed=7)
    assert np.array_equal(a, global_batch_indices(3, 16, 100, seed=7))
    assert not np.array_equal(a, global_batch_indices(3, 16, 100, seed=8))
    assert not np.array_equal(a, global_batch_indices(4, 16, 100, seed=7))


def test_each_epoch_is_a_permutation() -> None:
    epoch = np.concatenate([global_batch_indices(s, 4, 12, seed=0) for s in (1, 2, 3)])
    assert sorted(epoch.tolist()) == list(range(12))
    assert epoch.tolist() != list(range(12))  # shuffled
    nxt = np.concatenate([global_batch_indices(s, 4, 12, seed=0) for s in (4, 5, 6)])
    assert sorted(nxt.tolist()) == list(range(12))
    assert nxt.tolist() != epoch.tolist()  # a new order each epoch


def test_batches_straddle_epochs() -> None:
    # 10 windows, batches of 4: step 3 holds the last 2 of epoch 0 and the first 2 of epoch 1.
    steps = [global_batch_indices(s, 4, 10, seed=3).tolist() for s in range(1, 6)]
    flat = sum(steps, [])
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:]) == list(range(10))
    # A batch that starts an epoch sees that epoch's order from its beginning, whatever came before.
    long = global_batch_indices(1, 20, 10, seed=3).tolist()
    assert long == flat


LAYOUTS = [(1, 8), (2, 4), (4, 2), (2, 2)]  # (dp, local batch); the last needs 2 microbatches


@pytest.mark.parametrize("dp,local", LAYOUTS)
def test_every_layout_sees_the_same_global_batch(tmp_path: Path, dp: int, local: int) -> None:
    windows = counting_windows(tmp_path, 36)
    for step in (1, 2, 5, 6):  # step 5 holds the end of epoch 0 and the start of epoch 1
        expected = global_batch_indices(step, 8, 36, seed=11).tolist()
        per_rank = [BatchLoader(windows, 8, local, r, dp, seed=11).batch(step) for r in range(dp)]
        assert all(len(mbs) == 8 // (local * dp) for mbs in per_rank)
        # Documented layout: [microbatch][dp rank][local row].
        ordered = [row for m in range(8 // (local * dp)) for r in range(dp)
                   for row in window_ids(per_rank[r][m][0])]
        assert sorted(ordered) == sorted(expected)  # the same rows, as a multiset
        assert ordered == expected


def test_labels_are_inputs_shifted(tmp_path: Path) -> None:
    windows = counting_windows(tmp_path, 20)
    (inputs, labels), = BatchLoader(windows, 4, 4, 0, 1, seed=0).batch(1)
    assert inputs.shape == labels.shape == (4, SEQ)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(labels, inputs + 1)  # the next token of a counting file


def test_resume_continues_the_sequence(tmp_path: Path) -> None:
    windows = counting_windows(tmp_path, 20)
    straight = BatchLoader(windows, 4, 2, 1, 2, seed=5)
    expected = [next(straight) for _ in range(7)]
    first = BatchLoader(windows, 4, 2, 1, 2, seed=5)
    for _ in range(3):
        next(first)
    resumed = BatchLoader(windows, 4, 2, 1, 2, seed=5)
    resumed.step = first.step  # the loader's whole position
    for want in expected[3:]:
        got = next(resumed)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])


def test_loader_errors(tmp_path: Path) -> None:
    windows = counting_windows(tmp_path, 20)
    with pytest.raises(KilnError, match="divisible"):
        BatchLoader(windows, 6, 4, 0, 1, seed=0)
    with pytest.raises(KilnError, match="divisible"):
        BatchLoader(windows, 8, 2, 0, 3, seed=0)
    with pytest.raises(KilnError, match="too short"):
        BatchLoader(windows, 32, 4, 0, 2, seed=0)


def test_write_token_file_frames_documents(tmp_path: Path, tok: Tokenizer) -> None:
    out = tmp_path / "docs.bin"
    total = write_token_file(iter(DOCS), tok, out)
    expected = [t for d in DOCS for t in [tok.bos_id, *tok.encode(d), tok.eos_id]]
    got = np.fromfile(out, dtype=np.uint16).tolist()
    assert got == expected and total == len(expected)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta == {"tokens": len(expected), "dtype": "uint16"}
    assert got.count(tok.bos_id) == len(DOCS) == got.count(tok.eos_id)
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []


def test_cached_token_file_reuses_and_invalidates(tmp_path: Path, tok: Tokenizer) -> None:
    src = write_jsonl(tmp_path / "train.jsonl", DOCS)
    cache = tmp_path / "cache"
    first = cached_token_file(src, tok, cache)
    os.utime(first, ns=(1_000_000_000, 1_000_000_000))  # an old stamp a rewrite could not keep
    assert cached_token_file(src, tok, cache) == first
    assert first.stat().st_mtime_ns == 1_000_000_000
    write_jsonl(src, DOCS + ["a new document"])
    second = cached_token_file(src, tok, cache)
    assert second != first
    decoded = tok.decode(np.fromfile(second, dtype=np.uint16).tolist())
    assert decoded.endswith("a new document" + "<|end_of_text|>")
    assert token_file_for(second, tok, cache) == second  # a .bin is used as is
    with pytest.raises(KilnError, match="not found"):
        cached_token_file(tmp_path / "missing.jsonl", tok, cache)


def test_resolve_dataset(tmp_path: Path) -> None:
    assert resolve_dataset("shakespeare", "") == EMBEDDED_DATASETS["shakespeare"]
    assert all(p.exists() for p in resolve_dataset("shakespeare", "").values())
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("train.jsonl", "val.txt", "notes.md"):
        (folder / name).write_text("x")
    assert resolve_dataset("ignored", str(folder)) == {"train": folder / "train.jsonl",
                                                       "val": folder / "val.txt"}
    single = folder / "notes.md"
    assert resolve_dataset("ignored", str(single)) == {"train": single}
    with pytest.raises(KilnError, match="not found"):
        resolve_dataset("shakespeare", str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "val.jsonl").write_text("x")
    with pytest.raises(KilnError, match="no train"):
        resolve_dataset("shakespeare", str(empty))
    with pytest.raises(KilnError, match="shakespeare") as e:
        resolve_dataset("wikitext", "")
    assert "'wikitext'" in str(e.value)


def test_resolve_prepared_folder_skips_meta(tmp_path: Path, tok: Tokenizer) -> None:
    for split in ("train", "val"):
        write_token_file(iter(DOCS), tok, tmp_path / f"{split}.bin")
    assert (tmp_path / "train.json").exists()
    assert resolve_dataset("", str(tmp_path)) == {"train": tmp_path / "train.bin",
                                                  "val": tmp_path / "val.bin"}


def test_validation_batches_split_rows(tmp_path: Path) -> None:
    windows = counting_windows(tmp_path, 13)  # 13 windows, rounds of 2 × 3 = 6: 2 full rounds
    per_rank = [validation_batches(windows, 2, r, 3, max_steps=-1) for r in range(3)]
    assert all(len(b) == 2 for b in per_rank)
    seen = [w for rnd in range(2) for r in range(3) for w in window_ids(per_rank[r][rnd][0])]
    assert seen == list(range(12))  # in order, no overlap, nothing skipped but the partial round
    assert len(validation_batches(windows, 2, 0, 3, max_steps=1)) == 1
    with pytest.raises(KilnError, match="validation"):
        validation_batches(windows, 8, 0, 2, max_steps=-1)


def test_token_file_dtype_comes_from_the_tokenizer(tmp_path: Path, tok: Tokenizer) -> None:
    """A uint16 file (4096-token tokenizer) reads right under a model with a 128k vocabulary."""
    out = tmp_path / "t.bin"
    write_token_file(["To be, or not to be."], tok, out)
    expected = [tok.bos_id, *tok.encode("To be, or not to be."), tok.eos_id]
    windows = TokenWindows(out, seq_len=len(expected) - 1, vocab_size=128256)
    assert windows.rows(np.array([0]))[0].tolist() == expected


def test_token_ids_beyond_the_model_vocab_are_an_error(tmp_path: Path, tok: Tokenizer) -> None:
    out = tmp_path / "t.bin"
    write_token_file(["To be, or not to be."], tok, out)
    with pytest.raises(KilnError, match="another tokenizer"):
        TokenWindows(out, seq_len=2, vocab_size=10)


def test_resolve_dataset_other_sources(tmp_path: Path, tok: Tokenizer) -> None:
    """Names beyond the embedded corpus: a folder of shards, a glob, a hub id, a registered name;
    anything other than jsonl/txt is tokenized into the cache through `datasets`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.data.sources import register_dataset

    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"text": DOCS[:2]}), shards / "part-0.parquet")
    pq.write_table(pa.table({"text": DOCS[2:]}), shards / "part-1.parquet")
    assert resolve_dataset(str(shards), "") == {"train": str(shards)}
    assert resolve_dataset("", str(shards / "*.parquet")) == {"train": str(shards / "*.parquet")}
    assert resolve_dataset("allenai/c4", "") == {"train": "allenai/c4"}
    register_dataset("my_corpus", shards / "part-0.parquet")
    assert resolve_dataset("my_corpus", "") == {"train": shards / "part-0.parquet"}
    out = token_file_for(str(shards), tok, tmp_path / "cache")
    expected = [t for d in DOCS for t in tok.encode(d, bos=True, eos=True)]
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    assert token_file_for(str(shards), tok, tmp_path / "cache") == out  # cached
