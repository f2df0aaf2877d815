"""Tokenizes a corpus once into a prepared token folder: sharded token files and an index, in parallel.

Usage (from the repository root):
    python scripts/prepare_data.py --dataset shakespeare --out data/shakespeare
    python scripts/prepare_data.py --dataset-path my_corpus/ \\
        --tokenizer assets/tokenizer/tokenizer.json --out data/my_corpus --workers 8
    python train.py --config llama_debug --training.dataset_path data/my_corpus

A folder input holds train.* and optionally val.* (.jsonl/.txt, plain or .gz); a single file becomes
the train split alone. `--source` takes anything the streaming loader reads (a jsonl / json / parquet
/ csv / txt file, folder or glob, or a hub dataset name) and writes it as the train split:
    python scripts/prepare_data.py --source "data/*.parquet" --text-field content --out data/mine

The input is cut into pieces (byte ranges of about --piece-mb of a plain .jsonl file, else one file
each); --workers processes tokenize pieces side by side, each into its own shard, with memory bounded
by one chunk of documents per process. Killed, the same command resumes with the pieces not done.
Several nodes share the work with --nodes N --node-rank R on a shared folder (node 0 writes the
index when every shard is there). The folder's format: components/data/shards.py.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.data.shards import (  # noqa: E402
    INDEX,
    Piece,
    is_prepared,
    piece_documents,
    plan_pieces,
    shard_name,
    write_index,
    write_shard,
)
from components.data.sources import local_files, resolve_dataset  # noqa: E402
from components.data.token_cache import token_dtype  # noqa: E402
from components.data.tokenizer import Tokenizer  # noqa: E402
from components.runtime.errors import KilnError  # noqa: E402

Task = tuple[str, int, Piece]  # (split, shard index, piece)
_TOKENIZER: Tokenizer | None = None


def split_sources(args: argparse.Namespace) -> dict[str, str]:
    """The source of each split the command names."""
    splits = {"train": args.source} if args.source else resolve_dataset(args.dataset, args.dataset_path)
    for source in splits.values():
        if str(source).endswith(".bin") or is_prepared(source):
            raise KilnError(f"{source} is already a token file: train on it with --training.dataset_path")
    return {split: str(source) for split, source in splits.items()}


def plan(splits: dict[str, str], piece_bytes: int) -> list[Task]:
    """Every piece of every split, each with its shard index."""
    tasks: list[Task] = []
    for split, source in splits.items():
        pieces = plan_pieces(source, piece_bytes) if local_files(source) else [Piece(source)]
        tasks += [(split, k, piece) for k, piece in enumerate(pieces)]
    return tasks


def _init_worker(tokenizer_path: str, threads: int) -> None:
    """A worker process: its tokenizer, with `threads` threads of its own (before the first encode)."""
    global _TOKENIZER
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    _TOKENIZER = Tokenizer(tokenizer_path)


def _run_task(task: Task, out: str, text_field: str) -> tuple[str, dict]:
    """Tokenize one piece into its shard; returns (split, marker). Errors come back as KilnError."""
    split, k, piece = task
    marker = write_shard(piece_documents(piece, text_field), _TOKENIZER, Path(out) / shard_name(split, k))
    return split, {**marker, "bytes": _piece_bytes(piece)}


def _piece_bytes(piece: Piece) -> int:
    if piece.end >= 0:
        return piece.end - piece.start
    return Path(piece.path).stat().st_size if Path(piece.path).is_file() else 0


def _done(out: Path, task: Task) -> bool:
    split, k, _ = task
    return (out / shard_name(split, k).replace(".bin", ".json")).is_file()


def _remove_stale_temporaries(out: Path) -> None:
    """Half-written shards of this host's killed processes (another node's may still be writing)."""
    host = socket.gethostname()
    for tmp in out.glob(f"*.tmp-{host}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


class Progress:
    """One redrawn line on a terminal (documents, tokens, rate), and the totals for the summary."""

    def __init__(self, total: int, done_before: int) -> None:
        self.total, self.done, self.tokens, self.documents, self.bytes = total, done_before, 0, 0, 0
        self.started = time.perf_counter()
        self.live = sys.stderr.isatty()

    def add(self, marker: dict) -> None:
        self.done += 1
        self.tokens += marker["tokens"]
        self.documents += marker["documents"]
        self.bytes += marker["bytes"]
        if self.live:
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            print(f"\rpieces {self.done}/{self.total}: {self.documents:,} documents, {self.tokens:,} tokens "
                  f"({rate:,.0f} tokens/s)", end="", file=sys.stderr, flush=True)

    def seconds(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)


def prepare(splits: dict[str, str], tokenizer_path: Path, out: Path, text_field: str = "text",
            workers: int = 1, piece_bytes: int = 64 << 20, nodes: int = 1, node_rank: int = 0) -> dict | None:
    """Tokenize every split into out/ (shards, then index.json); returns the index (None on a node
    other than 0, which leaves the index to node 0)."""
    tokenizer = Tokenizer(tokenizer_path)
    if is_prepared(out):
        raise KilnError(f"{out} is already a prepared token folder (its {INDEX} is there): choose another "
                        "--out")
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    tasks = plan(splits, piece_bytes)
    mine = [t for i, t in enumerate(tasks) if i % nodes == node_rank]
    todo = [t for t in mine if not _done(out, t)]
    progress = Progress(len(mine), len(mine) - len(todo))
    if len(todo) < len(mine):
        print(f"resuming: {len(mine) - len(todo)} of {len(mine)} pieces already done")
    if workers == 1 or len(todo) <= 1:
        _init_worker(str(tokenizer_path), os.cpu_count() or 1)
        for task in todo:
            progress.add(_run_task(task, str(out), text_field)[1])
    else:
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, _init_worker, (str(tokenizer_path), 1)) as pool:
            results = [pool.apply_async(_run_task, (t, str(out), text_field)) for t in todo]
            for result in results:
                progress.add(result.get()[1])
    if progress.live:
        print(file=sys.stderr)
    seconds = progress.seconds()
    print(f"tokenized {progress.documents:,} documents, {progress.bytes / 1e6:,.1f} MB → {progress.tokens:,} "
          f"tokens in {len(todo)} shard(s) on {workers} process(es) in {seconds:.1f}s "
          f"({progress.tokens / seconds:,.0f} tokens/s)")
    if node_rank != 0:
        return None
    _wait_for_shards(out, tasks)
    counts = {split: sum(1 for s, _, _ in tasks if s == split) for split in splits}
    index = write_index(out, counts, tokenizer, splits)
    empty = [entry["source"] for entry in index["splits"].values() if entry["documents"] == 0]
    if empty:
        (out / INDEX).unlink()  # never leave an empty split looking prepared
        raise KilnError(f"{empty[0]}: no documents")
    for split, entry in index["splits"].items():
        print(f"{split}: {entry['source']} → {out}: {entry['documents']:,} documents, {entry['tokens']:,} "
              f"tokens in {len(entry['shards'])} shard(s)")
    return index


def _wait_for_shards(out: Path, tasks: list[Task]) -> None:
    """Node 0: poll until every node's shards are there."""
    last = time.monotonic()
    while not all(_done(out, t) for t in tasks):
        time.sleep(1.0)
        if time.monotonic() - last > 30:
            left = sum(not _done(out, t) for t in tasks)
            print(f"waiting for the other nodes' shards ({left} of {len(tasks)} left)", flush=True)
            last = time.monotonic()


