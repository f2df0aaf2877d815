"""A deep pipeline's peaks, planned at a shallower one and grown to its depth.

A pipelined rank's peak (1F1B, Interleaved1F1B) comes as its steady state runs: its state, its
stages' working memory, the forwards its schedule has in flight at its place on the pipeline, and
what every microbatch so far keeps to the step's end (its rows, its receive buffers). Only the
counts depend on the pipeline's depth; the rank's pieces (its stages' blocks, the embedding or the
head, its data-parallel, tensor and expert shards) do not. So the first, a middle and the last rank
of PP 32 are planned as the first, second and last of PP 4 over the same other degrees (a world
eight times smaller, at 5 microbatches a step instead of 33) and grown: where the most forwards
were in flight, by what each further forward keeps, stage by stage (RankPlan.steady_peak,
stage_keeps), and everywhere by what each further microbatch keeps to the step's end
(microbatch_bytes). The deep plan's fake step runs every microbatch through the rank's stages, the
shallow one a few: DeepSeek-V3's peak plans 284 → 99 s (docs/planning.md). Equal to the deep
plan's own peak to a few bytes: tests/e2e/test_plan_search_runs.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planning.pipeline_bubble import forwards_in_flight
from planning.rank_plan import RankPlan

SHALLOW_DEGREE = 4  # a first, a middle and a last rank, each with a neighbour on both sides but the ends
STEADY_SCHEDULES = ("1F1B", "Interleaved1F1B")  # those whose steady state is planned here


def fill(schedule: str, pp: int, stages_per_rank: int) -> int:
    """The microbatches that bring a schedule's pipeline to its steady state on every rank (a
    pipelined peak is planned at them; depth_scaling.rank_peak grows it past them). 1F1B: pp + 1 —
    at pp no forward follows the first rank's first backward, so its second runs with one forward
    fewer in flight than in any longer step. Interleaved1F1B: pp × stages per rank + pp — its
    microbatches come in rounds of pp, and the first rank's steady state from the round after its
    warm-up's on holds one receive buffer more than at pp × stages (measured: a test held the peak
    one buffer short at 16 microbatches before). Other schedules: 2."""
    if schedule == "1F1B":
        return pp + 1
    return pp * stages_per_rank + pp if schedule == "Interleaved1F1B" else 2


@dataclass(frozen=True)
class ShallowPipeline:
    """A deep pipeline (`pp` over `world` ranks) whose peaks are planned at `degree`."""

    pp: int
    world: int
    schedule: str
    stages_per_rank: int
    degree: int = SHALLOW_DEGREE

    @property
    def shallow_world(self) -> int:
        return self.world // self.pp * self.degree

    @property
    def microbatches(self) -> int:
        """The shallow plan's microbatches per step: those that fill its pipeline."""
        return fill(self.schedule, self.degree, self.stages_per_rank)

    def place(self, rank: int) -> int:
        """A rank's place on the deep pipeline (the pipeline is the mesh's outermost dimension)."""
        return rank // (self.world // self.pp)

    def shallow_place(self, place: int) -> int:
        """The shallow pipeline's place a deep one is planned at: the first, the last, or the second."""
        return 0 if place == 0 else self.degree - 1 if place == self.pp - 1 else 1

    def rank(self, rank: int) -> int:
        """The shallow world's rank that plans `rank`: the same coordinates but on the pipeline."""
        inner = self.world // self.pp
        return self.shallow_place(self.place(rank)) * inner + rank % inner

    def deepened(self, plan: RankPlan, rank: int) -> RankPlan:
        """The shallow plan of `rank` as the deep pipeline's, at the microbatches that fill it: its
        peak grown by the forwards more in flight (each as its stage keeps) and what the further
        microbatches keep; the optimizer's step, after every backward, by the latter only. Its rank,
        place and stages are the deep one's; its collectives and bubble stay the shallow step's (the
        search takes those from its timing plans)."""
        place, deep_fill = self.place(rank), fill(self.schedule, self.pp, self.stages_per_rank)
        deep = forwards_in_flight(self.schedule, self.pp, self.stages_per_rank, deep_fill, place)
        shallow = forwards_in_flight(self.schedule, self.degree, self.stages_per_rank, self.microbatches,
                                     self.shallow_place(place))
        forwards = sum((d - s) * keeps for d, s, keeps in zip(deep, shallow, plan.stage_keeps, strict=True))
        kept = (deep_fill - self.microbatches) * plan.microbatch_bytes
        # the moments with the most forwards in flight hold the further ones; the others (the step's
        # first forwards, its last backwards, its end) as many, or none more, in the deep step
        forwards_peak = max(plan.steady_peak + forwards, plan.forwards_peak) + kept
        # 0 where the step allocated nothing (its peak never rose above what was alive before it)
        optimizer_step_peak = plan.optimizer_step_peak + kept if plan.optimizer_step_peak else 0
        steady_peak = plan.steady_peak + forwards + kept
        return dataclasses.replace(plan, rank=rank, coordinates=plan.coordinates | {"pp": place},
                                   stages=[place + i * self.pp for i in range(self.stages_per_rank)],
                                   peak=max(forwards_peak, optimizer_step_peak),
                                   forwards_peak=forwards_peak, steady_peak=steady_peak,
                                   optimizer_step_peak=optimizer_step_peak,
                                   last_backward_peak=plan.last_backward_peak + kept, backward_starts=[])


def shallow_pipeline(schedule: str, pp: int, world: int, stages_per_rank: int) -> ShallowPipeline | None:
    """The shallow pipeline a deep one's peaks are planned at; None where planning the deep one costs
    about as much (pp at most SHALLOW_DEGREE) or its schedule is not one planned here."""
    if schedule not in STEADY_SCHEDULES or pp <= SHALLOW_DEGREE:
        return None
    return ShallowPipeline(pp, world, schedule, stages_per_rank)
