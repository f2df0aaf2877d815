"""Where documents come from: the corpora shipped in assets/ and registered datasets, JSON-lines and
plain-text files read by Kiln, and any other source (parquet, csv, folders, globs, hub datasets) streamed
through the `datasets` library; a run's dataset name or path resolved to the source of each split."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from components.config.loading import REPO_ROOT
from components.runtime.errors import KilnError

EMBEDDED_DATASETS: dict[str, dict[str, Path]] = {
    "shakespeare": {
        "train": REPO_ROOT / "assets/data/shakespeare/train.jsonl.gz",
        "val": REPO_ROOT / "assets/data/shakespeare/val.jsonl.gz",
    },
}


_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


_TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")


KILN_READS = _JSONL_SUFFIXES + _TEXT_SUFFIXES  # read by Kiln itself, not through `datasets`


def _open_text(path: Path) -> IO[str]:
    """Opens a file as UTF-8 text, decompressing it on the fly when it ends in .gz or .zst."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise KilnError(f"{path}: reading .zst files needs the zstandard package "
                            "(pip install -e \".[zstd]\")") from None
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, encoding="utf-8")


def text_of_json_line(line: str | bytes, text_field: str, where: Callable[[], str]) -> str:
    """The text field of one JSON line; a bad line is one error starting with where() (file:line)."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise KilnError(f"{where()}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{where()}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise KilnError(f"{where()}: no field {text_field!r} in this record")
    if not isinstance(record[text_field], str):
        raise KilnError(f"{where()}: field {text_field!r} is not a string")
    return record[text_field]


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    """Yields the text field of every non-blank line of a JSON-lines file."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield text_of_json_line(line, text_field, lambda n=lineno: f"{path}:{n}")


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
    except Exception as e:  # zstandard.ZstdError, without importing zstandard where it is not needed
        if type(e).__name__ != "ZstdError":
            raise
        raise KilnError(f"{path}: broken zstd file ({e})") from None


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


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
             ".arrow": "arrow"}  # .arrow: the files of a folder `datasets` saved (save_to_disk)


_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def _kind(path: Path) -> str | None:
    """The datasets builder for a file, looking through a compression suffix."""
    name = path.name
    for ext in _COMPRESSION:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return _BUILDERS.get(Path(name).suffix)


def local_files(source: str) -> list[Path]:
    """The data files a local source names (sorted): a file, every data file in a folder, or a glob;
    empty when the source is not local (a hub name)."""
    p = Path(source)
    if p.is_file():
        return [p]
    if p.is_dir():
        if (p / "state.json").is_file() and any(p.glob("*.arrow")):  # a folder `datasets` saved
            return sorted(p.glob("*.arrow"))
        return sorted(f for f in p.rglob("*") if f.is_file() and _kind(f))
    if any(c in source for c in "*?["):
        return sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
    return []


def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.endswith(tuple(_BUILDERS) + _COMPRESSION) or (
        os.sep in source and source.count("/") != 1)


def open_stream(source: str, split: str = "train", cache_dir: str | None = None) -> tuple[Any, str | None]:
    """(streaming IterableDataset, builder) for source; builder is None for hub datasets."""
    from datasets import load_dataset

    files = local_files(source)
    if files:
        kinds = {_kind(f) for f in files}
        if None in kinds or len(kinds) != 1:
            raise KilnError(f"{source}: cannot read {sorted(str(f.name) for f in files)[:5]} as one dataset "
                            f"(one kind of file of {', '.join(_BUILDERS)}, optionally compressed)")
        builder = kinds.pop()
        if all(f.stat().st_size == 0 for f in files):
            raise KilnError(f"{source}: no documents (empty)")
        try:
            ds = load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                              cache_dir=cache_dir)
        except Exception as e:  # datasets raises anything from StopIteration to ArrowInvalid here
            raise KilnError(f"{source}: cannot read it as {builder}: {type(e).__name__}: "
                            f"{str(e)[:300]}") from None
        return ds, builder
    if _looks_local(source):
        raise KilnError(f"dataset not found: {source} (no such file, folder or matching files)")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise KilnError(f"{source!r} is not a local file or folder, and HF_HUB_OFFLINE=1 forbids the "
                        f"Hugging Face hub; give a local path or go online")
    try:
        return load_dataset(source, split=split, streaming=True, cache_dir=cache_dir), None
    except Exception as e:  # the hub raises many kinds (connection, not found, gated)
        raise KilnError(f"cannot open Hugging Face dataset {source!r}: {type(e).__name__}: {e}") from None


def text_of(row: dict, field: str, builder: str | None, source: str) -> str:
    """The document text of one row; a missing field lists the fields there are."""
    key = "text" if builder == "text" else field
    if key not in row:
        raise KilnError(f"{source}: rows have no field {key!r}; fields: {', '.join(map(str, row))} "
                        f"(set training.dataset_text_field)")
    value = row[key]
    if not isinstance(value, str):
        raise KilnError(f"{source}: field {key!r} holds {type(value).__name__}, not text")
    return value


def register_dataset(name: str, train: Path, val: Path | None = None) -> None:
    """Make `training.dataset = name` mean these files (from a --job.custom_import module)."""
    EMBEDDED_DATASETS[name] = {"train": Path(train), **({"val": Path(val)} if val else {})}


def _hub_name(name: str) -> bool:
    """Whether name looks like a Hugging Face hub dataset id ("owner/name", no file suffix)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).suffix


def resolve_dataset(name: str, path: str) -> dict[str, Path | str]:
    """The source of each split: `path` when given (a folder with train.* / val.*, one file = train
    only, or any streaming source), else `name`: a registered dataset, a local file / folder /
    glob, or a hub dataset "owner/name". A `.bin` file is an already prepared token stream
    (scripts/prepare_data.py); other sources are tokenized into the cache by token_file_for."""

    if path:
        p = Path(path)
        if p.is_dir():
            splits: dict[str, Path | str] = {}
            for split in ("train", "val"):
                found = sorted(p.glob(f"{split}.*"))
                found = [f for f in found if not f.name.endswith(".json")]
                if found:
                    splits[split] = found[0]
            if "train" not in splits:
                if "val" not in splits and local_files(path):  # a folder of shards: all of it is train
                    return {"train": path}
                raise KilnError(f"training.dataset_path {path} has no train.* file")
            return splits
        if not p.exists():
            if local_files(path) or _hub_name(path):  # a glob, or owner/name on the hub
                return {"train": path}
            raise KilnError(f"training.dataset_path not found: {path}")
        return {"train": p}
    if name in EMBEDDED_DATASETS:
        return dict(EMBEDDED_DATASETS[name])
    if Path(name).exists() or local_files(name):
        return resolve_dataset("", name)
    if _hub_name(name):
        return {"train": name}  # a Hugging Face hub dataset, streamed into the cache
    raise KilnError(
        f"unknown dataset {name!r}: not a registered dataset ({', '.join(EMBEDDED_DATASETS)}), an "
        f"existing file, folder or glob, or a hub dataset named owner/name"
    )
