"""Reads raw documents from JSON-lines or plain-text files; names the corpora shipped in assets/."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from components.config import REPO_ROOT
from components.errors import KilnError

EMBEDDED_DATASETS: dict[str, dict[str, Path]] = {
    "shakespeare": {
        "train": REPO_ROOT / "assets/data/shakespeare/train.jsonl.gz",
        "val": REPO_ROOT / "assets/data/shakespeare/val.jsonl.gz",
    },
}

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_TEXT_SUFFIXES = (".txt", ".txt.gz")


def _open_text(path: Path) -> IO[str]:
    """Opens a file as UTF-8 text, decompressing it on the fly when it ends in .gz."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    """Yields the text field of every non-blank line of a JSON-lines file."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise KilnError(f"{path}:{lineno}: no field {text_field!r} in this record")
            text = record[text_field]
            if not isinstance(text, str):
                raise KilnError(f"{path}:{lineno}: field {text_field!r} is not a string")
            yield text


def _whole_file(path: Path) -> Iterator[str]:
    """Yields a plain-text file's content as a single document."""
    with _open_text(path) as f:
        yield f.read()


def _decode_errors_as_kiln(path: Path, texts: Iterator[str]) -> Iterator[str]:
    """Re-raises a bad encoding or gzip stream as a KilnError that names the file."""
    try:
        yield from texts
    except UnicodeDecodeError as e:
        raise KilnError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise KilnError(f"{path}: broken gzip file ({e})") from None


def read_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yields the documents of a .jsonl[.gz] file (one a line) or a .txt[.gz] file (the whole file).

    The path and its type are checked here, before iteration starts, so a bad config fails at
    once rather than at the first batch.
    """
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"data file not found: {path}")
    if path.name.endswith(_JSONL_SUFFIXES):
        texts = _jsonl_texts(path, text_field)
    elif path.name.endswith(_TEXT_SUFFIXES):
        texts = _whole_file(path)
    else:
        kinds = ", ".join(_JSONL_SUFFIXES + _TEXT_SUFFIXES)
        raise KilnError(f"cannot read {path}: expected a file ending in one of {kinds}")
    return _decode_errors_as_kiln(path, texts)
