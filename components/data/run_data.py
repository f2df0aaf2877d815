"""A run's data: its splits resolved once, text tokenized into the cache once, the training loader
(memmap windows or streaming) and this rank's validation batches."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from components.config.sections import JobConfig
from components.data.loader import BatchLoader, TokenWindows, validation_batches
from components.data.mixture import MixtureLoader, check_sources, held_out, parse_sources
from components.data.shards import ShardedTokens, is_prepared
from components.data.sources import resolve_dataset
from components.data.streaming import StreamingLoader
from components.data.token_cache import console, prepare_token_file, token_job
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError


@dataclass
class DataRanks:
    """Where this rank stands among the ranks that read different rows of a batch, and among the
    ranks that tokenize a new corpus together (every rank that sees the same cache folder)."""

    dp_rank: int
    dp: int
    worker: int = 0
    workers: int = 1
    is_main: bool = True  # says what tokenizing is doing


@dataclass
class RunData:
    """The training loader, the memmap windows behind it (None when streaming) and the validation
    batches (None without validation)."""

    loader: BatchLoader | StreamingLoader | MixtureLoader
    train_windows: TokenWindows | None
    val_batches: list[tuple[torch.Tensor, torch.Tensor]] | None
    description: str  # the start-up summary's data line
    # A mixture validated per source: each source's validation batches (val_batches is None then).
    val_sources: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None


def cache_folder(cfg: JobConfig) -> Path:
    """Where tokenized datasets are cached: training.data_cache_dir, else <dump_folder>/data_cache."""
    t = cfg.training
    return Path(t.data_cache_dir) if t.data_cache_dir else Path(cfg.job.dump_folder) / "data_cache"


def build_run_data(cfg: JobConfig, tokenizer: Tokenizer, vocab_size: int, global_batch: int,
                   ranks: DataRanks) -> RunData:
    """Resolve, tokenize (once, shared by the workers, cached) and open the run's data."""
    t = cfg.training
    if t.sources:
        return _mixture_data(cfg, tokenizer, vocab_size, global_batch, ranks)
    if t.dataset_path and is_prepared(t.dataset_path):
        return _prepared_data(cfg, tokenizer, vocab_size, global_batch, ranks)
    splits = resolve_dataset(t.dataset, t.dataset_path)
    streaming = t.dataset_mode == "streaming"
    to_tokenize = {k: v for k, v in splits.items() if not (streaming and k == "train")}
    if cfg.validation.dataset:
        to_tokenize["val"] = _validation_source(cfg.validation.dataset)
    cache = cache_folder(cfg)
    say = console if ranks.is_main else (lambda line: None)
    terminal = ranks.is_main and sys.stdout.isatty()
    files = {k: prepare_token_file(token_job(v, tokenizer, cache, t.dataset_text_field), tokenizer,
                                   ranks.worker, ranks.workers, say, terminal)
             for k, v in to_tokenize.items()}
    name = t.dataset_path or t.dataset
    if streaming:
        loader = StreamingLoader(str(splits["train"]), t.dataset_text_field, tokenizer, t.seq_len,
                                 global_batch, t.local_batch_size, ranks.dp_rank, ranks.dp,
                                 cache_dir=str(cache / "hf"))
        windows = None
        description = (f"data    {name}: streamed, tokenized on the fly, documents dealt to {ranks.dp} "
                       f"data-parallel rank(s) (field {t.dataset_text_field!r})")
    else:
        windows = TokenWindows(files["train"], t.seq_len, vocab_size)
        loader = BatchLoader(windows, global_batch, t.local_batch_size, ranks.dp_rank, ranks.dp, t.seed)
        description = (f"data    {name}: {len(windows.tokens):,} train tokens ({len(windows):,} windows; "
                       f"{len(windows) / global_batch:,.1f} steps per epoch)")
    val = _validation_batches(cfg, files, vocab_size, global_batch, ranks) if cfg.validation.enable else None
    return RunData(loader, windows, val, description)


def prepared_windows(folder: str | Path, split: str, tokenizer: Tokenizer, seq_len: int,
                     vocab_size: int) -> TokenWindows:
    """Windows over one split of a prepared token folder (scripts/prepare_data.py)."""
    tokens = ShardedTokens(folder, split, tokenizer.fingerprint)
    return TokenWindows.of_tokens(tokens, Path(folder) / split, seq_len, vocab_size)


def _prepared_data(cfg: JobConfig, tokenizer: Tokenizer, vocab_size: int, global_batch: int,
                   ranks: DataRanks) -> RunData:
    """A prepared token folder (training.dataset_path): its shards read in place, no cache."""
    t, folder = cfg.training, cfg.training.dataset_path
    if t.dataset_mode == "streaming":
        raise KilnError(f"training.dataset_path {folder} is a prepared token folder: read it with "
                        "dataset_mode = \"memmap\"")
    windows = prepared_windows(folder, "train", tokenizer, t.seq_len, vocab_size)
    loader = BatchLoader(windows, global_batch, t.local_batch_size, ranks.dp_rank, ranks.dp, t.seed)
    description = (f"data    {folder}: prepared, {len(windows.tokens):,} train tokens "
                   f"({len(windows):,} windows; {len(windows) / global_batch:,.1f} steps per epoch)")
    val = None
    if cfg.validation.enable:
        if cfg.validation.dataset:
            raise KilnError("validation.dataset with a prepared training.dataset_path: validate on the "
                            "folder's val split (scripts/prepare_data.py writes one from a val.* file)")
        val_windows = prepared_windows(folder, "val", tokenizer, t.seq_len, vocab_size)
        val = validation_batches(val_windows, global_batch // ranks.dp, ranks.dp_rank, ranks.dp,
                                 cfg.validation.steps)
    return RunData(loader, windows, val, description)


