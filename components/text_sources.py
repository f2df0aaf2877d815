"""Documents from any text source through the `datasets` library, streamed: local files (jsonl / json
/ parquet / csv / txt, plain or compressed; a file, a folder or a glob) or a Hugging Face hub
dataset by name (for users with the network). Never downloads when the source is local."""

import glob
import os
from pathlib import Path
from typing import Any

from components.errors import KilnError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
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
