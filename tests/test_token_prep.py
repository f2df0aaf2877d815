"""A new corpus is tokenized by every rank at once, outside any collective: the joined token file is
byte-identical to one process's, and a corpus that takes longer than the comm timeout trains."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, TINY, check_ok, run_train, train_rows

from components.data.sources import EMBEDDED_DATASETS, read_documents
from components.data.token_cache import prepare_token_file, token_job, write_token_file
from components.data.tokenizer import Tokenizer


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


def test_corpus_slower_than_the_comm_timeout_trains(tok, tmp_path):
    """2 ranks tokenize ~4.8M tokens (seconds) with comm.timeout_seconds 2: a barrier would time out."""
    corpus = tmp_path / "big.jsonl"
    docs = list(read_documents(EMBEDDED_DATASETS["shakespeare"]["train"]))
    with corpus.open("w") as f:
        for copy in range(3):
            for d in docs:
                f.write(json.dumps({"text": f"{copy} {d}"}) + "\n")
    cache = tmp_path / "cache"
    proc = run_train([*TINY, "--training.steps", "3", "--training.dataset_path", str(corpus),
                      "--training.local_batch_size", "4", "--training.data_cache_dir", str(cache),
                      "--comm.timeout_seconds", "2", "--job.dump_folder", str(tmp_path / "out")], nproc=2)
    check_ok(proc)
    assert "tokenized big-" in proc.stdout and "on 2 ranks" in proc.stdout
    assert [r["step"] for r in train_rows(tmp_path / "out")][-1] == 3
    joined = token_job(corpus, tok, cache).out
    single = tmp_path / "single.bin"
    write_token_file(read_documents(corpus), tok, single)
    assert joined.read_bytes() == single.read_bytes()
