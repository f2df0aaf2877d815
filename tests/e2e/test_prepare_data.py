"""Runs scripts/prepare_data.py as a user would; its .bin files must decode to the documents."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from components.data.loader import TokenWindows
from components.data.sources import REPO_ROOT, resolve_dataset
from components.data.token_cache import token_file_for
from components.data.tokenizer import Tokenizer

TOKENIZER = REPO_ROOT / "assets/tokenizer/tokenizer.json"
SPLITS = {
    "train": ["Now is the winter of our discontent", "Made glorious summer by this sun of York;",
              "Ünïcödé and a literal <|end_of_text|> stay text"],
    "val": ["And all the clouds that lour'd upon our house"],
}


def run_script(*args: str) -> subprocess.CompletedProcess:
    """Runs the script as a plain file from the repository root."""
    return subprocess.run([sys.executable, "scripts/prepare_data.py", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def documents(path: Path, tok: Tokenizer) -> list[str]:
    """Splits a token file at BOS/EOS and decodes each document."""
    ids = np.fromfile(path, dtype=np.uint16).tolist()
    docs, current = [], None
    for i in ids:
        if i == tok.bos_id:
            assert current is None, "BOS inside a document"
            current = []
        elif i == tok.eos_id:
            docs.append(tok.decode(current))
            current = None
        else:
            current.append(i)
    assert current is None, "file ends inside a document"
    return docs


def test_folder_round_trip(tmp_path: Path) -> None:
    src, out = tmp_path / "corpus", tmp_path / "prepared"
    src.mkdir()
    for split, docs in SPLITS.items():
        (src / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = run_script("--dataset-path", str(src), "--tokenizer", str(TOKENIZER), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "3 documents" in proc.stdout
    tok = Tokenizer(TOKENIZER)
    for split, docs in SPLITS.items():
        assert documents(out / f"{split}.bin", tok) == docs
        meta = json.loads((out / f"{split}.json").read_text())
        assert meta["tokens"] == (out / f"{split}.bin").stat().st_size // 2
    # What the trainer does with --training.dataset_path out: the .bin files, used as they are.
    splits = resolve_dataset("shakespeare", str(out))
    assert splits == {"train": out / "train.bin", "val": out / "val.bin"}
    assert token_file_for(splits["train"], tok, tmp_path / "cache") == out / "train.bin"
    windows = TokenWindows(splits["train"], seq_len=4, vocab_size=4096)
    assert windows.rows(np.array([0]))[0, 0].item() == tok.bos_id


def test_single_file_and_errors(tmp_path: Path) -> None:
    text = tmp_path / "play.txt"
    text.write_text("A horse! a horse! my kingdom for a horse!\n")
    out = tmp_path / "out"
    proc = run_script("--dataset-path", str(text), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "train.json"]
    assert documents(out / "train.bin", Tokenizer(TOKENIZER)) == [text.read_text()]

    missing = run_script("--dataset-path", str(tmp_path / "nowhere"), "--out", str(out))
    assert missing.returncode == 1 and "not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    again = run_script("--dataset-path", str(out / "train.bin"), "--out", str(tmp_path / "x"))
    assert again.returncode == 1 and "already a token file" in again.stderr


def test_unknown_dataset_name(tmp_path: Path) -> None:
    proc = run_script("--dataset", "wikitext", "--out", str(tmp_path))
    assert proc.returncode == 1 and "shakespeare" in proc.stderr


def test_streaming_source_round_trip(tmp_path: Path) -> None:
    """--source reads what the streaming loader reads (here parquet, with another text column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": SPLITS["train"], "n": [1, 2, 3]}), tmp_path / "docs.parquet")
    out = tmp_path / "prepared"
    proc = run_script("--source", str(tmp_path / "docs.parquet"), "--text-field", "content",
                      "--tokenizer", str(TOKENIZER), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert documents(out / "train.bin", Tokenizer(TOKENIZER)) == SPLITS["train"]
    bad = run_script("--source", str(tmp_path / "docs.parquet"), "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "no field 'text'; fields: content, n" in bad.stderr
