"""What a complete checkpoint holds: a manifest of its files, sizes and CRC-32s, and the check of it;
and a reader of its `.metadata` that runs no code from it.

DCP's `.metadata` says which tensors a checkpoint has, not whether the bytes of its `.distcp` files
are all there: a disk that filled up or a partial copy leaves a folder that looks complete and
fails deep inside the unpickler. The main rank writes `kiln_manifest.json` into `step-N.tmp` once
every rank's files are in, before the rename that publishes it; a resume checks it first.

DCP unpickles `.metadata` with plain pickle, so a crafted file would run code as it is read:
SafeFileSystemReader allows only the classes DCP's metadata is made of.
"""

import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

MANIFEST = "kiln_manifest.json"


_CHUNK = 1 << 20


def crc32_of(path: Path) -> int:
    """CRC-32 (zlib) of a file, read in chunks of _CHUNK bytes."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path) -> None:
    """Record every file of a finished checkpoint folder: {name: {size, crc32}}."""
    files = {p.name: {"size": p.stat().st_size, "crc32": crc32_of(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def checkpoint_problem(folder: Path, checksums: bool = True) -> str | None:
    """Why a checkpoint folder is damaged (one phrase), or None when it is intact. Without checksums
    only the files and their sizes are checked (cheap: for pruning, not for loading). A folder from
    before manifests is checked for a readable .metadata only."""
    manifest = folder / MANIFEST
    if manifest.exists():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError) as e:
            return f"its {MANIFEST} does not parse ({e})"
        for name, want in files.items():
            problem = _file_problem(folder / name, want, checksums)
            if problem:
                return problem
    try:
        SafeFileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # a truncated, foreign or crafted file: a reason, not a pickle trace
        return f"its .metadata does not parse ({type(e).__name__}: {e})"
    return None


def _file_problem(path: Path, want: dict, checksums: bool) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != want["size"]:
        return f"{path.name} is {size:,} bytes, the manifest says {want['size']:,} (truncated or overwritten)"
    if checksums and crc32_of(path) != want["crc32"]:
        return f"{path.name} fails its CRC-32 check (its bytes changed since it was saved)"
    return None


# What DCP's .metadata is made of, beyond the classes of torch.distributed.checkpoint.metadata.
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        own = module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type)
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if own or dtype or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused {module}.{name}: not part of a DCP checkpoint's metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader whose .metadata is unpickled through an allow-list (see the module's doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"its .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader completes it
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
