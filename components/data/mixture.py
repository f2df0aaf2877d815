"""A weighted mixture of token sources, read as a layout-invariant batch loader.

Each step's global batch takes from every source the rows its weight is owed: per source, the rows
owed so far are (rows of the phase so far) × weight / total weight, and a step gives each source the
whole rows it is behind, the last few rows going to the sources furthest behind. So over any window of
steps a source's share is within a row or two of its weight, not only in expectation. A source is
an endless sequence of epochs, each a seeded permutation of its windows; the rows it gives are
consecutive in that sequence, so a source that runs out simply starts its next epoch (in a new order,
said in one line). The step's rows are shuffled (seeded by the step) and laid out
[microbatch][dp rank][local row], as in the single-source loader.

The allocation is a deterministic function of the step within a phase: a phase starts at a step
with each source's position, and its weights. The checkpoint keeps the phase and the positions at
the saved step; resuming with other weights starts a new phase there, each source continuing where
it stood.
"""

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from components.data.loader import TokenWindows
from components.runtime.errors import KilnError


@dataclass
class MixtureSource:
    """One source of a mixture: where its text is and its weight."""

    path: str
    weight: float = 1.0
    text_field: str = "text"
    name: str = ""  # a short name for metrics (default: the path's last part)
    val_share: float = 0.0  # the share of its windows (the last ones) held out for validation

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.path.rstrip("/").rsplit("/", 1)[-1].split(".")[0] or self.path


SOURCE_KEYS = ("path", "weight", "text_field", "name", "val_share")


def parse_sources(text: str) -> list[MixtureSource]:
    """training.sources → sources: "PATH=WEIGHT,PATH=WEIGHT,..." (the command line; a weight left out
    is 1), or the JSON list the TOML's [[training.sources]] tables become."""
    if text.lstrip().startswith("["):
        return [_source_of_table(t, i) for i, t in enumerate(json.loads(text))]
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        path, has_weight, weight = item.rpartition("=") if "=" in item else (item, "", "1")
        try:
            out.append(MixtureSource(path.strip(), float(weight)))
        except ValueError:
            raise KilnError(f"training.sources: {item!r} is not PATH=WEIGHT (weight {weight!r} is not a "
                            "number)") from None
    return out


