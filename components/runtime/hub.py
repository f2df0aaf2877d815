"""Hugging Face hub assets by name: a hub id (owner/name) where Kiln takes a tokenizer or starting
weights is fetched through huggingface_hub into the Hugging Face cache (HF_HUB_CACHE) and read
from its snapshot folder; HF_HUB_OFFLINE=1 reads the cache only. A path that exists always wins.
"""

import fnmatch
import os
import re
import shutil
from pathlib import Path

from components.config.loading import resolve_path
from components.runtime.errors import KilnError

# The files of each kind of asset, as snapshot_download's allow_patterns.
ASSETS = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"],
    "config": ["config.json", "generation_config.json"],
    "weights": ["*.safetensors", "model.safetensors.index.json"],
}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    """Whether text reads as a hub repository id (owner/name) and is not an existing path."""
    return bool(_HUB_ID.match(text)) and not resolve_path(text).exists()


def asset_patterns(assets: list[str]) -> list[str]:
    """The allow_patterns of the named kinds of asset; an unknown kind is an error."""
    unknown = [a for a in assets if a not in ASSETS]
    if unknown:
        raise KilnError(f"unknown asset kind(s) {', '.join(unknown)}; choose from {', '.join(ASSETS)}")
    return [pattern for a in assets for pattern in ASSETS[a]]


def snapshot(repo_id: str, patterns: list[str] | None, revision: str | None = None) -> Path:
    """The cached snapshot folder of repo_id holding the files that match patterns (None = all),
    downloaded into the Hugging Face cache unless they are there already."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, revision=revision))
    except LocalEntryNotFoundError as e:
        offline = " (HF_HUB_OFFLINE is set: only the cache is read)" if _offline() else ""
        raise KilnError(f"hub repository {repo_id!r} is not in the Hugging Face cache and cannot be "
                        f"downloaded{offline}: {e}".splitlines()[0]) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise KilnError(f"cannot fetch hub repository {repo_id!r}: {e}".splitlines()[0]) from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_asset(text: str, assets: list[str] | None) -> Path:
    """A local path (resolve_path), or for a hub id the snapshot folder of its assets (None = all)."""
    if not is_hub_id(text):
        return resolve_path(text)
    return snapshot(text, asset_patterns(assets) if assets is not None else None)


def copy_snapshot(folder: Path, out: Path, patterns: list[str]) -> list[Path]:
    """Copy a snapshot's files that match patterns into out (hard links where the file system allows):
    the cache keeps symlinks into its blobs, out gets plain files. (An offline lookup returns the
    whole cached snapshot, whatever the patterns, hence the filter here.)"""
    copied = []
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        if not any(fnmatch.fnmatch(str(src.relative_to(folder)), pattern) for pattern in patterns):
            continue
        dst = out / src.relative_to(folder)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src.resolve(), dst)
        except OSError:
            shutil.copyfile(src, dst)
        copied.append(dst)
    return copied
