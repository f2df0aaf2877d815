"""torchft's lighthouse served from this process: for scripts/ft_launch.py, the tests and the
benchmark (on a cluster, run the `torchft_lighthouse` binary from the same wheel instead)."""

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def lighthouse(min_replicas: int, *, port: int = 0, heartbeat_timeout_ms: int = 2000,
               join_timeout_ms: int = 1000) -> Iterator[str]:
    """A lighthouse on `port` (0: any free one) until the block ends; yields its address."""
    os.environ.setdefault("RUST_LOG", "warn")  # read at torchft's import: else a line per quorum
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              quorum_tick_ms=50, heartbeat_timeout_ms=heartbeat_timeout_ms)
    try:
        yield server.address()
    finally:
        server.shutdown()