def _source_of_table(table: dict, index: int) -> MixtureSource:
    """One [[training.sources]] table; an unknown or missing key is named."""
    where = f"training.sources[{index}]"
    unknown = sorted(set(table) - set(SOURCE_KEYS))
    if unknown:
        raise KilnError(f"{where}: unknown key {unknown[0]!r} (a source has {', '.join(SOURCE_KEYS)})")
    if not isinstance(table.get("path"), str):
        raise KilnError(f"{where}: needs path = \"a file, folder, glob or dataset name\"")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise KilnError(f"{where}: weight must be a number, got {weight!r}")
    share = table.get("val_share", 0.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise KilnError(f"{where}: val_share must be a number in [0, 1), got {share!r}")
    return MixtureSource(table["path"], float(weight), str(table.get("text_field", "text")),
                         str(table.get("name", "")), float(share))


def held_out(source: MixtureSource, num_windows: int) -> int:
    """The windows a source holds out for validation: the last val_share of them (at least one)."""
    return max(1, round(num_windows * source.val_share)) if source.val_share > 0 else 0


def check_sources(sources: list[MixtureSource]) -> None:
    """Weights above zero, names unique (they key the metrics and the checkpoint)."""
    if not sources:
        raise KilnError("training.sources is empty")
    for s in sources:
        if not s.weight > 0:
            raise KilnError(f"training.sources: {s.path} has weight {s.weight}; a weight must be above 0")
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise KilnError(f"training.sources: two sources are named {twice[0]!r}; give them distinct names")


def step_rows(owed: np.ndarray, rows: int) -> np.ndarray:
    """Rows per source for one step of `rows`: the whole rows each is owed (owed: what its weight
    asks for by the end of the step minus what it has had), the rest to the largest remainders
    (ties to the lower index). Never negative; sums to `rows`."""
    base = np.maximum(np.floor(owed), 0).astype(np.int64)
    while base.sum() > rows:  # several sources owed a row at once: the least owed waits
        base[np.argmin(np.where(base > 0, owed - base, np.inf))] -= 1
    left = rows - int(base.sum())
    if left:
        order = np.lexsort((np.arange(len(owed)), -(owed - base)))
        base[order[:left]] += 1
    return base


@dataclass
class Phase:
    """A stretch of training with one set of weights: from `start` (the step before its first),
    with each source's position then."""

    start: int
    weights: np.ndarray
    positions: np.ndarray
    _counts: dict[int, np.ndarray] = field(default_factory=dict)

    def positions_after(self, step: int, global_batch: int) -> np.ndarray:
        """Each source's position (rows given since its first) after `step`; memoised, computed
        forward from the nearest known step."""
        if step <= self.start:
            return self.positions.copy()
        if step not in self._counts:
            known = max((k for k in self._counts if k < step), default=self.start)
            counts = self._counts.get(known, self.positions)
            share = self.weights / self.weights.sum()
            for k in range(known + 1, step + 1):
                owed = (k - self.start) * global_batch * share - (counts - self.positions)
                counts = counts + step_rows(owed, global_batch)
                if k % 64 == 0 or k == step:
                    self._counts[k] = counts
            for k in [k for k in self._counts if k < step - 256]:
                del self._counts[k]
        return self._counts[step]


@functools.lru_cache(maxsize=8)
def source_permutation(seed: int, source: int, epoch: int, num_windows: int) -> np.ndarray:
    """The window order of one epoch of one source (cached: many steps read it)."""
    return np.random.default_rng([seed, source, epoch]).permutation(num_windows)


def stream_indices(start: int, count: int, num_windows: int, seed: int, source: int) -> np.ndarray:
    """Windows `start` .. `start + count` of a source's endless sequence of seeded epochs."""
    positions = np.arange(start, start + count)
    epochs = positions // num_windows
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = source_permutation(seed, source, int(epoch), num_windows)[positions[mask] % num_windows]
    return out


class MixtureLoader:
    """This data-parallel rank's microbatches of (inputs, labels) for each step, from a weighted
    mixture; `sources_of(step)` gives the source of each of its rows (for per-source metrics)."""

    def __init__(self, sources: list[MixtureSource], windows: list[TokenWindows], global_batch_size: int,
                 local_batch_size: int, dp_rank: int, dp_degree: int, seed: int,
                 say: Callable[[str], None] = print) -> None:
        rows_per_microbatch = local_batch_size * dp_degree
        if global_batch_size % rows_per_microbatch:
            raise KilnError(f"training.global_batch_size {global_batch_size} must be divisible by "
                            f"local_batch_size {local_batch_size} × data-parallel degree {dp_degree} = "
                            f"{rows_per_microbatch}")
        # Each source trains on its first windows; the last val_share of them are held out.
        self.train_windows = [len(w) - held_out(s, len(w)) for s, w in zip(sources, windows, strict=True)]
        for s, w, n in zip(sources, windows, self.train_windows, strict=True):
            if n <= 0:
                raise KilnError(f"training.sources: {s.path} has no window of seq_len + 1 = {w.seq_len + 1} "
                                "tokens to train on")
        self.sources, self.windows = sources, windows
        self.names = [s.name for s in sources]
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.dp_rank, self.dp_degree, self.seed = dp_rank, dp_degree, seed
        self.microbatches = global_batch_size // rows_per_microbatch
        self.say = say
        self.phase = Phase(0, np.array([s.weight for s in sources], dtype=np.float64),
                           np.zeros(len(sources), dtype=np.int64))
        self.step = 1
        self._last_rows: tuple[int, tuple[np.ndarray, np.ndarray]] = (0, (np.empty(0), np.empty(0)))

    def _global_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of every row of the step's global batch, in the order ranks read them
        (kept for the step last asked: the batch and its per-source metrics ask for the same step)."""
        if self._last_rows[0] == step:
            return self._last_rows[1]
        before = self.phase.positions_after(step - 1, self.global_batch_size)
        after = self.phase.positions_after(step, self.global_batch_size)
        sources, windows = [], []
        for i, count_after in enumerate(after):
            count = int(count_after - before[i])
            sources.append(np.full(count, i))
            windows.append(stream_indices(int(before[i]), count, self.train_windows[i], self.seed, i))
        order = np.random.default_rng([self.seed, step, 1]).permutation(self.global_batch_size)
        rows = np.concatenate(sources)[order], np.concatenate(windows)[order]
        self._last_rows = (step, rows)
        return rows

    def _my_rows(self, values: np.ndarray) -> list[np.ndarray]:
        b, d = self.local_batch_size, self.dp_degree
        return [values[m * b * d + self.dp_rank * b: m * b * d + (self.dp_rank + 1) * b]
                for m in range(self.microbatches)]

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for `step` (does not move the loader)."""
        self._say_new_epochs(step)
        sources, windows = self._global_rows(step)
        out = []
        for src, win in zip(self._my_rows(sources), self._my_rows(windows), strict=True):
            rows = torch.stack([self.windows[s].rows(np.array([w]))[0]
                                for s, w in zip(src, win, strict=True)])
            out.append((rows[:, :-1], rows[:, 1:]))
        return out

    def sources_of(self, step: int) -> list[torch.Tensor]:
        """The source index of each of this rank's rows of `step`, per microbatch."""
        return [torch.from_numpy(s) for s in self._my_rows(self._global_rows(step)[0])]

    def _say_new_epochs(self, step: int) -> None:
        """One line when a source begins a new epoch within this step (it ran out)."""
        before = self.phase.positions_after(step - 1, self.global_batch_size)
        after = self.phase.positions_after(step, self.global_batch_size)
        for i, n in enumerate(self.train_windows):
            first_wrap = -(-max(int(before[i]), 1) // n) * n  # the next multiple of its size
            if first_wrap < after[i]:
                epoch = first_wrap // n + 1
                self.say(f"data    source {self.names[i]} ran out at step {step}: epoch {epoch} of its "
                         f"{n:,} windows, in a new order")

    def __iter__(self) -> "MixtureLoader":
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self, step: int) -> dict:
        """The phase and every source's position after `step`, by name."""
        positions = self.phase.positions_after(step, self.global_batch_size)
        return {"step": step, "phase_start": self.phase.start,
                "phase_positions": dict(zip(self.names, self.phase.positions.tolist(), strict=True)),
                "weights": dict(zip(self.names, self.phase.weights.tolist(), strict=True)),
                "positions": dict(zip(self.names, positions.tolist(), strict=True)),
                "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved phase when the weights are the same, else start a new one at the saved
        step with each source where it stood (a new source starts at its beginning)."""
        self._last_rows = (0, (np.empty(0), np.empty(0)))
        for key in ("seed", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise KilnError(f"the checkpoint's mixture was read with {key} {state[key]}, this run has "
                                f"{getattr(self, key)}: the data order would change. Keep it, or add "
                                "'dataloader' to checkpoint.exclude_from_loading")
        weights = np.array([s.weight for s in self.sources], dtype=np.float64)
        same = state["weights"] == dict(zip(self.names, weights.tolist(), strict=True))
        if same:
            start = state["phase_start"]
            self.phase = Phase(start, weights, np.array([state["phase_positions"][n] for n in self.names]))
            self.phase._counts[state["step"]] = np.array([state["positions"][n] for n in self.names])
            return
        step = state["step"]
        positions = np.array([state["positions"].get(n, 0) for n in self.names], dtype=np.int64)
        self.phase = Phase(step, weights, positions)
        old = state["weights"]
        change = ", ".join(f"{n} {old[n]:g}→{w:g}" if n in old else f"{n} (new) {w:g}"
                           for n, w in zip(self.names, weights.tolist(), strict=True))
        self.say(f"data    new mixture weights from step {step + 1} ({change}): each source continues "
                 "where it stood")
