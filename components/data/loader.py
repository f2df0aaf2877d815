"""A token file read as windows and a layout-invariant batch loader.

A token file (BOS doc EOS BOS doc EOS ...) is read as non-overlapping windows of seq_len + 1 tokens.
The global batch of step k is a pure function of (seed, k, global batch size, seq_len): a seeded
permutation of the windows per epoch, cut into consecutive global batches. Data-parallel rank r takes
its rows of it. So every layout sees the same global batch, and the loader's whole resume state is
the step.
"""

import functools
import json
from pathlib import Path

import numpy as np
import torch

from components.data.shards import ShardedTokens
from components.data.token_cache import token_dtype
from components.runtime.errors import KilnError


class TokenWindows:
    """A token file read as non-overlapping windows of seq_len + 1 tokens (inputs and shifted labels)."""

    def __init__(self, path: Path, seq_len: int, vocab_size: int) -> None:
        path = Path(path)
        if not path.exists():
            raise KilnError(f"token file not found: {path}")
        self.path = path
        # The dtype was chosen by the tokenizer that wrote the file (see the .json beside it);
        # the model's vocabulary only bounds the ids.
        meta = path.with_suffix(".json")
        try:
            dtype = json.loads(meta.read_text())["dtype"] if meta.exists() else token_dtype(vocab_size)
            np.dtype(dtype)
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(f"token file description {meta} is damaged ({e}); delete it and the .bin "
                            f"to tokenize again") from None
        if path.stat().st_size == 0:
            raise KilnError(f"token file {path} is empty: the dataset has no text")
        if path.stat().st_size % np.dtype(dtype).itemsize:
            raise KilnError(f"token file {path} is not a whole number of {dtype} tokens")
        self.tokens = ShardedTokens.one_file(path, np.dtype(dtype))  # the one-shard case of shards.py
        if len(self.tokens) and self.tokens.max() >= vocab_size:
            raise KilnError(
                f"token file {path} holds token id {self.tokens.max()}, outside the model's "
                f"vocabulary of {vocab_size}: it was made with another tokenizer"
            )
        self.seq_len = seq_len
        self.num_windows = max(0, (len(self.tokens) - 1) // seq_len)

    @classmethod
    def of_tokens(cls, tokens, name: Path, seq_len: int, vocab_size: int) -> "TokenWindows":
        """Windows over any token stream with len(), slicing and max() (a prepared folder's shards:
        components/data/shards.py); `name` names it in messages."""
        windows = cls.__new__(cls)
        if len(tokens) == 0:
            raise KilnError(f"{name} holds no tokens: the dataset has no text")
        if tokens.max() >= vocab_size:
            raise KilnError(f"{name} holds token id {tokens.max()}, outside the model's vocabulary of "
                            f"{vocab_size}: it was made with another tokenizer")
        windows.path, windows.tokens, windows.seq_len = Path(name), tokens, seq_len
        windows.num_windows = max(0, (len(tokens) - 1) // seq_len)
        return windows

    def __len__(self) -> int:
        return self.num_windows

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The windows at `indices` as an int64 tensor [len(indices), seq_len + 1]."""
        s = self.seq_len
        out = np.stack([self.tokens[i * s : i * s + s + 1] for i in indices]).astype(np.int64)
        return torch.from_numpy(out)


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """The window order of one epoch (cached: every step of the epoch reads it)."""
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


def global_batch_indices(step: int, global_batch_size: int, num_windows: int, seed: int) -> np.ndarray:
    """Window indices of the global batch of `step` (1-based): a function of its arguments alone.

    Batches are consecutive slices of an endless sequence of epochs, each epoch a permutation of
    all windows seeded by (seed, epoch); a batch may straddle two epochs.
    """
    start = (step - 1) * global_batch_size
    positions = np.arange(start, start + global_batch_size)
    epochs = positions // num_windows
    out = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = epoch_permutation(seed, int(epoch), num_windows)
        mask = epochs == epoch
        out[mask] = perm[positions[mask] % num_windows]
    return out


class BatchLoader:
    """Yields, for each training step, this data-parallel rank's microbatches of (inputs, labels).

    The global batch is laid out [microbatch][dp rank][local row]. Its only position is the step
    (`batch(step)`, or `step` for iteration), so resuming in any layout continues the same
    sequence of batches.
    """

    def __init__(self, windows: TokenWindows, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int) -> None:
        rows_per_microbatch = local_batch_size * dp_degree
        if global_batch_size % rows_per_microbatch != 0:
            raise KilnError(
                f"training.global_batch_size {global_batch_size} must be divisible by "
                f"local_batch_size {local_batch_size} × data-parallel degree {dp_degree} = "
                f"{rows_per_microbatch}"
            )
        if len(windows) < global_batch_size:
            raise KilnError(
                f"the corpus {windows.path.name} is too short: {len(windows.tokens)} tokens make "
                f"{len(windows)} windows of seq_len+1 = {windows.seq_len + 1} tokens, but one global "
                f"batch needs {global_batch_size}"
            )
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.microbatches = global_batch_size // rows_per_microbatch
        self.seed = seed
        self.step = 1  # the step whose batch comes next

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for `step` (does not move the loader)."""
        idx = global_batch_indices(step, self.global_batch_size, len(self.windows), self.seed)
        b, d = self.local_batch_size, self.dp_degree
        out = []
        for m in range(self.microbatches):
            start = m * b * d + self.dp_rank * b
            rows = self.windows.rows(idx[start : start + b])
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.batch(self.step)
        self.step += 1
        return batch


def validation_batches(windows: TokenWindows, local_batch_size: int, dp_rank: int, dp_degree: int,
                       max_steps: int, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the validation split (windows from `first` on), read in order in rounds of
    local_batch_size × dp rows (max_steps rounds; -1 = every full round). The trainer passes
    global_batch / dp as the local size, so a round is one global batch in every layout."""
    per_round = local_batch_size * dp_degree
    rounds = (len(windows) - first) // per_round
    if max_steps >= 0:
        rounds = min(rounds, max_steps)
    if rounds == 0:
        raise KilnError(
            f"the validation split has {len(windows) - first} windows, fewer than one round of "
            f"{per_round} (one global batch)"
        )
    out = []
    for r in range(rounds):
        start = first + r * per_round + dp_rank * local_batch_size
        rows = windows.rows(np.arange(start, start + local_batch_size))
        out.append((rows[:, :-1], rows[:, 1:]))
    return out
