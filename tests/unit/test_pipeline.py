"""Pipeline parallel's layer split and stage layout: which layers each stage holds, which stages each
rank runs, and the refusals. Training under every schedule is tests/e2e/test_pipeline_runs.py."""

import pytest

from components.runtime.errors import KilnError
from parallelisms.pipeline import parse_stage_layers, split_layers, stage_ids


def test_split_layers_and_stage_layout():
    assert split_layers(6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_layers(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]  # the extra layer goes to the middle
    assert split_layers(6, 3, layers_per_stage=1) == [[0], [1], [2, 3, 4, 5]]
    assert stage_ids(0, 2, "Interleaved1F1B") == [0, 2] and stage_ids(1, 2, "Interleaved1F1B") == [1, 3]
    assert stage_ids(0, 2, "ZBVZeroBubble") == [0, 3] and stage_ids(1, 2, "DualPipeV") == [1, 2]
    with pytest.raises(KilnError, match="more than the model's 2 layers"):
        split_layers(2, 3)
    assert parse_stage_layers("0-1,2-4,5", 6, 3) == [[0, 1], [2, 3, 4], [5]]
    for bad, words in (("0-2,4-5", "cover"), ("0-5", "names 1 stages"), ("0-x,3-5", "not a layer")):
        with pytest.raises(KilnError, match=words):
            parse_stage_layers(bad, 6, 2)
