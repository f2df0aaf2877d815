"""Runs scripts/prepare_data.py as a user would: its shards decode to the documents, several processes
and small pieces give the same token stream as one, a kill -9 resumes, training reads the folder with
the losses of the raw file, and bad input is one line. The format is components/data/shards.py."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from components.data.shards import ShardedTokens
from components.data.sources import REPO_ROOT
from components.data.token_cache import token_file_for
from components.data.tokenizer import Tokenizer
from tests.helpers.runs import TINY, check_ok, fails_with, run_train, train_rows

TOKENIZER = REPO_ROOT / "assets/tokenizer/tokenizer.json"
SPLITS = {
    "train": ["Now is the winter of our discontent", "Made glorious summer by this sun of York;",
              "Ünïcödé and a literal <|end_of_text|> stay text"],
    "val": ["And all the clouds that lour'd upon our house"],
}


def run_script(*args: str, wait: bool = True):
    """Runs the script as a plain file from the repository root."""
    cmd = [sys.executable, "scripts/prepare_data.py", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def documents(ids: np.ndarray, tok: Tokenizer) -> list[str]:
    """Splits a token stream at BOS/EOS and decodes each document."""
    docs, current = [], None
    for i in ids.tolist():
        if i == tok.bos_id:
            assert current is None, "BOS inside a document"
            current = []
        elif i == tok.eos_id:
            docs.append(tok.decode(current))
            current = None
        else:
            current.append(i)
    assert current is None, "stream ends inside a document"
    return docs


def stream(folder: Path, split: str = "train") -> np.ndarray:
    tokens = ShardedTokens(folder, split)
    return np.asarray(tokens[0:len(tokens)])


def corpus(path: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    words = "the king and queen of england went to war over bread and salt".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(5, 60)))}) + "\n"
                            for _ in range(n)))
    return path


def test_folder_round_trip(tmp_path: Path) -> None:
    src, out = tmp_path / "corpus", tmp_path / "prepared"
    src.mkdir()
    for split, docs in SPLITS.items():
        (src / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = run_script("--dataset-path", str(src), "--tokenizer", str(TOKENIZER), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "3 documents" in proc.stdout
    tok = Tokenizer(TOKENIZER)
    index = json.loads((out / "index.json").read_text())
    assert index["tokenizer"] == tok.fingerprint and index["dtype"] == "uint16"
    for split, docs in SPLITS.items():
        assert documents(stream(out, split), tok) == docs
        assert index["splits"][split]["documents"] == len(docs)


def test_workers_and_pieces_give_the_stream_of_one_file(tmp_path: Path) -> None:
    """2 processes over pieces of 20 KB (a dozen shards, cut inside lines) = the single-file token file."""
    raw = corpus(tmp_path / "big.jsonl", 2000)
    out = tmp_path / "prepared"
    proc = run_script("--source", str(raw), "--out", str(out), "--workers", "2", "--piece-mb", "0.02")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "index.json").read_text())
    assert len(index["splits"]["train"]["shards"]) > 10
    flat = token_file_for(raw, Tokenizer(TOKENIZER), tmp_path / "cache")
    assert np.array_equal(stream(out), np.fromfile(flat, dtype=np.uint16))


def test_a_killed_preparation_resumes(tmp_path: Path) -> None:
    raw = corpus(tmp_path / "big.jsonl", 6000)
    out = tmp_path / "prepared"
    proc = run_script("--source", str(raw), "--out", str(out), "--piece-mb", "0.01", wait=False)
    deadline = time.monotonic() + 120
    while len(list(out.glob("train-*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(out.glob("train-*.json")))
    assert 3 <= done and not (out / "index.json").exists()
    again = run_script("--source", str(raw), "--out", str(out), "--piece-mb", "0.01")
    assert again.returncode == 0, again.stderr
    assert f"resuming: {done} of " in again.stdout
    assert not list(out.glob("*.tmp-*"))
    flat = token_file_for(raw, Tokenizer(TOKENIZER), tmp_path / "cache")
    assert np.array_equal(stream(out), np.fromfile(flat, dtype=np.uint16))


def test_training_reads_the_folder_as_the_raw_file(tmp_path: Path, data_cache) -> None:
    out = tmp_path / "prepared"
    assert run_script("--dataset", "shakespeare", "--out", str(out), "--piece-mb", "0.5").returncode == 0
    raw = REPO_ROOT / "assets/data/shakespeare/train.jsonl.gz"
    check_ok(run_train([*TINY, "--training.steps", "3", "--training.dataset_path", str(out),
                        "--job.dump_folder", str(tmp_path / "a")]))
    check_ok(run_train([*TINY, "--training.steps", "3", "--training.dataset_path", str(raw),
                        "--job.dump_folder", str(tmp_path / "b"),
                        "--training.data_cache_dir", str(data_cache)]))
    assert [r["loss"] for r in train_rows(tmp_path / "a")] == [r["loss"] for r in train_rows(tmp_path / "b")]
    # Shards made by another tokenizer are refused by name.
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "tokenizer": "0" * 64}))
    args = [*TINY, "--training.dataset_path", str(out), "--job.dump_folder", str(tmp_path / "c")]
    fails_with(run_train(args), f"{out} was tokenized by", "not this run's tokenizer")


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    raw = corpus(tmp_path / "bad.jsonl", 400)
    lines = raw.read_text().splitlines()
    lines[321] = '{"text": "unclosed'
    raw.write_text("\n".join(lines) + "\n")
    proc = run_script("--source", str(raw), "--out", str(tmp_path / "o"), "--piece-mb", "0.004",
                      "--workers", "2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {raw}:322: not valid JSON (Unterminated string starting at)"
    assert not (tmp_path / "o" / "index.json").exists()
    missing = run_script("--dataset-path", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert missing.returncode == 1 and "not found" in missing.stderr
    again = run_script("--source", str(tmp_path / "o" / "train-00000.bin"), "--out", str(tmp_path / "y"))
    assert again.returncode == 1, again.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    proc = run_script("--source", str(empty), "--out", str(tmp_path / "z"))
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: {empty}: no documents"


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
    assert documents(stream(out), Tokenizer(TOKENIZER)) == SPLITS["train"]
    bad = run_script("--source", str(tmp_path / "docs.parquet"), "--out", str(tmp_path / "x"))
    assert bad.returncode != 0 and "no field 'text'; fields: content, n" in bad.stderr


def test_gzip_and_zstd_inputs(tmp_path: Path) -> None:
    """Compressed jsonl (gzip, zstd) prepares to the plain file's tokens; a broken zstd file is one line."""
    import gzip

    import zstandard

    raw = corpus(tmp_path / "c.jsonl", 300)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(raw.read_bytes()))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw.read_bytes()))
    streams = []
    for name in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst"):
        proc = run_script("--source", str(tmp_path / name), "--out", str(tmp_path / f"out-{name}"))
        assert proc.returncode == 0, proc.stderr
        streams.append(stream(tmp_path / f"out-{name}"))
    assert all(np.array_equal(streams[0], s) for s in streams[1:])
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    proc = run_script("--source", str(tmp_path / "bad.jsonl.zst"), "--out", str(tmp_path / "bad"))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: {tmp_path / 'bad.jsonl.zst'}: broken zstd file")


