"""A corpus that takes longer to tokenize than the comm timeout trains: every rank tokenizes its
part outside any collective, and the joined token file is byte-identical to one process's."""

import json

import pytest

from components.data.sources import EMBEDDED_DATASETS, read_documents
from components.data.token_cache import token_job, write_token_file
from components.data.tokenizer import Tokenizer
from tests.helpers.runs import REPO, TINY, check_ok, dump_args, run_train, train_rows


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")


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
                      "--comm.timeout_seconds", "2", *dump_args(tmp_path / "out")], nproc=2)
    check_ok(proc)
    assert "tokenized big-" in proc.stdout and "on 2 ranks" in proc.stdout
    assert [r["step"] for r in train_rows(tmp_path / "out")][-1] == 3
    joined = token_job(corpus, tok, cache).out
    single = tmp_path / "single.bin"
    write_token_file(read_documents(corpus), tok, single)
    assert joined.read_bytes() == single.read_bytes()
