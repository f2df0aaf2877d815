"""Tests the shipped tokenizer: reproducible training, lossless round trips, special ids, errors (the
training script run as a user runs it: tests/e2e/test_tokenizer_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.data.sources import EMBEDDED_DATASETS, REPO_ROOT, read_documents
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError
from scripts.train_tokenizer import train_tokenizer

SHIPPED = REPO_ROOT / "assets/tokenizer/tokenizer.json"

SAMPLES = [
    "",
    "To be, or not to be, that is the question:",
    "  leading spaces\tand tabs\r\nand CRLF\n\n",
    "Ünïcödé: naïve café, Ελληνικά, русский, 日本語, emoji 🎭🗡️, zero\u200bwidth",
    "a literal <|end_of_text|> and <|begin_of_text|> in the text",
    "\x00\x01 control bytes \x7f",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The shipped tokenizer, loaded once for the module."""
    return Tokenizer(SHIPPED)


def test_retraining_reproduces_the_shipped_file(tmp_path: Path) -> None:
    """Training on the shipped train split gives back the shipped tokenizer.json byte for byte."""
    texts = list(read_documents(EMBEDDED_DATASETS["shakespeare"]["train"]))
    out = tmp_path / "tokenizer.json"
    train_tokenizer(texts, vocab_size=4096).save(str(out), pretty=True)
    assert out.read_bytes() == SHIPPED.read_bytes()


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(tok: Tokenizer, text: str) -> None:
    """Decoding what was encoded gives the exact text back, non-ASCII and special names included."""
    assert tok.decode(tok.encode(text)) == text


def test_special_token_names_in_text_stay_text(tok: Tokenizer) -> None:
    """A document quoting a special token's name does not smuggle in a real BOS or EOS."""
    ids = tok.encode("<|begin_of_text|> <|end_of_text|>")
    assert tok.bos_id not in ids and tok.eos_id not in ids


def test_special_ids_and_vocab_size(tok: Tokenizer) -> None:
    """BOS/EOS are the first two ids, the vocabulary is 4096 in total, and bos/eos frame the ids."""
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size == 4096
    body = tok.encode("Exeunt.")
    assert tok.encode("Exeunt.", bos=True, eos=True) == [0, *body, 1]
    assert tok.decode([tok.bos_id, *body, tok.eos_id]) == "<|begin_of_text|>Exeunt.<|end_of_text|>"
    assert max(tok.encode(SAMPLES[3])) < tok.vocab_size


def test_fingerprint_follows_file_content(tok: Tokenizer, tmp_path: Path) -> None:
    """Copies share a fingerprint; any change to the file gives a new one."""
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(SHIPPED.read_bytes())
    assert Tokenizer(copy).fingerprint == tok.fingerprint
    copy.write_bytes(SHIPPED.read_bytes().replace(b'"dropout": null', b'"dropout":null'))
    assert Tokenizer(copy).fingerprint != tok.fingerprint


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    """The batched path gives the same ids as encoding one text at a time."""
    assert tok.encode_batch(SAMPLES, bos=True, eos=True) == [
        tok.encode(t, bos=True, eos=True) for t in SAMPLES
    ]


def test_compresses_shakespeare(tok: Tokenizer) -> None:
    """The BPE actually learned merges: English verse takes well under one token per character."""
    text = next(iter(read_documents(EMBEDDED_DATASETS["shakespeare"]["val"])))
    assert len(tok.encode(text)) < len(text) / 2.5


def test_missing_file(tmp_path: Path) -> None:
    """A missing tokenizer file is a KilnError naming the path."""
    path = tmp_path / "nope.json"
    with pytest.raises(KilnError, match="nope.json"):
        Tokenizer(path)


def test_invalid_file(tmp_path: Path) -> None:
    """A file that is not a tokenizer is a KilnError naming the path."""
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(KilnError, match="broken.json"):
        Tokenizer(path)


def test_tokenizer_without_bos_eos(tmp_path: Path) -> None:
    """A tokenizer with neither Llama-3 nor common BOS/EOS names is refused, naming the file."""
    path = tmp_path / "plain.json"
    train_tokenizer(["just some words"] * 3, vocab_size=300).save(str(path))
    text = path.read_text().replace("<|begin_of_text|>", "<|x|>")
    path.write_text(text.replace("<|end_of_text|>", "<|y|>"))
    with pytest.raises(KilnError, match=r"plain\.json.*BOS"):
        Tokenizer(path)


def test_common_fallback_names(tmp_path: Path) -> None:
    """GPT-2 style files with only <|endoftext|> use it for both BOS and EOS."""
    path = tmp_path / "gpt2ish.json"
    train_tokenizer(["just some words"] * 3, vocab_size=300).save(str(path))
    text = path.read_text().replace("<|begin_of_text|>", "<|x|>")
    path.write_text(text.replace("<|end_of_text|>", "<|endoftext|>"))
    tok = Tokenizer(path)
    assert tok.bos_id == tok.eos_id == 1


def test_hf_folder_with_config_names_bos_eos(tok: Tokenizer, tmp_path: Path) -> None:
    """A folder of HF files: its tokenizer.json, and BOS/EOS as tokenizer_config.json names them."""
    import json
    import shutil

    shutil.copyfile(tok.path, tmp_path / "tokenizer.json")
    plain = Tokenizer(tmp_path)
    assert (plain.bos_id, plain.eos_id) == (tok.bos_id, tok.eos_id)
    # Name other tokens of the vocabulary (as a model that uses them would) and they are taken.
    bos, eos = tok.decode([5]), tok.decode([6])
    config = {"bos_token": {"content": bos}, "eos_token": eos}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer(tmp_path)
    assert (named.bos_id, named.eos_id) == (5, 6)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(KilnError, match="has no tokenizer.json"):
        Tokenizer(tmp_path)
