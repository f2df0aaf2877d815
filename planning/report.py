"""A plan as a table a person reads at a glance (one column per planned rank), or as JSON."""

from __future__ import annotations

import dataclasses
import json

from planning.comm_floor import (
    against_floor,
    all_reduces_as_reductions,
    expert_parallel_floor,
    fsdp_gathers,
    rank_floor_groups,
    sharded_floor,
    tensor_parallel_floor,
)
from planning.model_shape import TensorParallelRows
from planning.plan import AC_MODES, Plan
from planning.rank_plan import RankPlan
from planning.search import Layout, SearchResult
from planning.step_time import rank_flops


def gib(nbytes: float) -> str:
    """Bytes in the unit that reads best: GiB from one GiB up, else MiB (KiB for tiny amounts)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:,.1f} MiB"
    return f"{nbytes / 2**10:,.1f} KiB"


def _amount(spare_gib: float) -> str:
    """GiB to spare or short: one decimal from one GiB up, finer units below (a tiny device's margin)."""
    return f"{spare_gib:,.1f} GiB" if abs(spare_gib) >= 1 else gib(abs(spare_gib) * 2**30)


def _by_dtype(sizes: dict[str, int]) -> str:
    return " + ".join(f"{gib(n)} {dtype}" for dtype, n in sorted(sizes.items())) or "0"


def _rank_title(rank: RankPlan) -> str:
    where = ", ".join(f"{k} {v}" for k, v in rank.coordinates.items() if k in ("pp", "ep"))
    stages = f"stage{'s' if len(rank.stages) > 1 else ''} {'+'.join(map(str, rank.stages))}"
    return f"rank {rank.rank}" + (f" ({stages}{', ' + where if where else ''})" if rank.bubble is not None
                                  else "")


def _rows(plan: Plan) -> list[tuple[str, list[str]]]:
    """(label, one cell per rank) for the memory part of the table."""
    ranks = plan.ranks
    rows = [
        ("parameters", [_by_dtype(r.parameters) for r in ranks]),
        ("gradients", [_by_dtype(r.gradients) for r in ranks]),
        ("optimizer state", [_by_dtype(r.optimizer) for r in ranks]),
        ("buffers", [gib(r.buffers) for r in ranks]),
        (f"peak in a step (AC {plan.ac_mode})", [gib(r.peak) for r in ranks]),
    ]
    labels = sorted({k for r in ranks for k in r.peak_breakdown}, key=lambda k: -max(
        r.peak_breakdown.get(k, 0) for r in ranks))
    rows += [(f"  at the peak: {label}", [gib(r.peak_breakdown.get(label, 0)) for r in ranks])
             for label in labels]
    if all(r.ac_peaks for r in ranks):
        rows.append(("peak with AC " + " / ".join(AC_MODES),
                     [" / ".join(gib(r.ac_peaks[m]) for m in AC_MODES) for r in ranks]))
    verdicts = []
    for r in ranks:
        fits, spare = plan.verdict(r)
        verdicts.append(f"fits, {_amount(spare)} to spare" if fits else
                        f"DOES NOT FIT: {_amount(-spare)} short")
    rows.append((f"on {plan.device.name} (keeping {plan.device.reserve_gib:g} GiB free)", verdicts))
    return rows


def _comm_rows(plan: Plan) -> list[tuple[str, list[str]]]:
    keys = sorted({(dim, kind) for r in plan.ranks for dim, kinds in r.communication.items()
                   for kind in kinds})
    rows = []
    for dim, kind in keys:
        cells = []
        for r in plan.ranks:
            nbytes = r.communication.get(dim, {}).get(kind)
            calls = r.calls.get(dim, {}).get(kind, 0)
            cells.append(f"{gib(nbytes)} in {calls:,}" if nbytes is not None else "-")
        rows.append((f"  {dim}: {kind}", cells))
    return rows or [("  (none: one process)", ["-" for _ in plan.ranks])]


def format_plan(plan: Plan) -> str:
    """The plan as aligned text."""
    header = [
        f"Plan · {plan.model} · {plan.num_params / 1e9:,.2f}B parameters · world {plan.world_size}",
        f"layout  {plan.layout}",
        f"batch   global {plan.global_batch} × seq {plan.seq_len} = {plan.tokens_per_step:,} tokens/step; "
        f"{plan.microbatches} microbatch(es) per rank; numerics {plan.numerics}",
    ]
    rows = [("", [_rank_title(r) for r in plan.ranks])] + _rows(plan)
    rows += [("communication per step (bytes in calls)", ["" for _ in plan.ranks])] + _comm_rows(plan)
    if any(r.bubble is not None for r in plan.ranks):
        rows.append(("pipeline bubble (idle share of the step)", [f"{r.bubble:.1%}" for r in plan.ranks]))
    width = max(len(label) for label, _ in rows) + 2
    cols = [max(len(row[1][i]) for row in rows) + 2 for i in range(len(plan.ranks))]
    table = [(label.ljust(width) + "".join(c.ljust(w) for c, w in zip(cells, cols, strict=True))).rstrip()
             for label, cells in rows]
    lines = header + [""] + table
    moe = max(r.moe_layers for r in plan.ranks)
    lines += ["", *step_lines(plan), *floor_lines(plan)]
    if moe:
        lines.append(f"MoE      {moe} layer(s) planned with perfectly balanced routing; a real step's "
                     "busiest expert takes more (moe_imbalance in metrics.jsonl)")
    lines.append(f"planned in {plan.seconds:,.1f} s on fake tensors")
    if plan.suggestions or plan.suggestions_seconds:
        lines += ["", *format_suggestions(plan)]
    return "\n".join(lines)


def floor_lines(plan: Plan) -> list[str]:
    """FSDP's, HSDP's, TP's and EP's bytes against the least the layout needs (planning/comm_floor.py),
    and why a step sends more."""
    if plan.facts is None:
        return []
    d = plan.facts.degrees
    tokens = plan.global_batch * plan.seq_len / (d["dp_replicate"] * d["dp_shard"] * d["cp"])
    worst: dict[tuple[str, str], float] = {}
    gathers = fsdp_gathers(d["pp"], plan.reshard_after_forward)
    for r in plan.ranks:
        groups = rank_floor_groups(r.parameters, r.block_parameters, r.expert_parameters, d, gathers)
        floor = sharded_floor(groups, d["dp_replicate"], plan.param_dtype, plan.reduce_dtype)
        if d["ep"] > 1 and r.moe_layers:
            floor |= expert_parallel_floor(r.moe_layers, tokens, plan.top_k, plan.hidden, plan.param_dtype)
        rows = r.tensor_parallel_rows
        if rows is not None and not plan.facts.float8:  # float8 linears gather in float8, below it
            floor |= tensor_parallel_floor(rows.gathers, rows.reductions, tokens, plan.hidden,
                                           plan.param_dtype, rows.heads if plan.loss_parallel else 0)
        for dim, kind, ratio in against_floor(all_reduces_as_reductions(r.communication), floor):
            worst[(dim, kind)] = max(ratio, worst.get((dim, kind), 0.0))
    if not worst:
        return []
    cells = ", ".join(f"{dim} {kind} {ratio:.2f}×" for (dim, kind), ratio in sorted(worst.items()))
    why = above_floor_reasons(plan, {key for key, ratio in worst.items() if ratio > 1.05})
    above = f"; above it: {'; '.join(why)}" if why else ""
    return [f"floor    sent / least this layout needs: {cells}{above}"]


def above_floor_reasons(plan: Plan, over: set[tuple[str, str]]) -> list[str]:
    """Why the step sends more than its floor on the (group, kind)s in `over`: the code paths and
    settings that do (docs/planning.md)."""
    tp = {kind for dim, kind in over if "tp" in dim.split(" = ")}
    rest = {kind for dim, kind in over if "tp" not in dim.split(" = ")}
    why = []
    if rest & {"all-gather", "reduce-scatter", "all-reduce"}:
        why.append("FSDP's collectives once per microbatch (fewer, larger microbatches send less)")
    if tp and "autocast" in plan.numerics:
        why.append("without FSDP's mixed precision, autocast keeps the norms' and the embedding's outputs "
                   "in float32, and TP gathers and reduce-scatters them so")
    if tp and not plan.loss_parallel:
        why.append("loss parallel off: TP gathers the logits whole")
    if "reduce-scatter" in tp and plan.facts.degrees["ep"] == 1 and any(r.moe_layers for r in plan.ranks):
        why.append("an MoE layer without EP sums its input's gradient by all-reduces (its routed experts', "
                   "and its shared experts' where it has them) where one reduce-scatter would do")
    if "all-gather" in tp and any((r.tensor_parallel_rows or TensorParallelRows()).joins for r in plan.ranks):
        why.append("an MTP module's joining projection moves its output from column to sequence shards, an "
                   "all-to-all on GPUs, planned as gloo's all-gather (the planner's meshes are CPU ones)")
    if tp or "all-to-all" in rest:
        if plan.ac_mode != "none":
            why.append(f"AC {plan.ac_mode} recomputes forwards, whose collectives send again")
        elif "all-to-all" in rest:  # EP's: each routed token there and back is all it needs
            why.append("EP sends more than each routed token there and back")
    return why


def step_lines(plan: Plan) -> list[str]:
    """The step-time model's prediction, part by part (planning/step_time.py)."""
    t, eff = plan.estimate, plan.device.efficiency
    compute = plan.mfu if plan.mfu is not None else eff.compute
    speedups = "".join([" × compile" * bool(plan.facts and plan.facts.compile),
                        " × float8" * bool(plan.facts and plan.facts.float8)])
    comm = ", ".join(f"{dim} {t.exposed[dim]:.3g} of {t.comm[dim]:.3g}" for dim in sorted(t.comm)) or "none"
    per_token = (rank_flops(plan.flops_per_token, plan.moe_flops_per_token, 1, 1, plan.facts.degrees)
                 if plan.facts else plan.flops_per_token)
    redundant = (f" + {(per_token - plan.flops_per_token) / 1e9:,.2f} (the MoE layers, which every TP rank "
                 "runs whole under EP)" if per_token > plan.flops_per_token else "")
    return [f"compute  {plan.flops_per_token / 1e9:,.2f}{redundant} GFLOP/token → {t.compute:,.3g} s "
            f"at {compute:.0%}"
            f"{speedups} of {plan.device.peak_tflops:,.4g} TFLOP/s"
            + (f" (AC {plan.ac_mode} recomputes)" if plan.ac_mode != "none" else "")
            + (f"; pipeline bubble {t.bubble:.1%}" if t.bubble else ""),
            f"comm     exposed s of s on the wire: {comm}",
            f"step     ≈ {t.seconds:,.3g} s → {t.tokens_per_second_per_device:,.0f} tokens/s/device "
            f"({plan.device.name}; docs/planning.md, the step-time model)"]


def format_suggestions(plan: Plan) -> list[str]:
    """The single changes tried for a plan that does not fit: those that fit, each with its peak, then
    those still short in one line."""
    fit = [g for g in plan.suggestions if g.fits]
    short = [g for g in plan.suggestions if not g.fits]
    where = f"on {plan.device.name}, keeping {plan.device.reserve_gib:g} GiB free"
    lines = []
    if fit:
        lines.append(f"what would fit ({where}; each change planned alone, fastest first; peak of its "
                     "fullest rank):")
        width = max(len(g.flags) for g in fit) + 2
        lines += [f"  {g.flags.ljust(width)}≈ {g.tokens_per_second_per_device:,.0f} tokens/s/device, peak "
                  f"{gib(g.peak)}, {_amount(g.spare_gib)} to spare  ({g.why})" for g in fit]
    else:
        lines.append(f"no single change tried fits ({where}); combine them, or plan more ranks")
    if short:
        lines.append("still short: " + "; ".join(
            f"{g.flags} (peak {gib(g.peak)}, {_amount(-g.spare_gib)} short)" for g in short))
    lines.append(f"{len(plan.suggestions)} change(s) tried in {plan.suggestions_seconds:,.1f} s")
    return lines


def plan_json(plan: Plan) -> str:
    """Everything in the plan, the estimates included, as JSON."""
    data = dataclasses.asdict(plan)
    data.update(tokens_per_step=plan.tokens_per_step, bubble=plan.bubble, step_seconds=plan.step_seconds,
                tokens_per_second_per_device=plan.tokens_per_second_per_device)
    for rank, r in zip(data["ranks"], plan.ranks, strict=True):
        fits, spare = plan.verdict(r)
        rank.update(fits=fits, spare_gib=round(spare, 3))
    return json.dumps(data, indent=1)


def format_search(result: SearchResult) -> str:
    """The best layouts that fit, fastest first, and how the search went."""
    r = result
    lines = [f"Search · {r.model} · world {r.world_size} · {r.device.name} · global batch {r.global_batch} × "
             f"seq {r.seq_len}",
             f"{r.considered} layouts enumerated, {r.refused} refused by the trainer's checks; of "
             f"{r.distinct} distinct, {r.distinct - r.untimed} timed ({r.untimed} could not beat those "
             f"ranked even at their least communication and peak); {r.sized} sized and ranked by predicted "
             "speed; "
             f"of the fastest, {r.checked} checked against memory, {r.too_big_by_rows} too big as fewer rows "
             f"per microbatch were, {r.floored} by a lower bound on their peak; {r.planned} fake plans in "
             f"{r.seconds:,.0f} s",
             *(f"plan failed: {failure}" for failure in r.failed), ""]
    if not r.ranked:
        lines.append("nothing fits: the smallest peaks were (≥: a lower bound, not planned further)")
        shown = r.too_big[:5]
    else:
        shown = r.ranked[:r.top]
    lines.append(f"{'':>3}  {'tokens/s/dev':>12}  {'step s':>8}  {'peak GiB':>9}  {'exposed comm s':>14}  "
                 f"{'bubble':>6}  layout")
    for i, lay in enumerate(shown, 1):
        t = lay.step
        peak = ("≥" if lay.peak_is_lower_bound else "") + f"{lay.peak / 2**30:.1f}"
        lines.append(f"{i:>3}  {lay.tokens_per_second_per_device:>12,.0f}  {t.seconds:>8.3g}  {peak:>9}  "
                     f"{sum(t.exposed.values()):>14.3g}  {t.bubble:>6.1%}  {lay.describe()}")
    if r.ranked:
        flags = " ".join(f"--{k} {v}" for k, v in r.ranked[0].flags.items())
        lines += ["", f"run the first with: {flags}"]
    return "\n".join(lines)


def search_json(result: SearchResult) -> str:
    """The search as JSON: the fastest layouts that fit and the five smallest found not to."""
    def row(lay: Layout) -> dict:
        t = lay.step
        return {"layout": lay.describe(), "flags": lay.flags, "degrees": lay.degrees,
                "ac_mode": lay.ac_mode, "rows_per_microbatch": lay.rows,
                "peak_gib": round(lay.peak / 2**30, 3), "peak_is_lower_bound": lay.peak_is_lower_bound,
                "fits": lay.fits, "tokens_per_second_per_device": round(lay.tokens_per_second_per_device, 2),
                "step_seconds": t.seconds, "compute_seconds": t.compute, "bubble": t.bubble,
                "comm_seconds": t.comm, "exposed_seconds": t.exposed}
    r = result
    return json.dumps({"model": r.model, "world_size": r.world_size, "device": r.device.name,
                       "global_batch": r.global_batch, "seq_len": r.seq_len, "considered": r.considered,
                       "refused": r.refused, "distinct": r.distinct, "untimed": r.untimed, "sized": r.sized,
                       "checked": r.checked,
                       "too_big_by_rows": r.too_big_by_rows, "floored": r.floored, "planned": r.planned,
                       "failed": r.failed, "seconds": r.seconds,
                       "ranked": [row(lay) for lay in r.ranked[:r.top]],
                       "too_big": [row(lay) for lay in r.too_big[:5]]}, indent=1)
