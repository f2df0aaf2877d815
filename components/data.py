"""Pre-tokenized token streams and a layout-invariant batch loader.

Documents are tokenized once into a flat memmap (BOS doc EOS BOS doc EOS ...) and read as
non-overlapping windows of seq_len + 1 tokens. The global batch of step k is a pure function of
(seed, k, global batch size, seq_len): a seeded permutation of the windows per epoch, cut into
consecutive global batches. Data-parallel rank r takes its rows of it. So every layout sees the
same global batch, and the loader's whole resume state is the step.
"""

import functools
import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from components.corpus import EMBEDDED_DATASETS, read_documents
from components.errors import KilnError
from components.tokenizer import Tokenizer

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


def write_chunk(f: BinaryIO, chunk: list[str], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    """Append the tokens of each document (BOS + text + EOS) to an open file; returns how many."""
    total = 0
    for ids in tokenizer.encode_batch(chunk, bos=True, eos=True):
        arr = np.asarray(ids, dtype=dtype)
        f.write(arr.tobytes())
        total += len(arr)
    return total


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
    from components.text_sources import local_files, open_stream, text_of

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
    if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz", ".txt", ".txt.gz")):
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
    from components.text_sources import local_files

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


class TokenWindows:
    """A token file read as non-overlapping windows of seq_len + 1 tokens (inputs and shifted labels)."""

    def __init__(self, path: Path, seq_len: int, vocab_size: int) -> None:
        path = Path(path)
        if not path.exists():
            raise KilnError(f"token file not found: {path}")
        self.path = path
        # The dtype was chosen by the tokenizer that wrote the file (see the .json beside it);
        # the model's vocabulary only bounds the ids.
        meta = path.with_suffix(".json")
        try:
            dtype = json.loads(meta.read_text())["dtype"] if meta.exists() else token_dtype(vocab_size)
            np.dtype(dtype)
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(f"token file description {meta} is damaged ({e}); delete it and the .bin "
                            f"to tokenize again") from None
        if path.stat().st_size == 0:
            raise KilnError(f"token file {path} is empty: the dataset has no text")
        if path.stat().st_size % np.dtype(dtype).itemsize:
            raise KilnError(f"token file {path} is not a whole number of {dtype} tokens")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        if len(self.tokens) and int(self.tokens.max()) >= vocab_size:
            raise KilnError(
                f"token file {path} holds token id {int(self.tokens.max())}, outside the model's "
                f"vocabulary of {vocab_size}: it was made with another tokenizer"
            )
        self.seq_len = seq_len
        self.num_windows = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The windows at `indices` as an int64 tensor [len(indices), seq_len + 1]."""
        s = self.seq_len
        out = np.stack([self.tokens[i * s : i * s + s + 1] for i in indices]).astype(np.int64)
        return torch.from_numpy(out)


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """The window order of one epoch (cached: every step of the epoch reads it)."""
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


def global_batch_indices(step: int, global_batch_size: int, num_windows: int, seed: int) -> np.ndarray:
    """Window indices of the global batch of `step` (1-based): a function of its arguments alone.

    Batches are consecutive slices of an endless sequence of epochs, each epoch a permutation of
    all windows seeded by (seed, epoch); a batch may straddle two epochs.
    """
    start = (step - 1) * global_batch_size
    positions = np.arange(start, start + global_batch_size)
    epochs = positions // num_windows
    out = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = epoch_permutation(seed, int(epoch), num_windows)
        mask = epochs == epoch
        out[mask] = perm[positions[mask] % num_windows]
    return out


class BatchLoader:
    """Yields, for each training step, this data-parallel rank's microbatches of (inputs, labels).

    The global batch is laid out [microbatch][dp rank][local row]. Its only position is the step
    (`batch(step)`, or `step` for iteration), so resuming in any layout continues the same
    sequence of batches.
    """

    def __init__(self, windows: TokenWindows, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int) -> None:
        rows_per_microbatch = local_batch_size * dp_degree
        if global_batch_size % rows_per_microbatch != 0:
            raise KilnError(
                f"training.global_batch_size {global_batch_size} must be divisible by "
                f"local_batch_size {local_batch_size} × data-parallel degree {dp_degree} = "
                f"{rows_per_microbatch}"
            )
        if len(windows) < global_batch_size:
            raise KilnError(
                f"the corpus {windows.path.name} is too short: {len(windows.tokens)} tokens make "
                f"{len(windows)} windows of seq_len+1 = {windows.seq_len + 1} tokens, but one global "
                f"batch needs {global_batch_size}"
            )
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.microbatches = global_batch_size // rows_per_microbatch
        self.seed = seed
        self.step = 1  # the step whose batch comes next

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for `step` (does not move the loader)."""
        idx = global_batch_indices(step, self.global_batch_size, len(self.windows), self.seed)
        b, d = self.local_batch_size, self.dp_degree
        out = []
        for m in range(self.microbatches):
            start = m * b * d + self.dp_rank * b
            rows = self.windows.rows(idx[start : start + b])
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.batch(self.step)
        self.step += 1
        return batch



def validation_batches(windows: TokenWindows, local_batch_size: int, dp_rank: int, dp_degree: int,
                       max_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the validation split, read in order in rounds of local_batch_size × dp rows
    (max_steps rounds; -1 = every full round). The trainer passes global_batch / dp as the local
    size, so a round is one global batch in every layout."""
    per_round = local_batch_size * dp_degree
    rounds = len(windows) // per_round
    if max_steps >= 0:
        rounds = min(rounds, max_steps)
    if rounds == 0:
        raise KilnError(
            f"the validation split has {len(windows)} windows, fewer than one round of "
            f"{per_round} (one global batch)"
        )
    out = []
    for r in range(rounds):
        start = r * per_round + dp_rank * local_batch_size
        rows = windows.rows(np.arange(start, start + local_batch_size))
        out.append((rows[:, :-1], rows[:, 1:]))
    return out
