"""Prepared token folders: a corpus tokenized into shards (uint16 where the vocabulary fits, else
uint32), each the tokens (BOS doc EOS ...) of one piece of the input, listed in an index.

    DIR/index.json            written last: the folder is complete when it exists
    DIR/train-00000.bin       the tokens of piece 0 of the train split
    DIR/train-00000.json      its marker: tokens, documents, characters, the largest id (written
                              after the shard, so a piece with a marker is done)
    DIR/val-00000.bin ...

A piece is a byte range of a plain JSON-lines file (about `piece_bytes`, cut at line starts) or a
whole file (compressed, plain text, or anything read through `datasets`): pieces are independent, so
processes (and nodes) tokenize different pieces at once, each writing its own shards, and a killed
preparation resumes with the pieces that have no marker. Memory stays bounded by one chunk of
documents per process. Training reads the shards of a split as one stream of tokens by memory map
(ShardedTokens); the index records the tokenizer that made them, and a run with another is refused.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.data.sources import KILN_READS, local_files, read_documents, text_of_json_line
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError

INDEX = "index.json"
FORMAT = "kiln-token-shards"


@dataclass(frozen=True)
class Piece:
    """One unit of work: a file, or a byte range [start, end) of a plain JSON-lines file."""

    path: str
    start: int = 0
    end: int = -1  # -1: the whole file


def plan_pieces(source: str, piece_bytes: int) -> list[Piece]:
    """The pieces of a local source (a file, folder or glob), in corpus order."""
    files = local_files(source)
    if not files:
        raise KilnError(f"no data files in {source}")
    pieces = []
    for f in files:
        size = f.stat().st_size
        if f.name.endswith(".jsonl"):  # byte ranges, read as bytes: a bad line is named by its number
            pieces += [Piece(str(f), a, min(a + piece_bytes, size)) for a in range(0, size, piece_bytes)]
        else:
            pieces.append(Piece(str(f)))
    return pieces


def _line_number(path: str, offset: int) -> int:
    """Lines before byte `offset` (for an error's line number; read only when one happens)."""
    count = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count


def _jsonl_range(piece: Piece, text_field: str) -> Iterator[str]:
    """The documents of the lines that start within [start, end) of a JSON-lines file, read in one
    go (memory: a piece)."""
    with open(piece.path, "rb") as f:
        if piece.start > 0:
            f.seek(piece.start - 1)
            f.readline()  # the rest of the line that began before the range (or its newline)
        begin = f.tell()
        if begin >= piece.end:
            return
        data = f.read(piece.end - begin)
        if not data.endswith(b"\n"):
            data += f.readline()  # the last line starts inside the range: all of it
    at = begin
    for line in data.split(b"\n"):
        if line.strip():
            yield text_of_json_line(line.rstrip(b"\r"), text_field,
                                    lambda at=at: f"{piece.path}:{_line_number(piece.path, at) + 1}")
        at += len(line) + 1


def piece_documents(piece: Piece, text_field: str) -> Iterator[str]:
    """The documents of a piece: Kiln's reader for jsonl / txt (plain or gz), `datasets` otherwise."""
    if piece.end >= 0:
        return _jsonl_range(piece, text_field)
    name = Path(piece.path).name
    if name.endswith(KILN_READS):
        return read_documents(piece.path, text_field)
    from components.data.sources import open_stream, text_of

    def streamed() -> Iterator[str]:
        ds, builder = open_stream(piece.path)
        for row in ds:
            yield text_of(row, text_field, builder, piece.path)

    return streamed()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def write_shard(documents: Iterator[str], tokenizer: Tokenizer, out: Path) -> dict:
    """Tokenize documents (BOS + text + EOS each) into `out` a chunk at a time (memory: one chunk),
    under a temporary name; then its marker. Returns the marker."""
    from components.data.token_cache import document_chunks, encode_chunk, token_dtype, writer_id

    dtype = token_dtype(tokenizer.vocab_size)
    tmp = out.with_name(f"{out.name}.tmp-{writer_id()}")
    tokens = docs = chars = 0
    largest = -1
    with open(tmp, "wb") as f:
        for chunk in document_chunks(documents):
            arr = encode_chunk(chunk, tokenizer, dtype)
            f.write(arr.tobytes())
            docs, chars, tokens = docs + len(chunk), chars + sum(map(len, chunk)), tokens + len(arr)
            largest = max(largest, int(arr.max()) if len(arr) else -1)
    os.replace(tmp, out)
    marker = {"tokens": tokens, "documents": docs, "characters": chars, "max_id": largest,
              "dtype": dtype.name}
    marker_path = out.with_suffix(".json")
    marker_tmp = marker_path.with_name(f"{marker_path.name}.tmp-{writer_id()}")
    marker_tmp.write_text(json.dumps(marker))
    os.replace(marker_tmp, marker_path)
    return marker


def write_index(folder: Path, splits: dict[str, int], tokenizer: Tokenizer, sources: dict[str, str]) -> dict:
    """Gather the shards' markers into index.json (the folder's completion mark); splits: shards per split."""
    from components.data.token_cache import token_dtype, writer_id

    index = {"format": FORMAT, "version": 1, "tokenizer": tokenizer.fingerprint,
             "tokenizer_path": str(tokenizer.path), "vocab_size": tokenizer.vocab_size,
             "dtype": token_dtype(tokenizer.vocab_size).name, "splits": {}}
    for split, count in splits.items():
        shards = []
        for k in range(count):
            marker = folder / shard_name(split, k).replace(".bin", ".json")
            if not marker.is_file():
                raise KilnError(f"{folder}: shard {shard_name(split, k)} is not finished")
            shards.append({"file": shard_name(split, k), **json.loads(marker.read_text())})
        index["splits"][split] = {"source": sources[split], "shards": shards,
                                  "tokens": sum(s["tokens"] for s in shards),
                                  "documents": sum(s["documents"] for s in shards)}
    tmp = folder / f"{INDEX}.tmp-{writer_id()}"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, folder / INDEX)
    return index


