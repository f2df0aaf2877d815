"""Preparation throughput against its ceiling: scripts/prepare_data.py's tokens/s beside the
`tokenizers` library's own batch-encode rate on the same machine and text, and its peak memory.

    python benchmarks/benchmark_prepare.py [--mb 200] [--workers 2]

The corpus is the embedded Shakespeare text cut into documents of 200–4,000 characters and written
as one plain .jsonl file of --mb megabytes. The ceiling: every document already in memory, the
library's encode_batch_fast over chunks of 512 on all cores (its own thread pool) with the ids taken
out, nothing read, converted or written. The preparation: the script as a user runs it, start to
end (process start-up, reading and JSON-parsing the file, writing shards and the index). Peak RSS
is the largest of the script's processes (getrusage of the waited-for children, measured before this
process loads the corpus for the ceiling).
"""

import argparse
import gzip
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from components.data.tokenizer import Tokenizer  # noqa: E402

TOKENIZER = REPO / "assets/tokenizer/tokenizer.json"


def make_corpus(path: Path, megabytes: float) -> int:
    """A jsonl file of about `megabytes` MB of Shakespeare documents; returns the document count."""
    with gzip.open(REPO / "assets/data/shakespeare/train.jsonl.gz", "rt") as f:
        text = "\n".join(json.loads(line)["text"] for line in f)
    rng = np.random.default_rng(0)
    written, count, target = 0, 0, int(megabytes * 1e6)
    with open(path, "w") as out:
        while written < target:
            start = int(rng.integers(0, len(text) - 4000))
            line = json.dumps({"text": text[start:start + int(rng.integers(200, 4000))]}) + "\n"
            out.write(line)
            written += len(line.encode())
            count += 1
    return count


def ceiling(path: Path) -> tuple[float, int]:
    """(tokens/s, tokens) of the tokenizers library's encode_batch_fast over the documents held in
    memory, the ids taken out of each encoding (plus BOS and EOS per document, counted not added)."""
    with open(path) as f:
        docs = [json.loads(line)["text"] for line in f]
    library = Tokenizer(TOKENIZER)._tok
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(docs), 512):
        batch = library.encode_batch_fast(docs[i:i + 512], add_special_tokens=False)
        tokens += sum(len(e.ids) + 2 for e in batch)
    return tokens / (time.perf_counter() - start), tokens


def prepare(path: Path, out: Path, workers: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, peak RSS GiB) of scripts/prepare_data.py, start to end."""
    start = time.perf_counter()
    cmd = [sys.executable, "scripts/prepare_data.py", "--source", str(path), "--out", str(out),
           "--workers", str(workers), "--piece-mb", "16"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    tokens = json.loads((out / "index.json").read_text())["splits"]["train"]["tokens"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB → GiB
    return tokens / seconds, tokens, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the generated corpus")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-prep-"))
    try:
        corpus = work / "corpus.jsonl"
        docs = make_corpus(corpus, a.mb)
        # The preparation first: a child forked by a process holding the ceiling's documents would
        # count them in its own peak until it execs.
        rate, prepared, peak = prepare(corpus, work / "out", a.workers)
        limit, tokens = ceiling(corpus)
        assert prepared == tokens, (prepared, tokens)
        print(f"\n| corpus | tokens | tokenizers' encode_batch tok/s | prepare_data.py "
              f"({a.workers} processes) tok/s | ratio | peak RSS per process |")
        print("|---|---|---|---|---|---|")
        print(f"| {a.mb:,.0f} MB, {docs:,} documents | {tokens:,} | {limit:,.0f} | {rate:,.0f} | "
              f"{rate / limit:.2f} | {peak:.2f} GiB |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
