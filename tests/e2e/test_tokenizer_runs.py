"""scripts/train_tokenizer.py run as a user runs it, on a streaming source. The tokenizer itself is
tests/unit/test_tokenizer.py."""

from __future__ import annotations

from pathlib import Path

from components.data.sources import REPO_ROOT
from components.data.tokenizer import Tokenizer


def test_train_tokenizer_on_a_streaming_source(tmp_path: Path) -> None:
    """scripts/train_tokenizer.py --source: a tokenizer trained on another corpus that Kiln loads."""
    import json
    import subprocess
    import sys

    rows = [{"body": f"Line {i} of the play, where kings and fools do talk."} for i in range(200)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tok.json"
    proc = subprocess.run([sys.executable, "scripts/train_tokenizer.py", "--source",
                           str(tmp_path / "c.jsonl"), "--text-field", "body", "--vocab-size", "300",
                           "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    trained = Tokenizer(out)
    assert trained.vocab_size == 300
    assert trained.decode(trained.encode("where kings and fools do talk")) == "where kings and fools do talk"