def _mixture_data(cfg: JobConfig, tokenizer: Tokenizer, vocab_size: int, global_batch: int,
                  ranks: DataRanks) -> RunData:
    """A weighted mixture (training.sources): each source's train split tokenized into the cache and
    read as windows by one MixtureLoader."""
    t = cfg.training
    sources = parse_sources(t.sources)
    check_sources(sources)
    if t.dataset_mode == "streaming":
        raise KilnError("training.sources: a mixture reads token files; dataset_mode streaming reads one "
                        "dataset (set dataset_mode = \"memmap\")")
    cache = cache_folder(cfg)
    say = console if ranks.is_main else (lambda line: None)
    terminal = ranks.is_main and sys.stdout.isatty()
    # Per source: its train windows, and (with validation) its validation windows and the first of them.
    windows: list[TokenWindows] = []
    val_windows: dict[str, tuple[TokenWindows, int]] = {}
    for s in sources:
        if is_prepared(s.path):  # a prepared token folder: read in place
            windows.append(prepared_windows(s.path, "train", tokenizer, t.seq_len, vocab_size))
            splits = json.loads((Path(s.path) / "index.json").read_text())["splits"]
            if cfg.validation.enable and "val" in splits and not s.val_share:
                val_windows[s.name] = (prepared_windows(s.path, "val", tokenizer, t.seq_len, vocab_size), 0)
            elif cfg.validation.enable and s.val_share:
                val_windows[s.name] = (windows[-1], len(windows[-1]) - held_out(s, len(windows[-1])))
            continue
        try:
            splits = resolve_dataset(s.path, "")
        except KilnError as e:
            raise KilnError(f"training.sources: {s.path}: {e}") from None
        files = {k: prepare_token_file(token_job(v, tokenizer, cache, s.text_field), tokenizer, ranks.worker,
                                       ranks.workers, say, terminal)
                 for k, v in splits.items() if k == "train" or (k == "val" and cfg.validation.enable)}
        windows.append(TokenWindows(files["train"], t.seq_len, vocab_size))
        if s.val_share and cfg.validation.enable:
            val_windows[s.name] = (windows[-1], len(windows[-1]) - held_out(s, len(windows[-1])))
        elif "val" in files:
            val_windows[s.name] = (TokenWindows(files["val"], t.seq_len, vocab_size), 0)
    loader = MixtureLoader(sources, windows, global_batch, t.local_batch_size, ranks.dp_rank, ranks.dp,
                           t.seed, say)
    total = sum(s.weight for s in sources)
    parts = ", ".join(f"{s.name} {s.weight / total:.0%} ({len(w.tokens):,} tokens)"
                      for s, w in zip(sources, windows, strict=True))
    description = f"data    mixture of {len(sources)}: {parts}"
    if not cfg.validation.enable:
        return RunData(loader, None, None, description)
    if cfg.validation.dataset:  # one validation set for the whole mixture
        files = {"val": prepare_token_file(token_job(_validation_source(cfg.validation.dataset), tokenizer,
                                                     cache, t.dataset_text_field), tokenizer, ranks.worker,
                                           ranks.workers, say, terminal)}
        return RunData(loader, None, _validation_batches(cfg, files, vocab_size, global_batch, ranks),
                       description)
    if not val_windows:
        raise KilnError("validation.enable with training.sources: no source has a validation split (a "
                        "folder with train.* and val.* files, a dataset with one, or val_share); name what "
                        "to validate on with --validation.dataset FILE")
    per_source = {name: validation_batches(w, global_batch // ranks.dp, ranks.dp_rank, ranks.dp,
                                           cfg.validation.steps, first)
                  for name, (w, first) in val_windows.items()}
    return RunData(loader, None, None, description + f"; validated per source ({', '.join(per_source)})",
                   per_source)


def _validation_source(dataset: str) -> Path | str:
    """validation.dataset: a dataset's val split, or the whole of a file, folder, glob or hub dataset."""
    try:
        splits = resolve_dataset(dataset, "")
    except KilnError as e:
        raise KilnError(f"validation.dataset: {e}") from None
    return splits.get("val", splits["train"])


def _validation_batches(cfg: JobConfig, files: dict[str, Path], vocab_size: int, global_batch: int,
                        ranks: DataRanks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's validation rows, checked at start-up: rounds of one global batch each."""
    if "val" not in files:
        source = cfg.training.dataset_path or cfg.training.dataset
        raise KilnError(f"validation.enable is set but the dataset {source} has no validation split: "
                        "name one with --validation.dataset FILE (a file, folder, glob or dataset), or "
                        "train on a folder with train.* and val.* files")
    windows = TokenWindows(files["val"], cfg.training.seq_len, vocab_size)
    rows = global_batch // ranks.dp
    return validation_batches(windows, rows, ranks.dp_rank, ranks.dp, cfg.validation.steps)
