"""The layouts a search considers: TP within a node, PP over the layers (1F1B, and interleaved with
two stages per rank), CP for long sequences, EP over an MoE model's experts, FSDP over the rest or
HSDP (replicas of one node's shards) — as config changes — and the rows per microbatch and the
pipeline bubble they are sized with.
"""

from __future__ import annotations

import copy
from typing import Any

from components.config.sections import JobConfig

SCHEDULES = {1: "1F1B", 2: "Interleaved1F1B"}  # stages per rank → the schedule searched
LONG_SEQUENCE = 16384  # context parallel is searched from this sequence length on


def powers(limit: int) -> list[int]:
    """The powers of two up to `limit`."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def enumerate_layouts(cfg: JobConfig, world: int, per_node: int, args: Any, can_pipeline: bool
                      ) -> list[dict[str, Any]]:
    """Config changes for every layout worth considering: TP within a node, PP over the layers, CP
    for long sequences, EP over the experts, FSDP over the rest (HSDP: replicas of one node's
    shards), and one row per microbatch (rows are sized later); AC modes are added by the search."""
    n_layers, seq = args.n_layers, cfg.training.seq_len
    experts = getattr(getattr(args, "moe", None), "num_experts", 0)
    out = []
    for tp in powers(min(per_node, world)):
        for pp in (powers(min(world // tp, n_layers)) if can_pipeline else [1]):
            for cp in (powers(min(world // (tp * pp), 16)) if seq >= LONG_SEQUENCE else [1]):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                eps = [e for e in powers(min(experts, dp * cp)) if experts % e == 0] if experts else [1]
                for ep in eps:
                    for replicas in sorted({1, max(1, (dp * cp * tp) // per_node)}):
                        if dp % replicas:
                            continue
                        for stages in ([1, 2] if pp > 1 else [1]):
                            out.append(layout_flags(tp, pp, cp, ep, replicas, dp // replicas, stages))
    return out


def layout_flags(tp: int, pp: int, cp: int, ep: int, replicas: int, shard: int, stages: int
                 ) -> dict[str, Any]:
    """The config changes that run one layout (one row per pipeline microbatch until sized)."""
    p = "parallelism."
    flags = {p + "tensor_parallel_degree": tp, p + "pipeline_parallel_degree": pp,
             p + "context_parallel_degree": cp, p + "expert_parallel_degree": ep,
             p + "data_parallel_replicate_degree": replicas, p + "data_parallel_shard_degree": shard}
    if pp > 1:
        flags[p + "pipeline_parallel_schedule"] = SCHEDULES[stages]
        flags[p + "pipeline_parallel_microbatch_size"] = 1
        # the schedule takes a step's rows whole; the loader's rows per microbatch, as planned, need
        # only divide them (a config's may not)
        flags["training.local_batch_size"] = 1
    return flags


def layout_degrees(d: Any, replicas: int) -> dict[str, int]:
    """A layout's degrees (of its ParallelDims `d`) with `replicas` HSDP replicas of its data-parallel
    ranks."""
    return {"pp": d.pp, "dp_replicate": replicas, "dp_shard": d.dp // replicas, "cp": d.cp, "tp": d.tp,
            "ep": d.ep}


def configured(cfg: JobConfig, flags: dict[str, Any]) -> JobConfig:
    """A copy of `cfg` with `flags` ({'section.key': value}) applied."""
    changed = copy.deepcopy(cfg)
    for key, value in flags.items():
        section, name = key.split(".")
        setattr(getattr(changed, section), name, value)
    return changed


def rows_options(per_rank: int) -> list[int]:
    """Rows per microbatch to consider: the powers of two that divide a rank's rows (up to 8)."""
    return [r for r in powers(min(per_rank, 8)) if per_rank % r == 0]


def closed_form_bubble(pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle share of a pipelined step: (pp − 1) warm-up and cool-down slots against v × n slots of
    work ((pp − 1) / (v·n + pp − 1), 1F1B and its interleaved form alike)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


