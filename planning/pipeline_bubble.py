"""The idle fraction of a pipeline schedule, from the order torch's schedule itself runs.

Every torch schedule writes its plan as `pipeline_order` (rank → actions: forward F, full backward
B, or backward split into input I and weight W, of a stage and microbatch). Replaying that order
with a forward costing 1, a backward 2 (input 1 + weight 1) and free communication, each action
starting once its rank is free and what it waits for is done, gives the step's length; the bubble
is the share of rank-time spent idle in it.
"""

from dataclasses import dataclass

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class BubbleResult:
    fraction: float  # idle rank-time / total rank-time
    makespan: float  # in forward units
    busy_per_rank: float  # compute per rank, forward units


def _compute_actions(action: object) -> list[tuple[int, str, int]]:
    """(stage, kind, microbatch) of an action's compute parts (an overlapped F+B has two)."""
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for sub in subs for a in _compute_actions(sub)]
    kind = action.computation_type.value
    return [(action.stage_index, kind, action.microbatch_index)] if kind in COSTS else []


def _ready(stage: int, kind: str, mb: int, last_stage: int, done: dict) -> float | None:
    """When an action's inputs are ready (None: not yet known)."""
    if kind == "F":
        needs = [(stage - 1, "F", mb)] if stage > 0 else []
    elif kind in ("B", "I"):
        needs = [(stage, "F", mb)] + ([(stage + 1, "BI", mb)] if stage < last_stage else [])
    else:  # W after this stage's input gradient
        needs = [(stage, "BI", mb)]
    times = []
    for s, k, m in needs:
        t = done.get((s, k, m)) if k != "BI" else done.get((s, "B", m), done.get((s, "I", m)))
        if t is None:
            return None
        times.append(t)
    return max(times, default=0.0)


def one_f_one_b_order(num_stages: int, n_microbatches: int) -> dict[int, list[tuple[int, str, int]]]:
    """The order torch's Schedule1F1B runs: stage s does min(m, p − s) forwards, then one backward
    and one forward in turn, then the remaining backwards. (torch's own pipeline_order for 1F1B
    misnumbers the later stages' forwards, docs/compatibility.md, so it is rebuilt from that rule.)"""
    order = {}
    for stage in range(num_stages):
        warmup = min(n_microbatches, num_stages - stage)
        actions = [(stage, "F", mb) for mb in range(warmup)]
        forward = warmup
        for mb in range(n_microbatches):
            actions.append((stage, "B", mb))
            if forward < n_microbatches:
                actions.append((stage, "F", forward))
                forward += 1
        order[stage] = actions
    return order


def forwards_before_first_backward(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> int:
    """The forwards (of a stage and microbatch) the first rank runs before its first backward, each
    still holding its activations then (forwards_in_flight's, summed)."""
    return sum(forwards_in_flight(schedule, pp, stages_per_rank, microbatches))


def forwards_in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int = 0
                       ) -> list[int]:
    """The forwards a pipeline rank (`rank`: its place on the pipeline) has run as its first backward
    begins, per local stage. 1F1B: min(n, pp − rank), as above. Interleaved1F1B: torch's warm-up,
    (v − 1) rounds of microbatches plus two per later rank, at most v·n, and the forward its steady
    state starts with; the i-th forward is of local stage (i // microbatches per round) mod v
    (tests/unit/test_pipeline.py holds both to torch's own order). Other schedules: one, the least."""
    if schedule == "1F1B":
        return [min(microbatches, pp - rank)]
    if schedule == "Interleaved1F1B":
        rounds = max(1, microbatches // pp)
        per_round = microbatches // rounds
        warmup = min((stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank), stages_per_rank * microbatches)
        counts = [0] * stages_per_rank
        for i in range(min(warmup + 1, stages_per_rank * microbatches)):
            counts[(i // per_round) % stages_per_rank] += 1
        return counts
    return [1] + [0] * (stages_per_rank - 1)


def schedule_bubble(schedule: object, num_stages: int) -> BubbleResult:
    """The bubble of a built torch schedule (its own order; 1F1B's from its runtime rule)."""
    if type(schedule).__name__ == "Schedule1F1B":
        return simulate(one_f_one_b_order(num_stages, schedule._n_microbatches), num_stages)
    return simulate({rank: [a for action in actions for a in _compute_actions(action)]
                     for rank, actions in schedule.pipeline_order.items()}, num_stages)


def simulate(queues: dict[int, list[tuple[int, str, int]]], num_stages: int) -> BubbleResult:
    """Replay every rank's compute actions (stage, kind, microbatch) in order; raises if the order
    cannot finish."""
    position = dict.fromkeys(queues, 0)
    free_at = dict.fromkeys(queues, 0.0)
    done: dict[tuple[int, str, int], float] = {}
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                stage, kind, mb = queue[position[rank]]
                ready = _ready(stage, kind, mb, num_stages - 1, done)
                if ready is None:
                    break
                finish = max(ready, free_at[rank]) + COSTS[kind]
                done[(stage, kind, mb)] = free_at[rank] = finish
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline order cannot finish (an action waits for one never run)")
    makespan = max(free_at.values())
    busy = [sum(COSTS[k] for _, k, _ in q) for q in queues.values()]
    return BubbleResult(1.0 - sum(busy) / (len(busy) * makespan), makespan, max(busy))
