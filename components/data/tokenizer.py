"""Wraps a Hugging Face tokenizer.json: text to ids and back, with explicit BOS/EOS handling."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from components.runtime.errors import KilnError

# Llama-3 names first (what Kiln's own tokenizer uses), then the usual names in other families;
# GPT-2 style vocabularies have only <|endoftext|>, which serves as both.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")


EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class Tokenizer:
    """Loads any tokenizer.json; BOS/EOS are added by Kiln, never by the file's post-processor."""

    def __init__(self, path: str | Path) -> None:
        """Loads the file and finds the BOS and EOS ids; failures are KilnErrors naming the file.

        path is a tokenizer.json, or a folder of Hugging Face tokenizer files: its tokenizer.json,
        and the BOS/EOS names of its tokenizer_config.json when there is one.
        """
        self.path = Path(path)
        named = {"BOS": None, "EOS": None}
        if self.path.is_dir():
            folder, self.path = self.path, self.path / "tokenizer.json"
            if not self.path.is_file():
                raise KilnError(f"tokenizer folder {folder} has no tokenizer.json")
            named = _special_names(folder / "tokenizer_config.json")
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
        self.bos_id = self._find((named["BOS"],) * bool(named["BOS"]) + BOS_NAMES, "BOS")
        self.eos_id = self._find((named["EOS"],) * bool(named["EOS"]) + EOS_NAMES, "EOS")

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


def _special_names(config: Path) -> dict[str, str | None]:
    """bos_token / eos_token of a tokenizer_config.json (a string or {"content": ...}), if any."""
    if not config.is_file():
        return {"BOS": None, "EOS": None}
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read {config}: {e}") from None

    def name(value: object) -> str | None:
        return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

    return {"BOS": name(data.get("bos_token")), "EOS": name(data.get("eos_token"))}
