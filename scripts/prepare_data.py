"""Tokenizes a dataset once into DIR/train.bin and DIR/val.bin (+ .json meta) for training.

Usage (from the repository root):
    python scripts/prepare_data.py --dataset shakespeare --out data/shakespeare
    python scripts/prepare_data.py --dataset-path my_corpus/ \\
        --tokenizer assets/tokenizer/tokenizer.json --out data/my_corpus
    python train.py --config llama_debug --training.dataset_path data/my_corpus

A folder input holds train.* and optionally val.* (.jsonl/.txt, plain or .gz); a single file becomes
the train split alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.corpus import read_documents  # noqa: E402
from components.data import resolve_dataset, token_dtype, write_token_file  # noqa: E402
from components.errors import KilnError  # noqa: E402
from components.tokenizer import Tokenizer  # noqa: E402


class Counted:
    """Passes documents through while counting them and their characters."""

    def __init__(self, docs: Iterable[str]) -> None:
        self.docs, self.count, self.chars = docs, 0, 0

    def __iter__(self) -> Iterator[str]:
        for doc in self.docs:
            self.count += 1
            self.chars += len(doc)
            yield doc


def prepare(splits: dict[str, Path], tokenizer: Tokenizer, out_dir: Path) -> dict[str, int]:
    """Writes out_dir/<split>.bin for each split, printing its counts; returns tokens per split."""
    totals = {}
    for split, source in splits.items():
        if source.suffix == ".bin":
            raise KilnError(f"{source} is already a token file: train on it with "
                            f"--training.dataset_path")
        docs = Counted(read_documents(source))
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
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/tokenizer.json"))
    parser.add_argument("--out", type=Path, required=True, help="folder for train.bin / val.bin")
    args = parser.parse_args()
    try:
        tokenizer = Tokenizer(args.tokenizer)
        splits = resolve_dataset(args.dataset, args.dataset_path)
        prepare(splits, tokenizer, args.out)
    except KilnError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    dtype = token_dtype(tokenizer.vocab_size).name
    print(f"tokenizer {args.tokenizer} (vocab {tokenizer.vocab_size}, {dtype}); "
          f"train with --training.dataset_path {args.out}")


if __name__ == "__main__":
    main()
