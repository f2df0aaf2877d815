"""The weighted mixture loader (components/data/mixture.py): exact shares over every window of steps,
layout-invariant batches, sources that run out, and phases (new weights on resume). Training on a
mixture, in layouts and across a kill, is tests/e2e/test_mixture_runs.py."""

import numpy as np
import pytest
import torch

from components.data.mixture import (
    MixtureLoader,
    MixtureSource,
    Phase,
    check_sources,
    parse_sources,
    step_rows,
)
from components.runtime.errors import KilnError


class FakeWindows:
    """A source of `n` windows whose rows hold (source id, window index) in their first two tokens."""

    def __init__(self, source: int, n: int, seq_len: int = 7) -> None:
        self.source, self.n, self.seq_len = source, n, seq_len

    def __len__(self) -> int:
        return self.n

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        out = torch.zeros(len(indices), self.seq_len + 1, dtype=torch.int64)
        out[:, 0] = self.source
        out[:, 1] = torch.from_numpy(np.asarray(indices))
        return out


def loader(weights, sizes, global_batch=8, local=4, dp_rank=0, dp=1, said=None) -> MixtureLoader:
    sources = [MixtureSource(f"s{i}.jsonl", w) for i, w in enumerate(weights)]
    return MixtureLoader(sources, [FakeWindows(i, n) for i, n in enumerate(sizes)], global_batch, local,
                         dp_rank, dp, seed=3, say=(said.append if said is not None else lambda _: None))


def global_rows(mix: MixtureLoader, step: int) -> list[tuple[int, int]]:
    rows = torch.cat([x for x, _ in mix.batch(step)])
    return [(int(a), int(b)) for a, b in rows[:, :2]]


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1, 1], [0.97, 0.02, 0.01], [3, 7]])
def test_shares_are_exact_over_every_window_of_steps(weights):
    g = 8
    rng = np.random.default_rng(0)
    phase = Phase(0, np.array(weights, dtype=float), np.zeros(len(weights), dtype=np.int64))
    share = np.array(weights) / sum(weights)
    counts = [phase.positions_after(k, g) for k in range(301)]
    for k in range(1, 301):
        step = counts[k] - counts[k - 1]
        assert step.sum() == g and (step >= 0).all()
    for _ in range(200):  # any window [a, b): within two rows of its share
        a, b = sorted(rng.integers(0, 301, 2))
        assert (np.abs(counts[b] - counts[a] - (b - a) * g * share) < 2).all()


def test_step_rows_never_negative_and_sum():
    assert step_rows(np.array([2.6, -0.4, 5.8]), 8).tolist() == [2, 0, 6]
    assert step_rows(np.array([0.9, 0.9, 0.9, 5.3]), 8).sum() == 8


def test_every_layout_reads_the_same_global_batch():
    whole = [global_rows(loader([0.6, 0.4], [50, 30], local=8), k) for k in (1, 2, 9)]
    for dp in (2, 4):
        for i, k in enumerate((1, 2, 9)):
            per_rank = [loader([0.6, 0.4], [50, 30], local=8 // dp, dp_rank=r, dp=dp).batch(k)
                        for r in range(dp)]
            # [microbatch][dp rank][local row]: one microbatch of 8 rows
            rows = torch.cat([mb[0][0] for mb in per_rank])
            assert [(int(a), int(b)) for a, b in rows[:, :2]] == whole[i]


def test_a_source_that_runs_out_starts_a_new_order_and_says_so():
    said: list[str] = []
    mix = loader([0.5, 0.5], [6, 1000], said=said)
    seen = [w for k in range(1, 4) for s, w in global_rows(mix, k) if s == 0]
    assert sorted(seen[:6]) == list(range(6)) and sorted(seen[6:12]) == list(range(6))
    assert seen[:6] != seen[6:12]  # a new order
    assert any("source s0 ran out at step 2: epoch 2 of its 6 windows" in line for line in said), said


def test_resume_with_the_same_weights_continues_the_phase():
    a = loader([0.7, 0.3], [40, 40])
    want = [global_rows(a, k) for k in range(1, 12)]
    b = loader([0.7, 0.3], [40, 40])
    b.load_state_dict(a.state_dict(5))
    assert [global_rows(b, k) for k in range(6, 12)] == want[5:]


def test_new_weights_start_a_phase_where_each_source_stood():
    said: list[str] = []
    a = loader([0.5, 0.5], [400, 400])
    before = a.state_dict(10)["positions"]
    b = loader([0.75, 0.25], [400, 400], said=said)
    b.load_state_dict(a.state_dict(10))
    rows = [r for k in range(11, 21) for r in global_rows(b, k)]
    got = {s: sorted(w for src, w in rows if src == s) for s in (0, 1)}
    assert len(got[0]) == 60 and len(got[1]) == 20  # 80 rows at 3:1
    # each source continues its own sequence: the windows after its first `before` ones
    fresh = loader([0.5, 0.5], [400, 400])
    stream0 = [w for k in range(1, 40) for s, w in global_rows(fresh, k) if s == 0]
    assert sorted(stream0[before["s0"]: before["s0"] + 60]) == got[0]
    assert said == ["data    new mixture weights from step 11 (s0 0.5→0.75, s1 0.5→0.25): each source "
                    "continues where it stood"]
    assert b.state_dict(20)["phase_start"] == 10


def test_parse_and_check():
    assert [(s.path, s.weight, s.name) for s in parse_sources("data/web.jsonl=0.6, code/=0.3,books")] == [
        ("data/web.jsonl", 0.6, "web"), ("code/", 0.3, "code"), ("books", 1.0, "books")]
    with pytest.raises(KilnError, match="weight 'x' is not a number"):
        parse_sources("a=x")
    with pytest.raises(KilnError, match="has weight 0.0; a weight must be above 0"):
        check_sources(parse_sources("a=0"))
    with pytest.raises(KilnError, match="two sources are named 'web'"):
        check_sources(parse_sources("a/web.jsonl=1,b/web.txt=1"))


def test_val_share_holds_the_last_windows_out_of_training():
    sources = [MixtureSource("a.jsonl", 1.0, val_share=0.25), MixtureSource("b.jsonl", 1.0)]
    mix = MixtureLoader(sources, [FakeWindows(0, 40), FakeWindows(1, 40)], 8, 8, 0, 1, seed=3,
                        say=lambda _: None)
    seen = {s: set() for s in (0, 1)}
    for k in range(1, 40):  # several epochs of each
        for s, w in global_rows(mix, k):
            seen[s].add(w)
    assert seen[0] == set(range(30)) and seen[1] == set(range(40))
    with pytest.raises(KilnError, match=r"val_share must be a number in \[0, 1\), got 1.5"):
        parse_sources('[{"path": "a", "val_share": 1.5}]')
