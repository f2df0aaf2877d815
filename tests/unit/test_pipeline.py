"""Pipeline parallel's layer split and stage layout: which layers each stage holds, which stages each
rank runs, and the refusals; the forwards a schedule has in flight at its first backward. Training
under every schedule is tests/e2e/test_pipeline_runs.py."""

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


@pytest.mark.parametrize("schedule,stages_per_rank", [("1F1B", 1), ("Interleaved1F1B", 2)])
@pytest.mark.parametrize("pp,microbatches", [(2, 2), (2, 3), (2, 4), (4, 4), (4, 6), (4, 8), (4, 10), (4, 12),
                                              (8, 12), (8, 16), (8, 64)])
def test_the_forwards_in_flight_at_the_first_backward_are_torchs(schedule, stages_per_rank, pp, microbatches):
    # the planner's lower bound on a pipeline's peak counts them, and a deep pipeline's peak planned
    # at a shallower one grows by them, stage by stage. Interleaved1F1B: torch's own order, built on
    # stand-in stages (it needs only the group's size and rank). 1F1B: the rule of torch's runtime
    # that one_f_one_b_order follows (torch's pipeline_order for it misnumbers forwards).
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    from planning.pipeline_bubble import forwards_before_first_backward, forwards_in_flight, one_f_one_b_order

    for rank in range(pp):
        if schedule == "1F1B":
            order = [(kind, stage) for stage, kind, _ in one_f_one_b_order(pp, microbatches)[rank]]
        else:
            stages = [SimpleNamespace(group_size=pp, group_rank=rank, num_stages=pp * stages_per_rank,
                                      stage_index=i * pp + rank) for i in range(stages_per_rank)]
            built = schedules.ScheduleInterleaved1F1B(stages, microbatches)
            order = [(a.computation_type.value, a.stage_index) for a in built.pipeline_order[rank]
                     if a is not None]
        kinds = [kind for kind, _ in order]
        expected = kinds.index("B")
        assert kinds[:expected] == ["F"] * expected
        per_stage = [sum(stage == i * pp + rank for _, stage in order[:expected])
                     for i in range(stages_per_rank)]
        assert forwards_in_flight(schedule, pp, stages_per_rank, microbatches, rank) == per_stage
        if rank == 0:
            assert forwards_before_first_backward(schedule, pp, stages_per_rank, microbatches) == expected