def is_prepared(folder: Path | str) -> bool:
    """Whether a folder is a complete prepared token folder."""
    return (Path(folder) / INDEX).is_file()


class ShardedTokens:
    """The shards of one split read as one stream of tokens (memory maps, nothing loaded). A flat token
    file (the run's data cache, or a .bin given as is) is the one-shard case: `one_file`."""

    @classmethod
    def one_file(cls, path: Path, dtype: np.dtype) -> "ShardedTokens":
        """A flat token file as a stream of one shard; its largest id is read once."""
        stream = cls.__new__(cls)
        stream.folder, stream.split, stream.dtype = path.parent, path.name, np.dtype(dtype)
        stream.parts = [np.memmap(path, dtype=dtype, mode="r")]
        stream.offsets = np.array([0, len(stream.parts[0])], dtype=np.int64)
        stream.max_id = int(stream.parts[0].max()) if len(stream.parts[0]) else -1
        return stream

    def __init__(self, folder: Path | str, split: str, tokenizer_fingerprint: str | None = None) -> None:
        folder = Path(folder)
        try:
            index = json.loads((folder / INDEX).read_text())
            entry = index["splits"][split]
        except (OSError, ValueError, KeyError) as e:
            raise KilnError(f"{folder}: not a complete prepared token folder with a {split!r} split "
                            f"({type(e).__name__}: {e})") from None
        if tokenizer_fingerprint is not None and index["tokenizer"] != tokenizer_fingerprint:
            made_by = index.get("tokenizer_path", "another tokenizer")
            raise KilnError(f"{folder} was tokenized by {made_by} (sha256 {index['tokenizer'][:12]}…), not "
                            "this run's tokenizer: prepare it again with scripts/prepare_data.py --tokenizer")
        self.folder, self.split, self.dtype = folder, split, np.dtype(index["dtype"])
        self.max_id = max((s["max_id"] for s in entry["shards"]), default=-1)
        self.parts = []
        for s in entry["shards"]:
            path = folder / s["file"]
            if not path.is_file() or path.stat().st_size != s["tokens"] * self.dtype.itemsize:
                raise KilnError(f"{path}: missing or not the size its index says: prepare the folder again")
            if s["tokens"]:
                self.parts.append(np.memmap(path, dtype=self.dtype, mode="r"))
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def max(self) -> int:
        return self.max_id

    def __getitem__(self, span: slice) -> np.ndarray:
        """Tokens [start, stop) of the split, across shard boundaries."""
        start, stop, _ = span.indices(len(self))
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        out = []
        while start < stop:
            part, base = self.parts[first], int(self.offsets[first])
            take = min(stop, base + len(part)) - start
            out.append(part[start - base: start - base + take])
            start += take
            first += 1
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.empty(0, self.dtype)
