"""On-the-fly tokenization for streamed sources: each data-parallel rank reads its own share of the
documents, tokenizes them (BOS text EOS) and packs them into `seq_len + 1`-token windows.

Stateful: its state (the dataset's position, the epoch and the unused tokens of the last document)
is saved in checkpoints per data-parallel rank, and resume continues with exactly the tokens an
uninterrupted run would have read. Unlike the memmap loader its batches depend on the
data-parallel degree (documents are dealt to ranks), so losses are not layout-invariant and a
checkpoint resumes only with the same degree.
"""

from collections.abc import Iterator

import torch

from components.data.sources import open_stream, text_of
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError


class StreamingLoader:
    """batch(step) → this rank's microbatches of (inputs, labels), read in order from the stream."""

    def __init__(self, source: str, text_field: str, tokenizer: Tokenizer, seq_len: int,
                 global_batch_size: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                 cache_dir: str | None = None) -> None:
        from datasets.distributed import split_dataset_by_node

        rows_per_microbatch = local_batch_size * dp_degree
        if global_batch_size % rows_per_microbatch != 0:
            raise KilnError(f"training.global_batch_size {global_batch_size} must be divisible by "
                            f"local_batch_size {local_batch_size} × data-parallel degree {dp_degree}")
        self.microbatches = global_batch_size // rows_per_microbatch
        self.source, self.text_field, self.tokenizer = source, text_field, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.global_batch_size, self.dp_rank, self.dp_degree = global_batch_size, dp_rank, dp_degree
        stream, self.builder = open_stream(source, cache_dir=cache_dir)
        self.dataset = split_dataset_by_node(stream, rank=dp_rank, world_size=dp_degree)
        self.epoch = 0
        self.buffer: list[int] = []
        self._rows: Iterator[dict] | None = None
        self._epoch_started = False  # set_epoch would not keep a position loaded from a checkpoint

    def _next_document(self) -> str:
        for _ in range(2):  # at most one epoch boundary per document
            if self._rows is None:
                if not self._epoch_started:
                    self.dataset.set_epoch(self.epoch)
                self._epoch_started = False
                self._rows = iter(self.dataset)
            try:
                row = next(self._rows)
            except StopIteration:
                self._rows = None
                self.epoch += 1
                continue
            except Exception as e:  # a malformed file: stop with its name rather than skip silently
                raise KilnError(f"{self.source}: cannot read the next document: {type(e).__name__}: "
                                f"{str(e)[:300]}") from None
            return text_of(row, self.text_field, self.builder, self.source)
        raise KilnError(f"{self.source}: no documents for data-parallel rank {self.dp_rank} of "
                        f"{self.dp_degree}")

    def _window(self) -> list[int]:
        span = self.seq_len + 1
        while len(self.buffer) < span:
            self.buffer += self.tokenizer.encode(self._next_document(), bos=True, eos=True)
        window, self.buffer = self.buffer[:span], self.buffer[span:]
        return window

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's microbatches (the stream moves on: call once per step, in order)."""
        out = []
        for _ in range(self.microbatches):
            rows = torch.tensor([self._window() for _ in range(self.local_batch_size)], dtype=torch.long)
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "epoch": self.epoch, "buffer": list(self.buffer),
                "dp_degree": self.dp_degree, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("dp_degree", "seq_len", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise KilnError(f"the checkpoint's streaming loader ran with {key} {state[key]}, this run "
                                f"uses {getattr(self, key)}: its position cannot be carried over. Keep "
                                f"{key}, or add 'dataloader' to checkpoint.exclude_from_loading")
        self.epoch, self.buffer = state["epoch"], list(state["buffer"])
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(state["dataset"])
        self._rows, self._epoch_started = None, True
