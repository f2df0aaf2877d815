"""Wraps a Hugging Face tokenizer.json: text to ids and back, with explicit BOS/EOS handling."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from components.errors import KilnError

# Llama-3 names first (what Kiln's own tokenizer uses), then the usual names in other families;
# GPT-2 style vocabularies have only <|endoftext|>, which serves as both.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class Tokenizer:
    """Loads any tokenizer.json; BOS/EOS are added by Kiln, never by the file's post-processor."""

    def __init__(self, path: str | Path) -> None:
        """Loads the file and finds the BOS and EOS ids; failures are KilnErrors naming the file."""
        self.path = Path(path)
        if not self.path.is_file():
            raise KilnError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception for any parse error
            raise KilnError(f"cannot load tokenizer {self.path}: {e}") from None
        # Identifies the exact vocabulary and merges, e.g. to name caches of token files.
        self.fingerprint = hashlib.sha256(self.path.read_bytes()).hexdigest()
        # Text that happens to contain "<|end_of_text|>" must stay text, not become an EOS.
        self._tok.encode_special_tokens = True
        self.bos_id = self._find(BOS_NAMES, "BOS")
        self.eos_id = self._find(EOS_NAMES, "EOS")

    def _find(self, names: Sequence[str], role: str) -> int:
        """Returns the id of the first of names in the vocabulary, or raises naming the file."""
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        looked_for = ", ".join(names)
        raise KilnError(f"tokenizer {self.path} has no {role} token (looked for {looked_for})")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included: the embedding size."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """Puts BOS in front and EOS at the end of ids as asked."""
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Turns text into ids, optionally framed by BOS and EOS."""
        return self._wrap(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        """Encodes many texts at once on the library's thread pool, skipping unneeded offsets."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, bos, eos) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Turns ids back into text; special tokens are kept so nothing is silently lost."""
        return self._tok.decode(list(ids), skip_special_tokens=False)
