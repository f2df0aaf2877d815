"""Streaming sources and the on-the-fly loader: every local format reads through `datasets`, and a
restored loader reads exactly the tokens an uninterrupted one would (world 1 and 2). Whole training
runs resuming from a streaming checkpoint are tests/e2e/test_streaming_runs.py."""

import csv
import json

import pytest
import torch

from components.data.sources import open_stream, text_of
from components.data.streaming import StreamingLoader
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError
from tests.helpers.documents import DOCS, write_jsonl


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer("assets/tokenizer/tokenizer.json")


def read_all(source: str, field: str = "text") -> list[str]:
    ds, builder = open_stream(source)
    return [text_of(row, field, builder, source) for row in ds]


def test_every_local_format_reads_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl.gz")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "a.parquet")
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        w.writerows([[d] for d in DOCS])
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", DOCS[:30])
    write_jsonl(folder / "part-1.jsonl", DOCS[30:])
    for source in ("a.jsonl.gz", "a.parquet", "a.csv", "shards", "shards/part-*.jsonl"):
        assert read_all(str(tmp_path / source)) == DOCS, source
    (tmp_path / "a.txt").write_text("\n".join(DOCS) + "\n")
    assert read_all(str(tmp_path / "a.txt")) == DOCS  # one document per line


@pytest.mark.parametrize("dp", [1, 2])
def test_loader_resumes_exactly(tok, tmp_path, dp):
    """Stopped after 7 steps and restored into a new loader: the next 23 steps (two epochs of this
    small corpus) equal the uninterrupted run's, on every rank."""
    source = write_jsonl(tmp_path / "c.jsonl")

    def make(rank: int) -> StreamingLoader:
        return StreamingLoader(source, "text", tok, 32, 4 * dp, 2, rank, dp)

    for rank in range(dp):
        straight = make(rank)
        expected = [straight.batch(s) for s in range(1, 31)]
        first = make(rank)
        got = [first.batch(s) for s in range(1, 8)]
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
        second = make(rank)
        second.load_state_dict(state)
        got += [second.batch(s) for s in range(8, 31)]
        assert straight.epoch >= 1
        for a, b in zip(expected, got, strict=True):
            for (xa, ya), (xb, yb) in zip(a, b, strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if dp == 2:  # the two ranks read different documents
        assert not torch.equal(make(0).batch(1)[0][0], make(1).batch(1)[0][0])


def test_bad_sources(tok, tmp_path):
    with pytest.raises(KilnError, match="dataset not found"):
        open_stream(str(tmp_path / "missing.jsonl"))
    source = write_jsonl(tmp_path / "other.jsonl", field="body")
    with pytest.raises(KilnError, match="no field 'text'; fields: body, id"):
        StreamingLoader(source, "text", tok, 32, 2, 2, 0, 1).batch(1)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(KilnError, match="no documents"):
        StreamingLoader(str(tmp_path / "empty.jsonl"), "text", tok, 32, 2, 2, 0, 1).batch(1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "\x00\x01 not json {\n")
    with pytest.raises(KilnError, match="bad.jsonl: cannot read"):
        StreamingLoader(str(bad), "text", tok, 4096, 1, 1, 0, 1).batch(1)


def test_hub_name_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KilnError, match="HF_HUB_OFFLINE"):
        open_stream("allenai/c4")
