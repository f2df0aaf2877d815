"""A small corpus of documents of uneven length, and a JSON-lines writer for it, for the streaming tests."""

import gzip
import json

DOCS = [f"Scene {i}. " + "Now is the winter of our discontent. " * (i % 5 + 1) for i in range(60)]


def write_jsonl(path, docs=DOCS, field="text") -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")
    return str(path)