def test_a_folder_datasets_saved(tmp_path: Path) -> None:
    """A folder written by datasets' save_to_disk reads its .arrow files (not its json metadata)."""
    import datasets

    datasets.Dataset.from_dict({"text": SPLITS["train"]}).save_to_disk(str(tmp_path / "saved"))
    proc = run_script("--source", str(tmp_path / "saved"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert documents(stream(tmp_path / "out"), Tokenizer(TOKENIZER)) == SPLITS["train"]


def test_bytes_that_are_not_utf8_are_one_line(tmp_path: Path) -> None:
    raw = corpus(tmp_path / "c.jsonl", 50)
    data = raw.read_bytes().split(b"\n")
    data[7] = b'{"text": "caf\xe9"}'  # latin-1, not UTF-8
    raw.write_bytes(b"\n".join(data))
    proc = run_script("--source", str(raw), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {raw}:8: not UTF-8 text"), proc.stderr


def test_two_nodes_share_the_work(tmp_path: Path) -> None:
    """--nodes 2: each node writes every other piece's shard into the shared folder; node 0 writes the
    index once node 1's shards are there. The stream equals one node's."""
    raw = corpus(tmp_path / "big.jsonl", 1500)
    out = tmp_path / "shared"
    common = ["--source", str(raw), "--out", str(out), "--piece-mb", "0.02", "--nodes", "2"]
    node0 = run_script(*common, "--node-rank", "0", wait=False)
    node1 = run_script(*common, "--node-rank", "1")
    assert node1.returncode == 0, node1.stderr
    assert "train:" not in node1.stdout  # only node 0 writes (and reports) the index
    stdout, stderr = node0.communicate(timeout=120)
    assert node0.returncode == 0, stderr
    flat = token_file_for(raw, Tokenizer(TOKENIZER), tmp_path / "cache")
    assert np.array_equal(stream(out), np.fromfile(flat, dtype=np.uint16))
