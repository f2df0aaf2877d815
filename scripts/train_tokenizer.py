"""Trains the shipped byte-level BPE tokenizer.json on a corpus split, deterministically.

Usage (from the repository root):
    python scripts/train_tokenizer.py --data assets/data/shakespeare/train.jsonl.gz \\
        --vocab-size 4096 --out assets/tokenizer/tokenizer.json
    python scripts/train_tokenizer.py --source "data/*.parquet" --text-field content --out my_tok.json

--source takes anything the streaming loader reads (jsonl / json / parquet / csv / txt files, a
folder, a glob, or a hub dataset name), --max-documents caps how many are read.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.data.sources import read_documents

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE whose vocabulary (specials included) has exactly vocab_size entries.

    Byte-level pre-tokenization and decoding make decode(encode(x)) == x for any string, and all
    256 bytes are in the base alphabet so no text is ever out of vocabulary.
    """
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: it would add a byte that decode cannot tell from a real leading space.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main() -> None:
    """Trains on --data, writes --out and reports the time taken and the split's token count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("assets/data/shakespeare/train.jsonl.gz"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("assets/tokenizer/tokenizer.json"))
    parser.add_argument("--source", default="", help="a streaming source instead of --data")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--max-documents", type=int, default=0, help="0 = all")
    args = parser.parse_args()

    if args.source:
        from itertools import islice

        from components.data.sources import open_stream, text_of
        from components.runtime.errors import KilnError

        try:
            ds, builder = open_stream(args.source)
            rows = islice(ds, args.max_documents or None)
            texts = [text_of(row, args.text_field, builder, args.source) for row in rows]
        except KilnError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        args.data = args.source
    else:
        texts = list(read_documents(args.data))
    start = time.perf_counter()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    seconds = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out), pretty=True)

    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    chars = sum(len(t) for t in texts)
    print(f"trained in {seconds:.1f}s: vocab {tokenizer.get_vocab_size()}, wrote {args.out}")
    print(f"{args.data}: {len(texts)} documents, {tokens} tokens, {chars / tokens:.2f} chars/token")


if __name__ == "__main__":
    main()
