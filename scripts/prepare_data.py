"""Tokenizes a dataset once into DIR/train.bin and DIR/val.bin (+ .json meta) for training.

Usage (from the repository root):
    python scripts/prepare_data.py --dataset shakespeare --out data/shakespeare
    python scripts/prepare_data.py --dataset-path my_corpus/ \\
        --tokenizer assets/tokenizer/tokenizer.json --out data/my_corpus
    python train.py --config llama_debug --training.dataset_path data/my_corpus

A folder input holds train.* and optionally val.* (.jsonl/.txt, plain or .gz); a single file becomes
the train split alone. `--source` takes anything the streaming loader reads (a jsonl / json / parquet
/ csv / txt file, folder or glob, or a hub dataset name) and writes it as the train split:
    python scripts/prepare_data.py --source "data/*.parquet" --text-field content --out data/mine
Tokenization runs in batches on the tokenizers library's thread pool (all cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.data.sources import open_stream, read_documents, resolve_dataset, text_of
from components.data.token_cache import token_dtype, write_token_file
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError


class Counted:
    """Passes documents through while counting them and their characters; on a terminal it shows
    the progress on one line."""

    def __init__(self, docs: Iterable[str], label: str = "") -> None:
        self.docs, self.count, self.chars, self.label = docs, 0, 0, label
        self.live = sys.stderr.isatty()

    def __iter__(self) -> Iterator[str]:
        start = time.perf_counter()
        for doc in self.docs:
            self.count += 1
            self.chars += len(doc)
            if self.live and self.count % 1000 == 0:
                rate = self.count / max(time.perf_counter() - start, 1e-9)
                print(f"\r{self.label}: {self.count:,} documents ({rate:,.0f}/s)", end="", file=sys.stderr)
            yield doc
        if self.live:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr)


def streamed_documents(source: str, text_field: str) -> Iterator[str]:
    """Documents of any streaming source (see components/data/sources.py)."""
    ds, builder = open_stream(source)
    for row in ds:
        yield text_of(row, text_field, builder, source)


def prepare(splits: dict[str, Path | str], tokenizer: Tokenizer, out_dir: Path,
            text_field: str | None = None) -> dict[str, int]:
    """Writes out_dir/<split>.bin for each split, printing its counts; returns tokens per split.
    With text_field the sources are streaming sources, else the embedded/plain files."""
    totals = {}
    for split, source in splits.items():
        if str(source).endswith(".bin"):
            raise KilnError(f"{source} is already a token file: train on it with "
                            f"--training.dataset_path")
        texts = streamed_documents(str(source), text_field) if text_field else read_documents(source)
        docs = Counted(texts, split)
        out = out_dir / f"{split}.bin"
        start = time.perf_counter()
        tokens = write_token_file(docs, tokenizer, out)
        seconds = max(time.perf_counter() - start, 1e-9)
        print(f"{split}: {source} → {out}: {docs.count:,} documents, {docs.chars:,} characters, "
              f"{tokens:,} tokens in {seconds:.1f}s ({tokens / seconds:,.0f} tokens/s)")
        totals[split] = tokens
    return totals


def main() -> None:
    """Parses the arguments and tokenizes every split; bad input is one message and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="shakespeare", help="an embedded dataset name")
    source.add_argument("--dataset-path", default="",
                        help="a folder with train.*/val.* files, or one file")
    source.add_argument("--source", default="",
                        help="a jsonl/json/parquet/csv/txt file, folder or glob, or a hub dataset name")
    parser.add_argument("--text-field", default="text", help="the text column of --source rows")
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/tokenizer.json"))
    parser.add_argument("--out", type=Path, required=True, help="folder for train.bin / val.bin")
    args = parser.parse_args()
    try:
        tokenizer = Tokenizer(args.tokenizer)
        if args.source:
            prepare({"train": args.source}, tokenizer, args.out, args.text_field)
        else:
            prepare(resolve_dataset(args.dataset, args.dataset_path), tokenizer, args.out)
    except KilnError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    dtype = token_dtype(tokenizer.vocab_size).name
    print(f"tokenizer {args.tokenizer} (vocab {tokenizer.vocab_size}, {dtype}); "
          f"train with --training.dataset_path {args.out}")


if __name__ == "__main__":
    main()
