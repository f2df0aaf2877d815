"""A new corpus is tokenized by every rank at once, outside any collective: the joined token file is
byte-identical to one process's (threads play the ranks here; real ranks, and a corpus that takes
longer than the comm timeout, are tests/e2e/test_token_prep_runs.py)."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from components.data.sources import EMBEDDED_DATASETS, read_documents
from components.data.token_cache import prepare_token_file, token_job, write_token_file
from components.data.tokenizer import Tokenizer
from tests.helpers.runs import REPO


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")


def prepare_together(source: Path, tok: Tokenizer, cache: Path, workers: int) -> Path:
    """`workers` threads play the ranks, each preparing the same job as its worker."""
    job = token_job(source, tok, cache)
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(lambda w: prepare_token_file(job, tok, w, workers), range(workers)))
    assert len(set(outs)) == 1
    return outs[0]


@pytest.mark.parametrize("workers", [2, 3])
def test_parts_join_into_the_one_process_file(workers, tok, tmp_path):
    source = EMBEDDED_DATASETS["shakespeare"]["train"]
    single = tmp_path / "single.bin"
    tokens = write_token_file(read_documents(source), tok, single)
    out = prepare_together(source, tok, tmp_path / "cache", workers)
    assert out.read_bytes() == single.read_bytes()
    assert json.loads(out.with_suffix(".json").read_text())["tokens"] == tokens
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, out.with_suffix(".json").name])


def test_a_rank_without_chunks_still_joins(tok, tmp_path):
    """Three short documents are one chunk: the second worker's part is empty."""
    source = tmp_path / "three.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("To be.", "Or not.", "To be!")))
    single = tmp_path / "single.bin"
    write_token_file(read_documents(source), tok, single)
    assert prepare_together(source, tok, tmp_path / "cache", 2).read_bytes() == single.read_bytes()
