"""Imported through --job.custom_import: a KilnError on rank 1 only, as when one rank cannot read a
file the others can."""

import os

from components.runtime.errors import KilnError

if os.environ.get("RANK") == "1":
    raise KilnError("cannot read /data/shard-1.bin (only this rank fails)")
