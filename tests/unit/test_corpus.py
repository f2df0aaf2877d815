"""Tests the shipped Shakespeare splits and read_documents on small files of each kind."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from components.data.sources import EMBEDDED_DATASETS, read_documents
from components.runtime.errors import KilnError

SPLITS = EMBEDDED_DATASETS["shakespeare"]
POEMS = {"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
         "rape_of_lucrece"}


def records(path: Path) -> list[dict[str, str]]:
    """Reads every JSON record of a shipped split, ids and titles included."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def shipped() -> dict[str, list[dict[str, str]]]:
    """Both shipped splits, read once for the module."""
    return {name: records(path) for name, path in SPLITS.items()}


def test_shipped_splits_load(shipped: dict[str, list[dict[str, str]]]) -> None:
    """read_documents yields one non-empty text per record of each split."""
    for name, path in SPLITS.items():
        texts = list(read_documents(path))
        assert texts == [r["text"] for r in shipped[name]]
        assert all(t.strip() for t in texts)
        assert all(set(r) == {"id", "title", "text"} for r in shipped[name])


def test_splits_disjoint_and_val_share(shipped: dict[str, list[dict[str, str]]]) -> None:
    """No id repeats anywhere, and val holds 2-5% of the documents."""
    train_ids = [r["id"] for r in shipped["train"]]
    val_ids = [r["id"] for r in shipped["val"]]
    assert len(set(train_ids + val_ids)) == len(train_ids) + len(val_ids)
    assert 0.02 <= len(val_ids) / (len(train_ids) + len(val_ids)) <= 0.05


def test_every_work_present_and_plays_split_by_scene(
    shipped: dict[str, list[dict[str, str]]],
) -> None:
    """All 42 works are there, and every play became several documents that start at a heading."""
    docs = shipped["train"] + shipped["val"]
    per_work = Counter(r["id"].split("/")[0] for r in docs)
    assert len(per_work) == 42
    plays = {work: n for work, n in per_work.items() if work not in POEMS}
    assert len(plays) == 37
    assert all(n >= 9 for n in plays.values()), plays  # the fewest scenes of any play is 9
    assert per_work["hamlet"] == 20
    for r in docs:
        work, index = r["id"].split("/")
        if work not in POEMS and index != "0":
            assert r["text"].upper().startswith(("ACT", "SCENE")), r["id"]


def test_read_jsonl(tmp_path: Path) -> None:
    """A .jsonl file yields its text field in order, skipping blank lines; other fields work too."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one", "body": "uno"}\n\n{"text": "two\\nlines", "body": "dos"}\n')
    assert list(read_documents(path)) == ["one", "two\nlines"]
    assert list(read_documents(path, text_field="body")) == ["uno", "dos"]


def test_read_jsonl_gz_and_txt(tmp_path: Path) -> None:
    """Gzipped JSON lines and plain or gzipped text files (one document each) all read."""
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "café"}\n')
    (tmp_path / "d.txt").write_text("whole\n\nfile", encoding="utf-8")
    with gzip.open(tmp_path / "d.txt.gz", "wt", encoding="utf-8") as f:
        f.write("zipped")
    assert list(read_documents(tmp_path / "d.jsonl.gz")) == ["café"]
    assert list(read_documents(str(tmp_path / "d.txt"))) == ["whole\n\nfile"]
    assert list(read_documents(tmp_path / "d.txt.gz")) == ["zipped"]


def test_missing_path_fails_at_call(tmp_path: Path) -> None:
    """A missing file is reported when read_documents is called, naming the path."""
    with pytest.raises(KilnError, match="absent.jsonl"):
        read_documents(tmp_path / "absent.jsonl")


def test_missing_field(tmp_path: Path) -> None:
    """A record without the text field is a KilnError naming the file, line and field."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:2: no field 'text'"):
        list(read_documents(path))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", "{oops\n", r"bad\.jsonl:1: not valid JSON"),
        ("num.jsonl", '{"text": 3}\n', r"num\.jsonl:1: field 'text' is not a string"),
        ("d.csv", "a,b\n", r"cannot read .*d\.csv"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    """Broken JSON, a non-string text and an unknown extension are KilnErrors naming the file."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(KilnError, match=message):
        list(read_documents(path))


def test_not_utf8(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a KilnError naming the file, not a UnicodeDecodeError."""
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(KilnError, match=r"latin1\.txt: not UTF-8"):
        list(read_documents(path))
