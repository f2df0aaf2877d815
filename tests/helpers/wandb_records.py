"""Read an offline W&B run file (run-<id>.wandb): LevelDB-log framed protobuf records, as wandb's
own writer frames them, so a test can see exactly what was logged without the network."""

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK, HEADER = 32768, 7  # LevelDB log blocks; a record header is crc32 (4), length (2), type (1)
FULL, LAST = 1, 4


def records(path: Path) -> Iterator:
    """Every Record of the file, reassembled from its chunks."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]  # the file header: ident, magic, version (7 bytes)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def run_info(path: Path) -> tuple[str, str, str]:
    """(run id, project, display name) of the run file."""
    run = next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
    return run.run_id, run.project, run.display_name


def history(path: Path) -> list[dict]:
    """The logged rows, W&B's own keys (_step, _runtime, _timestamp) included."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]
