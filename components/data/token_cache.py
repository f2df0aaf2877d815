"""Text tokenized once into a flat token file in the cache (BOS doc EOS BOS doc EOS ...), named by the
bytes of the source and the tokenizer so a changed corpus or tokenizer never reads a stale file.

A new corpus is tokenized by every rank of the job at once, outside any collective. Chunk c
(document_chunks: at most 512 documents or 256 Ki characters) belongs to worker c mod W. Each worker
reads the documents, tokenizes its chunks into a part file and writes, beside it, how many tokens each
chunk gave; worker 0 then joins the parts in chunk order, so the token file is byte-identical to the one
a single process writes. Nobody waits in a collective, whose comm timeout a real corpus would outlast:
workers poll the file system for the parts and for the finished file instead.
"""

import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from components.data.sources import KILN_READS, read_documents
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError

# A chunk of documents per encode_batch call: at most this many documents or characters (bounded
# memory, still fast), and the unit of work that ranks share when they tokenize a corpus together.
ENCODE_CHUNK = 512


ENCODE_CHUNK_CHARS = 1 << 18


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def writer_id() -> str:
    """Unique per process on a shared file system (several nodes may tokenize at once)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def document_chunks(items: Iterable[str]) -> Iterable[list[str]]:
    """Documents in lists of ENCODE_CHUNK documents or ENCODE_CHUNK_CHARS characters, whichever
    comes first (the last one shorter)."""
    chunk: list[str] = []
    chars = 0
    for item in items:
        chunk.append(item)
        chars += len(item)
        if len(chunk) == ENCODE_CHUNK or chars >= ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def encode_chunk(chunk: list[str], tokenizer: Tokenizer, dtype: np.dtype) -> np.ndarray:
    """The tokens of a chunk of documents (BOS + text + EOS each), in one array."""
    ids = [np.asarray(doc, dtype=dtype) for doc in tokenizer.encode_batch(chunk, bos=True, eos=True)]
    return np.concatenate(ids) if ids else np.empty(0, dtype=dtype)


def write_chunk(f: BinaryIO, chunk: list[str], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    """Append the tokens of a chunk of documents to an open file, in one write; returns how many."""
    tokens = encode_chunk(chunk, tokenizer, dtype)
    f.write(tokens.tobytes())
    return len(tokens)


def publish_token_file(tmp: Path, out: Path, tokens: int, dtype: np.dtype) -> None:
    """Give a finished token file its final name, its sidecar (token count, dtype) first: a reader
    that finds the .bin also finds its dtype, and no one ever sees a half-written file."""
    meta_tmp = out.with_name(f"{out.stem}.json.tmp-{writer_id()}")
    meta_tmp.write_text(json.dumps({"tokens": tokens, "dtype": dtype.name}))
    os.replace(meta_tmp, out.with_suffix(".json"))
    os.replace(tmp, out)


def write_token_file(documents: Iterable[str], tokenizer: Tokenizer, out: Path) -> int:
    """Tokenize documents (BOS + text + EOS each) into a flat binary file; returns the token count.

    Written under a temporary name and renamed, so a crash or a concurrent writer never leaves a
    half-written file under the final name.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{writer_id()}")
    with open(tmp, "wb") as f:
        total = sum(write_chunk(f, chunk, tokenizer, dtype) for chunk in document_chunks(documents))
    publish_token_file(tmp, out, total, dtype)
    return total


@dataclass(frozen=True)
class TokenJob:
    """A text source and the cache file its tokens go to; documents=None for a prepared .bin."""

    out: Path
    documents: Callable[[], Iterable[str]] | None = None


def _jsonl_job(source: Path, tokenizer: Tokenizer, cache_dir: Path, text_field: str) -> TokenJob:
    """jsonl / txt (plain or gz) read by Kiln's reader; the name hashes the bytes and the tokenizer,
    so a changed corpus or tokenizer never reads a stale cache."""
    if not source.exists():
        raise KilnError(f"dataset file not found: {source}")
    digest = hashlib.sha256()
    digest.update(tokenizer.fingerprint.encode())
    if text_field != "text":
        digest.update(text_field.encode())
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    out = cache_dir / f"{source.name.split('.')[0]}-{digest.hexdigest()[:16]}.bin"
    return TokenJob(out, lambda: read_documents(source, text_field))


def _stream_job(source: str, tokenizer: Tokenizer, cache_dir: Path, text_field: str) -> TokenJob:
    """Any streaming source (parquet / csv / json files, folders, globs, hub datasets) through the
    `datasets` library. Local files are identified by name, size and modification time, hub datasets
    by name (a hub dataset that changes upstream needs a fresh cache folder)."""
    from components.data.sources import local_files, open_stream, text_of

    digest = hashlib.sha256()
    for part in (tokenizer.fingerprint, source, text_field):
        digest.update(part.encode())
    for f in local_files(source):
        st = f.stat()
        digest.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    slug = "".join(c if c.isalnum() else "_" for c in Path(source.rstrip("/*")).name)[:40] or "data"

    def documents() -> Iterable[str]:
        ds, builder = open_stream(source)
        return (text_of(row, text_field, builder, source) for row in ds)

    return TokenJob(cache_dir / f"{slug}-{digest.hexdigest()[:16]}.bin", documents)


def token_job(source: Path | str, tokenizer: Tokenizer, cache_dir: Path,
              text_field: str = "text") -> TokenJob:
    """Where the tokens of `source` live: a prepared .bin as is, text sources in the cache (jsonl /
    txt by Kiln's reader, anything else through the `datasets` library)."""
    if str(source).endswith(".bin"):
        return TokenJob(Path(source))
    p = Path(source)
    if p.is_file() and p.name.endswith(KILN_READS):
        return _jsonl_job(p, tokenizer, cache_dir, text_field)
    return _stream_job(str(source), tokenizer, cache_dir, text_field)


def token_file_for(source: Path | str, tokenizer: Tokenizer, cache_dir: Path,
                   text_field: str = "text") -> Path:
    """The token file of `source`, tokenized by this process if the cache lacks it."""
    return _written(token_job(source, tokenizer, cache_dir, text_field), tokenizer)


def cached_token_file(source: Path, tokenizer: Tokenizer, cache_dir: Path, text_field: str = "text") -> Path:
    """Tokenize a jsonl / txt file into cache_dir once; later calls reuse the file."""
    return _written(_jsonl_job(source, tokenizer, cache_dir, text_field), tokenizer)


def _written(job: TokenJob, tokenizer: Tokenizer) -> Path:
    if job.documents is not None and not job.out.exists():
        write_token_file(job.documents(), tokenizer, job.out)
    return job.out


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

        # Another job sharing the cache (a second replica group) may have joined the parts first.
        _wait_for(lambda: job.out.exists() or parts_done() == workers,
                  lambda: f"the ranks' parts of {job.out.name} ({parts_done()}/{workers} done)", say)
        if job.out.exists():
            return job.out
        try:
            tokens = _join_parts(job.out, workers)
        except FileNotFoundError:  # the other job joined while this one read the parts
            if not job.out.exists():
                raise
            return job.out
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