def main() -> None:
    """Parses the arguments and prepares the folder; bad input is one message and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="shakespeare", help="an embedded dataset name")
    source.add_argument("--dataset-path", default="", help="a folder with train.*/val.* files, or one file")
    source.add_argument("--source", default="",
                        help="a jsonl/json/parquet/csv/txt file, folder or glob, or a hub dataset name")
    parser.add_argument("--text-field", default="text", help="the text field of JSON / table rows")
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/tokenizer.json"))
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (shards + index.json)")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing pieces side by side")
    parser.add_argument("--piece-mb", type=float, default=64.0,
                        help="a plain .jsonl file is cut into pieces of about this many MB (one shard each)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes sharing the work on a shared --out")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nodes")
    args = parser.parse_args()
    try:
        if not 0 <= args.node_rank < args.nodes or args.workers < 1:
            raise KilnError("--workers must be at least 1 and --node-rank in [0, --nodes)")
        index = prepare(split_sources(args), args.tokenizer, args.out, args.text_field, args.workers,
                        max(1, int(args.piece_mb * (1 << 20))), args.nodes, args.node_rank)
    except KilnError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if index is not None:
        dtype = token_dtype(index["vocab_size"]).name
        print(f"tokenizer {args.tokenizer} (vocab {index['vocab_size']}, {dtype}); "
              f"train with --training.dataset_path {args.out}")


if __name__ == "__main__":
    main()
