"""A corpus tokenized the first time by every rank of the job at once, outside any collective.

Chunk c (data.document_chunks: at most 512 documents or 256 Ki characters) belongs to worker
c mod W. Each worker reads the documents, tokenizes its chunks into a part file and writes,
beside it, how many tokens each chunk gave; worker 0 then joins the parts in chunk order, so the
token file is byte-identical to the one a single process writes. Nobody waits in a collective,
whose comm timeout a real corpus would outlast: workers poll the file system for the parts and
for the finished file instead.
"""

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from components.data import (
    TokenJob,
    document_chunks,
    publish_token_file,
    token_dtype,
    write_chunk,
    write_token_file,
    writer_id,
)
from components.tokenizer import Tokenizer

POLL_SECONDS = 0.2
REPORT_EVERY_SECONDS = 30.0


def prepare_token_file(job: TokenJob, tokenizer: Tokenizer, worker: int = 0, workers: int = 1,
                       say: Callable[[str], None] = lambda line: None, terminal: bool = False) -> Path:
    """The token file of `job`, made now if the cache lacks it: by this process alone when workers
    is 1, else as worker `worker` of `workers` (each must call this with the same job)."""
    if job.documents is None or job.out.exists():
        return job.out
    started = time.monotonic()
    if workers == 1:
        tokens = write_token_file(job.documents(), tokenizer, job.out)
        say(f"tokenized {job.out.name}: {tokens:,} tokens on 1 rank in {time.monotonic() - started:.1f} s")
        return job.out
    _write_part(job, tokenizer, worker, workers, say, terminal)
    if worker == 0:
        def parts_done() -> int:
            return sum(_meta_path(job.out, w, workers).exists() for w in range(workers))

        _wait_for(lambda: parts_done() == workers,
                  lambda: f"the ranks' parts of {job.out.name} ({parts_done()}/{workers} done)", say)
        tokens = _join_parts(job.out, workers)
        say(f"tokenized {job.out.name}: {tokens:,} tokens on {workers} ranks in "
            f"{time.monotonic() - started:.1f} s")
    else:
        _wait_for(job.out.exists, lambda: f"rank 0 to join {job.out.name}", say)
    return job.out


def _part_path(out: Path, worker: int, workers: int) -> Path:
    return out.with_name(f"{out.name}.part{worker}of{workers}")


def _meta_path(out: Path, worker: int, workers: int) -> Path:
    """Written last, under its final name only when the part is complete: the part's done marker."""
    return out.with_name(f"{out.name}.part{worker}of{workers}.json")


def _write_part(job: TokenJob, tokenizer: Tokenizer, worker: int, workers: int,
                say: Callable[[str], None], terminal: bool) -> None:
    """Tokenize this worker's chunks (c mod workers == worker) into its part file."""
    meta = _meta_path(job.out, worker, workers)
    if meta.exists():  # a finished part from an earlier attempt: same source, same tokenizer
        return
    dtype = token_dtype(tokenizer.vocab_size)
    part = _part_path(job.out, worker, workers)
    part.parent.mkdir(parents=True, exist_ok=True)
    tmp = part.with_name(f"{part.name}.tmp-{writer_id()}")
    counts, n_chunks, docs, tokens, started = [], 0, 0, 0, time.monotonic()
    with open(tmp, "wb") as f:
        for index, chunk in enumerate(document_chunks(job.documents())):
            n_chunks, docs = index + 1, docs + len(chunk)
            if index % workers != worker:
                continue
            counts.append(write_chunk(f, chunk, tokenizer, dtype))
            tokens += counts[-1]
            if terminal:
                rate = tokens / max(time.monotonic() - started, 1e-9)
                say(f"\rtokenizing {job.out.name}: {docs:,} documents read, "
                    f"{tokens:,} tokens in this rank's share 1/{workers} ({rate:,.0f} tokens/s)")
    if terminal:
        say("")
    os.replace(tmp, part)
    meta_tmp = meta.with_name(f"{meta.name}.tmp-{writer_id()}")
    meta_tmp.write_text(json.dumps({"chunks": n_chunks, "counts": counts, "dtype": dtype.name}))
    os.replace(meta_tmp, meta)


def _join_parts(out: Path, workers: int) -> int:
    """Concatenate the parts' chunks in corpus order into `out` (sidecar first, then the file),
    remove the parts; returns the token count."""
    metas = [json.loads(_meta_path(out, w, workers).read_text()) for w in range(workers)]
    dtype = np.dtype(metas[0]["dtype"])
    parts = [np.memmap(_part_path(out, w, workers), dtype=dtype, mode="r") if metas[w]["counts"] else None
             for w in range(workers)]
    offsets = [np.concatenate([[0], np.cumsum(m["counts"])]).astype(np.int64) for m in metas]
    tmp = out.with_name(f"{out.name}.tmp-{writer_id()}")
    total = 0
    with open(tmp, "wb") as f:
        for chunk in range(metas[0]["chunks"]):
            w, k = chunk % workers, chunk // workers
            piece = parts[w][offsets[w][k]:offsets[w][k + 1]]
            f.write(piece.tobytes())
            total += len(piece)
    del parts
    publish_token_file(tmp, out, total, dtype)
    for w in range(workers):
        _part_path(out, w, workers).unlink(missing_ok=True)
        _meta_path(out, w, workers).unlink(missing_ok=True)
    return total


def _wait_for(done: Callable[[], bool], what: Callable[[], str], say: Callable[[str], None]) -> None:
    """Poll the file system until done(); every REPORT_EVERY_SECONDS say what is awaited."""
    started = last = time.monotonic()
    while not done():
        time.sleep(POLL_SECONDS)
        now = time.monotonic()
        if now - last >= REPORT_EVERY_SECONDS:
            say(f"waiting for {what()} ({now - started:.0f} s)")
            last = now


def console(line: str) -> None:
    """say() for the main rank: lines that start with a carriage return redraw the current line."""
    if line.startswith("\r"):
        sys.stdout.write(line)
        sys.stdout.flush()
    else:
        print(line, flush=True)
